"""The Helm chart end to end: `helm install` into a real control plane, the operator runs from the chart's
Deployment (a pod the test kubelet runs like any other, Ready through kopf's /healthz), and an ECRecJob
applied with kubectl trains to Succeeded; `ecrec chaos --role any --count 3` kills a worker, the coordinator
and a server of a second job, which still succeeds, with every recovery in its status and in what a real
Prometheus scraped through the chart's PodMonitor and ServiceMonitor; `helm uninstall` removes the operator and
keeps the CRD and jobs.

Debian's Prometheus is built without Kubernetes service discovery, so `MonitorDiscovery` stands in for the
Prometheus Operator + kubernetes_sd: it reads the monitors `helm template --api-versions monitoring.coreos.com/v1`
renders and turns the pods they select (from the API server, every half second) into file_sd target groups with
the labels the Prometheus Operator gives them. Prometheus itself scrapes the pods for real.

This module starts a control plane of its own beside the session's (`kube`, whose build and skip rules it
shares): one with the Deployment and ReplicaSet controllers, which the session's runs without, and without
the ECRecJob CRD, which the chart must install itself (Helm skips a CRD that exists already).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.prom import Prometheus

from . import util
from .testenv import REPO, KubeTestEnv, find_helm
from .util import wait_for

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
    # Services on a range of their own: the main control plane's kubelet proxies 127.0.10.0/24 on this loopback
    # (a coordinator Service on the same ClusterIP and port in both failed a CI run: EADDRINUSE)
    env.start(state, watch_pid=os.getpid(), controllers=CONTROLLERS, service_cidr="127.0.9.0/24")
    kubelet = TestKubelet(env.kubeconfig, tmp_path_factory.mktemp("helm-kubelet"))
    try:
        kubelet.start()
        yield Cluster(env, kubelet, tmp_path_factory.mktemp("helm"))
    finally:
        kubelet.stop()
        env.stop()
        print(f"helm e2e: control plane {state}, kubelet {kubelet.out_dir}")


def operator_pod(c: Cluster) -> dict | None:
    pods = c.get("pods", "-n", OP_NS, "-l", "app.kubernetes.io/component=operator")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return live[0] if len(live) == 1 else None


def ready(pod: dict | None) -> bool:
    conds = (pod or {}).get("status", {}).get("conditions") or []
    return any(x["type"] == "Ready" and x["status"] == "True" for x in conds)


def chart_for_test_plane(out: Path) -> Path:
    """A copy of the chart whose kubeVersion admits the test control plane (1.20.2, Debian's build, the only
    one here). The chart needs 1.21 for its NetworkPolicies (kubernetes.io/metadata.name), which nothing
    enforces here (no network plugin); everything else is the chart as it is."""
    copy = out / "chart-1.20" / CHART.name
    shutil.copytree(CHART, copy, dirs_exist_ok=True)
    meta = copy / "Chart.yaml"
    text = meta.read_text()
    assert 'kubeVersion: ">=1.21.0-0"' in text, "the chart's kubeVersion changed: update this copy"
    meta.write_text(text.replace('kubeVersion: ">=1.21.0-0"', 'kubeVersion: ">=1.20.0-0"'))
    return copy


@pytest.fixture(scope="module")
def release(cluster: Cluster):
    """`helm install` of the chart (the CRD comes with it); yields the operator's pod once it is Ready."""
    c = cluster
    c.kubectl("create", "namespace", NS)
    assert c.kubectl("get", "crd", "ecrecjobs.ecrec.dev", check=False).returncode != 0  # the chart brings it

    c.helm("install", RELEASE, str(chart_for_test_plane(c.out)), "-n", OP_NS, "--create-namespace")
    crd = c.get("crd", "ecrecjobs.ecrec.dev")  # from the chart's crds/: exactly the committed file
    committed = yaml.safe_load((CHART / "crds" / "ecrecjobs.yaml").read_text())
    assert crd["spec"]["versions"][0]["schema"] == committed["spec"]["versions"][0]["schema"]
    c.env.wait_crd_established("ecrecjobs.ecrec.dev")

    # The Deployment's pod comes from its ReplicaSet (kube-controller-manager), runs on the test kubelet and
    # turns Ready only once kopf's /healthz answers the readiness probe.
    yield wait_for("the operator pod to be Ready", lambda: (p := operator_pod(c)) and ready(p) and p, 240)
    c.helm("uninstall", RELEASE, "-n", OP_NS, check=False)  # test_helm_uninstall... did it already, normally


@pytest.mark.timeout(900)
def test_helm_install_runs_the_operator_as_a_deployment_and_a_job_trains(cluster: Cluster, release: dict):
    c, pod = cluster, release
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

    def kopf_health():
        # A candidate's stand-in /healthz (plain text) made the pod Ready; the leader's kopf answers with its
        # probes as JSON. Requests at the handoff are refused or reset (the stand-in's socket closes first).
        try:
            r = httpx.get(f"http://{ip}:8080/healthz", timeout=10)
        except httpx.TransportError:
            return None
        return r.status_code == 200 and r.headers.get("content-type", "").startswith("application/json")

    wait_for("kopf's /healthz in the leader", kopf_health, 60, every=0.5)

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
    c.kubectl("apply", "-f", "-", input=util.job_manifest("helm-small", NS, **{"training.steps": 200}))

    seen: dict[str, dict] = {}  # every pod of the job seen while it ran: the operator removes them at the end

    def finished():
        for p in c.get("pods", "-n", NS, "-l", "ecrec.dev/job=helm-small")["items"]:
            seen[p["metadata"]["name"]] = p
        st = c.get("ecj", "helm-small", "-n", NS).get("status") or {}
        assert st.get("phase") != "Failed", st
        return st if st.get("phase") == "Succeeded" and st.get("completionTime") else None

    status = wait_for("the job to succeed", finished, timeout=600, every=1)
    # The operator's final checks ran in its pod too: the model's AUC and the parity check.
    assert status["step"] == 200 and 0.5 < status["eval"]["auc"] <= 1.0
    assert status["parityCheck"]["mismatches"] == 0 and status["parityCheck"]["stripes"] > 0
    job_pods = list(seen.values())
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


# ------------------------------------------------------------------------------- chaos, scraped by Prometheus --
def selector(sel: dict) -> str:
    """A LabelSelector as the API's label_selector string (the API server does the matching)."""
    parts = [f"{k}={v}" for k, v in (sel.get("matchLabels") or {}).items()]
    for e in sel.get("matchExpressions") or []:
        op, key, values = e["operator"], e["key"], ",".join(e.get("values") or [])
        parts.append(
            {"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})", "Exists": key}.get(
                op, f"!{key}"
            )
        )
    return ",".join(parts)


def sanitize(label: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in label)


class MonitorDiscovery:
    """The pods the chart's PodMonitor and ServiceMonitor select, as Prometheus file_sd target groups labelled
    the way the Prometheus Operator labels them (namespace, pod, container, endpoint, job, podTargetLabels)."""

    def __init__(self, kubeconfig: Path, monitors: list[dict]):
        from kubernetes import client, config

        self.api_client = config.new_client_from_config(str(kubeconfig))
        self.core = client.CoreV1Api(self.api_client)
        self.monitors = monitors

    def _pods(self, namespace_selector: dict, label_selector: str) -> list:
        if namespace_selector.get("any"):
            return self.core.list_pod_for_all_namespaces(label_selector=label_selector).items
        return [
            p
            for ns in namespace_selector.get("matchNames") or []
            for p in self.core.list_namespaced_pod(ns, label_selector=label_selector).items
        ]

    def _group(self, pod, port_name: str, path: str, job: str, target_labels: list[str]) -> dict | None:
        if pod.status.phase != "Running" or not pod.status.pod_ip or pod.metadata.deletion_timestamp:
            return None
        for container in pod.spec.containers:
            for port in container.ports or []:
                if port.name == port_name:
                    labels = {
                        "namespace": pod.metadata.namespace,
                        "pod": pod.metadata.name,
                        "container": container.name,
                        "endpoint": port_name,
                        "job": job,
                        "__metrics_path__": path,
                    }
                    pod_labels = pod.metadata.labels or {}
                    labels |= {sanitize(k): pod_labels[k] for k in target_labels if k in pod_labels}
                    return {"targets": [f"{pod.status.pod_ip}:{port.container_port}"], "labels": labels}
        return None

    def groups(self) -> list[dict]:
        out = []
        for m in self.monitors:
            spec, ns = m["spec"], m["metadata"]["namespace"]
            job = f"{ns}/{m['metadata']['name']}"
            if m["kind"] == "PodMonitor":
                (ep,) = spec["podMetricsEndpoints"]
                pods = self._pods(spec["namespaceSelector"], selector(spec["selector"]))
                targets = spec.get("podTargetLabels", [])
                out += [self._group(p, ep["port"], ep.get("path", "/metrics"), job, targets) for p in pods]
            else:  # ServiceMonitor: the Services it selects, then each one's pods and its port's target port
                (ep,) = spec["endpoints"]
                for ns_name in spec["namespaceSelector"]["matchNames"]:
                    services = self.core.list_namespaced_service(
                        ns_name, label_selector=selector(spec["selector"])
                    )
                    for svc in services.items:
                        (port,) = [p for p in svc.spec.ports if p.name == ep["port"]]
                        pods = self._pods(
                            {"matchNames": [ns_name]}, selector({"matchLabels": svc.spec.selector})
                        )
                        out += [
                            self._group(p, port.target_port, ep.get("path", "/metrics"), job, [])
                            for p in pods
                        ]
        return [g for g in out if g]


def rendered_monitors(c: Cluster) -> list[dict]:
    """The PodMonitor and ServiceMonitor the chart renders where monitoring.coreos.com/v1 is served."""
    out = c.helm(
        "template",
        RELEASE,
        str(CHART),
        "-n",
        OP_NS,
        "--api-versions",
        "monitoring.coreos.com/v1",
        "--set",
        "monitoring.enabled=true",
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d and d["kind"] in ("PodMonitor", "ServiceMonitor")]


def scrape(prom: Prometheus, discovery: MonitorDiscovery, stop) -> None:
    while not stop.wait(0.5):
        try:
            prom.set_groups(discovery.groups())
        except Exception as e:  # noqa: BLE001 — the API server is busy: the next round tries again
            print(f"discovery: {e}")


@pytest.mark.timeout(1500)
def test_chaos_kills_any_pod_and_every_recovery_is_in_the_status_and_in_prometheus(
    cluster: Cluster, release: dict, tmp_path: Path
):
    c, name = cluster, "helm-chaos"
    monitors = rendered_monitors(c)
    assert {m["kind"] for m in monitors} == {"PodMonitor", "ServiceMonitor"}
    prom = Prometheus(tmp_path / "prometheus")
    discovery = MonitorDiscovery(c.env.kubeconfig, monitors)
    stop = threading.Event()
    feeder = threading.Thread(target=scrape, args=(prom, discovery, stop), daemon=True)
    try:
        prom.start()
        feeder.start()
        # Training time for three faults and their recoveries (chaos stops early, and the test fails, if the job
        # finishes first), paced so that no machine finishes first: on 2 cores the three were over ~30 s in.
        c.kubectl("apply", "-f", "-", input=util.job_manifest(name, NS, **util.paced(75)))
        wait_for(
            "training to run",
            lambda: (util.get_job(c, NS, name).get("status") or {}).get("step", 0) >= 10,
            timeout=180,
        )
        # Seed 25 draws worker 0, the coordinator, then server 2: the candidates are the 8 pods sorted by name
        # (a replacement keeps its predecessor's place), so the choice is reproducible.
        proc = util.chaos(
            c.env.kubeconfig,
            NS,
            "--job",
            name,
            "--role",
            "any",
            "--count",
            "3",
            "--interval",
            "2",
            "--seed",
            "25",
        )
        assert proc.returncode == 0, proc.stderr + json.dumps(
            util.get_job(c, NS, name).get("status"), indent=1
        )
        rows = util.chaos_table(proc.stdout)
        assert [r["n"] for r in rows] == [1, 2, 3], proc.stdout
        assert {r["role"] for r in rows} == {"server", "worker", "coordinator"}, (
            "pick another seed: the draw must hit every role"
        )
        assert all(r["action"] == "pod-kill" and util.recovered(r) for r in rows), rows
        assert len({r["pod"] for r in rows}) == 3  # each fault hit a pod that was running then

        status = util.wait_done(c, NS, name, timeout=600)
        assert status["parityCheck"]["mismatches"] == 0 and status["parityCheck"]["stripes"] > 0
        assert status["replacements"] >= 3 and status["coordinatorIncarnation"] >= 2
        server_faults = [r for r in rows if r["role"] == "server"]
        for shard in {r["index"] for r in server_faults}:
            hits = sum(1 for r in server_faults if r["index"] == shard)
            recs = util.completed_recoveries(status, shard)
            assert len(recs) >= hits and all(r["rowsRecovered"] > 0 for r in recs), status["recoveries"]
        live = {p["metadata"]["name"] for p in util.pods(c, NS, f"ecrec.dev/job={name}")}
        assert not live & {r["pod"] for r in rows}, "a killed pod is still there"

        # What Prometheus scraped. Each coordinator incarnation is its own target (pod label); counters start
        # at 0 in a successor, so recoveries are summed over the incarnations, and must not be counted twice.
        sel = f'ecrec_job="{name}", ecrec_dev_role="coordinator", namespace="{NS}"'
        coordinators = {r["pod"] for r in rows if r["role"] == "coordinator"}
        wait_for(
            "Prometheus to have scraped every coordinator incarnation",
            lambda: (
                len(
                    {
                        s["metric"]["pod"]
                        for s in prom.query(f"max_over_time(ecrec_training_step{{{sel}}}[1h])")
                    }
                )
                >= 1 + len(coordinators)
            ),
            60,
        )
        completed = prom.value(f"sum(max_over_time(ecrec_recoveries_completed_total{{{sel}}}[1h]))")
        assert completed == len(server_faults), completed
        to_recover = prom.value(f"sum(max_over_time(ecrec_time_to_recover_seconds_count{{{sel}}}[1h]))")
        assert to_recover == len(server_faults), to_recover
        # The operator (ServiceMonitor target) counted a replacement pod for each role hit.
        for role in {r["role"] for r in rows}:
            hits = sum(1 for r in rows if r["role"] == role)
            expr = (
                f'max_over_time(ecrec_operator_pods_created_total{{role="{role}", replacement="true"}}[1h])'
            )
            got = wait_for(f"Prometheus to show the {role} replacement", lambda e=expr: prom.value(e), 60)
            assert got >= hits, (role, got)
    finally:
        stop.set()
        feeder.join(timeout=10)
        prom.stop()
        discovery.api_client.close()
        print(f"prometheus: {prom.dir}")


def test_helm_uninstall_removes_the_operator_and_keeps_the_crd_and_jobs(cluster: Cluster, release: dict):
    c = cluster
    c.helm("uninstall", RELEASE, "-n", OP_NS, "--wait", "--timeout", "120s")
    wait_for(
        "the operator pod to go",
        lambda: operator_pod(c) is None and not c.get("pods", "-n", OP_NS)["items"],
        120,
    )
    # Helm never deletes a chart's CRDs (that would delete every job): the CRD and the jobs stay.
    assert c.kubectl("get", "crd", "ecrecjobs.ecrec.dev", check=False).returncode == 0
    assert c.get("ecj", "helm-small", "-n", NS)["status"]["phase"] == "Succeeded"
    assert c.kubectl("get", "clusterrole", OPERATOR, check=False).returncode != 0
