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

`fallback`: the cycle of strategy ecrec's checkpoint fallback (`faultTolerance.ecrec.fallback`). ECRec
rebuilds up to r lost shards by itself, so a failure neither rolls back nor restores: it only holds the
checkpoints off (none is taken, and one under way is abandoned, while a shard is lost or being rebuilt) until
the coordinator says the shard is rebuilt (`rebuilt`). Only when more than r are lost at once
(`beyond_parity`) does it roll back as the checkpoint strategy does: workers stop, the lost shards'
replacements register, every server loads the last checkpoint, every rank resumes at its step. No final
checkpoint: at the end of training ECRec still rebuilds a lost shard, and workers are released once all are
done.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from ecrec.core.quantize import intermittent_full

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
    baseline: bool = True  # checknrun: a full baseline, else an increment over `base`
    base: int | None = None
    hot: bool = False  # cpr: a hot-row save over full checkpoint `base`, taken while training goes on


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
    base: int | None = None  # checknrun: the baseline an increment applies to


@dataclass
class CheckpointCycle:
    strategy: str
    num_workers: int
    num_servers: int
    interval_seconds: float | None = None
    interval_steps: int | None = None
    incremental: bool = True  # checknrun: increments between baselines
    hot_interval: float | None = None  # cpr with hotRows: seconds between hot-row saves (r x the interval)
    fallback: bool = False  # strategy ecrec's checkpoint fallback (module docstring)
    phase: Phase = Phase.TRAINING
    next_id: int = 1
    pending: int | None = None  # the checkpoint being paused for or written
    pending_final: bool = False
    # intervalSteps: workers pause for `pending` once they have completed this many steps
    pause_at: int | None = None
    pending_baseline: bool = True
    cut: Progress | None = None  # each rank's (step, samples) when the pending checkpoint's cut was taken
    # checknrun: the checkpoint being written in the background while training goes on (snapshotted), the
    # last baseline, and the sizes of the increments since it (fractions of the rows: the intermittent policy)
    persisting: int | None = None
    last_baseline: int | None = None
    sizes: list[float] = field(default_factory=list)
    last: Committed | None = None
    rollback: int = 0  # generation: +1 per failure a rollback strategy answers
    floor: int = 0  # a successor coordinator's rollbacks start above this (taken_over)
    resume: Progress | None = None  # where each rank resumes after the last rollback
    failed: set[int] = field(default_factory=set)  # shards lost and not yet restored
    restoring: set[int] = field(default_factory=set)  # cpr: shards loading their checkpoint
    last_end: float | None = None  # when the last checkpoint (or the training) started counting
    workers: dict[int, Worker] = field(default_factory=dict)
    rollbacks: int = 0
    steps_redone: int = 0
    # CPR's portion of lost samples (partial recovery only): each failure adds the samples since the last
    # checkpoint over total samples x servers (§4.1); total_samples 0: not tracked
    total_samples: int = 0
    pls: float = 0.0
    _before_commit: tuple | None = field(default=None, repr=False)
    # cpr's hot-row saves: the one being written, the last committed over `last`, when the last one ended
    hot_pending: int | None = None
    last_hot: int | None = None
    last_hot_end: float | None = None

    def __post_init__(self) -> None:
        if self.strategy not in CHECKPOINT_STRATEGIES:
            raise ValueError(f"not a checkpoint strategy: {self.strategy}")
        if self.fallback and self.strategy != "checkpoint":
            raise ValueError("the ecrec fallback writes full checkpoints (strategy checkpoint)")
        if (self.interval_seconds is None) == (self.interval_steps is None):
            raise ValueError("exactly one of interval_seconds and interval_steps")

    @property
    def rolls_back(self) -> bool:
        """A lost shard rolls every rank back (the fallback only when told: `beyond_parity`)."""
        return self.strategy in ROLLBACK_STRATEGIES and not self.fallback

    @property
    def rolling_back(self) -> bool:
        return self.phase in (Phase.STOPPING, Phase.RESTORING)

    @property
    def decoupled(self) -> bool:
        """Check-N-Run: training resumes once the servers have copied their state; the write goes on."""
        return self.strategy == "checknrun"

    # ------------------------------------------------------------------------------------------- inputs --
    def started(self, now: float) -> list[Act]:
        """Training started (every worker and server registered)."""
        self.last_end = now
        if self.phase is Phase.TRAINING:  # (a successor whose seed predates the start may be rolling back)
            self._arm()
        return []

    def report(
        self, rank: int, step: int, samples: int, done: bool, paused: int | None, stopped: int
    ) -> list[Act]:
        w = self.workers.setdefault(rank, Worker())
        if self.rolling_back:
            # Where each rank stopped is what the restore counts as redone; reports while it is stopped may
            # carry older counts (the coordinator's of its last report before the stop): they never lower it.
            step, samples = max(step, w.step), max(samples, w.samples)
        w.step, w.samples, w.done, w.paused, w.stopped = step, samples, done, paused, stopped
        w.lost = False
        return self._advance()

    def worker_lost(self, rank: int) -> list[Act]:
        """Its process died: its replacement registers later (and reads `control` then). A lost worker's
        updates are all applied or lost with it, so it is as good as paused or stopped."""
        self.workers.setdefault(rank, Worker()).lost = True
        return self._advance()

    def tick(self, now: float) -> list[Act]:
        if self.finished:
            return []  # the final checkpoint holds the end of training: nothing changes after it
        armed = self.phase is Phase.PAUSING and self.pause_at is not None and not self.pending_final
        idle = self.persisting is None and self.hot_pending is None  # checkpoints never overlap
        if (self.phase is Phase.TRAINING or armed) and self.last_end is not None and not self.failed and idle:
            final_due = self.all_done() and not (self.last and self.last.final) and not self.fallback
            if not self.restoring and (final_due or (not armed and self._due(now))):
                self._begin_pause(final=self.all_done())
            elif self.phase is Phase.TRAINING and self._hot_due(now) and not self.all_done():
                self.hot_pending = self.next_id
                self.next_id += 1
                return [
                    Act(
                        "write",
                        self.hot_pending,
                        tuple(range(self.num_servers)),
                        hot=True,
                        base=self.last.checkpoint,
                    )
                ]
        return self._advance()

    def _hot_due(self, now: float) -> bool:
        if self.hot_interval is None or self.last is None or self.restoring:
            return False
        since = self.last_hot_end if self.last_hot_end is not None else self.last_end
        return since is not None and now - since >= self.hot_interval

    def failure(self, shard: int) -> list[Act]:
        """The coordinator declared `shard` failed."""
        if shard in self.failed:
            return []
        self.failed.add(shard)
        self.restoring.discard(shard)
        self.pending, self.pending_final = None, False  # a checkpoint missing a shard is never committed
        self.persisting = self.hot_pending = None
        if self.rolls_back or (
            self.fallback and self.phase is Phase.RESTORING
        ):  # (a restore missing a shard)
            self._roll_back()
        elif self.fallback and self.phase is Phase.STOPPING:
            pass  # one more shard for the rollback under way to wait for
        elif self.phase in (Phase.PAUSING, Phase.WRITING):
            self.phase = Phase.TRAINING
        return self._advance()

    def _roll_back(self) -> None:
        self.rollback = (
            max(self.rollback, self.floor) + 1
        )  # above every generation an earlier coordinator used
        self.rollbacks += 1
        self.phase = Phase.STOPPING

    def beyond_parity(self, lost: tuple[int, ...], registered: tuple[int, ...] = ()) -> list[Act]:
        """fallback: more than r shards are lost at once (`lost`; of them, `registered` have a replacement
        registered already): roll every rank back to the last checkpoint. Again while rolling back: nothing
        (the rollback under way restores every shard)."""
        if not self.fallback:
            raise ValueError("beyond_parity is the ecrec fallback's")
        self.failed = (self.failed | set(lost)) - set(registered)
        self.pending, self.pending_final, self.pause_at = None, False, None
        if not self.rolling_back:
            self._roll_back()
        return self._advance()

    def rebuilt(self, shard: int) -> list[Act]:
        """fallback: ECRec rebuilt `shard` (it held the checkpoints off since its failure)."""
        if self.rolling_back or shard not in self.failed:
            return []  # a rollback's shards come back by the restore
        self.failed.discard(shard)
        if self.phase is Phase.TRAINING and not self.failed:
            self._arm()
        return self._advance()

    def taken_over(
        self,
        last: Committed | None,
        last_hot: int | None,
        generation: int,
        now: float,
        failed: tuple[int, ...] = (),
        registered: tuple[int, ...] = (),
        rolling_back: bool = False,
    ) -> list[Act]:
        """This cycle belongs to a successor coordinator (failover, `generation` > 1), which starts from the
        store's newest committed checkpoint (`last`, and cpr's newest hot-row save over it). What the dead one
        had in flight is abandoned: a checkpoint being written is never committed (its files stay behind), and
        its ids and rollback generations are left behind too — this one's start above every id an earlier
        coordinator could have published ((generation - 1) * 2**20), so nothing it asks for is mistaken for
        an earlier request. A rollback strategy rolls back to `last` at once: whether a rollback or a
        checkpoint was under way cannot be known, and the rollback is the strategy's one way back to a
        consistent cut. cpr trains on. The first checkpoint after it is a full one (checknrun's record of
        the rows changed since its baseline may be of an abandoned checkpoint). `failed`: shards lost when it
        took over, of which `registered` have a replacement (their failures were counted before). The ecrec
        fallback rolls back only if its predecessor was (`rolling_back`: workers may be stopped, waiting for a
        restore); otherwise ECRec goes on rebuilding what is lost."""
        floor = self.floor = (generation - 1) << 20
        self.next_id = max(self.next_id, floor + 1)
        self.last, self.last_hot, self.last_end = last, last_hot, now
        self.last_baseline, self.sizes = None, []
        self.pending = self.persisting = self.hot_pending = None
        self.pending_final, self.pause_at = False, None
        self.failed, self.restoring = set(failed), set()
        acts: list[Act] = []
        if self.rolls_back or (self.fallback and rolling_back):
            self.rollback = max(self.rollback, floor) + 1
            self.rollbacks += 1
            self.phase = Phase.STOPPING
        else:
            self.phase = Phase.TRAINING
            self._arm()
        for shard in registered:
            acts += self.registered(shard)
        return acts + self._advance()

    def registered(self, shard: int) -> list[Act]:
        """A replacement for `shard` registered: it can load its checkpoint (fallback: ECRec rebuilds it unless
        a rollback is under way)."""
        if shard not in self.failed or (self.fallback and not self.rolling_back):
            return []
        if self.rolls_back or self.fallback:
            self.failed.discard(shard)
            return self._advance()
        self.failed.discard(shard)
        self.restoring.add(shard)
        ckpt = self.last_hot or (self.last.checkpoint if self.last else None)  # the full one + its hot saves
        return [Act("restore", ckpt, (shard,))]

    def snapshotted(self, checkpoint: int, ok: bool, now: float) -> list[Act]:
        """checknrun: every server copied its part of `checkpoint`; training resumes while they write it."""
        if self.phase is not Phase.WRITING or checkpoint != self.pending:
            return []
        if not ok:
            return self.written(checkpoint, False, now)
        self.persisting, self.pending = checkpoint, None
        self.phase = Phase.TRAINING
        return self._advance()

    def written(self, checkpoint: int, ok: bool, now: float, fraction: float | None = None) -> list[Act]:
        """Every server wrote its shard of `checkpoint` (ok), or one could not. `fraction`: of all rows, those
        in it (checknrun's increments)."""
        if checkpoint == self.hot_pending and self.last is not None:
            self.hot_pending, self.last_hot_end = None, now
            if not ok:
                return []
            self.last_hot = checkpoint
            return [
                Act(
                    "commit",
                    checkpoint,
                    progress=_rows(self.last.progress),
                    hot=True,
                    base=self.last.checkpoint,
                )
            ]
        synchronous = self.phase is Phase.WRITING and checkpoint == self.pending
        if not synchronous and checkpoint != self.persisting:
            return []  # abandoned meanwhile (a failure)
        acts: list[Act] = []
        if ok:
            self._before_commit = (self.last, self.last_baseline, list(self.sizes))
            progress = dict(self.cut or {})
            self.last_hot, self.last_hot_end = None, now
            base = None if self.pending_baseline else self.last_baseline
            self.last = Committed(checkpoint, progress, final=self.pending_final, base=base)
            if self.pending_baseline:
                self.last_baseline, self.sizes = checkpoint, []
            else:
                self.sizes.append(fraction if fraction is not None else 1.0)
            commit = Act("commit", checkpoint, progress=_rows(progress), final=self.pending_final)
            acts.append(replace(commit, baseline=self.pending_baseline, base=base))
        self.pending, self.pending_final, self.persisting = None, False, None
        if synchronous:
            self.phase = Phase.TRAINING
        self.last_end = now
        self._arm()
        return acts + self._advance()

    def commit_failed(self, checkpoint: int) -> list[Act]:
        """The manifest of `checkpoint` could not be written: the checkpoint before it is the latest again."""
        if checkpoint == self.last_hot:
            self.last_hot = None  # the full checkpoint alone is still a sound (older) restore point
            return []
        if self.last is not None and self.last.checkpoint == checkpoint and self._before_commit is not None:
            self.last, self.last_baseline, self.sizes = self._before_commit
            self._before_commit = None
        return []

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
            # Partial recovery (CPR): the shard lost what it learned since the last checkpoint. Counted now, not
            # when the failure was declared: the workers' reports then could be up to a report interval old
            # (a kill just after a checkpoint read as nothing lost), while since then they have stood still
            # at the step the failure stopped them (every step needs every shard) and said so.
            back = [s for s in shards if s in self.restoring]
            if self.total_samples and back:
                done = sum(w.samples for w in self.workers.values())
                saved = sum(n for _s, n in self.last.progress.values()) if self.last else 0
                self.pls += len(back) * max(0, done - saved) / (self.total_samples * self.num_servers)
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
        """Training is over and its final state is checkpointed: workers may exit (fallback: every worker
        done, and no rollback under way)."""
        if self.fallback:
            return self.all_done() and self.phase is Phase.TRAINING
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
                self.cut = {r: (w.step, w.samples) for r, w in self.workers.items()}
                self.pending_baseline = (
                    self.strategy != "checknrun"
                    or not self.incremental
                    or self.last_baseline is None
                    or intermittent_full(self.sizes)
                )
                write = Act("write", self.pending, tuple(range(self.num_servers)), final=self.pending_final)
                base = None if self.pending_baseline else self.last_baseline
                return [replace(write, baseline=self.pending_baseline, base=base)]
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


# -- CPR's interval selection (cpr-partial-recovery.txt §2, §4.1) ---------------------------------------------
def cpr_interval(target_pls: float, num_servers: int, mtbf: float) -> float:
    """The checkpoint interval whose expected PLS is the target: E[PLS] = 0.5 T_save / (T_fail N_emb) (Eq. 4),
    so T_save,part = 2 PLS N_emb T_fail."""
    return 2.0 * target_pls * num_servers * mtbf


def full_recovery_interval(save_seconds: float, mtbf: float) -> float:
    """The interval that minimizes full recovery's overhead (Eq. 1): T_save,full = sqrt(2 O_save T_fail)."""
    return (2.0 * save_seconds * mtbf) ** 0.5


def expected_pls(interval: float, num_servers: int, mtbf: float) -> float:
    return 0.5 * interval / (mtbf * num_servers)
