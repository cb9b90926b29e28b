"""The pure part of `ecrec chaos`: the job's pods as chaos sees them, which one a fault hits, whether the job is
healthy, what a status snapshot says about a fault, and the table of faults (tests/test_chaos.py). Plain JSON
dicts in, plain data out; ecrec.chaos.run does the I/O.
"""

from __future__ import annotations

import datetime
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ecrec.core.roles import ROLES as CORE_ROLES
from ecrec.podlabels import LABEL_JOB, pod_identity

ACTIONS = ("pod-kill", "pod-failure", "node-loss")
INJECTORS = ("auto", "chaos-mesh", "annotation")
# The roles `--role any` draws from, and the only ones a fault may target: every process role (ecrec.core.roles)
# in the order a seeded draw has always used. The coordinator fails over (docs/protocol.md): its successor
# starts from the state the operator keeps in the job's status.
ANY_ROLES: tuple[str, ...] = ("server", "worker", "coordinator")
assert sorted(ANY_ROLES) == sorted(CORE_ROLES)
ROLES = (*ANY_ROLES, "any")

# The annotation injector (honoured by tests/k8s/kubelet/) and the node label saying a node honours it.
PAUSE_SECONDS = "chaos.ecrec.dev/pause-seconds"
PAUSE_ID = "chaos.ecrec.dev/pause-id"
PAUSE_NODE_LABEL = "chaos.ecrec.dev/pause-annotation"
# Node loss by annotation (honoured by the test kubelet, which says so with the node label): a new id makes the
# node's machine die — its pods' processes SIGKILLed, no heartbeat, no status — for that many seconds.
NODE_DOWN_SECONDS = "chaos.ecrec.dev/node-down-seconds"
NODE_DOWN_ID = "chaos.ecrec.dev/node-down-id"
NODE_DOWN_LABEL = "chaos.ecrec.dev/node-down-annotation"

CHAOS_MESH_GROUP, CHAOS_MESH_VERSION, PODCHAOS_PLURAL = "chaos-mesh.org", "v1alpha1", "podchaos"
ECREC_GROUP, ECREC_VERSION, ECREC_PLURAL = "ecrec.dev", "v1alpha1", "ecrecjobs"
DONE = ("Succeeded", "Failed")


class ChaosError(Exception):
    """A fault that cannot be injected, or a job that cannot be found: one line for the user."""


def roles_for(role: str) -> tuple[str, ...]:
    return ANY_ROLES if role == "any" else (role,)


# -------------------------------------------------------------------------------------------- pods --
@dataclass(frozen=True)
class PodView:
    """What chaos needs to know of one of the job's pods."""

    name: str
    role: str
    index: int  # shard id, rank, 0 for the coordinator
    incarnation: int
    phase: str
    deleting: bool
    node: str

    @property
    def running(self) -> bool:
        return self.phase == "Running" and not self.deleting


def view(pod: dict) -> PodView | None:
    """A pod (as the API returns it, camelCase JSON) of the job, or None if it is not one of its processes."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if (ident := pod_identity(meta.get("labels"))) is None:
        return None
    role, index, incarnation = ident
    return PodView(
        name=meta.get("name", ""),
        role=role,
        index=index,
        incarnation=incarnation,
        phase=status.get("phase", "Pending"),
        deleting=bool(meta.get("deletionTimestamp")),
        node=(pod.get("spec") or {}).get("nodeName") or "",
    )


def views(pods: Iterable[dict]) -> list[PodView]:
    return [v for v in (view(p) for p in pods) if v is not None]


def candidates(pods: Iterable[dict], role: str) -> list[PodView]:
    """The pods a fault may hit: running, not being deleted, of the roles `role` stands for; sorted by name so
    that a seed picks the same pod for the same cluster."""
    roles = roles_for(role)
    return sorted((v for v in views(pods) if v.role in roles and v.running), key=lambda v: v.name)


def choose_target(pods: Iterable[dict], role: str, rng: random.Random) -> PodView | None:
    pool = candidates(pods, role)
    return rng.choice(pool) if pool else None


# ----------------------------------------------------------------------------------------- health --
def unhealthy(status: dict, pods: Iterable[dict], num_servers: int, num_workers: int) -> str | None:
    """Why the job is not ready for the next fault (nor recovered from the last), or None when it is: phase
    Running, every shard up, no recovery open, exactly one running pod per shard, rank and the coordinator."""
    phase = status.get("phase")
    if phase != "Running":
        return f"phase {phase or 'unknown'}" + (f" ({status['reason']})" if status.get("reason") else "")
    servers = status.get("servers") or {}
    if servers.get("up") != num_servers:
        return f"{servers.get('up', 0)}/{num_servers} servers up"
    for rec in status.get("recoveries") or []:
        if rec.get("state") != "completed":
            return f"recovery of shard {rec.get('shard')} is {rec.get('state')}"
    running: dict[tuple[str, int], int] = {}
    for v in views(pods):
        if v.running:
            running[(v.role, v.index)] = running.get((v.role, v.index), 0) + 1
    for role, n in (("coordinator", 1), ("server", num_servers), ("worker", num_workers)):
        for i in range(n):
            got = running.get((role, i), 0)
            if got != 1:
                what = {"coordinator": "the coordinator", "server": f"shard {i}", "worker": f"rank {i}"}[role]
                return f"{what} has {got} running pods"
    return None


# ---------------------------------------------------------------------------------------- injector --
def choose_injector(requested: str, chaos_mesh: bool, node_honours_annotation: bool) -> str:
    """The pod-failure injector to use; ChaosError when the requested one cannot work here."""
    if requested not in INJECTORS:
        raise ChaosError(f"--injector {requested}: must be one of {', '.join(INJECTORS)}")
    if requested == "chaos-mesh" and not chaos_mesh:
        raise ChaosError(
            f"--injector chaos-mesh: the API server does not serve {PODCHAOS_PLURAL}.{CHAOS_MESH_GROUP}/"
            f"{CHAOS_MESH_VERSION}; install Chaos Mesh (https://chaos-mesh.org) first"
        )
    if requested == "chaos-mesh" or (requested == "auto" and chaos_mesh):
        return "chaos-mesh"
    if requested == "annotation" or node_honours_annotation:
        return "annotation"
    raise ChaosError(
        "pod-failure needs Chaos Mesh (no PodChaos resource, chaos-mesh.org/v1alpha1, on this cluster) or a node "
        f"that honours the {PAUSE_SECONDS} annotation (label {PAUSE_NODE_LABEL}=true, the test kubelet); "
        "install Chaos Mesh, or use --action pod-kill"
    )


def pod_chaos(name: str, namespace: str, job: str, pod: str, duration: float) -> dict:
    """The Chaos Mesh PodChaos that makes one pod fail for `duration` seconds."""
    return {
        "apiVersion": f"{CHAOS_MESH_GROUP}/{CHAOS_MESH_VERSION}",
        "kind": "PodChaos",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {LABEL_JOB: job, "app.kubernetes.io/managed-by": "ecrec-chaos"},
        },
        "spec": {
            "action": "pod-failure",
            "mode": "one",
            "duration": f"{duration:g}s",
            "selector": {"pods": {namespace: [pod]}},
        },
    }


def pause_patch(duration: float, fault_id: str) -> dict:
    """The merge patch of the annotation injector: a new id makes it a new fault."""
    return {"metadata": {"annotations": {PAUSE_SECONDS: f"{duration:g}", PAUSE_ID: fault_id}}}


# ------------------------------------------------------------------------------------------- faults --
def parse_time(text: str | None) -> float | None:
    """An RFC 3339 time of the status (`2024-05-01T12:00:00.25Z`) as a Unix time."""
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def recovery_key(rec: dict) -> tuple:
    return (rec.get("shard"), rec.get("detectedAt") or rec.get("killedAt"))


@dataclass
class Fault:
    """One injected fault and what the job's status has said about it so far."""

    n: int
    action: str
    role: str
    index: int
    pod: str
    incarnation: int
    injected_at: float  # Unix time (this command's clock)
    duration: float | None = None  # pod-failure: how long the process is paused
    injector: str = ""  # pod-failure: chaos-mesh | annotation
    known: frozenset = frozenset()  # recovery records that existed before the fault
    detected_at: float | None = None
    continued_at: float | None = None
    recovered_at: float | None = None
    rows: int | None = None
    outcome: str = "running"  # running | recovered | undetected | timeout | job failed
    note: str = ""
    resumed_step: int | None = None  # workers: the job's step when the rank ran again
    node: str = ""  # node-loss: the node lost (chaosnodes.py)

    @property
    def over(self) -> bool:
        return self.outcome != "running"

    def rel(self, t: float | None) -> float | None:
        return None if t is None else t - self.injected_at


def new_fault(
    n: int, action: str, target: PodView, status: dict, now: float, duration: float | None = None, injector=""
) -> Fault:
    return Fault(
        n=n,
        action=action,
        role=target.role,
        index=target.index,
        pod=target.name,
        incarnation=target.incarnation,
        injected_at=now,
        duration=duration if action == "pod-failure" else None,
        injector=injector,
        known=frozenset(recovery_key(r) for r in status.get("recoveries") or []),
    )


def observe(
    fault: Fault,
    status: dict,
    pods: Sequence[dict],
    num_servers: int,
    num_workers: int,
    now: float,
    *,
    timeout: float,
    detect_within: float,
) -> Fault:
    """Updates `fault` from one snapshot of the job's status and pods taken at `now`; returns it.

    `detect_within`: seconds after a server's pause ended by which a failure that the coordinator has not
    declared counts as undetected (the pause was shorter than its failure timeout)."""
    if fault.over:
        return fault
    phase = status.get("phase")
    if phase == "Failed":
        fault.outcome, fault.note = "job failed", status.get("reason") or ""
        return fault
    healthy = unhealthy(status, pods, num_servers, num_workers) is None
    finished = phase == "Succeeded"
    if fault.role == "server":
        _observe_server(fault, status, healthy or finished, now, detect_within)
    else:
        _observe_worker(fault, status, pods, healthy, finished, now)
    if not fault.over and now - fault.injected_at > timeout:
        fault.outcome = "timeout"
        fault.note = unhealthy(status, pods, num_servers, num_workers) or "not recovered"
    return fault


def _observe_server(fault: Fault, status: dict, healthy: bool, now: float, detect_within: float) -> None:
    rec = next(
        (
            r
            for r in status.get("recoveries") or []
            if r.get("shard") == fault.index and recovery_key(r) not in fault.known
        ),
        None,
    )
    if rec is None:
        paused_until = fault.injected_at + (fault.duration or 0.0)
        if fault.action == "pod-failure" and healthy and now > paused_until + detect_within:
            fault.outcome = "undetected"
            fault.note = "the pause ended before the coordinator declared the server failed"
        return
    fault.detected_at = parse_time(rec.get("detectedAt"))
    fault.continued_at = parse_time(rec.get("continuedAt"))
    fault.rows = rec.get("rowsRecovered")
    if rec.get("state") == "failed":
        fault.outcome, fault.note = "recovery failed", rec.get("message") or ""
    elif rec.get("state") == "completed" and healthy:
        fault.recovered_at = parse_time(rec.get("completedAt"))
        fault.outcome = "recovered"


def _observe_worker(
    fault: Fault, status: dict, pods: Sequence[dict], healthy: bool, finished: bool, now: float
) -> None:
    # A worker's rank, or the coordinator: no coordinator record to read, the pods and the step tell.
    rank = [v for v in views(pods) if v.role == fault.role and v.index == fault.index]
    replaced = any(v.running and v.incarnation > fault.incarnation for v in rank)
    step = status.get("step") or 0
    if fault.continued_at is None:
        if replaced:
            fault.continued_at = now
        elif fault.action == "pod-failure" and now >= fault.injected_at + (fault.duration or 0.0):
            victim = next((v for v in rank if v.name == fault.pod), None)
            if victim is not None and victim.running:
                fault.continued_at = fault.injected_at + (fault.duration or 0.0)  # the pause is over
        if fault.continued_at is not None:
            fault.resumed_step = step
            fault.note = "replaced" if replaced else "resumed"
    if finished:
        fault.recovered_at, fault.outcome = now, "recovered"
        fault.note = (fault.note + "; " if fault.note else "") + "the job finished"
    elif fault.continued_at is not None and healthy and step > (fault.resumed_step or 0):
        fault.recovered_at, fault.outcome = now, "recovered"


# -------------------------------------------------------------------------------------------- table --
COLUMNS = ("#", "fault", "pod", "injected", "detected", "continued", "recovered", "rows rebuilt", "outcome")


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}s"


def table_rows(faults: Iterable[Fault]) -> list[tuple[str, ...]]:
    """One row per fault: the times are seconds after the fault was injected."""
    rows = []
    for f in faults:
        what = f"{f.action} {f.role} {f.index}"
        if f.node:
            what = f"{f.action} {f.node}" + (f" ({f.duration:g}s)" if f.duration is not None else "")
            what += f": {f.role} {f.index}"
        elif f.duration is not None:
            what += f" ({f.duration:g}s)"
        injected = datetime.datetime.fromtimestamp(f.injected_at, datetime.UTC).strftime("%H:%M:%S")
        rows.append(
            (
                str(f.n),
                what,
                f.pod,
                injected,
                _secs(f.rel(f.detected_at)),
                _secs(f.rel(f.continued_at)),
                _secs(f.rel(f.recovered_at)),
                "-" if f.rows is None else f"{f.rows:,}",
                f.outcome + (f" ({f.note})" if f.note else ""),
            )
        )
    return rows


def fault_dict(f: Fault) -> dict:
    return {
        "n": f.n,
        "action": f.action,
        "role": f.role,
        "index": f.index,
        "pod": f.pod,
        "node": f.node or None,
        "injector": f.injector or None,
        "duration": f.duration,
        "injectedAt": f.injected_at,
        "detectedSeconds": f.rel(f.detected_at),
        "continuedSeconds": f.rel(f.continued_at),
        "recoveredSeconds": f.rel(f.recovered_at),
        "rowsRecovered": f.rows,
        "outcome": f.outcome,
        "note": f.note,
    }
