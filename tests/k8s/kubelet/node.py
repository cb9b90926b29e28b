"""The node: its object in the API, registered, labelled and kept Ready by heartbeats and its lease.

`Node` registers the node (default `ecrec-local-0`; `ecrec-local-<i>` when one kubelet serves several;
capacity: this machine's cores and memory, 110 pods; labels: hostname, os, arch, `topology.kubernetes.io/zone`
(`zone-<i mod zones>`, for failure-domain tests), `ecrec.dev/test-kubelet=true`,
`chaos.ecrec.dev/pause-annotation=true`, since pauses.py honours the pause annotations, and
`chaos.ecrec.dev/node-down-annotation=true`, since outages.py honours the node-down ones), takes over one that
exists already, patches its status (conditions, addresses, nodeInfo) and renews its Lease in
`kube-node-lease` every `heartbeat_s` (as a kubelet does: kube-controller-manager's node lifecycle controller
reads the lease), and marks it NotReady when the kubelet stops.

The heartbeat thread also reads the node's annotations about once a second (`ANNOTATION_POLL_S`): a new
node-down id kills the node's machine for its seconds (outages.py): no status, no lease meanwhile, the
kubelet's `on_down`/`on_up` for its pods; the heartbeat resumes at once when the time is up.

Everything here is about one node and nothing else: one kubelet process holds one `Node` per node it serves,
each with its own heartbeat thread. `_ready`/`_ready_since` are written by `patch_status`, which runs on one
thread at a time (start(), then the node's heartbeat thread, then stop() after joining it): no lock. The
outage state (`_down_id`, `down_until`) belongs to the heartbeat thread (after register()).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from ecrec.chaos import NODE_DOWN_ID, NODE_DOWN_LABEL, PAUSE_NODE_LABEL

from .api import now_iso
from .images import RUNTIME
from .outages import down_request

NODE_NAME = "ecrec-local-0"
KUBELET_VERSION = "v1.20.2-ecrec-test"
ZONE_LABEL = "topology.kubernetes.io/zone"
LEASE_NAMESPACE = "kube-node-lease"
# A kubelet's default (--node-lease-duration-seconds); renewed every heartbeat. The node lifecycle controller
# does not read it: a renewTime that moved (or the Ready condition's lastHeartbeatTime) is a heartbeat, and a
# node without one for its --node-monitor-grace-period (hack/kube-testenv: ECREC_KUBE_NODE_GRACE, default
# 40 s) goes Unknown. So `heartbeat_s` must stay well under that grace, whatever this says.
LEASE_SECONDS = 40
ANNOTATION_POLL_S = 1.0  # how often the heartbeat thread reads the node's annotations (node loss)


def node_names(count: int) -> list[str]:
    """The names of the nodes one kubelet serves: ecrec-local-0 .. ecrec-local-<count-1>."""
    if count < 1:
        raise ValueError(f"a kubelet serves at least one node, not {count}")
    return [f"ecrec-local-{i}" for i in range(count)]


def now_micro() -> str:
    """A Lease's renewTime (metav1.MicroTime)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_capacity() -> dict[str, str]:
    """This machine's cores and memory, 110 pods: the node's capacity and allocatable."""
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    return {
        "cpu": str(os.cpu_count() or 1),
        "memory": f"{mem_kib}Ki",
        "pods": "110",
        "ephemeral-storage": "64Gi",
    }


class Node:
    """One node's object in the API. `call` is the kubelet's API call wrapper (returns JSON dicts)."""

    def __init__(
        self,
        name: str,
        capacity: dict[str, str],
        call,
        core: Any,
        log: logging.Logger,
        zone: str = "zone-0",
        coordination: Any = None,
    ):
        """`coordination`: a CoordinationV1Api for the node's Lease (none: no lease is kept)."""
        self.name = name
        self.capacity = capacity
        self.call = call
        self.core = core
        self.log = log
        self.zone = zone
        self.coordination = coordination
        self.uid = ""  # from register(): the lease's owner reference
        self._since = ""  # these three from register()
        self._ready: bool | None = None
        self._ready_since = ""
        self._down_id: str | None = None  # the last node-down id seen; register(): the one already there
        self.down_until: float | None = None  # monotonic end of the machine's outage, while it is down

    def conditions(self, ready: bool) -> list[dict]:
        now = now_iso()
        conds = []
        for type_, reason, msg in (
            ("MemoryPressure", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            ("DiskPressure", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        ):
            conds.append(
                {
                    "type": type_,
                    "status": "False",
                    "reason": reason,
                    "message": msg,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": self._since,
                }
            )
        if ready != self._ready:
            self._ready, self._ready_since = ready, now
        conds.append(
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "reason": "KubeletReady" if ready else "KubeletStopped",
                "message": "test kubelet is posting ready status" if ready else "test kubelet stopped",
                "lastHeartbeatTime": now,
                "lastTransitionTime": self._ready_since,
            }
        )
        return conds

    def patch_status(self, ready: bool) -> None:
        status = {
            "capacity": self.capacity,
            "allocatable": self.capacity,
            "conditions": self.conditions(ready),
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": self.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": platform.release(),
                "osImage": "ecrec test kubelet (local processes)",
                "containerRuntimeVersion": f"{RUNTIME}://1",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": KUBELET_VERSION,
                "operatingSystem": "linux",
                "architecture": self.arch(),
            },
        }
        self.call(
            self.core.patch_node_status,
            self.name,
            {"status": status},
            _content_type="application/merge-patch+json",
        )

    @staticmethod
    def arch() -> str:
        m = platform.machine()
        return {"x86_64": "amd64", "aarch64": "arm64"}.get(m, m)

    def labels(self) -> dict[str, str]:
        return {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": self.arch(),
            ZONE_LABEL: self.zone,
            "ecrec.dev/test-kubelet": "true",
            PAUSE_NODE_LABEL: "true",  # honours the pause annotations (ecrec chaos --action pod-failure)
            NODE_DOWN_LABEL: "true",  # honours the node-down annotations (ecrec chaos --node; outages.py)
        }

    def register(self) -> None:
        self._since = now_iso()
        self._ready, self._ready_since = None, self._since
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": self.labels()},
        }
        try:
            got = self.call(self.core.create_node, node)
            self.log.info("node %s registered", self.name)
        except ApiException as e:
            if e.status != 409:
                raise
            got = self.call(
                self.core.patch_node,
                self.name,
                {"metadata": {"labels": self.labels()}},
                _content_type="application/merge-patch+json",
            )
            self.log.info("node %s exists already: taking it over", self.name)
        self.uid = got["metadata"]["uid"]
        # A machine death asked for before this kubelet ran is over for it (no crash again on a restart).
        self._down_id = (got["metadata"].get("annotations") or {}).get(NODE_DOWN_ID)
        self.patch_status(ready=True)
        self.renew_lease()

    def renew_lease(self) -> None:
        """Creates or renews the node's Lease (kube-node-lease/<node>), owned by the Node so that it goes with
        it."""
        if self.coordination is None:
            return
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now_micro()}
        try:
            self.call(
                self.coordination.patch_namespaced_lease,
                self.name,
                LEASE_NAMESPACE,
                {"spec": spec},
                _content_type="application/merge-patch+json",
            )
            return
        except ApiException as e:
            if e.status != 404:
                raise
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": LEASE_NAMESPACE,
                "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self.uid}],
            },
            "spec": spec,
        }
        try:
            self.call(self.coordination.create_namespaced_lease, LEASE_NAMESPACE, lease)
        except ApiException as e:
            if e.status != 409:  # created meanwhile: renewed at the next heartbeat
                raise

    def heartbeat(self) -> None:
        """The node's status (Ready) and its lease, each on its own (one failing does not skip the other)."""
        for what, beat in (
            ("status", lambda: self.patch_status(ready=True)),
            ("lease", self.renew_lease),
        ):
            try:
                beat()
            except Exception as e:
                self.log.warning("node %s heartbeat (%s) failed: %s", self.name, what, e)

    def heartbeat_loop(
        self,
        stopping: threading.Event,
        period: float,
        on_down: Callable[[str], None] | None = None,
        on_up: Callable[[str], None] | None = None,
    ) -> None:
        """The heartbeat every `period` s, and the node's annotations every ANNOTATION_POLL_S s, until
        `stopping`. A machine death (outages.py): `on_down(name)` at its start, no heartbeat while it lasts, at
        its end the heartbeat at once, then `on_up(name)`, again every poll while it raises."""
        next_beat = time.monotonic() + period
        next_poll = time.monotonic() + ANNOTATION_POLL_S
        up_pending = False
        while True:
            until = min(next_poll, next_beat if self.down_until is None else self.down_until)
            if stopping.wait(max(0.0, until - time.monotonic())):
                return
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + ANNOTATION_POLL_S
                self._poll_down(on_down)
            if self.down_until is not None:
                if time.monotonic() < self.down_until:
                    continue
                self.down_until = None
                self.log.info("node %s: machine back up: heartbeat resumes", self.name)
                next_beat, up_pending = 0.0, on_up is not None
            if time.monotonic() >= next_beat:
                self.heartbeat()
                next_beat = time.monotonic() + period
            if up_pending and on_up is not None:
                try:
                    on_up(self.name)
                    up_pending = False
                except Exception as e:
                    self.log.warning("node %s: back up, pods not handled yet: %s; again in 1 s", self.name, e)

    def _poll_down(self, on_down: Callable[[str], None] | None) -> None:
        """Reads the node's annotations; a new node-down request kills its machine now (or, while it is down,
        makes the outage last at least that long)."""
        try:
            got = self.call(self.core.read_node, self.name)
        except Exception as e:
            self.log.warning("node %s: reading its annotations failed: %s", self.name, e)
            return
        req = down_request(got["metadata"].get("annotations"))
        if req is None or req[1] == self._down_id:
            return
        seconds, self._down_id = req
        until = time.monotonic() + seconds
        was_down = self.down_until is not None
        self.down_until = max(until, self.down_until or until)
        self._ready = None  # when it is back, its Ready condition starts anew (lastTransitionTime)
        self.log.warning("node %s: machine down for %gs (node-down id %s)", self.name, seconds, req[1])
        if not was_down and on_down is not None:
            on_down(self.name)
