"""The ECRecJob's status, as a pure function of what the operator observed (no I/O).

The coordinator's `/v1/status` is the source of truth for training (phase, step, throughput, shards,
recoveries); the pods give the replica counts. Conditions follow Kubeflow: one per type, `lastTransitionTime`
kept while the status does not change, reasons `ECRecJob<Suffix>`. The result is validated against
`ecrec.spec.JobStatus` (the CRD's status schema) and returned as the body of a status merge patch.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

from ecrec.core.reconcile import Proc
from ecrec.spec import CheckpointingStatus, JobSpec, JobStatus

# Which condition types hold in each phase (Created holds from the first pass on).
PHASE_CONDITIONS = {
    "Pending": set(),
    "Running": {"Running"},
    "Degraded": {"Running", "Degraded"},
    "Recovering": {"Running", "Recovering"},
    "Checking": {"Running", "Checking"},  # trained; the final checks run before the job is complete
    "Succeeded": {"Succeeded"},
    "Failed": {"Failed"},
}


def _ts(t: datetime.datetime | float | None) -> str | None:
    if t is None:
        return None
    if isinstance(t, int | float):
        t = datetime.datetime.fromtimestamp(t, datetime.UTC)
    return t.astimezone(datetime.UTC).isoformat().replace("+00:00", "Z")


def set_condition(
    conditions: list[dict], ctype: str, status: str, reason: str, message: str, now: str
) -> list[dict]:
    """The conditions with `ctype` set; its lastTransitionTime changes only when its status does."""
    out, found = [], False
    for c in conditions:
        if c.get("type") == ctype:
            found = True
            changed = c.get("status") != status
            c = {
                **c,
                "status": status,
                "reason": reason,
                "message": message,
                "lastUpdateTime": now,
                "lastTransitionTime": now if changed else c.get("lastTransitionTime", now),
            }
        out.append(c)
    if not found:
        out.append(
            {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "lastUpdateTime": now,
                "lastTransitionTime": now,
            }
        )
    return out


def _replicas(procs: Iterable[Proc]) -> dict:
    out: dict[str, dict[str, int]] = {}
    for p in procs:
        r = out.setdefault(p.role, {"active": 0, "succeeded": 0, "failed": 0})
        if p.state in ("pending", "running"):
            r["active"] += 1
        elif p.state == "succeeded":
            r["succeeded"] += 1
        elif p.state == "failed":
            r["failed"] += 1
    return out


def job_status(
    spec: JobSpec,
    coordinator: dict | None,
    procs: Iterable[Proc],
    previous: dict,
    now: datetime.datetime,
    *,
    replacements: int,
) -> dict:
    """The status merge patch for this pass. `coordinator` is its /v1/status (None while it is not up)."""
    procs = list(procs)
    ts = _ts(now)
    c = coordinator or {}
    phase = c.get("phase") or "Pending"
    reason = c.get("reason")
    conditions = set_condition(
        list(previous.get("conditions") or []), "Created", "True", "ECRecJobCreated", "pods created", ts
    )
    holds = PHASE_CONDITIONS.get(phase, set())
    for ctype in ("Running", "Degraded", "Recovering", "Checking", "Succeeded", "Failed"):
        if ctype in holds:
            conditions = set_condition(
                conditions, ctype, "True", f"ECRecJob{ctype}", reason or f"job is {phase}", ts
            )
        elif any(x.get("type") == ctype for x in conditions):
            conditions = set_condition(conditions, ctype, "False", f"ECRecJob{ctype}", f"job is {phase}", ts)
    pods_by_shard = {
        p.index: p.instance for p in procs if p.role == "server" and p.state in ("pending", "running")
    }
    shards = [
        {
            "shard": int(s["shard"]),
            "state": s.get("state"),
            "incarnation": int(s.get("incarnation", 0)),
            **({"pod": pods_by_shard[int(s["shard"])]} if int(s["shard"]) in pods_by_shard else {}),
        }
        for s in c.get("cluster", {}).get("shards", [])
    ]
    t0 = c.get("startedAt")

    def at(rel: float | None) -> str | None:
        return _ts(t0 + rel) if rel is not None and t0 is not None else None

    recoveries = [
        {
            "shard": r["shard"],
            "state": r.get("state"),
            "killedAt": at(r.get("killed_at")),
            "detectedAt": at(r.get("detected_at")),
            "continuedAt": at(r.get("continued_at")),
            "completedAt": at(r.get("completed_at")),
            "rowsRecovered": r.get("rows_recovered"),
            "message": r.get("error"),
        }
        for r in c.get("recoveries", [])
    ]
    out = {
        "phase": phase,
        "reason": reason,
        "conditions": conditions,
        "startTime": previous.get("startTime") or ts,
        # Succeeded is complete only once the final checks ran (the handler sets it then).
        "completionTime": previous.get("completionTime") or (ts if phase == "Failed" else None),
        "step": c.get("step"),
        "totalSteps": spec.training.steps,
        "samplesPerSecond": c.get("samplesPerSecond"),
        "servers": {
            "up": sum(s["state"] == "up" for s in shards),
            "total": spec.servers.replicas,
            "shards": shards,
        }
        if shards
        else {"up": 0, "total": spec.servers.replicas},
        "replicaStatuses": _replicas(procs),
        "recoveries": [{k: v for k, v in r.items() if v is not None} for r in recoveries],
        "replacements": replacements,
        # What a replacement coordinator starts from (docs/protocol.md, Coordinator failover).
        "resume": _without_nulls(c.get("resume")),
        "checkpointing": _checkpointing(c.get("checkpointing")),
    }
    if not coordinator:
        # Nothing to say about training yet (or the coordinator is momentarily unreachable): keep what was.
        for key in ("phase", "step", "samplesPerSecond", "recoveries", "reason", "resume", "checkpointing"):
            if previous.get(key) is not None:
                out[key] = previous[key]
        out["conditions"] = previous.get("conditions") or conditions
        out.pop("servers") if previous.get("servers") else None
    validated = JobStatus.model_validate({k: v for k, v in out.items() if v is not None})
    return validated.to_dict()


def _checkpointing(stats: dict | None) -> dict | None:
    """The coordinator's checkpoint stats as the status schema has them (its interval settings are the spec's)."""
    if not stats:
        return None
    fields = {f.alias for f in CheckpointingStatus.model_fields.values()}
    return _without_nulls({k: v for k, v in stats.items() if k in fields})


def _without_nulls(value: Any) -> Any:
    """`value` without null fields, at any depth: a merge patch deletes a field set to null, so the stored
    status would never equal what was sent and every pass would patch it again."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


# Conditions that describe a running job: False while it is suspended (it has no pods).
_RUNNING_CONDITIONS = ("Running", "Degraded", "Recovering", "Checking", "FailureDomainsAtRisk")


def suspended_status(previous: dict, now: datetime.datetime) -> dict:
    """The status merge patch of a suspended job (runPolicy.suspend): phase Suspended, condition Suspended,
    and what a resumed job must not carry over cleared (None deletes a field in a merge patch): its start time
    (activeDeadlineSeconds counts from the resume, as a Kubernetes Job's does), the coordinator's incarnation
    and seed (a resumed job starts afresh, not as a coordinator failover)."""
    ts = _ts(now)
    message = "runPolicy.suspend is true: the job's pods are deleted and none are created"
    conditions = set_condition(
        list(previous.get("conditions") or []), "Suspended", "True", "ECRecJobSuspended", message, ts
    )
    for ctype in _RUNNING_CONDITIONS:
        if any(c.get("type") == ctype and c.get("status") == "True" for c in conditions):
            conditions = set_condition(
                conditions, ctype, "False", "ECRecJobSuspended", "job is suspended", ts
            )
    return {
        "phase": "Suspended",
        "reason": message,
        "conditions": conditions,
        "startTime": None,
        "coordinatorIncarnation": None,
        "resume": None,
        "samplesPerSecond": None,
    }


def resumed_status(previous: dict, now: datetime.datetime) -> dict:
    """The status merge patch of a job resumed once its suspended pods are gone: Pending, condition Suspended
    False, and the last run's training state cleared (the job starts over from step 0)."""
    ts = _ts(now)
    conditions = set_condition(
        list(previous.get("conditions") or []), "Suspended", "False", "ECRecJobResumed", "job is resumed", ts
    )
    cleared = ("step", "samplesPerSecond", "servers", "recoveries", "checkpointing", "startTime")
    return {"phase": "Pending", "reason": "resumed", "conditions": conditions, **dict.fromkeys(cleared)}
