"""The scheduler's part: pending pods bound to the node.

`Binder` binds every pending unbound pod of the default scheduler to its node (the `binding` subresource),
unless the pod's `nodeSelector` does not match the node's labels (then PodScheduled=False, Unschedulable);
there is no resource accounting: every pod fits. It is fed the watch of unbound pods (kubelet.py; not with
`bind_pending=False`, for a second kubelet in one cluster). It stands in for kube-scheduler where that does
not run (one node, the default of the `kube` fixture and `make k8s-up`): it binds every pod whatever it
asks for, where kube-scheduler accounts requests against the nodes' capacity. With kube-scheduler (several
nodes: `make k8s-up NODES=4`, the `kube_multi` fixture) no Binder runs.

Only the watch thread of unbound pods calls a Binder: no lock.
"""

from __future__ import annotations

import logging
from typing import Any

from kubernetes.client.exceptions import ApiException

from .api import TERMINAL, now_iso
from .node import Node


class Binder:
    """Binds pending pods to one node. `call` is the kubelet's API call wrapper (returns JSON dicts)."""

    def __init__(self, node: Node, call, core: Any, log: logging.Logger):
        self.node = node
        self.call = call
        self.core = core
        self.log = log
        self._unschedulable: dict[str, str] = {}  # uid -> message last written

    def sync(self, pods: list[dict]) -> None:
        for p in pods:
            self.on_event("ADDED", p)

    def on_event(self, etype: str, pod: dict) -> None:
        """The scheduler's part: bind a pending pod to this node."""
        meta, spec = pod["metadata"], pod["spec"]
        if etype == "DELETED" or spec.get("nodeName") or meta.get("deletionTimestamp"):
            return  # DELETED here also means "left the selection": bound meanwhile
        if spec.get("schedulerName", "default-scheduler") != "default-scheduler":
            return
        if (pod.get("status") or {}).get("phase") in TERMINAL:
            return
        key = f"{meta['namespace']}/{meta['name']}"
        labels = self.node.labels()
        mismatch = {k: v for k, v in (spec.get("nodeSelector") or {}).items() if labels.get(k) != v}
        try:
            if mismatch:
                msg = f"0/1 nodes are available: 1 node(s) didn't match node selector {mismatch}."
                if self._unschedulable.get(meta["uid"]) != msg:
                    cond = {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": msg,
                        "lastProbeTime": None,
                        "lastTransitionTime": now_iso(),
                    }
                    self.call(
                        self.core.patch_namespaced_pod_status,
                        meta["name"],
                        meta["namespace"],
                        {"metadata": {"uid": meta["uid"]}, "status": {"conditions": [cond]}},
                        _content_type="application/merge-patch+json",
                    )
                    self._unschedulable[meta["uid"]] = msg
                    self.log.info("%s: unschedulable: %s", key, msg)
                return
            binding = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": self.node.name},
            }
            self.call(self.core.create_namespaced_pod_binding, meta["name"], meta["namespace"], binding)
            self.log.info("%s: bound to %s", key, self.node.name)
        except ApiException as e:
            if e.status not in (404, 409):  # gone, or bound by someone else meanwhile
                self.log.warning("%s: binding failed: %s %s", key, e.status, e.body)
