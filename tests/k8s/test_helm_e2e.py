"""The Helm chart end to end: `helm install` into a real control plane, the operator runs from the chart's
Deployment (a pod the test kubelet runs like any other, Ready through kopf's /healthz), and an ECRecJob
applied with kubectl trains to Succeeded; `helm uninstall` removes the operator and keeps the CRD and jobs.

This module starts a control plane of its own beside the session's (`kube`, whose build and skip rules it
shares): one with the Deployment and ReplicaSet controllers, which the session's runs without, and without
the ECRecJob CRD, which the chart must install itself (Helm skips a CRD that exists already).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .testenv import REPO, KubeTestEnv, find_helm

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

RELEASE = "ecrec"
OP_NS = "ecrec-system"
NS = "helm-e2e"
CHART = REPO / "charts" / "ecrec"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
OPERATOR = "ecrec-operator"  # the Deployment, ServiceAccount and ClusterRole of release "ecrec"
CONTROLLERS = "garbagecollector,namespace,deployment,replicaset"


class Cluster:
    """A control plane with its own test kubelet, and helm/kubectl against it."""

    def __init__(self, env: KubeTestEnv, kubelet, out: Path):
        self.env, self.kubelet, self.out = env, kubelet, out
        self.helm_path = find_helm()

    def kubectl(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.env.kubectl(*args, **kw)

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [self.helm_path, f"--kubeconfig={self.env.kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            # helm's caches and config under the test's directory, not $HOME
            env={
                **os.environ,
                "HELM_CACHE_HOME": str(self.out / "helm-cache"),
                "HELM_CONFIG_HOME": str(self.out / "helm-config"),
                "HELM_DATA_HOME": str(self.out / "helm-data"),
            },
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
        return proc

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)


@pytest.fixture(scope="module")
def cluster(kube, tmp_path_factory):
    from .kubelet import TestKubelet

    env = KubeTestEnv()
    state = tmp_path_factory.mktemp("helm-kube")
    env.start(state, watch_pid=os.getpid(), controllers=CONTROLLERS)
    kubelet = TestKubelet(env.kubeconfig, tmp_path_factory.mktemp("helm-kubelet"))
    try:
        kubelet.start()
        yield Cluster(env, kubelet, tmp_path_factory.mktemp("helm"))
    finally:
        kubelet.stop()
        env.stop()
        print(f"helm e2e: control plane {state}, kubelet {kubelet.out_dir}")


def wait_for(what: str, fn, timeout: float, every: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def job_manifest(name: str) -> str:
    """examples/k8s-small.yaml, smaller: the tiny model and fewer steps (8 pods all the same)."""
    doc = yaml.safe_load((REPO / "examples/k8s-small.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"]["model"] = {"preset": "tiny"}
    doc["spec"]["training"].update({"steps": 200, "batchSize": 256})
    return yaml.safe_dump(doc)


def operator_pod(c: Cluster) -> dict | None:
    pods = c.get("pods", "-n", OP_NS, "-l", "app.kubernetes.io/component=operator")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return live[0] if len(live) == 1 else None


def ready(pod: dict | None) -> bool:
    conds = (pod or {}).get("status", {}).get("conditions") or []
    return any(x["type"] == "Ready" and x["status"] == "True" for x in conds)


@pytest.mark.timeout(900)
def test_helm_install_runs_the_operator_as_a_deployment_and_a_job_trains(cluster: Cluster):
    c = cluster
    c.kubectl("create", "namespace", NS)
    assert c.kubectl("get", "crd", "ecrecjobs.ecrec.dev", check=False).returncode != 0  # the chart brings it

    c.helm("install", RELEASE, str(CHART), "-n", OP_NS, "--create-namespace")
    crd = c.get("crd", "ecrecjobs.ecrec.dev")  # from the chart's crds/: exactly the committed file
    committed = yaml.safe_load((CHART / "crds" / "ecrecjobs.yaml").read_text())
    assert crd["spec"]["versions"][0]["schema"] == committed["spec"]["versions"][0]["schema"]
    c.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/ecrecjobs.ecrec.dev")

    # The Deployment's pod comes from its ReplicaSet (kube-controller-manager), runs on the test kubelet and
    # turns Ready only once kopf's /healthz answers the readiness probe.
    pod = wait_for("the operator pod to be Ready", lambda: (p := operator_pod(c)) and ready(p) and p, 240)
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "ReplicaSet" and owner["name"].startswith(f"{OPERATOR}-")
    deploy = c.get("deployment", OPERATOR, "-n", OP_NS)
    wait_for(
        "the Deployment to count it ready",
        lambda: c.get("deployment", OPERATOR, "-n", OP_NS).get("status", {}).get("readyReplicas") == 1,
        60,
    )
    (container,) = pod["spec"]["containers"]
    assert container["image"] == f"ecrec-operator:{APP_VERSION}"
    assert pod["spec"]["serviceAccountName"] == OPERATOR
    assert deploy["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    ip = pod["status"]["podIP"]
    assert httpx.get(f"http://{ip}:8080/healthz", timeout=10).status_code == 200

    # The credentials the kubelet handed the pod are the ServiceAccount's, with the chart's rights only.
    key = f"{OP_NS}_{pod['metadata']['name']}"
    sa_kubeconfig = next((c.kubelet.out_dir / "pods" / key).glob("volumes-*/kube-api-access/kubeconfig"))
    token = (sa_kubeconfig.parent / "token").read_text()
    claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "==="))
    assert claims["sub"] == f"system:serviceaccount:{OP_NS}:{OPERATOR}"

    def can_i(*args: str) -> str:  # kubectl with the pod's kubeconfig only: its token, not the admin's
        return subprocess.run(
            [c.env.kubectl_path, f"--kubeconfig={sa_kubeconfig}", "auth", "can-i", *args],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()

    assert can_i("create", "pods", "-n", NS) == "yes"
    assert can_i("get", "secrets", "-n", NS) == "yes"  # the job token's Secret (ecrec.auth)
    assert can_i("list", "secrets", "-n", NS) == "no" and can_i("delete", "secrets", "-n", NS) == "no"

    # A job, applied as a user would: the operator in the pod creates its pods, with the chart's defaults.
    c.kubectl("apply", "-f", "-", input=job_manifest("helm-small"))

    def finished():
        st = c.get("ecj", "helm-small", "-n", NS).get("status") or {}
        assert st.get("phase") != "Failed", st
        return st if st.get("phase") == "Succeeded" and st.get("completionTime") else None

    status = wait_for("the job to succeed", finished, timeout=600, every=1)
    # The operator's final checks ran in its pod too: the model's AUC and the parity check.
    assert status["step"] == 200 and 0.5 < status["eval"]["auc"] <= 1.0
    assert status["parityCheck"]["mismatches"] == 0 and status["parityCheck"]["stripes"] > 0
    job_pods = c.get("pods", "-n", NS, "-l", "ecrec.dev/job=helm-small")["items"]
    # The job's own NetworkPolicy and token Secret, created by the operator, owned by the job.
    policy = c.get("networkpolicy", "helm-small-ecrec", "-n", NS)
    assert policy["spec"]["podSelector"] == {"matchLabels": {"ecrec.dev/job": "helm-small"}}
    secret = c.get("secret", "helm-small-token", "-n", NS)
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "ECRecJob"
    assert {p["metadata"]["labels"]["ecrec.dev/role"] for p in job_pods} == {
        "coordinator",
        "server",
        "worker",
    }
    for p in job_pods:
        (jc,) = p["spec"]["containers"]
        # The job kept the spec's default image: the chart's runtime image replaced it.
        assert jc["image"] == f"ecrec:{APP_VERSION}", jc["image"]
        assert jc["securityContext"]["readOnlyRootFilesystem"] is True
        assert p["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}

    # The operator's /metrics (served on its pod IP, the chart's metricsPort) counted the pods it created.
    text = httpx.get(f"http://{ip}:9090/metrics", timeout=10).text
    created = sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "ecrec_operator_pods_created_total"
    )
    assert created >= len(job_pods), text

    c.helm("uninstall", RELEASE, "-n", OP_NS, "--wait", "--timeout", "120s")
    wait_for(
        "the operator pod to go",
        lambda: operator_pod(c) is None and not c.get("pods", "-n", OP_NS)["items"],
        120,
    )
    # Helm never deletes a chart's CRDs (that would delete every job): the CRD and the job stay.
    assert c.kubectl("get", "crd", "ecrecjobs.ecrec.dev", check=False).returncode == 0
    assert c.get("ecj", "helm-small", "-n", NS)["status"]["phase"] == "Succeeded"
    assert c.kubectl("get", "clusterrole", OPERATOR, check=False).returncode != 0
