"""`ecrec chaos`'s loop: wait until the job is healthy, inject a fault, observe the job until it has recovered
(or not), then the next one (see the package docstring)."""

from __future__ import annotations

import json
import random
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .cluster import Cluster
from .faults import (
    ACTIONS,
    COLUMNS,
    DONE,
    ROLES,
    ChaosError,
    Fault,
    choose_injector,
    choose_target,
    fault_dict,
    new_fault,
    observe,
    pod_chaos,
    roles_for,
    table_rows,
    unhealthy,
)
from .nodes import NODE_ACTION, choose_node, choose_node_injector, down_patch, node_faults, taint_patch


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
    node: str | None = None  # node-loss: the node's name, or "random" (nodes.py)


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
    if (opts.node is not None) != (opts.action == NODE_ACTION):
        raise ChaosError("--node goes with --action node-loss (and node-loss with --node NAME|random)")
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
    node_loss = opts.action == NODE_ACTION
    if (node_loss or "server" in roles_for(opts.role)) and strategy != "ecrec":
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
    if node_loss:
        say(
            f"chaos on ECRecJob {ns}/{opts.job}: {opts.count} x node-loss of {opts.node or 'random'} for "
            f"{opts.duration:g}s, seed {seed}"
        )
    else:
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
                say(f"the job is {status['phase']}: stopping after {n - 1} faults")
                break
        pods = cluster.pods(opts.job)
        if node_loss:
            new, undo = _inject_node_loss(cluster, opts, n, pods, status, rng, say)
        else:
            new, undo = _inject_pod_fault(cluster, opts, n, pods, status, rng, chaos_mesh, say)
        faults.extend(new)
        try:
            # (A node that runs none of the job's pods is lost all the same: its taint stays for the duration.)
            while not all(f.over for f in new) or (not new and undo is not None):
                time.sleep(opts.poll)
                status = (cluster.job(opts.job).get("status")) or {}
                pods = cluster.pods(opts.job)
                for f in new:
                    observe(
                        f,
                        status,
                        pods,
                        num_servers,
                        num_workers,
                        time.time(),
                        timeout=opts.timeout,
                        detect_within=detect_within,
                    )
                if undo is not None and undo(time.time()):
                    undo = None
        finally:
            if undo is not None:
                undo(None)
        for f in new:
            row = dict(zip(COLUMNS, table_rows([f])[0], strict=True))
            say(
                f"  {row['fault']}: detected {row['detected']}, training continued {row['continued']}, "
                f"recovered {row['recovered']}: {row['outcome']}"
            )
        if any(f.outcome not in ("recovered", "undetected") for f in new):
            break
    ok = len({f.n for f in faults}) == opts.count and all(f.outcome == "recovered" for f in faults)
    return faults, seed, 0 if ok else 1


# An undo ends what an injection left behind: called with the time while the fault is observed (True: done) and
# with None once it is over, whatever happened.
Undo = Callable[[float | None], bool]


def _inject_pod_fault(
    cluster: Cluster, opts: Options, n: int, pods: list[dict], status: dict, rng, chaos_mesh: bool, say
) -> tuple[list[Fault], Undo | None]:
    target = choose_target(pods, opts.role, rng)
    if target is None:
        raise ChaosError(f"no running pod of role {opts.role} in job {cluster.namespace}/{opts.job}")
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
    if not chaos_name:
        return [fault], None

    def undo(now: float | None) -> bool:
        if now is None:
            cluster.delete_pod_chaos(chaos_name)
        return False  # the PodChaos goes once the fault is over

    return [fault], undo


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


def _inject_node_loss(
    cluster: Cluster, opts: Options, n: int, pods: list[dict], status: dict, rng, say
) -> tuple[list[Fault], Undo | None]:
    """Loses a node (nodes.py): one fault per pod of the job on it. Its undo lifts the taint once the duration
    is over (the annotation injector's node comes back by itself)."""
    names = [(nd.get("metadata") or {}).get("name", "") for nd in cluster.nodes()]
    node = choose_node(opts.node or "random", pods, names, rng)
    obj = cluster.node(node)
    injector = choose_node_injector(opts.injector, (obj.get("metadata") or {}).get("labels"))
    now = time.time()
    new = node_faults(n, node, pods, status, now, opts.duration, injector)
    lost = ", ".join(f"{f.role} {f.index}" for f in new) or "no pod of the job"
    if injector == "annotation":
        cluster.patch_node(node, down_patch(opts.duration, f"{n}-{uuid.uuid4().hex[:8]}"))
    else:
        cluster.patch_node(node, taint_patch(obj, down=True))
        try:
            for f in new:
                cluster.delete_pod(f.pod, 0)
        except BaseException:  # a node left cordoned and tainted would outlive the chaos run
            cluster.patch_node(node, taint_patch(cluster.node(node), down=False))
            raise
    say(f"fault {n}/{opts.count}: node-loss {node} for {opts.duration:g}s (injector {injector}): {lost}")
    if injector == "annotation":
        return new, None
    until = now + opts.duration

    def undo(t: float | None) -> bool:
        if t is not None and t < until:
            return False
        cluster.patch_node(node, taint_patch(cluster.node(node), down=False))
        say(f"  node {node} is back (taint and cordon lifted)")
        return True

    return new, undo


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
