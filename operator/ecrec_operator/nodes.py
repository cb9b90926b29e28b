"""The nodes a job's pods run on, as the operator sees them: their labels (failure domains, domains.py) and
whether they are lost — the machine died, or stopped talking to the cluster.

A node is lost when its object is gone, or when its Ready condition is Unknown: the node lifecycle controller
sets that once the kubelet has not renewed the node's lease for the node monitor grace period (40 s by
default). Then nothing on it reports or cleans up: its pods keep phase Running in the API, and a deletion
stays Terminating forever, since only the node's kubelet could confirm it. So the operator deletes the job's
pods there with grace period 0 (what the pod garbage collector does for out-of-service nodes), and they are
then replaced like any deleted pod (ecrec.core.reconcile), on other nodes. Ready False is not loss: the
kubelet is alive and said so, and stops its pods itself if it must.

A partitioned node's processes may outlive their pods: a server's successor has a new incarnation and the
coordinator fences the old one (docs/protocol.md), a worker's rank goes on under its new instance.

The decisions are pure functions of plain data; `NodeCache` reads nodes (`get` on nodes: the operator's
ClusterRole) and keeps each for `ttl` seconds, so that every job's pass can ask.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ecrec.podlabels import pod_identity

LOST_EVENT = "NodeLost"


@dataclass(frozen=True)
class NodeInfo:
    """What the operator needs of a Node: its labels and the status of its Ready condition (None: none)."""

    labels: Mapping[str, str] = field(default_factory=dict)
    ready: str | None = "True"


def lost_reason(name: str, node: NodeInfo | None) -> str | None:
    """Why node `name`'s pods are lost (None: they are not). `node` None: the node object is gone."""
    if node is None:
        return f"node {name} is gone"
    if node.ready == "Unknown":
        return f"node {name} stopped reporting (Ready Unknown)"
    return None


def pods_on_lost_nodes(pods: Iterable[dict], nodes: Mapping[str, NodeInfo | None]) -> list[tuple[dict, str]]:
    """The job's pods (the operator's index entries) bound to a lost node, each with the reason. A node not in
    `nodes` was not looked at and counts as healthy; a pod that finished (Succeeded, Failed) is left alone."""
    out = []
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        if not node or node not in nodes or pod_identity((p.get("metadata") or {}).get("labels")) is None:
            continue
        if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        why = lost_reason(node, nodes[node])
        if why is not None:
            out.append((p, why))
    return out


def bound_nodes(pods: Iterable[dict]) -> set[str]:
    return {n for p in pods if (n := (p.get("spec") or {}).get("nodeName"))}


class Unreadable(Exception):
    """A node could not be read (not because it is gone): nothing is decided on it this time."""


class NodeCache:
    """Node name -> `NodeInfo` (None when the node is gone), read with `read(name)` and kept for `ttl` seconds.
    A read that raises `Unreadable` is not kept, and the node is left out of `get`'s answer."""

    def __init__(self, read: Callable[[str], NodeInfo | None], ttl: float = 2.0):
        self._read, self._ttl = read, ttl
        self._cache: dict[str, tuple[float, NodeInfo | None]] = {}
        self._lock = threading.Lock()

    def get(self, names: Iterable[str]) -> dict[str, NodeInfo | None]:
        now, out = time.monotonic(), {}
        for name in set(names):
            with self._lock:
                hit = self._cache.get(name)
            if hit is None or now - hit[0] > self._ttl:
                try:
                    hit = (now, self._read(name))
                except Unreadable:
                    continue
                with self._lock:
                    self._cache[name] = hit
            out[name] = hit[1]
        return out

    def labels(self, names: Iterable[str]) -> dict[str, Mapping[str, str]]:
        """Node -> its labels, for the nodes that exist."""
        return {n: info.labels for n, info in self.get(names).items() if info is not None}
