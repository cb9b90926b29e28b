"""What every part of a pod's worker shares: its containers' state, the two ways a step stops short, and the
declaration of the worker's state (`PodBase`) and of what it uses of its kubelet (`KubeletHost`).

`PodWorker` (lifecycle.py) is one thread per pod, put together from one mixin per concern: PodEnv (env.py),
PodDNS (dns.py), PodVolumes (volumes.py), PodProbes (probes.py), PodPauses (pauses.py), PodTermination
(termination.py) and PodStatus (status.py). Each of them is a `PodBase`: the attributes below are set once in
`PodWorker.__init__` and read and written only from the worker's own thread, so no lock guards them; other
threads only call `update`, `gone`, `wake` and `crash` (a reference swap and events).
"""

from __future__ import annotations

import logging
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .ips import IPAllocator


class NotYet(Exception):
    """Something the container needs is not there yet (a Service without a ready pod, a ConfigMap): wait."""


class PodFails(Exception):
    """The pod cannot run here at all: it ends Failed with this reason and message."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


@dataclass
class ProbeState:
    spec: dict
    next_at: float
    successes: int = 0
    failures: int = 0


@dataclass
class Container:
    """One container of a pod: its spec, its current process, and what its status says."""

    spec: dict
    init: bool
    proc: subprocess.Popen | None = None
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict = field(default_factory=dict)
    restart_count: int = 0
    runs: int = 0  # processes started so far
    ready: bool = False
    started: bool = False  # the startup probe passed (or there is none) and it runs
    done: bool = False  # exited for good (no restart follows)
    exit_code: int | None = None  # of the last exit
    started_mono: float = 0.0
    restart_at: float = 0.0  # monotonic time of the next start after an exit
    quick_exits: int = 0  # exits in a row after < 10 s, for the back-off
    kill_at: float | None = None  # SIGKILL the group at this monotonic time (after a SIGTERM)
    probes: dict[str, ProbeState] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def image(self) -> str:
        return self.spec.get("image", "")


class KubeletHost(Protocol):
    """What a pod worker uses of the kubelet that runs it (kubelet.py's TestKubelet)."""

    log: logging.Logger
    out_dir: Path  # pods/<ns>_<pod>/ and persistentvolumes/ under it
    ips: IPAllocator
    node_name: str  # its first node (a pod's own is its spec.nodeName)
    capacity: dict[str, str]  # the node's allocatable, for resourceFieldRef without a limit
    fork_ecrec: bool
    core: Any  # kubernetes.client.CoreV1Api
    api: Any  # kubernetes.client.ApiClient: its configuration is the server and CA of the pods' kubeconfig
    proxy: Any  # tests/k8s/kubeproxy.py's ServiceProxy
    stop_grace: float
    _stopping: threading.Event
    _stop_deadline: float  # monotonic: stop() bounds every grace period by it

    def call(self, fn, *args, **kwargs) -> Any: ...

    def forked(self, argv: list[str], env: dict[str, str], log: Path, name: str, cwd: Path) -> Any: ...

    def _forget(self, w: Any) -> None: ...


class PodBase:
    """The state of one pod's worker, shared by the mixins that make up `PodWorker` (set in its __init__)."""

    kl: KubeletHost
    log: logging.Logger
    pod: dict  # the latest object seen by the watch (replaced by update())
    uid: str
    ns: str
    pod_name: str
    key: str  # ns/name, for logs
    dir: Path  # pods/<ns>_<pod>/: container logs
    vol_dir: Path  # volumes-<uid8>/ under dir
    work_dir: Path  # the containers' working directory
    sa_env: dict[str, str]  # KUBECONFIG of the pod's service-account credentials, if any
    ip: str | None
    start_time: str
    policy: str  # restartPolicy
    inits: list[Container]
    mains: list[Container]
    initialized: bool
    volumes_ready: bool
    failure: tuple[str, str] | None  # (reason, message): the pod Failed here
    init_failed: bool
    phase: str
    _conds: dict[str, dict]  # the pod conditions last written, by type
    _written: str | None  # the status last written, as JSON
    _wake: threading.Event
    _gone: threading.Event  # the object left the API (force-deleted, or deleted by us)
    _next_wait: float  # monotonic time before which NotYet conditions are not retried
    _pause_id: str | None
    _paused_until: float | None  # monotonic time of the SIGCONT while paused
