"""`ecrec chaos --node NAME|random`: a node lost, as when its machine dies — every pod of the job on it gone at
once, the node silent — for `--duration` seconds; then the node comes back.

How the loss is injected (`--injector`):
- `annotation`: the node annotations `chaos.ecrec.dev/node-down-seconds` and `chaos.ecrec.dev/node-down-id` (a
  new id per fault), which the test kubelet (tests/k8s/kubelet/) honours as a machine death: it SIGKILLs the
  node's pods' processes and stops the node's heartbeat and lease for that long, so the node lifecycle
  controller marks it NotReady (Ready Unknown) after its grace period and taints it, exactly as for a dead
  machine. Its nodes say so with the label `chaos.ecrec.dev/node-down-annotation=true`.
- `taint`, for any cluster (a real machine cannot be killed through the API): the node is cordoned and tainted
  `chaos.ecrec.dev/node-down:NoExecute` (Kubernetes evicts every pod there that does not tolerate it) and the
  job's pods on it are deleted with grace period 0 at once; after the duration the taint and the cordon go.
  The node stays Ready: what the job meets is its pods gone together and nothing new placed there.
- `auto` (default): annotation where the node carries that label, else taint.

A node fault is measured as one fault per pod of the job that ran on the node (`ecrec.chaos.Fault`, action
node-loss, the node named), each observed as a pod-kill of that pod would be; the fault is over when all are.

Pure decisions here (tests/test_chaos_nodes.py); the API calls are `ecrec.chaos.Cluster`'s.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from .faults import (
    NODE_DOWN_ID,
    NODE_DOWN_LABEL,
    NODE_DOWN_SECONDS,
    ChaosError,
    Fault,
    PodView,
    new_fault,
    views,
)

NODE_ACTION = "node-loss"
NODE_INJECTORS = ("auto", "annotation", "taint")
NODE_TAINT_KEY = "chaos.ecrec.dev/node-down"


def job_nodes(pods: Iterable[dict]) -> dict[str, list[PodView]]:
    """node -> the job's running pods on it, by name."""
    out: dict[str, list[PodView]] = {}
    for v in sorted(views(pods), key=lambda v: v.name):
        if v.running and v.node:
            out.setdefault(v.node, []).append(v)
    return out


def choose_node(requested: str, pods: Iterable[dict], nodes: Sequence[str], rng: random.Random) -> str:
    """The node to lose: `requested`, which must exist, or for `random` one of the nodes running a pod of the
    job (sorted: a seed picks the same node for the same cluster)."""
    if requested != "random":
        if requested not in nodes:
            raise ChaosError(
                f"--node {requested}: no such node (nodes: {', '.join(sorted(nodes)) or 'none'})"
            )
        return requested
    pool = sorted(job_nodes(pods))
    if not pool:
        raise ChaosError("--node random: no node runs a pod of the job")
    return rng.choice(pool)


def choose_node_injector(requested: str, node_labels: dict[str, str] | None) -> str:
    if requested not in NODE_INJECTORS:
        raise ChaosError(f"--injector {requested}: a node loss takes one of {', '.join(NODE_INJECTORS)}")
    if requested != "auto":
        return requested
    return "annotation" if (node_labels or {}).get(NODE_DOWN_LABEL) == "true" else "taint"


def down_patch(seconds: float, fault_id: str) -> dict:
    """The merge patch of the annotation injector: a new id makes it a new loss."""
    return {"metadata": {"annotations": {NODE_DOWN_SECONDS: f"{seconds:g}", NODE_DOWN_ID: fault_id}}}


def taint_patch(node: dict, down: bool) -> dict:
    """The merge patch that cordons and taints `node` (down) or lifts both (a merge patch replaces the taint
    list whole: the node's other taints are kept as they are)."""
    spec = node.get("spec") or {}
    taints = [t for t in spec.get("taints") or [] if t.get("key") != NODE_TAINT_KEY]
    if down:
        taints.append({"key": NODE_TAINT_KEY, "value": "true", "effect": "NoExecute"})
    return {"spec": {"unschedulable": down or None, "taints": taints or None}}


def node_faults(
    n: int, node: str, pods: Iterable[dict], status: dict, now: float, duration: float, injector: str
) -> list[Fault]:
    """One fault per pod of the job running on `node` when it is lost."""
    out = []
    for target in job_nodes(pods).get(node, []):
        f = new_fault(n, NODE_ACTION, target, status, now, injector=injector)
        f.duration, f.node = duration, node
        out.append(f)
    return out
