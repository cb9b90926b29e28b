"""The test kubelet: kube-scheduler and kubelet for one node of the test control plane, as local processes.

The control plane of `hack/kube-testenv` runs no scheduler, kubelet, DNS or kube-proxy, so pods would stay
Pending forever. `TestKubelet` registers the node `ecrec-local-0` (capacity: this machine's cores and memory,
110 pods) and then, through the `kubernetes` client against the real API server:

- **schedules**: binds every pending unbound pod of the default scheduler to its node (the `binding`
  subresource), unless the pod's `nodeSelector` does not match the node's labels (then PodScheduled=False,
  Unschedulable); there is no resource accounting: every pod fits.
- **runs** each container's command/args (`$(VAR)` references expanded as Kubernetes does) as a local
  process in its own session, with the env of the pod spec only: `value`, `valueFrom` (fieldRef: metadata.name,
  .namespace, .uid, .labels['k'], .annotations['k'], spec.nodeName, spec.serviceAccountName, status.podIP,
  status.podIPs, status.hostIP; resourceFieldRef; configMapKeyRef; secretKeyRef) and `envFrom`. Images map to
  local programs in ONE place, `image_for` below: any image named `ecrec` (`ecrec:dev`, `ghcr.io/o/ecrec:1`,
  `ecrec:0.1.0-cuda`) or `ecrec-operator` is this repository's `.venv`, with the image's ENTRYPOINT (`ecrec`,
  `ecrec-operator`); any other image fails the pod (ErrImagePull), it is never run. With `fork_ecrec`, a
  command that is the `ecrec` entrypoint is forked from a fork server (ecrec.forkserver) instead.
  Init containers run first, one after the other.
- **gives each pod its own loopback IP** 127.0.x.y as status.podIP (never 127.0.0.0/24, nor the Service range
  127.0.10.0/24 of the API server); Linux routes all of 127/8 to `lo`, so a process binds its pod IP without
  any setup. The processes must bind their pod IP (env from `status.podIP`), not 0.0.0.0: they share one
  network namespace. `hostNetwork` pods get 127.0.0.1.
- **reports** phase, conditions (PodScheduled, Initialized, ContainersReady, Ready), containerStatuses and
  initContainerStatuses (waiting/running/terminated, exitCode, restartCount, lastState) with merge patches of
  the `status` subresource. Probes: readiness, liveness and startup, each httpGet (on the pod IP), tcpSocket or
  exec, with their delays, periods, timeouts and thresholds; no readiness probe = ready once running.
- **honours restartPolicy**: Always/OnFailure restart the container (restartCount+1) after a back-off of
  0.5 s doubling to 10 s (CrashLoopBackOff meanwhile); Never leaves it terminated and the pod ends Succeeded
  (all exited 0) or Failed.
- **deletes**: on a pod's deletionTimestamp, SIGTERM to every container's process group, SIGKILL after the
  grace period (the delete's, else terminationGracePeriodSeconds), then the pod object is removed (grace 0,
  UID precondition).
- **pauses** (the stand-in for Chaos Mesh's pod-failure, used by `ecrec chaos`): a new value of the pod
  annotation `chaos.ecrec.dev/pause-id` with `chaos.ecrec.dev/pause-seconds: S` SIGSTOPs every running
  container's process group and SIGCONTs it S seconds later; the pod stays Running and probes go on. A pod
  being deleted or killed gets SIGCONT right after its SIGTERM, so a paused process still handles it. The
  node carries the label `chaos.ecrec.dev/pause-annotation=true` to say it honours the annotation.
- **volumes**: emptyDir, configMap and secret volumes are written under the pod's directory; since processes
  cannot get a mount namespace here, every `mountPath` (with subPath) that appears as a path in command, args
  or env values is rewritten to that directory. A persistentVolumeClaim volume is one directory per claim,
  `persistentvolumes/<ns>_<claim>/`, shared by every pod that mounts it and kept when they go (the stand-in
  for a ReadWriteMany volume; there is no PV controller: the claim must exist, its phase is not looked at; the
  pod waits in ContainerCreating until it does). Other volume types fail the pod (UnsupportedVolume).
  ConfigMap/Secret updates are not propagated after the pod started.
- **service-account credentials**: the API server runs without the ServiceAccount admission plugin, so no pod
  gets the `kube-api-access` volume. Unless `automountServiceAccountToken: false` (pod or ServiceAccount),
  the kubelet asks the API server for a token of the pod's ServiceAccount (TokenRequest bound to the pod,
  24 h, not refreshed) and writes what the projected volume would hold - `token`, `ca.crt`, `namespace` -
  under the pod's directory, as if mounted at /var/run/secrets/kubernetes.io/serviceaccount (paths to it in
  command, args or env are rewritten like any mountPath). The client libraries read that fixed path, which
  a process cannot have without a mount namespace; so instead of the in-cluster env
  (KUBERNETES_SERVICE_HOST/PORT) the process gets `KUBECONFIG` naming a kubeconfig there: this API server,
  its CA and the token file. The process then acts with its ServiceAccount's rights (RBAC is enforced); only
  the libraries' in-cluster code path is not exercised. No ServiceAccount `default` (nothing creates one
  here): no credentials; another ServiceAccount that does not exist: the pod waits for it.

**Networking stand-in.** There is no cluster DNS. This kubelet rewrites Service DNS names found in env
*values* - `<svc>.<ns>.svc`, `<svc>.<ns>.svc.cluster.local` and the per-pod form
`<hostname>.<subdomain>.<ns>.svc[.cluster.local]` - to an address, once a ready pod is behind the Service
(chosen by the Service's selector; not-ready pods count if the Service has publishNotReadyAddresses): for a
Service with a ClusterIP, that ClusterIP (from 127.0.10.0/24, on loopback), where `tests/k8s/kubeproxy.py`, a
userspace kube-proxy, forwards each new connection to a ready pod's targetPort - so the address keeps working
when the pod behind it is replaced; for a headless Service, the pod's IP (`:port` unchanged); a pod's own
per-pod name is its own IP, as its /etc/hosts would say. Until every such name resolves, the container waits
in ContainerCreating, saying which name it waits for. Names in command/args are not rewritten: pass them
through env and `$(VAR)`. Short names (`<svc>`, `<svc>.<ns>`) are not resolved. DNS rewriting and the proxy are
the only place where the harness stands in for cluster networking; no `*_SERVICE_HOST` env is injected.

**Not done**: container images, resource limits, namespaces/cgroups, hostPort, securityContext (the processes
run as this user), NetworkPolicy (nothing enforces it), lifecycle hooks, ephemeral containers,
`kubectl logs/exec` (read the log files instead), node leases.

**Files** (under `out_dir`): `kubelet.log`; per pod `pods/<ns>_<pod>/<container>.log` (appended across
restarts, each start marked by a `=====` header line), `pods/<ns>_<pod>/work/` (the working directory)
and `pods/<ns>_<pod>/volumes-<uid8>/<volume>/`.

**Processes**: each container process runs in its own session (so its whole process group is signalled) and
gets PR_SET_PDEATHSIG=SIGKILL (through `setpriv`, else prctl): it dies with the kubelet thread that started
it, hence with the kubelet. `stop()` terminates every process the kubelet started.

Run it:
    kl = TestKubelet(kubeconfig, out_dir); kl.start(); ...; kl.stop()        # pytest: the `kubelet` fixture
    python -m tests.k8s.kubelet --kubeconfig K --out out/k8s                  # until SIGTERM/SIGINT
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import datetime as dt
import http.client
import ipaddress
import json
import logging
import math
import os
import platform
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from ecrec.chaos import PAUSE_ID, PAUSE_NODE_LABEL, PAUSE_SECONDS
from tests.k8s.kubeproxy import ServiceProxy

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv"
NODE_NAME = "ecrec-local-0"
RUNTIME = "ecrec-test"  # scheme of containerID / imageID, like docker:// or containerd://
KUBELET_VERSION = "v1.20.2-ecrec-test"

LOGGER = "ecrec.test-kubelet"  # + ".<node>": one logger (and kubelet.log) per kubelet


# ------------------------------------------------------------------------------------------------- images --
@dataclass(frozen=True)
class Image:
    """What an image stands for locally: PATH entries put first, its ENTRYPOINT and CMD, and its ENV."""

    path: tuple[str, ...]
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


ECREC_IMAGE = Image(
    path=(str(VENV / "bin"),),
    entrypoint=("ecrec",),  # the console script of pyproject.toml; command: [...] replaces it
    env=(("PYTHONUNBUFFERED", "1"), ("VIRTUAL_ENV", str(VENV))),
)
OPERATOR_IMAGE = Image(  # dockerfiles/operator.Dockerfile: the same venv, ENTRYPOINT ecrec-operator
    path=ECREC_IMAGE.path, entrypoint=("ecrec-operator",), env=ECREC_IMAGE.env
)
IMAGES = {"ecrec": ECREC_IMAGE, "ecrec-operator": OPERATOR_IMAGE}


def image_name(ref: str) -> str:
    """`ghcr.io/org/ecrec:0.1@sha256:..` -> `ecrec`: the last path component without tag or digest."""
    return ref.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]


def image_for(ref: str) -> Image | None:
    """THE image mapping: the local stand-in of image `ref`, or None when there is none (the pod fails).

    Any image whose last path component is named `ecrec` (`ecrec:dev`, `ghcr.io/org/ecrec:0.1`,
    `localhost:5000/ecrec@sha256:...`, `ecrec:0.1.0-cuda`) or `ecrec-operator` runs from this repository's
    .venv: `.venv/bin` comes first on PATH, so `python`, `python3`, `ecrec`, `ecrec-operator`, `uvicorn` ...
    are the venv's, and an absolute command whose basename is in `.venv/bin` (`/usr/local/bin/python`) is
    the venv's too. ENTRYPOINT is `ecrec` (`ecrec-operator` for that image), ENV PYTHONUNBUFFERED=1.
    """
    return IMAGES.get(image_name(ref))


# ---------------------------------------------------------------------------------------------- helpers --
PR_SET_PDEATHSIG = 1
SETPRIV = shutil.which("setpriv")
TERMINAL = ("Succeeded", "Failed")


def _die_with_parent() -> None:  # fallback without setpriv; runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def spawn(argv: list[str], env: dict[str, str], cwd: Path, stdout: Any) -> subprocess.Popen:
    """Starts argv (argv[0] absolute) in a new session that is SIGKILLed when the calling thread dies."""
    preexec = None
    if SETPRIV:
        argv = [SETPRIV, "--pdeathsig", "KILL", "--", *argv]
    else:
        preexec = _die_with_parent
    return subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=preexec,
    )


def killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([a-zA-Z]*)")
_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_SUFFIX.update({f"{p}i": 1024 ** (i + 1) for i, p in enumerate("KMGTPE")})


def quantity(text: str) -> float:
    """A resource quantity (`500m`, `2Gi`, `1.5`) as a number."""
    m = _QUANTITY.fullmatch(str(text).strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"not a quantity: {text!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


_VAR_REF = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known names replaced, unknown ones kept, `$$` -> `$`."""
    return _VAR_REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


# <hostname>.<subdomain>.<ns>.svc[.cluster.local] or <svc>.<ns>.svc[.cluster.local], then maybe :port
_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
SERVICE_NAME = re.compile(
    rf"(?<![-A-Za-z0-9.])(?:(?P<host>{_LABEL})\.)?(?P<svc>{_LABEL})\.(?P<ns>{_LABEL})\.svc"
    rf"(?:\.cluster\.local)?\.?(?![-A-Za-z0-9])(?::(?P<port>\d+)(?![0-9]))?"
)


class NotYet(Exception):
    """Something the container needs is not there yet (a Service without a ready pod, a ConfigMap): wait."""


class PodFails(Exception):
    """The pod cannot run here at all: it ends Failed with this reason and message."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


class IPAllocator:
    """Pod IPs 127.0.x.y (x in 1..254 except 9 and 10, y in 1..254), handed out round-robin from a random start,
    so that two kubelets on one machine (two test sessions) rarely meet and a freed IP is not reused at once."""

    # 127.0.0.0/24 is the host's own; 127.0.10.0/24 and 127.0.9.0/24 are Service IPs (the main control plane's
    # and the Helm tests' own)
    XS = [x for x in range(1, 255) if x not in (9, 10)]

    def __init__(self, seed: int | None = None):
        self._n = len(self.XS) * 254
        self._cursor = random.Random(seed).randrange(self._n)
        self._used: set[str] = set()
        self._lock = threading.Lock()

    def _ip(self, i: int) -> str:
        return f"127.0.{self.XS[i // 254]}.{i % 254 + 1}"

    def allocate(self, prefer: str | None = None) -> str:
        with self._lock:
            if prefer and prefer not in self._used and self.valid(prefer):
                self._used.add(prefer)
                return prefer
            for k in range(self._n):
                i = (self._cursor + k) % self._n
                ip = self._ip(i)
                if ip not in self._used:
                    self._cursor = i + 1
                    self._used.add(ip)
                    return ip
        raise RuntimeError("no free pod IP")

    def release(self, ip: str | None) -> None:
        with self._lock:
            self._used.discard(ip)

    @classmethod
    def valid(cls, ip: str) -> bool:
        parts = ip.split(".")
        return (
            len(parts) == 4
            and parts[:2] == ["127", "0"]
            and all(p.isdigit() for p in parts)
            and int(parts[2]) in cls.XS
            and 1 <= int(parts[3]) <= 254
        )


IPS = IPAllocator()  # shared by the kubelets of one process: two of them never hand out the same IP


# ------------------------------------------------------------------------------------------- containers --
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


BACKOFF_START, BACKOFF_MAX, BACKOFF_RESET_AFTER = 0.5, 10.0, 10.0
SA_VOLUME, SA_MOUNT = "kube-api-access", "/var/run/secrets/kubernetes.io/serviceaccount"
SA_TOKEN_SECONDS = 86400
VOLUME_KINDS = ("emptyDir", "configMap", "secret", "persistentVolumeClaim")


# ------------------------------------------------------------------------------------------- pod worker --
class PodWorker(threading.Thread):
    """Runs one pod from its binding to the removal of its object; the only writer of that pod's status.

    Every process of the pod is started from this thread, so PR_SET_PDEATHSIG ties them to it: when it ends,
    whatever it left running is SIGKILLed by the kernel."""

    def __init__(self, kubelet: TestKubelet, pod: dict):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.kl = kubelet
        self.log = kubelet.log
        self.pod = pod
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.key = f"{self.ns}/{self.pod_name}"
        self.dir = kubelet.out_dir / "pods" / f"{self.ns}_{self.pod_name}"
        self.vol_dir = self.dir / f"volumes-{self.uid[:8]}"
        self.work_dir = self.dir / "work"
        self.sa_env: dict[str, str] = {}  # KUBECONFIG of the pod's service-account credentials, if any
        self.ip: str | None = None
        self.start_time = (pod.get("status") or {}).get("startTime") or now_iso()
        spec = pod["spec"]
        self.policy: str = spec.get("restartPolicy", "Always")
        self.inits = [Container(c, True) for c in spec.get("initContainers") or []]
        self.mains = [Container(c, False) for c in spec.get("containers") or []]
        self._adopt_counts(pod)
        self.initialized = not self.inits
        self.volumes_ready = False
        self.failure: tuple[str, str] | None = None  # (reason, message): the pod Failed here
        self.init_failed = False
        self.phase = "Pending"
        self._conds: dict[str, dict] = {}
        self._written: str | None = None
        self._wake = threading.Event()
        self._gone = threading.Event()  # the object left the API (force-deleted, or deleted by us)
        self._next_wait = 0.0  # monotonic time before which NotYet conditions are not retried
        # Pauses (chaos): one asked for before this worker admitted the pod is not for its processes.
        self._pause_id = (self._pause_request() or (0.0, None))[1]
        self._paused_until: float | None = None  # monotonic time of the SIGCONT while paused

    # -- called from other threads --
    def update(self, pod: dict) -> None:
        self.pod = pod
        self._wake.set()

    def gone(self) -> None:
        self._gone.set()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    # -- the loop --
    def run(self) -> None:
        try:
            self._run()
        except Exception:
            self.log.exception("%s: pod worker failed", self.key)
        finally:
            self._kill_all(grace=0)
            self.kl._forget(self)

    def _run(self) -> None:
        self._setup()
        while True:
            if self._gone.is_set():
                self.log.info("%s: the pod object is gone; killing its processes", self.key)
                self._kill_all(grace=0)
                return
            if self.kl._stopping.is_set():
                self._kill_all(grace=self.kl.stop_grace)
                return
            if self.pod["metadata"].get("deletionTimestamp"):
                self._terminate()
                return
            self._pause_tick()
            if self.phase not in TERMINAL:
                self._step()
            self._write_status()
            self._wake.wait(0.1)
            self._wake.clear()

    def _setup(self) -> None:
        status = self.pod.get("status") or {}
        if self.pod["spec"].get("hostNetwork"):
            self.ip = "127.0.0.1"
        else:
            self.ip = self.kl.ips.allocate(prefer=status.get("podIP"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log.info("%s: admitted, pod IP %s", self.key, self.ip)
        unknown = [c for c in self.inits + self.mains if image_for(c.image) is None]
        if unknown:
            c = unknown[0]
            msg = (
                f'image "{c.image}" (container {c.name}) is not known to the test kubelet: it runs only images'
                f" named ecrec or ecrec-operator, from this repository's .venv"
                " (see image_for in tests/k8s/kubelet.py)"
            )
            self._fail(PodFails("ErrImagePull", msg), unknown)
            return
        for v in self.pod["spec"].get("volumes") or []:
            if not any(k in v for k in VOLUME_KINDS):
                kind = next((k for k in v if k != "name"), "?")
                msg = f"volume {v['name']} ({kind}): the test kubelet supports {', '.join(VOLUME_KINDS)}"
                self._fail(PodFails("UnsupportedVolume", msg), self.inits + self.mains)
                return

    def _fail(self, e: PodFails, containers: list[Container]) -> None:
        """Ends the pod Failed for a reason of its own (not a container's exit); `containers` wait for it."""
        self.log.warning("%s: Failed: %s: %s", self.key, e.reason, e.message)
        self.failure = (e.reason, e.message)
        for c in containers:
            if c.proc is None and "waiting" in c.state:
                c.state = {"waiting": {"reason": e.reason, "message": e.message}}
        self.phase = "Failed"

    def _adopt_counts(self, pod: dict) -> None:
        """Keeps restart counts of a pod that an earlier kubelet ran (its processes died with it)."""
        status = pod.get("status") or {}
        for key, containers in (("initContainerStatuses", self.inits), ("containerStatuses", self.mains)):
            old = {s["name"]: s for s in status.get(key) or []}
            for c in containers:
                s = old.get(c.name)
                if s and ("running" in s.get("state", {}) or "terminated" in s.get("state", {})):
                    c.restart_count, c.runs = s.get("restartCount", 0), 1  # the next start is a restart

    # -- one round --
    def _step(self) -> None:
        if not self.volumes_ready:
            if time.monotonic() < self._next_wait:
                return
            try:
                self._make_volumes()
                self._service_account()
                self.volumes_ready = True
            except NotYet as e:
                self._waiting_all("ContainerCreating", str(e))
                self._next_wait = time.monotonic() + 0.5
                return
            except PodFails as e:
                self._fail(e, self.inits + self.mains)
                return
        if not self.initialized:
            pending = next((c for c in self.inits if not c.done), None)
            if pending is None:
                self.initialized = True
            else:
                self._drive(pending)
                if pending.done and pending.exit_code != 0:  # restartPolicy Never: the pod fails
                    self.init_failed = True
                elif pending.done:
                    self._wake.set()  # next init container (or the main ones) at once
                if not self.initialized:
                    self.phase = self._phase()
                    return
        for c in self.mains:
            self._drive(c)
        self.phase = self._phase()
        if self.phase in TERMINAL:
            self._kill_all(grace=0)  # nothing should run by now; stragglers of the process groups go

    def _waiting_all(self, reason: str, message: str) -> None:
        for c in self.inits + self.mains:
            if c.proc is None and not c.done and "waiting" in c.state:
                c.state = {"waiting": {"reason": reason, "message": message}}

    def _drive(self, c: Container) -> None:
        now = time.monotonic()
        if c.proc is None:
            if c.done or now < c.restart_at or now < self._next_wait:
                return
            self._start(c)
            return
        if c.kill_at is not None and now >= c.kill_at:
            killpg(c.proc.pid, signal.SIGKILL)
            c.kill_at = now + 3600
        rc = c.proc.poll()
        if rc is None:
            self._probe_all(c)
            return
        self._exited(c, rc)

    def _start(self, c: Container) -> None:
        image = image_for(c.image)
        assert image is not None  # checked in _setup
        try:
            env = self._env(c, image)
        except NotYet as e:
            c.state = {"waiting": {"reason": "ContainerCreating", "message": str(e)}}
            self._next_wait = time.monotonic() + 0.5
            return
        except PodFails as e:  # fail fast: a test waiting for Running would otherwise only time out
            self._fail(e, [c])
            return
        c.env = env
        spec = c.spec
        command, args = spec.get("command"), spec.get("args")
        if command:
            argv = list(command) + list(args or [])
        else:
            argv = list(image.entrypoint) + list(args if args else image.cmd)
        # paths first, then $(VAR): env values are rewritten already and must not be rewritten twice
        argv = [expand(self._rewrite_paths(c, a), env) for a in argv]
        cwd = self.work_dir
        if spec.get("workingDir"):
            cwd = Path(self._rewrite_paths(c, spec["workingDir"]))
        if c.runs:
            c.restart_count += 1
        c.runs += 1
        logfile = self.dir / f"{c.name}.log"
        exe = self._which(argv[0], env) if argv else None
        with open(logfile, "a") as out:
            out.write(f"===== {now_iso()} {self.key} container {c.name} start #{c.runs}: {argv}\n")
            out.flush()
            if not argv or exe is None or not cwd.is_dir():
                why = (
                    "no command and the image has no ENTRYPOINT"
                    if not argv
                    else f"executable {argv[0]!r} not found on PATH {env['PATH']}"
                    if exe is None
                    else f"working directory {cwd} does not exist"
                )
                out.write(f"===== StartError: {why}\n")
                self.log.warning("%s: container %s cannot start: %s", self.key, c.name, why)
                c.started_mono = time.monotonic()
                c.state = {"running": {"startedAt": now_iso()}}
                self._exited(c, 128, reason="StartError", message=why)
                return
            if self.kl.fork_ecrec and Path(exe) == VENV / "bin" / "ecrec":
                c.proc = self.kl.forked(argv[1:], env, logfile, c.name, cwd)
            else:
                c.proc = spawn([exe, *argv[1:]], env, cwd, out)
        c.started_mono = time.monotonic()
        c.state = {"running": {"startedAt": now_iso()}}
        c.ready = False
        c.kill_at = None
        c.probes = {}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if spec.get(kind) and not c.init:
                p = spec[kind]
                c.probes[kind] = ProbeState(p, c.started_mono + p.get("initialDelaySeconds", 0))
        c.started = "startupProbe" not in c.probes
        self.log.info("%s: container %s started, pid %d: %s", self.key, c.name, c.proc.pid, argv)

    @staticmethod
    def _which(cmd: str, env: dict[str, str]) -> str | None:
        """The executable for argv[0]: looked up on the container's PATH; an absolute path whose basename is
        in .venv/bin is the venv's (`/usr/local/bin/python` of an image)."""
        if "/" not in cmd:
            return shutil.which(cmd, path=env.get("PATH"))
        if not cmd.startswith("/"):
            return None
        twin = VENV / "bin" / Path(cmd).name
        if twin.exists():
            return str(twin)
        return cmd if os.access(cmd, os.X_OK) and Path(cmd).is_file() else None

    def _exited(self, c: Container, rc: int, reason: str | None = None, message: str | None = None) -> None:
        if c.proc is not None:
            killpg(c.proc.pid, signal.SIGKILL)  # what the process left behind in its group
        code, sig = (128 - rc, -rc) if rc < 0 else (rc, None)
        term: dict[str, Any] = {
            "exitCode": code,
            "reason": reason or ("Completed" if code == 0 else "Error"),
            "startedAt": c.state.get("running", {}).get("startedAt", now_iso()),
            "finishedAt": now_iso(),
            "containerID": self._cid(c),
        }
        if sig:
            term["signal"] = sig
        if message:
            term["message"] = message
        self.log.info("%s: container %s exited %d (%s)", self.key, c.name, code, term["reason"])
        ran = time.monotonic() - c.started_mono
        c.proc, c.ready, c.started, c.exit_code, c.kill_at = None, False, False, code, None
        restart = (
            (self.policy != "Never" and code != 0)
            if c.init
            else (self.policy == "Always" or (self.policy == "OnFailure" and code != 0))
        )
        if not restart:
            c.done = True
            c.state = {"terminated": term}
            return
        c.quick_exits = c.quick_exits + 1 if ran < BACKOFF_RESET_AFTER else 1
        delay = min(BACKOFF_MAX, BACKOFF_START * 2 ** (c.quick_exits - 1))
        c.restart_at = time.monotonic() + delay
        c.last_state = {"terminated": term}
        c.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:g}s restarting failed container={c.name} pod={self.pod_name}",
            }
        }

    def _cid(self, c: Container) -> str:
        return f"{RUNTIME}://{self.uid[:8]}-{c.name}-{c.runs}"

    # -- env, DNS stand-in, volumes --
    def _env(self, c: Container, image: Image) -> dict[str, str]:
        """The process env: a minimal base, the image's ENV, then the container's env (pod spec only)."""
        spec = self.pod["spec"]
        env: dict[str, str] = {
            "PATH": os.pathsep.join([*image.path, "/usr/local/bin", "/usr/bin", "/bin"]),
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            "HOSTNAME": spec.get("hostname") or self.pod_name,
            **self.sa_env,
            **dict(image.env),
        }
        for src in c.spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                data = self._config_data("configmap", src["configMapRef"])
            elif "secretRef" in src:
                data = self._config_data("secret", src["secretRef"])
            else:
                continue
            env.update({prefix + k: v for k, v in data.items()})
        for var in c.spec.get("env") or []:
            name = var["name"]
            if "valueFrom" in var:
                value = self._value_from(c, var["valueFrom"])
                if value is None:
                    continue  # an optional key that is missing: no variable
                value = self._rewrite_paths(c, value)
            else:  # paths before $(VAR), as for args
                value = expand(self._rewrite_paths(c, var.get("value", "")), env)
            env[name] = self._resolve_service_names(value)
        return env

    def _value_from(self, c: Container, src: dict) -> str | None:
        meta = self.pod["metadata"]
        if "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            m = re.fullmatch(r"metadata\.(labels|annotations)\['(.*)'\]", path)
            if m:
                return (meta.get(m.group(1)) or {}).get(m.group(2), "")
            values = {
                "metadata.name": self.pod_name,
                "metadata.namespace": self.ns,
                "metadata.uid": self.uid,
                "spec.nodeName": self.kl.node_name,
                "spec.serviceAccountName": self.pod["spec"].get("serviceAccountName", ""),
                "status.podIP": self.ip,
                "status.podIPs": self.ip,
                "status.hostIP": "127.0.0.1",
            }
            if path not in values:
                raise PodFails("CreateContainerConfigError", f"unsupported fieldRef {path!r}")
            return values[path]
        if "resourceFieldRef" in src:
            ref = src["resourceFieldRef"]
            target = c
            if ref.get("containerName"):
                target = next((x for x in self.inits + self.mains if x.name == ref["containerName"]), c)
            kind, _, res = ref["resource"].partition(".")
            given = ((target.spec.get("resources") or {}).get(kind) or {}).get(res)
            if given is None:  # no limit: the node's allocatable, as the kubelet does
                given = self.kl.capacity.get(res, "0")
            divisor = quantity(ref.get("divisor", "1") or "1")
            return str(math.ceil(quantity(given) / divisor))
        for key, kind in (("configMapKeyRef", "configmap"), ("secretKeyRef", "secret")):
            if key in src:
                ref = src[key]
                data = self._config_data(kind, ref)
                if ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    raise NotYet(f"waiting for key {ref['key']} of {kind} {self.ns}/{ref.get('name')}")
                return data[ref["key"]]
        raise PodFails("CreateContainerConfigError", f"unsupported valueFrom {sorted(src)}")

    def _config_data(self, kind: str, ref: dict) -> dict[str, str]:
        """The data of a ConfigMap or Secret (decoded); {} if missing and optional; NotYet if missing."""
        name = ref.get("name") or ref.get("secretName") or ""
        read = (
            self.kl.core.read_namespaced_config_map
            if kind == "configmap"
            else self.kl.core.read_namespaced_secret
        )
        try:
            obj = self.kl.call(read, name, self.ns)
        except ApiException as e:
            if e.status != 404:
                raise
            if ref.get("optional"):
                return {}
            raise NotYet(f"waiting for {kind} {self.ns}/{name}") from None
        if kind == "secret":
            return {
                k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()
            }
        data = dict(obj.get("data") or {})
        data.update(
            {
                k: base64.b64decode(v).decode(errors="replace")
                for k, v in (obj.get("binaryData") or {}).items()
            }
        )
        return data

    def _resolve_service_names(self, value: str) -> str:
        """Rewrites Service DNS names in an env value to a ready pod's IP (the networking stand-in)."""
        if ".svc" not in value:
            return value
        return SERVICE_NAME.sub(self._resolve_one, value)

    def _resolve_one(self, m: re.Match) -> str:
        host, svc_name, ns, port = m.group("host"), m.group("svc"), m.group("ns"), m.group("port")
        spec = self.pod["spec"]
        if host and ns == self.ns and host == spec.get("hostname") and svc_name == spec.get("subdomain"):
            return self.ip + (f":{port}" if port else "")  # the pod's own name: its /etc/hosts entry
        name = m.group(0)
        try:
            svc = self.kl.call(self.kl.core.read_namespaced_service, svc_name, ns)
        except ApiException as e:
            if e.status == 404:
                raise NotYet(f"waiting for Service {ns}/{svc_name} (for {name})") from None
            raise
        selector = svc["spec"].get("selector") or {}
        if not selector:
            raise NotYet(f"Service {ns}/{svc_name} has no selector: the test kubelet cannot resolve {name}")
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        pods = self.kl.call(self.kl.core.list_namespaced_pod, ns, label_selector=label_selector)["items"]
        not_ready_ok = bool(svc["spec"].get("publishNotReadyAddresses"))
        chosen = None
        for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
            st = p.get("status") or {}
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
            if host and (p["spec"].get("hostname") != host or p["spec"].get("subdomain") != svc_name):
                continue
            if st.get("podIP") and not p["metadata"].get("deletionTimestamp") and (ready or not_ready_ok):
                chosen = p
                break
        if chosen is None:
            raise NotYet(f"waiting for a ready pod behind Service {ns}/{svc_name} (for {name})")
        ip = chosen["status"]["podIP"]
        if not host and self.kl.proxy.ensure(svc):
            # The Service's own ClusterIP, proxied (tests/k8s/kubeproxy.py): it keeps leading to a ready
            # pod when the one behind it now is replaced.
            ip = svc["spec"]["clusterIP"]
        elif port and not host and svc["spec"].get("clusterIP") != "None":
            port = self._target_port(svc, chosen, int(port))
        self.log.info(
            "%s: %s -> %s%s (pod %s)",
            self.key,
            name,
            ip,
            f":{port}" if port else "",
            chosen["metadata"]["name"],
        )
        return ip + (f":{port}" if port else "")

    @staticmethod
    def _target_port(svc: dict, pod: dict, port: int) -> str:
        """The pod port behind Service port `port` (what kube-proxy would forward to)."""
        for sp in svc["spec"].get("ports") or []:
            if sp.get("port") == port:
                target = sp.get("targetPort", port)
                if isinstance(target, int) or str(target).isdigit():
                    return str(target)
                for ctr in pod["spec"].get("containers") or []:
                    for cp in ctr.get("ports") or []:
                        if cp.get("name") == target:
                            return str(cp["containerPort"])
        return str(port)

    def _volume_dir(self, name: str) -> Path:
        """Where volume `name` lives here: under the pod's directory, or a claim's directory shared by pods."""
        for v in self.pod["spec"].get("volumes") or []:
            if v["name"] == name and "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                return self.kl.out_dir / "persistentvolumes" / f"{self.ns}_{claim}"
        return self.vol_dir / name

    def _make_volumes(self) -> None:
        """Writes emptyDir/configMap/secret volumes under vol_dir (once, when the pod starts); finds claims."""
        volumes = self.pod["spec"].get("volumes") or []
        if not volumes:
            return
        shutil.rmtree(self.vol_dir, ignore_errors=True)
        for v in volumes:
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                try:
                    self.kl.call(self.kl.core.read_namespaced_persistent_volume_claim, claim, self.ns)
                except ApiException as e:
                    if e.status != 404:
                        raise
                    raise NotYet(f'persistentvolumeclaim "{claim}" not found') from None
                self._volume_dir(v["name"]).mkdir(parents=True, exist_ok=True)
                continue
            d = self.vol_dir / v["name"]
            d.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in v:
                continue
            kind = "configmap" if "configMap" in v else "secret"
            src = v["configMap"] if kind == "configmap" else v["secret"]
            data = self._config_data(kind, src)
            mode = src.get("defaultMode", 0o644)
            items = src.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item["key"] not in data:
                    if src.get("optional"):
                        continue
                    raise NotYet(
                        f"waiting for key {item['key']} of {kind} {self.ns}/{src.get('name') or src.get('secretName')}"
                    )
                f = d / item["path"]
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(data[item["key"]])
                f.chmod(item.get("mode", mode))

    def _service_account(self) -> None:
        """The stand-in for the projected service-account volume (see the module docstring)."""
        spec = self.pod["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return
        name = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
        try:
            sa = self.kl.call(self.kl.core.read_namespaced_service_account, name, self.ns)
        except ApiException as e:
            if e.status != 404:
                raise
            if name == "default":
                return
            raise NotYet(f"waiting for ServiceAccount {self.ns}/{name}") from None
        if sa.get("automountServiceAccountToken") is False:
            return
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": SA_TOKEN_SECONDS,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.pod_name, "uid": self.uid},
            },
        }
        token = self.kl.call(self.kl.core.create_namespaced_service_account_token, name, self.ns, request)
        d = self.vol_dir / SA_VOLUME
        d.mkdir(parents=True, exist_ok=True)
        cfg = self.kl.api.configuration
        (d / "token").write_text(token["status"]["token"])
        (d / "ca.crt").write_bytes(Path(cfg.ssl_ca_cert).read_bytes())
        (d / "namespace").write_text(self.ns)
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "in-cluster",
                    "cluster": {"server": cfg.host, "certificate-authority": str(d / "ca.crt")},
                }
            ],
            "users": [{"name": name, "user": {"tokenFile": str(d / "token")}}],
            "contexts": [
                {
                    "name": "in-cluster",
                    "context": {"cluster": "in-cluster", "user": name, "namespace": self.ns},
                }
            ],
            "current-context": "in-cluster",
        }
        (d / "kubeconfig").write_text(json.dumps(kubeconfig))
        self.sa_env = {"KUBECONFIG": str(d / "kubeconfig")}
        for c in self.inits + self.mains:  # where the volume would be mounted: paths to it are rewritten
            mounts = c.spec.setdefault("volumeMounts", [])
            if not any(m["mountPath"] == SA_MOUNT for m in mounts):
                mounts.append({"name": SA_VOLUME, "mountPath": SA_MOUNT, "readOnly": True})
        self.log.info("%s: credentials of ServiceAccount %s written (KUBECONFIG)", self.key, name)

    def _rewrite_paths(self, c: Container, text: str) -> str:
        """Container paths under a volumeMount -> the volume's local directory (there is no mount)."""
        mounts = c.spec.get("volumeMounts") or []
        if not mounts or "/" not in text:
            return text
        local = {}
        for vm in mounts:
            mp = vm["mountPath"].rstrip("/") or "/"
            local[mp] = str(self._volume_dir(vm["name"]) / vm.get("subPath", "")).rstrip("/")
        pattern = "|".join(re.escape(p) for p in sorted(local, key=len, reverse=True))
        return re.sub(rf"(?<![-\w./])({pattern})(?=/|$|[^-\w.])", lambda m: local[m.group(1)], text)

    # -- probes --
    def _probe_all(self, c: Container) -> None:
        now = time.monotonic()
        if c.kill_at is not None:
            return  # being killed
        if not c.started:
            st = c.probes["startupProbe"]
            if now >= st.next_at:
                ok = self._probe_once(c, st)
                if ok is True:
                    c.started = True
                    now = time.monotonic()
                    for kind in ("readinessProbe", "livenessProbe"):
                        if kind in c.probes:
                            c.probes[kind].next_at = max(c.probes[kind].next_at, now)
                elif ok is False:
                    self._kill_container(c, "startup probe failed")
            if not c.started:
                return
        rp = c.probes.get("readinessProbe")
        if rp is None:
            c.ready = True
        elif now >= rp.next_at:
            ok = self._probe_once(c, rp)
            if ok is not None:
                c.ready = ok
        lp = c.probes.get("livenessProbe")
        if lp is not None and now >= lp.next_at and self._probe_once(c, lp) is False:
            self._kill_container(c, "liveness probe failed")

    def _probe_once(self, c: Container, st: ProbeState) -> bool | None:
        """Runs the probe; returns True/False once a threshold is crossed, else None (no verdict yet)."""
        spec = st.spec
        st.next_at = time.monotonic() + spec.get("periodSeconds", 10)
        ok = self._probe(c, spec)
        if ok:
            st.successes, st.failures = st.successes + 1, 0
            return True if st.successes >= spec.get("successThreshold", 1) else None
        st.failures, st.successes = st.failures + 1, 0
        return False if st.failures >= spec.get("failureThreshold", 3) else None

    def _probe(self, c: Container, spec: dict) -> bool:
        timeout = spec.get("timeoutSeconds", 1)
        try:
            if "exec" in spec:
                cmd = spec["exec"].get("command") or []
                exe = self._which(cmd[0], c.env) if cmd else None
                if exe is None:
                    return False
                with spawn([exe, *cmd[1:]], c.env, self.work_dir, subprocess.DEVNULL) as p:
                    try:
                        return p.wait(timeout) == 0
                    except subprocess.TimeoutExpired:
                        killpg(p.pid, signal.SIGKILL)
                        p.wait()
                        return False
            if "httpGet" in spec:
                h = spec["httpGet"]
                host, port = h.get("host") or self.ip, self._port(c, h["port"])
                if not is_loopback(host):
                    self.log.warning(
                        "%s: probe host %s is not a loopback address: failing it", self.key, host
                    )
                    return False
                if h.get("scheme", "HTTP").upper() == "HTTPS":
                    ctx = ssl.create_default_context()
                    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # as the kubelet: no checks
                    conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                        host, port, timeout=timeout, context=ctx
                    )
                else:
                    conn = http.client.HTTPConnection(host, port, timeout=timeout)
                try:
                    headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
                    conn.request("GET", h.get("path") or "/", headers=headers)
                    return 200 <= conn.getresponse().status < 400
                finally:
                    conn.close()
            if "tcpSocket" in spec:
                t = spec["tcpSocket"]
                host = t.get("host") or self.ip
                if not is_loopback(host):
                    return False
                with socket.create_connection((host, self._port(c, t["port"])), timeout=timeout):
                    return True
        except (OSError, http.client.HTTPException):
            return False
        return False

    @staticmethod
    def _port(c: Container, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for cp in c.spec.get("ports") or []:
            if cp.get("name") == port:
                return int(cp["containerPort"])
        raise OSError(f"no port named {port}")

    # -- pauses (chaos) --
    def _pause_request(self) -> tuple[float, str] | None:
        """(seconds, id) of the pod's pause annotations, if it has valid ones."""
        ann = self.pod["metadata"].get("annotations") or {}
        pause_id, seconds = ann.get(PAUSE_ID), ann.get(PAUSE_SECONDS)
        try:
            s = float(seconds)
        except (TypeError, ValueError):
            return None
        return (s, pause_id) if pause_id and math.isfinite(s) and s > 0 else None

    def _pause_tick(self) -> None:
        """Starts a newly asked-for pause (SIGSTOP) and ends a pause whose time is up (SIGCONT)."""
        req = self._pause_request()
        if req is not None and req[1] != self._pause_id:
            self._pause_id = req[1]
            until = time.monotonic() + req[0]
            self._paused_until = max(until, self._paused_until or until)
            for c in self.inits + self.mains:
                if c.proc is not None:
                    killpg(c.proc.pid, signal.SIGSTOP)
            self.log.info("%s: paused for %gs (pause id %s)", self.key, req[0], req[1])
        if self._paused_until is not None and time.monotonic() >= self._paused_until:
            self._resume("the pause is over")

    def _resume(self, why: str) -> None:
        if self._paused_until is None:
            return
        self._paused_until = None
        for c in self.inits + self.mains:
            if c.proc is not None:
                killpg(c.proc.pid, signal.SIGCONT)
        self.log.info("%s: resumed: %s", self.key, why)

    # -- signals --
    def _grace(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        g = meta.get("deletionGracePeriodSeconds")
        if g is None:
            g = spec.get("terminationGracePeriodSeconds", 30)
        return float(g)

    def _kill_container(self, c: Container, why: str) -> None:
        self.log.info("%s: container %s: %s, killing it", self.key, c.name, why)
        if c.proc is not None:
            killpg(c.proc.pid, signal.SIGTERM)
            if self._paused_until is not None:
                killpg(c.proc.pid, signal.SIGCONT)  # a paused process handles its SIGTERM
            c.kill_at = time.monotonic() + self._grace()

    def _kill_all(self, grace: float) -> None:
        """SIGTERM every container's process group, SIGKILL after `grace` s; waits for them."""
        running = [c for c in self.inits + self.mains if c.proc is not None]
        if not running:
            return
        sig = signal.SIGTERM if grace > 0 else signal.SIGKILL
        for c in running:
            killpg(c.proc.pid, sig)
        self._resume("stopping the pod")  # after the signal: a paused process handles it before anything else
        deadline = time.monotonic() + grace
        while grace > 0 and time.monotonic() < deadline and any(c.proc.poll() is None for c in running):
            if self._gone.is_set() and not self.kl._stopping.is_set():
                break  # force-deleted meanwhile: no more grace
            if self.kl._stopping.is_set():
                deadline = min(deadline, self.kl._stop_deadline)  # stop() bounds every grace period
            time.sleep(0.05)
        for c in running:
            killpg(c.proc.pid, signal.SIGKILL)
            try:
                rc = c.proc.wait(10)
            except subprocess.TimeoutExpired:  # cannot happen after SIGKILL, short of a D-state process
                self.log.error("%s: pid %d survived SIGKILL", self.key, c.proc.pid)
                continue
            self._exited_final(c, rc)

    def _exited_final(self, c: Container, rc: int) -> None:
        code, sig = (128 - rc, -rc) if rc < 0 else (rc, None)
        term = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.state.get("running", {}).get("startedAt", now_iso()),
            "finishedAt": now_iso(),
            "containerID": self._cid(c),
        }
        if sig:
            term["signal"] = sig
        self.log.info("%s: container %s stopped, exit code %d", self.key, c.name, code)
        c.proc, c.ready, c.done, c.exit_code = None, False, True, code
        c.state = {"terminated": term}

    def _terminate(self) -> None:
        """The pod is being deleted: stop its processes within the grace period, then remove the object."""
        grace = self._grace()
        self.log.info("%s: deleting (grace %gs)", self.key, grace)
        self._kill_all(grace=grace)
        if self.phase not in TERMINAL:
            self.phase = self._phase()
        self._write_status()
        try:
            self.kl.call(
                self.kl.core.delete_namespaced_pod,
                self.pod_name,
                self.ns,
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )
            self.log.info("%s: pod object removed", self.key)
        except ApiException as e:
            if e.status not in (404, 409):  # gone already, or a new pod of that name (not ours to delete)
                raise

    # -- status --
    def _phase(self) -> str:
        """Kubernetes' getPhase over the containers' states."""
        if self.failure or self.init_failed:
            return "Failed"
        if not self.initialized:
            return "Pending"
        waiting = running = stopped = succeeded = 0
        for c in self.mains:
            if c.proc is not None:
                running += 1
            elif c.done:
                stopped += 1
                succeeded += c.exit_code == 0
            elif c.last_state:  # in back-off after an exit
                stopped += 1
            else:
                waiting += 1
        if waiting:
            return "Pending"
        if running:
            return "Running"
        if self.policy == "Always":
            return "Running"
        if stopped == succeeded and all(c.done for c in self.mains):
            return "Succeeded"
        if self.policy == "Never":
            return "Failed"
        return "Running"

    def _cond(self, type_: str, ok: bool, reason: str | None = None, message: str | None = None) -> dict:
        status = "True" if ok else "False"
        old = self._conds.get(type_)
        if old is None or old["status"] != status:
            old = {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": now_iso()}
        cond = {**old}
        for k, v in (("reason", reason), ("message", message)):
            if v:
                cond[k] = v
            else:
                cond.pop(k, None)
        self._conds[type_] = cond
        return cond

    def _container_status(self, c: Container) -> dict:
        st: dict[str, Any] = {
            "name": c.name,
            "image": c.image,
            "imageID": f"{RUNTIME}://{c.image}",
            "ready": c.ready and c.proc is not None,
            "started": c.proc is not None and c.started,
            "restartCount": c.restart_count,
            "state": c.state,
            "lastState": c.last_state,
        }
        if c.runs:
            st["containerID"] = self._cid(c)
        return st

    def _status(self) -> dict:
        terminal = self.phase in TERMINAL
        not_ready = [c.name for c in self.mains if not (c.ready and c.proc is not None)]
        ready = not terminal and not not_ready and bool(self.mains)
        why = "PodCompleted" if terminal else ("ContainersNotReady" if not_ready else None)
        msg = (
            None if terminal or not not_ready else f"containers with unready status: [{' '.join(not_ready)}]"
        )
        pending_init = [c.name for c in self.inits if not c.done]
        conds = [
            self._cond(
                "Initialized",
                self.initialized or terminal,
                None if self.initialized or terminal else "ContainersNotInitialized",
                None
                if self.initialized or terminal
                else f"containers with incomplete status: [{' '.join(pending_init)}]",
            ),
            self._cond("Ready", ready, why, msg),
            self._cond("ContainersReady", ready, why, msg),
            self._cond("PodScheduled", True),
        ]
        status: dict[str, Any] = {
            "phase": self.phase,
            "conditions": conds,
            "hostIP": "127.0.0.1",
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "containerStatuses": [self._container_status(c) for c in self.mains],
            "reason": self.failure[0] if self.failure else None,
            "message": self.failure[1] if self.failure else None,
        }
        if self.inits:
            status["initContainerStatuses"] = [self._container_status(c) for c in self.inits]
        return status

    def _write_status(self) -> None:
        status = self._status()
        text = json.dumps(status, sort_keys=True)
        if text == self._written or self._gone.is_set():
            return
        try:
            # merge patch: strategic merge appends to podIPs (422); the uid fails the patch on a new pod
            self.kl.call(
                self.kl.core.patch_namespaced_pod_status,
                self.pod_name,
                self.ns,
                {"metadata": {"uid": self.uid}, "status": status},
                _content_type="application/merge-patch+json",
            )
            self._written = text
        except ApiException as e:
            if e.status == 404 or (e.status in (409, 422) and self._uid_changed()):
                self.gone()  # deleted, or replaced by a new pod of the same name
            else:
                self.log.warning("%s: status write failed: %s %s", self.key, e.status, e.reason)

    def _uid_changed(self) -> bool:
        try:
            return (
                self.kl.call(self.kl.core.read_namespaced_pod, self.pod_name, self.ns)["metadata"]["uid"]
                != self.uid
            )
        except ApiException:
            return True


# ---------------------------------------------------------------------------------------------- kubelet --
class TestKubelet:
    """Scheduler + kubelet for one node; see the module docstring. `start()` returns once the node is
    registered and the watches run; `stop()` kills every process it started and returns."""

    __test__ = False  # not a pytest test class despite its name

    def __init__(
        self,
        kubeconfig: str | os.PathLike,
        out_dir: str | os.PathLike,
        node_name: str = NODE_NAME,
        bind_pending: bool = True,
        stop_grace: float = 5.0,
        heartbeat_s: float = 10.0,
        fork_ecrec: bool = False,
    ):
        """`bind_pending=False`: run only pods bound to `node_name` already (a second kubelet in one cluster);
        `stop_grace`: seconds between SIGTERM and SIGKILL of the pods' processes on `stop()`;
        `fork_ecrec`: a container whose command is the `ecrec` image's entrypoint is forked from a fork
        server (`ecrec.forkserver`, as `ecrec local` starts its processes) instead of starting a new
        interpreter: the same `ecrec ROLE ARGS` with the pod's env, cwd and log, in its own session, without
        1-2 s of CPU for imports per pod. Its children die with the kubelet's process, not with the pod's
        worker thread."""
        self.kubeconfig = Path(kubeconfig)
        self.out_dir = Path(out_dir).resolve()
        self.node_name = node_name
        self.bind_pending = bind_pending
        self.stop_grace = stop_grace
        self.heartbeat_s = heartbeat_s
        self.fork_ecrec = fork_ecrec
        self._forkserver: Any = None  # ecrec.forkserver.ForkServer, with fork_ecrec, from start()
        self.ips = IPS
        self.capacity = self._capacity()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._workers: dict[str, PodWorker] = {}
        self._threads: list[threading.Thread] = []
        self._streams: set[Any] = set()
        self._unschedulable: dict[str, str] = {}  # uid -> message last written
        self._finished: set[str] = set()  # uids whose worker ended: late events must not start them again
        self._stop_deadline = 0.0
        self.log = logging.getLogger(f"{LOGGER}.{node_name}")
        self._log_handler: logging.Handler | None = None
        self._started = False

    def forked(self, argv: list[str], env: dict[str, str], log: Path, name: str, cwd: Path) -> Any:
        """`ecrec ARGV` forked from the fork server (see `fork_ecrec`), Popen-like."""
        return self._forkserver.spawn(argv, env, log, name, cwd=cwd)

    # -- API access --
    def call(self, fn, *args, **kwargs) -> Any:
        """Calls a CoreV1Api method and returns the JSON body as dicts (camelCase, as kubectl shows it).

        Raw responses also dodge the client's failure to deserialize the Status a binding returns."""
        kwargs.setdefault("_request_timeout", 30)
        resp = fn(*args, _preload_content=False, **kwargs)
        return json.loads(resp.data) if resp.data else None

    @staticmethod
    def _capacity() -> dict[str, str]:
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

    # -- lifecycle --
    def start(self) -> TestKubelet:
        if self._started:
            raise RuntimeError("already started")
        self._started = True
        (self.out_dir / "pods").mkdir(parents=True, exist_ok=True)
        self._log_handler = logging.FileHandler(self.out_dir / "kubelet.log")
        self._log_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.log.addHandler(self._log_handler)
        self.log.setLevel(logging.INFO)
        if self.fork_ecrec:
            from ecrec.forkserver import ForkServer

            # From this thread, which outlives every pod's: the fork server dies with the thread that started
            # it (PR_SET_PDEATHSIG is per thread), and its children with it.
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self._forkserver = ForkServer(self.out_dir, self.out_dir / "forkserver.log", env)
        cfg = k8s.Configuration()
        k8s_config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=cfg)
        cfg.connection_pool_maxsize = 64  # one worker thread per pod, each calling the API
        self.api = k8s.ApiClient(cfg)
        self.core = k8s.CoreV1Api(self.api)
        self.proxy = ServiceProxy(self.call, self.core, PodWorker._target_port)
        self._register_node()
        watches = [("node", f"spec.nodeName={self.node_name}", self._on_pod_event, self._sync_node_pods)]
        if self.bind_pending:
            watches.append(("unbound", "spec.nodeName=", self._on_unbound_event, self._sync_unbound))
        for name, selector, handler, sync in watches:
            t = threading.Thread(
                target=self._watch_loop, args=(selector, handler, sync), name=f"watch-{name}", daemon=True
            )
            t.start()
            self._threads.append(t)
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        self._threads.append(hb)
        self.log.info("test kubelet started: node %s, out %s", self.node_name, self.out_dir)
        return self

    def stop(self) -> None:
        """Stops watching, kills every pod process (SIGTERM, SIGKILL after stop_grace) and marks the node
        NotReady. Pod objects stay as they are."""
        if not self._started or self._stopping.is_set():
            return
        self._stop_deadline = time.monotonic() + self.stop_grace
        self._stopping.set()
        with self._lock:
            streams, workers = list(self._streams), list(self._workers.values())
        for s in streams:
            try:
                s.shutdown()  # unblocks the watch thread's read
            except Exception:
                pass
        for w in workers:
            w.wake()
        for w in workers:
            w.join(self.stop_grace + 15)
            if w.is_alive():
                self.log.error("%s: worker did not stop", w.key)
        for t in self._threads:
            t.join(10)
        if self._forkserver is not None:
            self._forkserver.close()
        self.proxy.stop()
        try:
            self._patch_node_status(ready=False)
        except Exception as e:
            self.log.warning("could not mark node %s NotReady: %s", self.node_name, e)
        self.log.info("test kubelet stopped")
        if self._log_handler is not None:
            self.log.removeHandler(self._log_handler)
            self._log_handler.close()
        self.api.close()

    def __enter__(self) -> TestKubelet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def pids(self) -> dict[str, list[int]]:
        """`ns/pod` -> pids of its running container processes (for tests)."""
        with self._lock:
            workers = list(self._workers.values())
        return {w.key: [c.proc.pid for c in w.inits + w.mains if c.proc is not None] for w in workers}

    # -- node --
    def _node_conditions(self, ready: bool) -> list[dict]:
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
                    "lastTransitionTime": self._node_since,
                }
            )
        if ready != self._node_ready:
            self._node_ready, self._ready_since = ready, now
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

    def _patch_node_status(self, ready: bool) -> None:
        status = {
            "capacity": self.capacity,
            "allocatable": self.capacity,
            "conditions": self._node_conditions(ready),
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": self.node_name},
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
                "architecture": self._arch(),
            },
        }
        self.call(
            self.core.patch_node_status,
            self.node_name,
            {"status": status},
            _content_type="application/merge-patch+json",
        )

    @staticmethod
    def _arch() -> str:
        m = platform.machine()
        return {"x86_64": "amd64", "aarch64": "arm64"}.get(m, m)

    def _node_labels(self) -> dict[str, str]:
        return {
            "kubernetes.io/hostname": self.node_name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": self._arch(),
            "ecrec.dev/test-kubelet": "true",
            PAUSE_NODE_LABEL: "true",  # honours the pause annotations (ecrec chaos --action pod-failure)
        }

    def _register_node(self) -> None:
        self._node_since = now_iso()
        self._node_ready, self._ready_since = None, self._node_since
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.node_name, "labels": self._node_labels()},
        }
        try:
            self.call(self.core.create_node, node)
            self.log.info("node %s registered", self.node_name)
        except ApiException as e:
            if e.status != 409:
                raise
            self.call(
                self.core.patch_node,
                self.node_name,
                {"metadata": {"labels": self._node_labels()}},
                _content_type="application/merge-patch+json",
            )
            self.log.info("node %s exists already: taking it over", self.node_name)
        self._patch_node_status(ready=True)

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self.heartbeat_s):
            try:
                self._patch_node_status(ready=True)
            except Exception as e:
                self.log.warning("node heartbeat failed: %s", e)

    # -- watches --
    def _watch_loop(self, selector: str, handler, sync) -> None:
        """List, then watch from that resourceVersion; relist on 410 Gone or an error."""
        rv = None
        while not self._stopping.is_set():
            try:
                if rv is None:
                    lst = self.call(self.core.list_pod_for_all_namespaces, field_selector=selector)
                    rv = lst["metadata"]["resourceVersion"]
                    sync(lst["items"])
                resp = self.core.list_pod_for_all_namespaces(
                    watch=True,
                    field_selector=selector,
                    resource_version=rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=300,
                    _preload_content=False,
                    _request_timeout=(10, 330),
                )
                with self._lock:
                    self._streams.add(resp)
                try:
                    if self._stopping.is_set():
                        break
                    for line in iter_resp_lines(resp):
                        if self._stopping.is_set():
                            break
                        if not line:
                            continue
                        ev = json.loads(line)
                        obj = ev["object"]
                        if ev["type"] == "ERROR":
                            if obj.get("code") == 410:  # too old a resourceVersion: list again
                                rv = None
                                break
                            raise RuntimeError(f"watch error: {obj}")
                        rv = obj["metadata"]["resourceVersion"]
                        if ev["type"] != "BOOKMARK":
                            handler(ev["type"], obj)
                finally:
                    with self._lock:
                        self._streams.discard(resp)
                    resp.release_conn()
            except Exception as e:
                if self._stopping.is_set():
                    break
                if isinstance(e, ApiException) and e.status == 410:
                    rv = None
                    continue
                self.log.warning("watch %s: %s: %s; again in 1 s", selector, type(e).__name__, e)
                rv = None
                self._stopping.wait(1)

    def _sync_node_pods(self, pods: list[dict]) -> None:
        uids = {p["metadata"]["uid"] for p in pods}
        with self._lock:
            vanished = [w for uid, w in self._workers.items() if uid not in uids]
        for w in vanished:
            w.gone()
        for p in pods:
            self._on_pod_event("ADDED", p)

    def _on_pod_event(self, etype: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            w = self._workers.get(uid)
            if etype == "DELETED":
                if w is not None:
                    w.gone()
                return
            if w is not None:
                w.update(pod)
                return
            if uid in self._finished or self._stopping.is_set():
                return
            if (pod.get("status") or {}).get("phase") in TERMINAL:
                return  # finished under an earlier kubelet: nothing to run
            w = PodWorker(self, pod)
            self._workers[uid] = w
            w.start()  # under the lock: stop() never sees a worker it cannot join

    def _forget(self, w: PodWorker) -> None:
        with self._lock:
            self._finished.add(w.uid)
            if self._workers.get(w.uid) is w:
                del self._workers[w.uid]
        if w.ip != "127.0.0.1":
            self.ips.release(w.ip)

    def _sync_unbound(self, pods: list[dict]) -> None:
        for p in pods:
            self._on_unbound_event("ADDED", p)

    def _on_unbound_event(self, etype: str, pod: dict) -> None:
        """The scheduler's part: bind a pending pod to this node."""
        meta, spec = pod["metadata"], pod["spec"]
        if etype == "DELETED" or spec.get("nodeName") or meta.get("deletionTimestamp"):
            return  # DELETED here also means "left the selection": bound meanwhile
        if spec.get("schedulerName", "default-scheduler") != "default-scheduler":
            return
        if (pod.get("status") or {}).get("phase") in TERMINAL:
            return
        key = f"{meta['namespace']}/{meta['name']}"
        labels = self._node_labels()
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
                "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name},
            }
            self.call(self.core.create_namespaced_pod_binding, meta["name"], meta["namespace"], binding)
            self.log.info("%s: bound to %s", key, self.node_name)
        except ApiException as e:
            if e.status not in (404, 409):  # gone, or bound by someone else meanwhile
                self.log.warning("%s: binding failed: %s %s", key, e.status, e.body)


# ------------------------------------------------------------------------------------------------- main --
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.k8s.kubelet",
        description="The test kubelet: schedules and runs the pods of a test control plane as local processes.",
    )
    ap.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), help="default: $KUBECONFIG")
    ap.add_argument("--out", default="out/k8s", help="kubelet.log and pods/<ns>_<pod>/ (default: out/k8s)")
    ap.add_argument("--node", default=NODE_NAME, help=f"node name (default: {NODE_NAME})")
    ap.add_argument("--no-bind", action="store_true", help="run only pods already bound to --node")
    ap.add_argument("--stop-grace", type=float, default=5.0, help="SIGTERM..SIGKILL on exit (default: 5 s)")
    args = ap.parse_args(argv)
    if not args.kubeconfig:
        ap.error("--kubeconfig or $KUBECONFIG is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    kl = TestKubelet(
        args.kubeconfig,
        args.out,
        node_name=args.node,
        bind_pending=not args.no_bind,
        stop_grace=args.stop_grace,
    )
    kl.start()
    print(f"test kubelet: node {args.node} ready; pod logs in {kl.out_dir / 'pods'}", flush=True)
    while not done.wait(1):
        pass
    kl.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
