"""The coordinator's recovery records: one `RecoveryRecord` per failure of a shard, from its kill (if known)
to its full recovery, the events they log and the recovery metrics that follow them.

No threads and no I/O of its own (a fault point marks a completed rebuild). Lock discipline: the records are
shared by the request handlers, the ticker and the recovery driver's threads; every method is called with
the coordinator's lock held, and so is every read or write of a record's fields.
"""

from __future__ import annotations

from collections.abc import Iterator

from ecrec.core.recovery import RecoveryRecord, Step
from ecrec.core.workers import JobProgress
from ecrec.faults import fault_point


class RecoveryLog:
    def __init__(self, progress: JobProgress, metrics):
        self.progress, self.metrics = progress, metrics  # where events are logged, what is counted
        self.records: list[RecoveryRecord] = []

    def __iter__(self) -> Iterator[RecoveryRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def open(self, shard: int) -> RecoveryRecord:
        """The record of the shard's current (not yet completed) failure, created if none is open."""
        for rec in reversed(self.records):
            if rec.shard == shard and rec.state != "completed":
                return rec
        rec = RecoveryRecord(shard)
        self.records.append(rec)
        return rec

    def latest(self, shard: int) -> RecoveryRecord | None:
        return next((r for r in reversed(self.records) if r.shard == shard), None)

    def detected(self, shard: int, at: float) -> RecoveryRecord:
        rec = self.open(shard)
        rec.detected_at = rec.detected_at or at
        return rec

    def killed(self, shard: int, at: float) -> None:
        self.open(shard).killed_at = at

    # -- a rebuild's course (the recovery driver) ----------------------------------------------------------
    def started(self, rec: RecoveryRecord, plan: list[Step], now: float) -> None:
        rec.plan, rec.steps_total, rec.steps_done, rec.state = plan, len(plan), 0, "running"
        rec.done = {}
        rec.started_at = rec.started_at or now
        self.progress.event("recovery_started", now, shard=rec.shard)
        self.metrics.of(self.metrics.recoveries_started).inc()

    def step_done(self, rec: RecoveryRecord, kind: str, took: float, rows: int, rows_total: int) -> None:
        rec.step_done(kind, took)
        if kind == "data":
            # rows_total: a rebuild resumed after a failover finds its earlier steps done
            self.rows_recovered(rec, rec.rows_recovered + rows, rows_total)
        elif kind == "parity":
            rec.parity_recovered += rows

    def attempt_failed(self, rec: RecoveryRecord, error: str, now: float) -> None:
        rec.error = error
        self.progress.event("recovery_failed", now, shard=rec.shard, error=rec.error)

    def rows_recovered(self, rec: RecoveryRecord, *counts: int) -> None:
        """The record's rebuilt rows rise to the largest of `counts`; the per-shard counter rises with it (the
        two agree)."""
        before = rec.rows_recovered
        rec.rows_recovered = max(before, *counts)
        self.metrics.of(self.metrics.rows_recovered, shard=str(rec.shard)).inc(rec.rows_recovered - before)

    def completed(self, rec: RecoveryRecord, now: float, fault: str | None = None) -> None:
        rec.state, rec.completed_at, rec.error = "completed", now, None
        self.progress.event("recovery_completed", now, shard=rec.shard, rows=rec.rows_recovered)
        if fault is not None:
            fault_point(fault)
        m = self.metrics
        m.of(m.recoveries_completed).inc()
        m.of(m.time_to_recover).observe(now - (rec.killed_at or rec.detected_at or rec.started_at or now))

    def restore_completed(self, shard: int, rows: int, now: float) -> None:
        """A replacement loaded its checkpoint (checkpoint strategies): the shard's record completes."""
        rec = self.open(shard)
        rec.state, rec.completed_at, rec.error, rec.rows_recovered = "completed", now, None, rows
        rec.started_at = rec.started_at or now
        self.progress.event("recovery_completed", now, shard=shard, rows=rows)
        m = self.metrics
        m.of(m.recoveries_completed).inc()
        m.of(m.rows_recovered, shard=str(shard)).inc(rows)
        m.of(m.time_to_recover).observe(now - (rec.killed_at or rec.detected_at or now))

    def continued(self, steps_at: list[float]) -> None:
        """A worker's steps completed at `steps_at` (sorted): each failure's first step after its detection
        is when training continued."""
        for rec in self.records:
            if (first := rec.continue_at(steps_at)) is not None:
                self.progress.event("training_continued", first, shard=rec.shard)
                self.metrics.of(self.metrics.time_to_continue).observe(
                    first - (rec.killed_at or rec.detected_at)
                )

    def stuck(self, now: float, limit: float) -> str | None:
        """Why a shard is not recovered within `limit` seconds of its failure, if one is not."""
        for rec in self.records:
            if rec.state != "completed" and rec.detected_at is not None and now - rec.detected_at > limit:
                doing = rec.error or (
                    f"rebuilt {rec.steps_done} of {rec.steps_total} steps"
                    if rec.state == "running"
                    else "no replacement registered"
                )
                return (
                    f"shard {rec.shard} not recovered within {limit:g}s of its failure ({rec.state}: {doing})"
                )
        return None

    # -- failover and views --------------------------------------------------------------------------------
    def seed(self) -> list[dict]:
        return [r.seed() for r in self.records]

    def restore(self, seeds: list[dict]) -> None:
        self.records = [RecoveryRecord.restore(r) for r in seeds]

    def to_dict(self, rec: RecoveryRecord) -> dict:
        return rec.to_dict(self.progress.started_at)

    def view(self, t0: float | None) -> list[dict]:
        return [r.to_dict(t0) for r in self.records]

    def by_shard(self) -> dict[int, dict]:
        """The latest record of each shard, as the scrape-time collector exports it."""
        out = {}
        for rec in self.records:  # the latest record of each shard wins
            out[rec.shard] = {
                "phase": rec.state,
                "lock_groups": sum(s.kind != "dense" for s in rec.plan),
                "lock_groups_done": rec.done.get("data", 0) + rec.done.get("parity", 0),
                "rows": rec.rows_recovered,
            }
        return out
