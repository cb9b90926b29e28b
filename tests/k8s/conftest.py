"""The `kube` fixture: one real control plane (etcd + kube-apiserver + kube-controller-manager) per session, whose
one node the test kubelet (`kubelet`) both schedules and runs. `kube_multinode` and `kubelet_multinode`: a
second one, started by the first module that asks and shared for the session, with kube-scheduler and
MULTINODE_NODES nodes served by one test kubelet.

The build (minutes, once per machine; cached afterwards) runs after collection, outside every test's
timeout, and only when a selected test is marked `k8s`. A failed build fails the tests, with the reason; only an
explicit ECREC_SKIP_K8S=1 skips them (and .ci/run never sets it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from .testenv import REPO, BuildError, KubeTestEnv, build_log_path

_build: dict[str, object] = {}  # "error": BuildError | None once the build was attempted


def _selected_k8s(items) -> bool:
    return any(item.get_closest_marker("k8s") for item in items)


def pytest_collection_finish(session: pytest.Session) -> None:
    if "error" in _build or not _selected_k8s(session.items) or os.environ.get("ECREC_SKIP_K8S") == "1":
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(
            f"k8s: hack/kube-testenv build (minutes the first time on this machine, cached afterwards;"
            f" log {build_log_path()})"
        )
    try:
        KubeTestEnv.ensure_built()
        _build["error"] = None
    except BuildError as e:
        _build["error"] = e
        if tr is not None:
            tr.write_line(f"k8s: BUILD FAILED: {e}", red=True, bold=True)
    except Exception as e:  # a timeout, a missing script: the tests report it
        _build["error"] = BuildError(f"{type(e).__name__}: {e}")


def _need_built() -> None:
    """Skips (ECREC_SKIP_K8S=1) or fails the test unless the control plane is built."""
    if os.environ.get("ECREC_SKIP_K8S") == "1":
        pytest.skip("ECREC_SKIP_K8S=1: Kubernetes tests skipped")
    if "error" not in _build:  # e.g. selected by a keyword after collection: build here
        try:
            KubeTestEnv.ensure_built()
            _build["error"] = None
        except BuildError as e:
            _build["error"] = e
    error = _build["error"]
    if error is not None:
        if os.environ.get("ECREC_SKIP_K8S") == "1":
            pytest.skip(f"ECREC_SKIP_K8S=1: Kubernetes tests skipped (control plane: {error})")
        pytest.fail(f"the Kubernetes test control plane could not be built: {error}", pytrace=False)


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory):
    """A started control plane (KubeTestEnv) without kube-scheduler; stopped at the end of the session."""
    _need_built()
    env = KubeTestEnv()
    state = tmp_path_factory.mktemp("kube")
    env.start(state, watch_pid=os.getpid())
    try:
        yield env
    finally:
        env.stop()
        shutil.rmtree(state / "etcd", ignore_errors=True)  # ~100 MB of preallocated WAL; logs stay


CRD_NAME = "ecrecjobs.ecrec.dev"


def apply_crd(kube: KubeTestEnv) -> str:
    """The ECRecJob CRD from `ecrec crd`, applied and Established; the controller-manager restarted so its
    garbage collector watches ECRecJobs at once (it would otherwise discover them within 30 s)."""
    crd = subprocess.run(
        [sys.executable, "-m", "ecrec.cli", "crd"], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    kube.kubectl("apply", "-f", "-", input=crd)
    kube.wait_crd_established(CRD_NAME)
    kube.restart_controller_manager()
    return CRD_NAME


@pytest.fixture(scope="session")
def ecrec_crd(kube: KubeTestEnv) -> str:
    """The ECRecJob CRD in the `kube` control plane (apply_crd)."""
    return apply_crd(kube)


@pytest.fixture(scope="session")
def kubelet(kube: KubeTestEnv, tmp_path_factory: pytest.TempPathFactory):
    """The test kubelet (tests/k8s/kubelet/) on node ecrec-local-0 of the `kube` control plane: pending pods
    get bound and run as local processes. Its log and the pods' logs are under `kubelet.out_dir` (a pytest
    temp dir: `kubelet.log`, `pods/<ns>_<pod>/<container>.log`). Stopped, with every process it started,
    before the control plane."""
    from .kubelet import TestKubelet  # imports the kubernetes client: only where a test needs it

    # The job pods' processes forked from a fork server, as `ecrec local` starts them: the suite starts ~120
    # of them, each 1-2 s of CPU in imports beside training. tests/k8s/test_helm_e2e.py's own kubelet starts
    # every container as a new interpreter, as a real kubelet would.
    kl = TestKubelet(kube.kubeconfig, tmp_path_factory.mktemp("kubelet"), fork_ecrec=True)
    kl.start()
    try:
        yield kl
    finally:
        kl.stop()


@pytest.fixture(scope="module")
def core(kube: KubeTestEnv):
    """A CoreV1Api client with the admin kubeconfig."""
    from kubernetes import client, config

    api = config.new_client_from_config(str(kube.kubeconfig))
    yield client.CoreV1Api(api)
    api.close()


@pytest.fixture(scope="module")
def ns(request: pytest.FixtureRequest, kube: KubeTestEnv, kubelet) -> str:
    """The namespace named by the test module's NS, created once per module, with the kubelet running."""
    name = request.module.NS
    kube.kubectl("create", "namespace", name)
    return name


MULTINODE_NODES = 4
# The node lifecycle controller of `kube_multinode` marks a node without heartbeats Unknown (and taints it
# unreachable) after MULTINODE_NODE_GRACE s, looking every 2 s; `kubelet_multinode` beats every
# MULTINODE_HEARTBEAT s, well within it even on loaded cores. Short, so that a node lost by annotation
# (kubelet/outages.py) is seen lost in a test's time, not after Kubernetes' 40 s.
MULTINODE_NODE_GRACE = 12.0
MULTINODE_NODE_MONITOR_PERIOD = 2.0
MULTINODE_HEARTBEAT = 2.0


@pytest.fixture(scope="session")
def kube_multinode(tmp_path_factory: pytest.TempPathFactory):
    """A control plane of its own with kube-scheduler (and the node lifecycle controller: grace
    MULTINODE_NODE_GRACE s, period 2 s), the ECRecJob CRD applied; shared by the modules that use it (each
    leaves its nodes schedulable), stopped at the end of the session. Its Service range, 127.0.7.0/24, differs
    from every other control plane's in the session (see KubeTestEnv.start)."""
    _need_built()
    env = KubeTestEnv()
    state = tmp_path_factory.mktemp("kube-multinode")
    env.start(
        state,
        watch_pid=os.getpid(),
        scheduler=True,
        service_cidr="127.0.7.0/24",
        node_grace=MULTINODE_NODE_GRACE,
        node_monitor_period=MULTINODE_NODE_MONITOR_PERIOD,
    )
    try:
        apply_crd(env)
        yield env
    finally:
        env.stop()
        shutil.rmtree(state / "etcd", ignore_errors=True)


@pytest.fixture(scope="session")
def kubelet_multinode(kube_multinode: KubeTestEnv, tmp_path_factory: pytest.TempPathFactory):
    """The test kubelet serving MULTINODE_NODES nodes, ecrec-local-0..3 (zone-0, zone-1, zone-0, zone-1), of
    `kube_multinode`: it binds nothing (kube-scheduler does) and runs the pods bound to any of them; each
    node's heartbeat every MULTINODE_HEARTBEAT s (within the control plane's grace). Returns once every node
    is schedulable."""
    from .kubelet import TestKubelet

    kl = TestKubelet(
        kube_multinode.kubeconfig,
        tmp_path_factory.mktemp("kubelet-multinode"),
        nodes=MULTINODE_NODES,
        bind_pending=False,
        fork_ecrec=True,
        heartbeat_s=MULTINODE_HEARTBEAT,
    )
    kl.start()
    try:
        kube_multinode.wait_nodes_schedulable(kl.node_names)
        yield kl
    finally:
        kl.stop()
