"""`ecrec chaos`: inject pod faults into a running ECRecJob, one at a time, and measure how it recovers.

Chaos Mesh's vocabulary: **pod-kill** deletes a pod (grace period 0 by default, as Chaos Mesh does);
**pod-failure** leaves the pod in place but makes its process unresponsive for `--duration` seconds. The job has
to notice a paused server through its coordinator (heartbeats stop, probes time out): the pod's phase stays
Running. Each fault waits until the job is healthy again (phase Running, every shard up, no recovery open, one
running pod per shard and rank) and `--interval` seconds more; then the next one. What is printed is a table of
the faults with the time from each fault to training continuing and to full recovery.

How pod-failure is injected (`--injector`):
- `chaos-mesh`: a Chaos Mesh `PodChaos` (chaos-mesh.org/v1alpha1, action pod-failure, the target pod, the
  duration), deleted again once the fault is over;
- `annotation`: the pod annotations `chaos.ecrec.dev/pause-seconds` and `chaos.ecrec.dev/pause-id` (a new id per
  fault), which the test kubelet (tests/k8s/kubelet/) honours in place of Chaos Mesh's daemon: SIGSTOP of the
  pod's processes, SIGCONT after the duration. Its node says so with the label `chaos.ecrec.dev/pause-annotation`;
- `auto` (default): chaos-mesh where the API server serves PodChaos, else annotation where the target's node
  carries that label, else an error saying what is missing.

Times: server faults are measured with the coordinator's own timestamps (`status.recoveries`: detectedAt,
continuedAt = the first training step after the detection, completedAt = every lost row rebuilt), relative to
the moment this command injected the fault (its clock; the coordinator's clock is assumed to agree). Worker
faults have no recovery record: training continues when the rank runs again (a replacement pod is Running, or
the pause is over), and it has recovered once, after that, the job's step (the slowest rank's) has advanced and
the job is healthy.

The decisions (which pod, which injector, what a status snapshot says about a fault, the table) are pure
functions of plain JSON dicts (tests/test_chaos.py); `run` does the I/O with the `kubernetes` client.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core.roles import ROLES as CORE_ROLES
from .podlabels import LABEL_JOB, pod_identity

ACTIONS = ("pod-kill", "pod-failure")
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
        if f.duration is not None:
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


# ---------------------------------------------------------------------------------------------- I/O --
@dataclass
class Options:
    job: str
    namespace: str | None = None
    action: str = "pod-kill"
    role: str = "any"
    interval: float = 10.0
    count: int = 1
    seed: int | None = None
    duration: float = 20.0
    injector: str = "auto"
    grace_period: int = 0
    timeout: float = 300.0
    kubeconfig: str | None = None
    context: str | None = None
    output: str = "table"
    poll: float = 0.5


def _kubeconfig_files(explicit: str | None) -> str | None:
    """The kubeconfig as kubectl finds it: --kubeconfig, else $KUBECONFIG (a list of files), else
    ~/.kube/config; None: in-cluster (the pod's service account)."""
    if explicit:
        return explicit
    env = os.environ.get("KUBECONFIG")
    if env and any(Path(p).expanduser().exists() for p in env.split(os.pathsep) if p):
        return env
    home = Path("~/.kube/config").expanduser()
    return str(home) if home.exists() else None


IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class Cluster:
    """The few API calls chaos makes, as JSON dicts."""

    def __init__(self, kubeconfig: str | None, context: str | None, namespace: str | None):
        try:
            from kubernetes import client, config
        except ImportError:
            raise ChaosError(
                "ecrec chaos needs the kubernetes client: pip install 'ecrec[operator]'"
            ) from None

        files = _kubeconfig_files(kubeconfig)
        if files is not None:
            self.api = config.new_client_from_config(config_file=files, context=context)
            _, active = config.list_kube_config_contexts(config_file=files)
            if context:
                contexts, _ = config.list_kube_config_contexts(config_file=files)
                active = next((c for c in contexts if c["name"] == context), active)
            default_ns = (active or {}).get("context", {}).get("namespace") or "default"
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)
            self.api = client.ApiClient(cfg)
            default_ns = (
                IN_CLUSTER_NAMESPACE.read_text().strip() if IN_CLUSTER_NAMESPACE.exists() else "default"
            )
        else:
            raise ChaosError(
                "no kubeconfig: pass --kubeconfig, set KUBECONFIG, create ~/.kube/config, or run in a pod"
            )
        self.namespace = namespace or default_ns
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def close(self) -> None:
        self.api.close()

    @staticmethod
    def _json(resp) -> Any:
        return json.loads(resp.data) if resp.data else None

    def job(self, name: str) -> dict:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._json(
                self.custom.get_namespaced_custom_object(
                    ECREC_GROUP, ECREC_VERSION, self.namespace, ECREC_PLURAL, name, _preload_content=False
                )
            )
        except ApiException as e:
            if e.status == 404:
                raise ChaosError(f"ECRecJob {self.namespace}/{name} not found") from None
            raise ChaosError(f"ECRecJob {self.namespace}/{name}: {e.status} {e.reason}") from None

    def pods(self, job: str) -> list[dict]:
        resp = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{LABEL_JOB}={job}", _preload_content=False
        )
        return self._json(resp)["items"]

    def node_honours_annotation(self, node: str) -> bool:
        from kubernetes.client.exceptions import ApiException

        if not node:
            return False
        try:
            obj = self._json(self.core.read_node(node, _preload_content=False))
        except ApiException:  # e.g. no permission to read nodes: then only --injector annotation uses it
            return False
        return (obj["metadata"].get("labels") or {}).get(PAUSE_NODE_LABEL) == "true"

    def has_chaos_mesh(self) -> bool:
        """Whether the API server serves PodChaos (discovery: every authenticated user may ask)."""
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self.custom.get_api_resources(CHAOS_MESH_GROUP, CHAOS_MESH_VERSION, _preload_content=False)
        except ApiException:  # 404: the group is not served
            return False
        return any(r.get("name") == PODCHAOS_PLURAL for r in self._json(resp).get("resources", []))

    def delete_pod(self, name: str, grace: int) -> None:
        self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=grace)

    def pause(self, pod: str, duration: float, fault_id: str) -> None:
        self.core.patch_namespaced_pod(pod, self.namespace, pause_patch(duration, fault_id))

    def create_pod_chaos(self, manifest: dict) -> None:
        self.custom.create_namespaced_custom_object(
            CHAOS_MESH_GROUP, CHAOS_MESH_VERSION, self.namespace, PODCHAOS_PLURAL, manifest
        )

    def delete_pod_chaos(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.custom.delete_namespaced_custom_object(
                CHAOS_MESH_GROUP, CHAOS_MESH_VERSION, self.namespace, PODCHAOS_PLURAL, name
            )
        except ApiException as e:
            if e.status != 404:
                raise


def _spec_counts(job: dict) -> tuple[int, int, float, str]:
    """(servers, workers, failure timeout, strategy) of the job's effective spec."""
    from ecrec.spec import job_from_spec

    j = job_from_spec(job["metadata"]["name"], job.get("spec") or {})
    s = j.spec
    return (
        s.servers.replicas,
        s.workers.replicas,
        s.coordinator.failure_timeout_seconds,
        s.fault_tolerance.strategy,
    )


def run(opts: Options, say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)):
    """Injects the faults; returns (faults, seed, exit code). Raises ChaosError for what cannot start."""
    if opts.action not in ACTIONS:
        raise ChaosError(f"--action {opts.action}: must be one of {', '.join(ACTIONS)}")
    if opts.role not in ROLES:
        raise ChaosError(f"--role {opts.role}: must be one of {', '.join(ROLES)}")
    if opts.count < 1 or opts.interval < 0 or opts.duration < 1 or opts.grace_period < 0:
        raise ChaosError("--count must be >= 1, --interval >= 0, --duration >= 1, --grace-period >= 0")
    seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    cluster = Cluster(opts.kubeconfig, opts.context, opts.namespace)
    try:
        return _run(opts, cluster, rng, seed, say)
    finally:
        cluster.close()


def _run(opts: Options, cluster: Cluster, rng: random.Random, seed: int, say) -> tuple[list[Fault], int, int]:
    ns = cluster.namespace
    job = cluster.job(opts.job)
    num_servers, num_workers, failure_timeout, strategy = _spec_counts(job)
    if "server" in roles_for(opts.role) and strategy != "ecrec":
        raise ChaosError(
            f"server faults need faultTolerance.strategy ecrec (the job's is {strategy}: a lost server fails "
            "it); use --role worker"
        )
    if opts.action == "pod-failure" and opts.duration <= failure_timeout:
        say(
            f"warning: --duration {opts.duration:g}s is not longer than the coordinator's failure timeout "
            f"({failure_timeout:g}s): a paused server may go unnoticed"
        )
    chaos_mesh = cluster.has_chaos_mesh() if opts.action == "pod-failure" else False
    say(
        f"chaos on ECRecJob {ns}/{opts.job}: {opts.count} x {opts.action} of role {opts.role}, seed {seed}"
        + (f", pauses of {opts.duration:g}s" if opts.action == "pod-failure" else "")
    )
    faults: list[Fault] = []
    # A silent server is declared failed after the failure timeout; allow for polling and slow ticks.
    detect_within = failure_timeout + 10.0
    for n in range(1, opts.count + 1):
        status = _wait_healthy(cluster, opts, num_servers, num_workers, say)
        if status is None:
            break
        if opts.interval:
            end = time.monotonic() + opts.interval
            while time.monotonic() < end:
                time.sleep(min(opts.poll, max(0.0, end - time.monotonic())))
            status = (cluster.job(opts.job).get("status")) or {}
            if status.get("phase") in DONE:
                say(f"the job is {status['phase']}: stopping after {len(faults)} faults")
                break
        pods = cluster.pods(opts.job)
        target = choose_target(pods, opts.role, rng)
        if target is None:
            raise ChaosError(f"no running pod of role {opts.role} in job {ns}/{opts.job}")
        injector = ""
        if opts.action == "pod-failure":
            injector = choose_injector(
                opts.injector,
                chaos_mesh,
                opts.injector == "auto" and cluster.node_honours_annotation(target.node),
            )
        fault = new_fault(n, opts.action, target, status, time.time(), opts.duration, injector)
        chaos_name = _inject(cluster, opts, fault)
        say(
            f"fault {n}/{opts.count}: {opts.action} {target.role} {target.index}: pod {target.name}"
            + (f" (injector {injector})" if injector else "")
        )
        faults.append(fault)
        try:
            while not fault.over:
                time.sleep(opts.poll)
                status = (cluster.job(opts.job).get("status")) or {}
                observe(
                    fault,
                    status,
                    cluster.pods(opts.job),
                    num_servers,
                    num_workers,
                    time.time(),
                    timeout=opts.timeout,
                    detect_within=detect_within,
                )
        finally:
            if chaos_name:
                cluster.delete_pod_chaos(chaos_name)
        row = dict(zip(COLUMNS, table_rows([fault])[0], strict=True))
        say(
            f"  detected {row['detected']}, training continued {row['continued']}, recovered "
            f"{row['recovered']}: {row['outcome']}"
        )
        if fault.outcome not in ("recovered", "undetected"):
            break
    ok = len(faults) == opts.count and all(f.outcome == "recovered" for f in faults)
    return faults, seed, 0 if ok else 1


def _inject(cluster: Cluster, opts: Options, fault: Fault) -> str | None:
    """Injects the fault; returns the name of the PodChaos to delete afterwards, if one was created."""
    if fault.action == "pod-kill":
        cluster.delete_pod(fault.pod, opts.grace_period)
        return None
    fault_id = f"{fault.n}-{uuid.uuid4().hex[:8]}"
    if fault.injector == "annotation":
        cluster.pause(fault.pod, opts.duration, fault_id)
        return None
    name = f"ecrec-chaos-{fault.pod}-{fault_id}"[:253]
    cluster.create_pod_chaos(pod_chaos(name, cluster.namespace, opts.job, fault.pod, opts.duration))
    return name


def _wait_healthy(cluster: Cluster, opts: Options, num_servers: int, num_workers: int, say) -> dict | None:
    """The job's status once it is ready for a fault; None if it finished first. ChaosError after --timeout."""
    deadline = time.monotonic() + opts.timeout
    last = None
    while True:
        status = (cluster.job(opts.job).get("status")) or {}
        if status.get("phase") in DONE:
            say(f"the job is {status['phase']}" + (f": {status['reason']}" if status.get("reason") else ""))
            return None
        why = unhealthy(status, cluster.pods(opts.job), num_servers, num_workers)
        if why is None and (status.get("step") or 0) > 0:
            return status
        why = why or "training has not started"
        if why != last:
            say(f"waiting for the job: {why}")
            last = why
        if time.monotonic() > deadline:
            raise ChaosError(f"the job was not healthy within {opts.timeout:g}s: {why}")
        time.sleep(opts.poll)


def print_table(faults: Sequence[Fault], seed: int, output: str = "table") -> None:
    if output == "json":
        print(json.dumps({"seed": seed, "faults": [fault_dict(f) for f in faults]}, indent=2))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    t = Table(box=box.SIMPLE, title=f"ecrec chaos (seed {seed})")
    for c in COLUMNS:
        t.add_column(c, justify="right" if c in ("#", "detected", "continued", "recovered") else "left")
    for row in table_rows(faults):
        t.add_row(*row)
    Console(width=200 if not sys.stdout.isatty() else None).print(t)


__all__ = [
    "ACTIONS",
    "ANY_ROLES",
    "ChaosError",
    "Fault",
    "Options",
    "choose_injector",
    "choose_target",
    "observe",
    "pod_chaos",
    "run",
    "table_rows",
    "unhealthy",
]
