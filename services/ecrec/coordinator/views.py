"""What the coordinator shows of the job: `/v1/status`, the scrape-time metrics state, the job's phase, and
why it cannot finish (if it cannot). Read-only: every function is called with the coordinator's lock held and
changes nothing but the coordinator's own CPU reading.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from ecrec.coordinator.checkpoints import CheckpointDriver
from ecrec.coordinator.records import RecoveryLog
from ecrec.core.cluster import ClusterMap, ShardState
from ecrec.core.cpu import CpuAccount
from ecrec.core.spares import SparePool
from ecrec.core.workers import JobProgress, WorkerRegistry
from ecrec.spec import Job, JobSpec


class CoordinatorState(Protocol):
    """What the views read of `ecrec.coordinator.service.Coordinator`."""

    job: Job
    spec: JobSpec
    generation: int
    clock: Callable[[], float]
    failed_reason: str | None
    cluster: ClusterMap
    workers: WorkerRegistry
    progress: JobProgress
    recoveries: RecoveryLog
    ckpt: CheckpointDriver | None
    cpu: CpuAccount
    spares: SparePool

    @property
    def finished(self) -> bool: ...

    def resume_state(self) -> dict: ...


def resume_state(c: CoordinatorState, max_events: int) -> dict:
    """What a successor needs to carry on after this process dies (its `seed`; the job's latest `max_events`
    events)."""
    p = c.progress
    return {
        "generation": c.generation,
        **c.cluster.seed(),
        "startedAt": p.started_at,
        "finishedAt": p.finished_at,
        "lastStepAt": c.workers.last_step_at,
        "workers": c.workers.seed(),
        "recoveries": c.recoveries.seed(),
        "events": p.events[-max_events:],
        **({"checkpointing": c.ckpt.stats()} if c.ckpt is not None else {}),
    }


def phase(c: CoordinatorState) -> str:
    if c.failed_reason:
        return "Failed"
    if c.finished:
        return "Succeeded"
    states = {s.state for s in c.cluster.shards}
    if c.progress.started_at is None:
        return "Pending"
    if ShardState.FAILED in states:
        return "Degraded"
    if ShardState.RECOVERING in states:
        return "Recovering"
    return "Running"


def status(c: CoordinatorState) -> dict:
    p = c.progress
    end = p.finished_at or c.clock()
    elapsed = (end - p.started_at) if p.started_at else 0.0
    c.cpu.report("coordinator", "self", time.process_time())
    return {
        "job": c.job.name,
        "generation": c.generation,
        "resume": c.resume_state(),
        "phase": phase(c),
        "reason": c.failed_reason,
        "cluster": c.cluster.snapshot(),
        "startedAt": p.started_at,
        "finishedAt": p.finished_at,
        "elapsedSeconds": round(elapsed, 3),
        "step": min((w.step for w in p.workers.values()), default=0),
        "samples": p.total_samples,
        "samplesPerSecond": p.recent_rate(),
        "meanSamplesPerSecond": round(p.total_samples / elapsed, 1) if elapsed > 0 else 0.0,
        "workers": [vars(w) for w in sorted(p.workers.values(), key=lambda w: w.rank)],
        "throughputSeries": p.series(),
        "samplesSeries": p.samples_series(),
        "events": list(p.events),
        "recoveries": c.recoveries.view(p.started_at),
        **({"checkpointing": c.ckpt.stats()} if c.ckpt is not None else {}),
        "cpuSeconds": c.cpu.by_role(),
        # by server process; the cluster map's shards name their instances
        "serverCpuSeconds": c.cpu.by_instance("server"),
        "spares": c.spares.snapshot(),
    }


def metrics_state(c: CoordinatorState) -> dict:
    """The job as the coordinator's scrape-time collector exports it (ecrec.metrics.JobCollector)."""
    workers = c.progress.workers.values()
    return {
        "step": min((w.step for w in workers), default=0),
        "target_steps": c.spec.training.steps,
        "losses": {w.rank: w.loss for w in workers if w.loss is not None and not w.lost},
        "phase": phase(c),
        "shards": [(s.shard, s.state.value, s.incarnation) for s in c.cluster.shards],
        "recoveries": c.recoveries.by_shard(),
        **({"checkpointing": c.ckpt.stats()} if c.ckpt is not None else {}),
    }


def why_stuck(c: CoordinatorState, now: float) -> str | None:
    """Why the job cannot finish, if it cannot: more than r servers lost at once, a shard not rebuilt in
    time, or no worker progressing. None while it can."""
    spec = c.spec
    if c.cluster.recoverable:
        lost = c.cluster.lost()
        r = spec.fault_tolerance.ecrec.r
        if c.ckpt is None and len(lost) > r:  # checkpoints restore any number of lost shards
            from ecrec.jobctx import JobContext

            placement = JobContext(c.job).placement
            names = ", ".join(f"{s} ({c.cluster.shards[s].state.value})" for s in lost)
            return (
                f"{len(lost)} servers lost at once, more than r={r} can rebuild: shards {names}; "
                f"{placement.stripes_lost(lost)} of {placement.num_stripes()} stripes lost"
            )
        stuck = c.recoveries.stuck(now, spec.coordinator.recovery_timeout_seconds)
        if stuck is not None:
            return stuck
    limit = spec.coordinator.progress_timeout_seconds
    if c.ckpt is not None and (c.ckpt.cycle.holding or c.ckpt.cycle.all_done()):
        return None  # paused for a checkpoint or a restore, bounded by the recovery timeout above
    since = c.workers.last_step_at or c.progress.started_at
    # Workers give up after `limit` without progress and say why; this is the backstop for a worker that
    # cannot even say so.
    if since is not None and now - since > limit + 15.0:
        return f"no worker completed a step for {now - since:.0f}s (progressTimeoutSeconds {limit:g})"
    return None
