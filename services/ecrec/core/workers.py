"""The coordinator's worker registry as a state machine (no threads, no I/O, no clock reads: times come in).

`JobProgress` is the job's record of training: each rank's `WorkerProgress`, the samples over time and the
event log. `WorkerRegistry` decides what the workers' requests do to it — registration, a replacement, a
rejoin after a coordinator failover, a progress report, a lost or finished process, a silent one, a rollback
— refusing (`Refused`, nothing changed) what does not fit the current state and rejecting (`ValueError`)
what is malformed. The coordinator service holds its lock around every call and does the rest (metrics,
checkpoint cycle, the start and the end of training).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ecrec.core.cluster import Refused
from ecrec.core.timeline import SamplesTimeline


@dataclass
class WorkerProgress:
    rank: int
    instance: str = ""
    incarnation: int = 1
    step: int = 0
    samples: int = 0
    loss: float | None = None
    done: bool = False
    error: str | None = None
    lost: bool = False
    # When the coordinator last heard this process (registration, progress: its reporter thread posts every
    # 0.5 s whatever training does, so only a hung or paused process goes quiet), and whether it has been
    # quiet for longer than the failure timeout: the launcher then deletes it and a replacement resumes.
    heard_at: float | None = None
    unresponsive: bool = False


@dataclass
class JobProgress:
    """Training progress over time. t = 0 is when the last worker registered (training start)."""

    num_workers: int
    workers: dict[int, WorkerProgress] = field(default_factory=dict)
    started_at: float | None = None
    finished_at: float | None = None
    samples_log: list[tuple[float, int]] = field(default_factory=list)  # (wall time, total samples)
    # the same total by when its steps completed (the reports' step times), for samples_series
    timeline: SamplesTimeline = field(default_factory=SamplesTimeline)
    events: list[dict] = field(default_factory=list)

    @property
    def total_samples(self) -> int:
        return sum(w.samples for w in self.workers.values())

    def workers_gone(self) -> dict[str, int]:
        """rank -> the newest incarnation of it whose process is gone: reported lost, or replaced by a newer
        one (admitted only once its predecessor was reported lost). Servers abort what those left staged at
        once (ShardStore.expire); a worker that is merely silent is not in it (it may come back)."""
        out = {}
        for rank, w in self.workers.items():
            gone = w.incarnation if w.lost else w.incarnation - 1
            if gone > 0:
                out[str(rank)] = gone
        return out

    def rel(self, at: float) -> float:
        return round(at - (self.started_at or at), 3)

    def event(self, kind: str, at: float, **detail) -> dict:
        ev = {
            "t": self.rel(at),
            "wall": at,
            "kind": kind,
            **{k: v for k, v in detail.items() if v is not None},
        }
        self.events.append(ev)
        return ev

    def sample(self, now: float) -> None:
        if self.started_at is not None and self.finished_at is None:
            self.samples_log.append((now, self.total_samples))
            self.timeline.update(self.total_samples, now)  # changes without step times: a rollback, a rejoin

    def series(self, window: float = 1.0) -> list[list[float]]:
        """[seconds since start, samples/s over the trailing `window`] for every logged sample. A rollback
        (checkpoint strategies) takes the samples count back: a window across one shows no progress, 0, not a
        negative rate (the status schema and the dashboard take throughput as >= 0)."""
        out, j = [], 0
        log_ = self.samples_log
        for i, (t, n) in enumerate(log_):
            while j < i and t - log_[j][0] > window:
                j += 1
            if i > j and t > log_[j][0]:
                out.append([round(self.rel(t), 3), max(0.0, round((n - log_[j][1]) / (t - log_[j][0]), 1))])
        return out

    def samples_series(self) -> list[list[float]]:
        """[seconds since start, total samples], linear in between, by when the steps completed (to 0.05 s,
        `SamplesTimeline`): where rates over an arbitrary window are computed from (a benchmark's
        kill-to-recovery window is shorter than `series`' trailing one, and than the reports' interval)."""
        return [[self.rel(t), round(n, 1)] for t, n in self.timeline.series()]

    def recent_rate(self, window: float = 2.0) -> float:
        s = self.series(window)
        return s[-1][1] if s else 0.0

    def started(self, now: float) -> None:
        self.started_at = now
        self.samples_log.append((now, 0))
        self.timeline.start(now)
        self.event("training_started", now)

    def finish(self, now: float, sample: bool = True) -> None:
        """Training is over: the last sample of the series (unless `sample` is False), the event (once)."""
        if self.finished_at is None:
            if sample:
                self.sample(now)
            self.finished_at = now
            self.event("training_finished", now)


def step_times(times: list[float], last_step_at: float | None) -> list[float]:
    """The completion times a progress report carries, sorted, non-finite ones dropped (for when training
    continued after a failure)."""
    out = sorted(t for t in times if math.isfinite(t))
    if last_step_at is not None and math.isfinite(last_step_at):
        out.append(last_step_at)
    return out


class WorkerRegistry:
    """Which process serves each rank, and how far it got. `last_step_at`: when some worker last completed a
    step (the coordinator's stall detection)."""

    SEEDED = ("rank", "instance", "incarnation", "step", "samples")

    def __init__(self, num_workers: int):
        self.progress = JobProgress(num_workers=num_workers)
        self.last_step_at: float | None = None

    @property
    def num_workers(self) -> int:
        return self.progress.num_workers

    @property
    def all_registered(self) -> bool:
        return len(self.progress.workers) == self.progress.num_workers

    @property
    def all_done(self) -> bool:
        return self.all_registered and all(w.done for w in self.progress.workers.values())

    # -- failover ------------------------------------------------------------------------------------------
    def seed(self) -> list[dict]:
        return [
            {k: getattr(w, k) for k in self.SEEDED} | {"done": w.done, "lost": w.lost}
            for w in sorted(self.progress.workers.values(), key=lambda w: w.rank)
        ]

    def restore(self, workers: list[dict], now: float) -> None:
        p = self.progress
        for w in workers:
            rank = int(w["rank"])
            if not 0 <= rank < p.num_workers:
                raise Refused(f"seed lists worker rank {rank} outside [0, {p.num_workers})")
            p.workers[rank] = WorkerProgress(
                rank,
                str(w.get("instance", "")),
                int(w.get("incarnation", 1)),
                int(w.get("step", 0)),
                int(w.get("samples", 0)),
                done=bool(w.get("done")),
                lost=bool(w.get("lost")),
                heard_at=now,  # the restored ones get a failure timeout from now to be heard
            )

    def serving(self, now: float) -> None:
        """The coordinator answers from `now` on (ClusterMap.serving): restored workers may be silent until a
        failure timeout after it."""
        for w in self.progress.workers.values():
            w.heard_at = max(w.heard_at or 0.0, now)

    # -- registration --------------------------------------------------------------------------------------
    def worker(self, rank: int, instance: str) -> WorkerProgress:
        """The registered worker of `rank`, if `instance` is that process; refused otherwise."""
        if not 0 <= rank < self.progress.num_workers:
            raise ValueError(f"worker rank {rank} out of range [0, {self.progress.num_workers})")
        w = self.progress.workers.get(rank)
        if w is None:
            raise Refused(f"worker {rank} has not registered")
        if w.instance != instance:
            raise Refused(f"worker {rank} is registered as instance {w.instance!r}, not {instance!r}")
        return w

    def registered(self, rank: int, instance: str) -> bool:
        w = self.progress.workers.get(rank)
        return w is not None and w.instance == instance

    def register(
        self, rank: int, instance: str, incarnation: int, replacement: bool, now: float
    ) -> WorkerProgress:
        """A worker process registers: its rank's first, or a replacement for one reported lost (it resumes
        where its predecessor's last progress report ended)."""
        self._check_registration(rank, instance)
        known = self.progress.workers.get(rank)
        if known is not None and known.instance != instance:
            if not (replacement and known.lost and not known.done):
                raise Refused(
                    f"worker {rank} is registered as instance {known.instance!r}; a replacement is "
                    "admitted only after that process was reported lost"
                )
            if incarnation <= known.incarnation:
                raise Refused(f"worker {rank}: incarnation {incarnation} is not after {known.incarnation}")
            known.instance, known.incarnation, known.lost = instance, incarnation, False
            self.progress.event("worker_replaced", now, worker=rank, step=known.step)
        elif known is None and replacement:
            raise Refused(f"worker {rank} never registered: its first process is not a replacement")
        w = self.progress.workers.setdefault(rank, WorkerProgress(rank, instance, incarnation))
        w.heard_at, w.unresponsive = now, False
        return w

    def rejoin(
        self, rank: int, instance: str, incarnation: int, step: int, samples: int, restored: bool, now: float
    ) -> WorkerProgress:
        """A worker that registered with an earlier generation: the seed lists it (its progress reports were
        refused for another reason, or the seed is older than its registration) or lists an older process of
        its rank. Its own count of steps is the truth; it never goes back. Only a coordinator that replaced
        another (`restored`) admits rejoins."""
        self._check_registration(rank, instance)
        if not restored:
            raise Refused(f"worker {rank}: only a coordinator that replaced another admits rejoins")
        known = self.progress.workers.get(rank)
        if known is not None and known.instance != instance:
            if incarnation <= known.incarnation:
                raise Refused(
                    f"worker {rank}: incarnation {incarnation} is not newer than {known.incarnation}"
                )
            known.instance, known.incarnation, known.lost, known.done = instance, incarnation, False, False
        w = self.progress.workers.setdefault(rank, WorkerProgress(rank, instance, incarnation))
        if step > w.step:
            self.last_step_at = now
        w.step, w.samples = max(w.step, step), max(w.samples, samples)
        w.heard_at, w.unresponsive = now, False
        self.progress.event("worker_rejoined", now, worker=rank, step=w.step)
        return w

    def _check_registration(self, rank: int, instance: str) -> None:
        if not 0 <= rank < self.progress.num_workers:
            raise ValueError(f"worker rank {rank} out of range")
        if not instance:
            raise Refused("instance: a registering worker must name itself")

    # -- progress ------------------------------------------------------------------------------------------
    def check_report(self, w: WorkerProgress, step: int, samples: int, loss: float | None) -> None:
        """Refuse a report that goes back, reject a loss that is not a number; nothing changes."""
        if step < w.step or samples < w.samples:
            raise Refused(f"worker {w.rank}: step {step} is behind its last report (step {w.step})")
        if loss is not None and not math.isfinite(loss):
            raise ValueError("loss: must be a finite number or null")

    def report(
        self,
        w: WorkerProgress,
        step: int,
        samples: int,
        loss: float | None,
        done: bool,
        error: str | None,
        times: list[float],
        last_step_at: float | None,
        now: float,
    ) -> int | None:
        """Take a checked report (`check_report`): the samples it adds, or None from a process reported lost
        (its counts are not taken; a replacement resumes from the last ones)."""
        if step > w.step:
            self.last_step_at = now
        if w.lost:
            return None
        w.heard_at = now
        if w.unresponsive:  # it came back before it was replaced
            w.unresponsive = False
            self.progress.event("worker_responsive", w.heard_at, worker=w.rank, step=step)
        delta = max(0, samples - w.samples)
        steps = step - w.step
        w.step, w.samples, w.loss, w.done, w.error = step, samples, loss, done, error
        times = times or ([last_step_at] if last_step_at is not None and steps > 0 else [])
        self.progress.timeline.update(self.progress.total_samples, now, times, steps)
        return delta

    def heard(self, w: WorkerProgress, now: float) -> None:
        w.heard_at = now

    def lost(self, rank: int, instance: str, replacing: bool, reason: str, now: float) -> bool:
        """A worker process died before finishing its steps; False if it was finished or reported already."""
        w = self.worker(rank, instance)
        if w.done or w.lost:
            return False
        w.lost, w.done = True, not replacing
        detail = {"reason": reason} if reason else {}
        self.progress.event("worker_lost", now, worker=rank, step=w.step, **detail)
        return True

    def finished(self, rank: int, instance: str, steps: int, samples: int, now: float) -> int | None:
        """A worker process exited 0 (all its steps done): it counts as done at least at `steps`/`samples`.
        Returns the samples that adds, or None if it was finished or reported lost already."""
        w = self.worker(rank, instance)
        if w.done or w.lost:
            return None
        steps, samples = max(w.step, steps), max(w.samples, samples)
        delta = samples - w.samples
        w.step, w.samples, w.done = steps, samples, True
        self.progress.event("worker_finished", now, worker=rank, step=steps)
        return delta

    def check_silent(self, now: float, timeout: float) -> list[WorkerProgress]:
        """Mark a training worker silent for longer than `timeout` unresponsive (hung or paused: a busy one
        still reports); returns the ones marked now. Only after training started: before, workers only wait
        for the start."""
        p = self.progress
        if p.started_at is None or p.finished_at is not None:
            return []
        out = []
        for w in p.workers.values():
            if w.done or w.lost or w.unresponsive:
                continue
            if now - max(w.heard_at or 0.0, p.started_at) > timeout:
                w.unresponsive = True
                p.event("worker_unresponsive", now, worker=w.rank, step=w.step)
                out.append(w)
        return out

    def rolled_back(self, resume: dict[int, tuple[int, int]], now: float) -> None:
        """Every rank goes back to the step the restored checkpoint recorded for it."""
        p = self.progress
        for rank, (step, samples) in resume.items():
            w = p.workers.get(rank)
            if w is not None:
                w.step, w.samples, w.done = step, samples, False
        p.finished_at = None
        self.last_step_at = now  # the stall clock starts again with the replay
        p.event("rolled_back", now, steps={str(r): s for r, (s, _n) in resume.items()})
