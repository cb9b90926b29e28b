"""A successor coordinator's side of failover (docs/protocol.md, "Coordinator failover"): the state it takes
over from its predecessor's seed, and the moment its watch for failures starts. Called with the coordinator's
lock held (or, from its constructor, before anyone else can hold it)."""

from __future__ import annotations


def restore(c, seed: dict, max_events: int) -> None:
    """Take over what the dead coordinator last published (`Coordinator.resume_state`)."""
    now = c.clock()
    c.cluster.restore(seed, now)
    p = c.progress
    p.started_at = seed.get("startedAt")
    p.finished_at = seed.get("finishedAt")
    c.workers.last_step_at = seed.get("lastStepAt")
    c.workers.restore(seed.get("workers", []), now)
    c.recoveries.restore(seed.get("recoveries", []))
    p.events = [dict(e) for e in seed.get("events", [])][-max_events:]
    if p.started_at is not None:
        p.samples_log.append((now, p.total_samples))
        p.timeline.start(now, p.total_samples)
    p.event("coordinator_restored", now, generation=c.generation, epoch=c.cluster.epoch)
    c.apply([])


def serving(c) -> None:
    """The process answers from now on: nobody's heartbeat could arrive before, so the failure timeouts of the
    servers and workers a seed restored count from now (a successor slow to start, e.g. on a busy machine,
    declared every server it restored failed before any could reach it)."""
    now = c.clock()
    c.cluster.serving(now)
    c.workers.serving(now)
