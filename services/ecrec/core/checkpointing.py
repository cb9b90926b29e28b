"""The checkpoint-based strategies on the coordinator — checkpoint, checknrun, cpr — as a state machine (no I/O).

The coordinator feeds `CheckpointCycle` what it learns (time, each worker's reports, shard failures and
registrations, the servers' answers) and carries out the `Act`s it returns; workers read `control()` with the
answers to their reports. Design: docs/protocol.md, "Checkpoint strategies".

A checkpoint is a consistent cut: workers pause at a step boundary with their last update applied, the
servers write their shards, the manifest is written last, workers resume. On a server failure:
- `checkpoint`, `checknrun` (rollback): workers stop, the replacement registers, every server loads the last
  committed checkpoint (none yet: the initial state) and every rank resumes at the step the checkpoint
  recorded for it; the steps since are trained again (the paper's lost work);
- `cpr` (partial recovery): only the replacement loads its shard of the last checkpoint; nobody stops or
  rolls back, so the other shards keep their newer rows (CPR's accuracy cost).

Workers of a rollback strategy stay up after their last step until the job is finished: a failure before
then rolls them back too. When every worker is done a final checkpoint is written, so that a failure after
training restores the final state with nothing to redo.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

ROLLBACK_STRATEGIES = ("checkpoint", "checknrun")
CHECKPOINT_STRATEGIES = (*ROLLBACK_STRATEGIES, "cpr")

Progress = dict[int, tuple[int, int]]  # rank -> (step, samples)


class Phase(str, Enum):
    TRAINING = "training"
    PAUSING = "pausing"  # workers asked to pause for checkpoint `pending`
    WRITING = "writing"  # the servers write it
    STOPPING = "stopping"  # a shard failed: workers asked to stop for rollback `rollback`
    RESTORING = "restoring"  # servers load the last checkpoint


@dataclass(frozen=True)
class Act:
    """What the coordinator must do now.

    write:   every server writes its shard of checkpoint `checkpoint` (answer with `written`)
    commit:  write the manifest of `checkpoint` (the servers' files are all there), recording `progress`
    restore: `shards` load checkpoint `checkpoint` (None: the initial state) (answer with `restored`)
    """

    kind: str
    checkpoint: int | None = None
    shards: tuple[int, ...] = ()
    progress: tuple[tuple[int, int, int], ...] = ()  # (rank, step, samples)
    final: bool = False


@dataclass
class Worker:
    step: int = 0
    samples: int = 0
    done: bool = False
    paused: int | None = None  # the checkpoint id it is paused for
    stopped: int = 0  # the rollback generation it has stopped for
    lost: bool = False  # its process died; a replacement resumes the rank (it holds nothing up meanwhile)

    def holds_for(self, checkpoint: int | None) -> bool:
        return self.lost or self.done or self.paused == checkpoint


@dataclass
class Committed:
    checkpoint: int
    progress: Progress
    final: bool = False


@dataclass
class CheckpointCycle:
    strategy: str
    num_workers: int
    num_servers: int
    interval_seconds: float | None = None
    interval_steps: int | None = None
    phase: Phase = Phase.TRAINING
    next_id: int = 1
    pending: int | None = None  # the checkpoint being paused for or written
    pending_final: bool = False
    pause_at: int | None = (
        None  # intervalSteps: workers pause for `pending` once they completed this many steps
    )
    last: Committed | None = None
    rollback: int = 0  # generation: +1 per failure a rollback strategy answers
    resume: Progress | None = None  # where each rank resumes after the last rollback
    failed: set[int] = field(default_factory=set)  # shards lost and not yet restored
    restoring: set[int] = field(default_factory=set)  # cpr: shards loading their checkpoint
    last_end: float | None = None  # when the last checkpoint (or the training) started counting
    workers: dict[int, Worker] = field(default_factory=dict)
    rollbacks: int = 0
    steps_redone: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in CHECKPOINT_STRATEGIES:
            raise ValueError(f"not a checkpoint strategy: {self.strategy}")
        if (self.interval_seconds is None) == (self.interval_steps is None):
            raise ValueError("exactly one of interval_seconds and interval_steps")

    @property
    def rolls_back(self) -> bool:
        return self.strategy in ROLLBACK_STRATEGIES

    # ------------------------------------------------------------------------------------------- inputs --
    def started(self, now: float) -> list[Act]:
        """Training started (every worker and server registered)."""
        self.last_end = now
        self._arm()
        return []

    def report(
        self, rank: int, step: int, samples: int, done: bool, paused: int | None, stopped: int
    ) -> list[Act]:
        w = self.workers.setdefault(rank, Worker())
        w.step, w.samples, w.done, w.paused, w.stopped = step, samples, done, paused, stopped
        w.lost = False
        return self._advance()

    def worker_lost(self, rank: int) -> list[Act]:
        """Its process died: its replacement registers later (and reads `control` then). A lost worker's
        updates are all applied or lost with it, so it is as good as paused or stopped."""
        self.workers.setdefault(rank, Worker()).lost = True
        return self._advance()

    def tick(self, now: float) -> list[Act]:
        armed = self.phase is Phase.PAUSING and self.pause_at is not None and not self.pending_final
        if (self.phase is Phase.TRAINING or armed) and self.last_end is not None and not self.failed:
            final_due = self.all_done() and not (self.last and self.last.final)
            if not self.restoring and (final_due or (not armed and self._due(now))):
                self._begin_pause(final=self.all_done())
        return self._advance()

    def failure(self, shard: int) -> list[Act]:
        """The coordinator declared `shard` failed."""
        if shard in self.failed:
            return []
        self.failed.add(shard)
        self.restoring.discard(shard)
        self.pending, self.pending_final = None, False  # a checkpoint missing a shard is never committed
        if self.rolls_back:
            self.rollback += 1
            self.rollbacks += 1
            self.phase = Phase.STOPPING
        elif self.phase in (Phase.PAUSING, Phase.WRITING):
            self.phase = Phase.TRAINING
        return self._advance()

    def registered(self, shard: int) -> list[Act]:
        """A replacement for `shard` registered: it can load its checkpoint."""
        if shard not in self.failed:
            return []
        if self.rolls_back:
            self.failed.discard(shard)
            return self._advance()
        self.failed.discard(shard)
        self.restoring.add(shard)
        ckpt = self.last.checkpoint if self.last else None
        return [Act("restore", ckpt, (shard,))]

    def written(self, checkpoint: int, ok: bool, now: float) -> list[Act]:
        """Every server wrote its shard of `checkpoint` (ok), or one could not."""
        if self.phase is not Phase.WRITING or checkpoint != self.pending:
            return []  # abandoned meanwhile (a failure)
        acts: list[Act] = []
        if ok:
            progress = {r: (w.step, w.samples) for r, w in self.workers.items()}
            self.last = Committed(checkpoint, progress, final=self.pending_final)
            acts.append(Act("commit", checkpoint, progress=_rows(progress), final=self.pending_final))
        self.pending, self.pending_final = None, False
        self.phase = Phase.TRAINING
        self.last_end = now
        self._arm()
        return acts + self._advance()

    def restored(self, shards: tuple[int, ...], ok: bool, now: float) -> list[Act]:
        if not ok:
            return []  # the coordinator fails the job with the servers' reason
        if self.phase is Phase.RESTORING:
            progress = self.last.progress if self.last else {r: (0, 0) for r in range(self.num_workers)}
            self.steps_redone += sum(
                max(0, w.step - progress.get(r, (0, 0))[0]) for r, w in self.workers.items()
            )
            self.resume = dict(progress)
            for r, w in self.workers.items():
                w.step, w.samples = progress.get(r, (0, 0))
                w.done = False
            self.phase = Phase.TRAINING
            self.last_end = now
        else:
            self.restoring.difference_update(shards)
        if self.phase is Phase.TRAINING and not self.failed and not self.restoring:
            self._arm()
        return self._advance()

    # ------------------------------------------------------------------------------------------ outputs --
    def control(self) -> dict:
        """What workers are told with every answer to their reports."""
        return {
            "phase": self.phase.value,
            "pause": self.pending if self.phase in (Phase.PAUSING, Phase.WRITING) else None,
            "pauseAtStep": self.pause_at if self.phase is Phase.PAUSING else None,
            "rollback": self.rollback,
            "resume": None
            if self.resume is None or self.phase in (Phase.STOPPING, Phase.RESTORING)
            else {str(r): list(v) for r, v in self.resume.items()},
            "finished": self.finished,
        }

    @property
    def holding(self) -> bool:
        """Training is held up by the cycle: a checkpoint being written or paused for, or a rollback."""
        if self.phase in (Phase.WRITING, Phase.STOPPING, Phase.RESTORING):
            return True
        return self.phase is Phase.PAUSING and any(w.paused == self.pending for w in self.workers.values())

    @property
    def finished(self) -> bool:
        """Training is over and its final state is checkpointed: workers may exit."""
        return bool(self.last and self.last.final) and self.phase is Phase.TRAINING and not self.failed

    def shard_ready(self, shard: int) -> bool:
        return shard not in self.failed and shard not in self.restoring and self.phase is not Phase.RESTORING

    # ---------------------------------------------------------------------------------------- internals --
    def all_done(self) -> bool:
        return len(self.workers) == self.num_workers and all(w.done for w in self.workers.values())

    def _due(self, now: float) -> bool:
        """intervalSeconds: time for the next checkpoint (intervalSteps arms them ahead instead)."""
        if self.interval_seconds is None:
            return False
        return self.last_end is not None and now - self.last_end >= self.interval_seconds

    def _begin_pause(self, final: bool, at_step: int | None = None) -> None:
        if self.phase is not Phase.PAUSING:  # an armed checkpoint keeps its id when it becomes the final one
            self.pending = self.next_id
            self.next_id += 1
        self.pending_final, self.pause_at = final, at_step
        self.phase = Phase.PAUSING

    def _arm(self) -> None:
        """intervalSteps: publish the next checkpoint ahead, at the next multiple of the interval above the
        fastest rank, so every rank pauses after exactly that many steps (a cut at the same step)."""
        if self.interval_steps is None or self.all_done():
            return
        fastest = max((w.step for w in self.workers.values()), default=0)
        self._begin_pause(final=False, at_step=(fastest // self.interval_steps + 1) * self.interval_steps)

    def _advance(self) -> list[Act]:
        if self.phase is Phase.PAUSING:
            ready = len(self.workers) == self.num_workers and all(
                w.holds_for(self.pending) for w in self.workers.values()
            )
            if ready:
                self.pending_final = self.pending_final or self.all_done()  # nothing after it: the last one
                self.phase = Phase.WRITING
                return [Act("write", self.pending, tuple(range(self.num_servers)), final=self.pending_final)]
        elif self.phase is Phase.STOPPING:
            stopped = len(self.workers) == self.num_workers and all(
                w.lost or w.stopped >= self.rollback for w in self.workers.values()
            )
            if stopped and not self.failed:
                self.phase = Phase.RESTORING
                ckpt = self.last.checkpoint if self.last else None
                return [Act("restore", ckpt, tuple(range(self.num_servers)))]
        return []


def _rows(progress: Progress) -> tuple[tuple[int, int, int], ...]:
    return tuple((r, s, n) for r, (s, n) in sorted(progress.items()))
