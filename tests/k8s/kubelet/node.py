"""The node: its object in the API, registered, labelled and kept Ready by heartbeats.

`Node` registers the node (default `ecrec-local-0`; capacity: this machine's cores and memory, 110 pods;
labels: hostname, os, arch, `ecrec.dev/test-kubelet=true` and `chaos.ecrec.dev/pause-annotation=true`, since
pauses.py honours the pause annotations), takes over one that exists already, patches its status (conditions,
addresses, nodeInfo) every `heartbeat_s` and marks it NotReady when the kubelet stops. Not done: node leases.

Everything here is about one node and nothing else, so that one kubelet process can hold one `Node` per node
it serves (#31). `_ready`/`_ready_since` are written by `patch_status`, which runs on one thread at a time
(start(), then the heartbeat thread, then stop() after joining it): no lock.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from ecrec.chaos import PAUSE_NODE_LABEL

from .api import now_iso
from .images import RUNTIME

NODE_NAME = "ecrec-local-0"
KUBELET_VERSION = "v1.20.2-ecrec-test"


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

    def __init__(self, name: str, capacity: dict[str, str], call, core: Any, log: logging.Logger):
        self.name = name
        self.capacity = capacity
        self.call = call
        self.core = core
        self.log = log
        self._since = ""  # these three from register()
        self._ready: bool | None = None
        self._ready_since = ""

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
            "ecrec.dev/test-kubelet": "true",
            PAUSE_NODE_LABEL: "true",  # honours the pause annotations (ecrec chaos --action pod-failure)
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
            self.call(self.core.create_node, node)
            self.log.info("node %s registered", self.name)
        except ApiException as e:
            if e.status != 409:
                raise
            self.call(
                self.core.patch_node,
                self.name,
                {"metadata": {"labels": self.labels()}},
                _content_type="application/merge-patch+json",
            )
            self.log.info("node %s exists already: taking it over", self.name)
        self.patch_status(ready=True)

    def heartbeat_loop(self, stopping: threading.Event, period: float) -> None:
        while not stopping.wait(period):
            try:
                self.patch_status(ready=True)
            except Exception as e:
                self.log.warning("node heartbeat failed: %s", e)
