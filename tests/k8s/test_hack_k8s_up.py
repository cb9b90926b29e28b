"""`make k8s-up` / `make k8s-down` in sequence, both modes, one state dir: whatever ran before, k8s-up works.

The first hour of a new user: `make k8s-up` (a local operator, its RBAC applied with kubectl), `make k8s-down`,
then `make k8s-up OPERATOR=helm`. Helm refuses to adopt objects it did not create (the ServiceAccount that
kubectl applied); every k8s-up therefore starts a fresh cluster (hack/k8s-up deletes the last one's etcd data),
so neither mode inherits the other's objects — in particular no Helm-installed operator Deployment runs beside
a later local operator. A k8s-up while the last one still runs is refused instead of wiping it.

The scripts run as a user runs them, with a control plane of their own (not the session's `kube`); its
Service range differs from the session's and the Helm e2e's (see KubeTestEnv.start).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from .testenv import REPO, BuildError, KubeTestEnv, find_helm, find_kubectl

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

OP_NS = "ecrec-system"


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    if os.environ.get("ECREC_SKIP_K8S") == "1":
        pytest.skip("ECREC_SKIP_K8S=1: Kubernetes tests skipped")
    try:
        KubeTestEnv.ensure_built()  # what the `kube` fixture needs too: cached after the first time
    except BuildError as e:
        pytest.fail(f"the Kubernetes test control plane could not be built: {e}", pytrace=False)
    find_helm(), find_kubectl()
    d = tmp_path_factory.mktemp("k8s-up")
    yield d
    _script("k8s-down", d, check=False)  # whatever a failed test left running


def _script(name: str, d, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "ECREC_KUBE_SERVICE_CIDR": "127.0.8.0/24",
        "ECREC_KUBE_WATCH_PID": str(os.getpid()),  # the control plane stops with this test run at the latest
    }
    r = subprocess.run(
        [str(REPO / "hack" / name), str(d), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    if check:
        assert r.returncode == 0, (
            f"hack/{name} {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        )
    return r


def _kubectl(d, *args: str) -> dict:
    r = subprocess.run(
        [find_kubectl(), f"--kubeconfig={d}/kubeconfig", *args, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(r.stdout)


def _operator_sa_labels(d) -> dict:
    return _kubectl(d, "-n", OP_NS, "get", "serviceaccount", "ecrec-operator")["metadata"].get("labels") or {}


def _deployments(d) -> list[str]:
    return [x["metadata"]["name"] for x in _kubectl(d, "-n", OP_NS, "get", "deployments")["items"]]


def test_k8s_up_local_down_up_helm_down_up_local(state):
    d = state
    _script("k8s-up", d, "local")
    assert _operator_sa_labels(d).get("app.kubernetes.io/managed-by") != "Helm"  # kubectl applied it
    assert _deployments(d) == []
    again = _script("k8s-up", d, "local", check=False)  # still up: refused, and nothing is wiped
    assert again.returncode == 1 and "hack/k8s-down" in again.stderr, again.stderr
    assert _operator_sa_labels(d) is not None
    _script("k8s-down", d)
    assert not (d / "run" / "operator.pid").exists()

    up = _script("k8s-up", d, "helm")  # failed before: "ServiceAccount ... exists and cannot be imported"
    assert "helm release ecrec" in up.stdout, up.stdout
    assert _operator_sa_labels(d).get("app.kubernetes.io/managed-by") == "Helm"
    assert _deployments(d) == ["ecrec-operator"]
    _script("k8s-down", d)

    _script("k8s-up", d, "local")  # and back: the Helm release's operator Deployment is gone with its cluster
    assert _deployments(d) == []
    assert _operator_sa_labels(d).get("app.kubernetes.io/managed-by") != "Helm"
    _script("k8s-down", d)
