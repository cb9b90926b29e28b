"""The real kube-scheduler on the test control plane, with four nodes served by one test kubelet
(`kube_multinode`, `kubelet_multinode`): pods are bound by the scheduler, not the kubelet, and run on the node
it chose; an ECRecJob's server pods are spread over distinct nodes by the topologySpreadConstraint the operator
renders from `servers.failureDomain`; servers pinned to one node get the job condition FailureDomainsAtRisk,
computed from the nodes the scheduler bound them to; a node lost by annotation (the test kubelet's machine
death, kubelet/outages.py) goes Unknown and unreachable-tainted by the node lifecycle controller, its pod's
process dies, and back up the pod ends Failed (NodeLost). `make k8s-up NODES=4` (hack/k8s-up) brings up the
same by hand.

The operator runs as a separate process with its ServiceAccount's token, as in test_operator_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from ecrec.chaos import NODE_DOWN_ID, NODE_DOWN_LABEL, NODE_DOWN_SECONDS

from . import util
from .conftest import MULTINODE_NODE_GRACE, MULTINODE_NODES, _need_built
from .test_control_plane import listening_sockets
from .test_operator_e2e import running_operator
from .testenv import REPO, KubeTestEnv, find_kubectl
from .util import wait_for

pytestmark = pytest.mark.k8s

NS = "sched-e2e"
IMAGE = "ghcr.io/ecrec/ecrec:dev"  # any image named ecrec runs from the repo's .venv
HOSTNAME = "kubernetes.io/hostname"
# Requests far below a node's capacity (this machine's cores, 1 on a small runner): where a pod lands is then
# the spread's doing, never a node too full for it.
SMALL = {"requests": {"cpu": "100m", "memory": "128Mi"}}


@pytest.fixture(scope="module")
def ns(kube_multinode: KubeTestEnv, kubelet_multinode) -> str:
    kube_multinode.kubectl("create", "namespace", NS)
    return NS


@pytest.fixture(scope="module")
def operator(kube_multinode: KubeTestEnv, ns: str, tmp_path_factory):
    out = tmp_path_factory.mktemp("operator-multinode")
    with running_operator(kube_multinode, out, NS) as op:
        yield op


# ---------------------------------------------------------------------------------------------- helpers --
def pod_manifest(name: str, **spec) -> dict:
    """A pod that prints the node it runs on (downward API: spec.nodeName), then sleeps."""
    container = {
        "name": "main",
        "image": IMAGE,
        "command": [
            "python",
            "-c",
            "import os, time; print('node=' + os.environ['NODE'], flush=True); time.sleep(600)",
        ],
        "env": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "volumeMounts": spec.pop("volumeMounts", []),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"terminationGracePeriodSeconds": 2, "containers": [container], **spec},
    }


def apply(kube: KubeTestEnv, *objs: dict) -> None:
    kube.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)})
    )


def get_pod(kube: KubeTestEnv, name: str) -> dict:
    return json.loads(kube.kubectl("get", "pod", name, "-n", NS, "-o", "json").stdout)


def running(kube: KubeTestEnv, name: str, timeout: float = 60) -> dict:
    def check():
        pod = get_pod(kube, name)
        return pod if pod["status"].get("phase") == "Running" else None

    return wait_for(f"pod {name} to run", check, timeout)


def scheduled_events(kube: KubeTestEnv, name: str) -> list[dict]:
    """The Scheduled events of pod `name` (kube-scheduler writes them; the kubelet's Binder writes none)."""
    out = kube.kubectl(
        "get",
        "events",
        "-n",
        NS,
        "-o",
        "json",
        "--field-selector",
        f"involvedObject.name={name},reason=Scheduled",
    ).stdout
    return json.loads(out)["items"]


def reporter(event: dict) -> str | None:
    """Who wrote a core/v1 event: events.k8s.io events (the 1.20 scheduler's) say reportingComponent, older
    ones source.component."""
    return event.get("reportingComponent") or (event.get("source") or {}).get("component")


def assert_bound_by_scheduler(kube: KubeTestEnv, name: str, node: str) -> None:
    events = wait_for(f"the Scheduled event of {name}", lambda: scheduled_events(kube, name), 30)
    assert {reporter(e) for e in events} == {"default-scheduler"}, events
    assert [e["message"] for e in events] == [f"Successfully assigned {NS}/{name} to {node}"], events


def pod_log(kubelet, name: str) -> str:
    path = Path(kubelet.out_dir) / "pods" / f"{NS}_{name}" / "main.log"
    return path.read_text() if path.exists() else ""


def get_node(kube: KubeTestEnv, name: str) -> dict:
    return json.loads(kube.kubectl("get", "node", name, "-o", "json").stdout)


def node_ready(node: dict) -> str | None:
    """The status of a Node's Ready condition: True, False or Unknown (the node lifecycle controller's, for a
    node whose heartbeat stopped)."""
    return next((c["status"] for c in node["status"].get("conditions") or [] if c["type"] == "Ready"), None)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def job_manifest(name: str, **overrides) -> str:
    """The e2e job (util.job_manifest) with 4 servers (k=3, r=1), small requests for every role."""
    spec = {
        "servers.replicas": 4,
        "faultTolerance.ecrec.k": 3,
        "servers.resources": SMALL,
        "workers.resources": SMALL,
        "coordinator.resources": SMALL,
        **overrides,
    }
    return util.job_manifest(name, NS, **spec)


def server_pods(kube: KubeTestEnv, name: str) -> list[dict]:
    return util.pods(kube, NS, f"ecrec.dev/job={name},ecrec.dev/role=server")


def bound_servers(kube: KubeTestEnv, name: str, count: int) -> list[dict] | None:
    got = [p for p in server_pods(kube, name) if p["spec"].get("nodeName")]
    return got if len(got) >= count else None


def domain_condition(kube: KubeTestEnv, name: str, status: str) -> dict | None:
    conds = (util.get_job(kube, NS, name).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "FailureDomainsAtRisk" and c["status"] == status), None)


def delete_job(kube: KubeTestEnv, name: str) -> None:
    """Deletes the job and waits for its pods to go: the next test's pods get the CPU."""
    kube.kubectl("delete", "ecj", name, "-n", NS, "--wait=false")
    wait_for("the job's pods to go", lambda: util.pods(kube, NS, f"ecrec.dev/job={name}") == [], 90)


# ------------------------------------------------------------------------------------------------ tests --
def test_nodes_have_their_own_heartbeat_lease_and_labels(kube_multinode: KubeTestEnv, kubelet_multinode):
    nodes = json.loads(kube_multinode.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    names = [f"ecrec-local-{i}" for i in range(MULTINODE_NODES)]
    assert sorted(n["metadata"]["name"] for n in nodes) == names
    for i, node in enumerate(sorted(nodes, key=lambda n: n["metadata"]["name"])):
        labels = node["metadata"]["labels"]
        assert labels[HOSTNAME] == names[i] and labels["topology.kubernetes.io/zone"] == f"zone-{i % 2}"
        assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
        assert not [t for t in node["spec"].get("taints") or [] if t["key"].startswith("node.kubernetes.io/")]
    leases = json.loads(kube_multinode.kubectl("get", "leases", "-n", "kube-node-lease", "-o", "json").stdout)
    holders = {x["metadata"]["name"]: x["spec"]["holderIdentity"] for x in leases["items"]}
    assert holders == {n: n for n in names}, holders
    # kube-scheduler runs beside the other components, and listens on nothing but loopback
    pids = kube_multinode.pids()
    assert "kube-scheduler" in pids, pids
    for pid, addr in listening_sockets([pids["kube-scheduler"]]):
        assert addr.startswith("127."), f"kube-scheduler (pid {pid}) listens on {addr}"


def test_pods_are_bound_by_kube_scheduler_and_run_on_the_node_it_chose(
    kube_multinode: KubeTestEnv, kubelet_multinode, ns: str
):
    kube = kube_multinode
    free = [pod_manifest(f"free-{i}") for i in range(3)]
    pinned = pod_manifest("pinned", nodeSelector={HOSTNAME: "ecrec-local-3"})
    nowhere = pod_manifest("nowhere", nodeSelector={HOSTNAME: "ecrec-local-9"})
    apply(kube, *free, pinned, nowhere)
    for name in ["free-0", "free-1", "free-2", "pinned"]:
        pod = running(kube, name)
        node = pod["spec"]["nodeName"]
        assert_bound_by_scheduler(kube, name, node)
        # the kubelet ran it as that node: the downward API gave the process its node's name
        wait_for(
            f"{name}'s output",
            lambda name=name, node=node: f"node={node}" in pod_log(kubelet_multinode, name),
            30,
        )
        if name == "pinned":
            assert node == "ecrec-local-3"

    # Nothing binds a pod no node can take: kube-scheduler says why, having looked at all four nodes.
    def unschedulable():
        conds = get_pod(kube, "nowhere")["status"].get("conditions") or []
        return next((c for c in conds if c["type"] == "PodScheduled" and c["status"] == "False"), None)

    cond = wait_for("nowhere's PodScheduled=False", unschedulable, 30)
    assert cond["reason"] == "Unschedulable", cond
    assert cond["message"].startswith(f"0/{MULTINODE_NODES} nodes are available"), cond
    assert not get_pod(kube, "nowhere")["spec"].get("nodeName")
    kubelet_log = (Path(kubelet_multinode.out_dir) / "kubelet.log").read_text()
    assert "kube-scheduler binds" in kubelet_log and ": bound to " not in kubelet_log
    kube.kubectl("delete", "pods", "--all", "-n", NS, "--wait=false")


def test_a_pod_with_an_unbound_claim_is_scheduled(kube_multinode: KubeTestEnv, kubelet_multinode, ns: str):
    """No PV controller binds claims here: the scheduler runs without its VolumeBinding/VolumeZone plugins
    (hack/kube-testenv), else a checkpoint job's pods would never leave Pending."""
    kube = kube_multinode
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "shared", "namespace": NS},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    pod = pod_manifest("with-claim", volumeMounts=[{"name": "data", "mountPath": "/data"}])
    pod["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": "shared"}}]
    apply(kube, claim, pod)
    got = running(kube, "with-claim")
    assert_bound_by_scheduler(kube, "with-claim", got["spec"]["nodeName"])
    kube.kubectl("delete", "pod", "with-claim", "-n", NS, "--wait=false")


def test_a_node_lost_by_annotation_goes_notready_and_its_pods_processes_die(
    kube_multinode: KubeTestEnv, kubelet_multinode, ns: str
):
    """The test kubelet's machine death (kubelet/outages.py), as `ecrec chaos --node` asks for it: the pod's
    process dies at once while its object says Running (a dead machine reports nothing); the node lifecycle
    controller marks the node Unknown and taints it unreachable after its grace (12 s here); back up after the
    outage, the node is Ready, the pod Failed with reason NodeLost (restartPolicy Never; one with Always runs
    again, restartCount 1), and a new pod runs there."""
    kube, node, outage = kube_multinode, "ecrec-local-1", 25

    def elapsed() -> float:
        return time.monotonic() - t0

    def lost():
        n = get_node(kube, node)
        return n if node_ready(n) in ("Unknown", "False") else None

    def unreachable() -> bool:
        taints = get_node(kube, node)["spec"].get("taints") or []
        return "node.kubernetes.io/unreachable" in {t["key"] for t in taints}

    def restarted(pod: dict) -> bool:
        [cs] = pod["status"]["containerStatuses"]
        return cs["restartCount"] == 1 and "running" in cs["state"]

    def failed():
        pod = get_pod(kube, "doomed")
        return pod if pod["status"]["phase"] == "Failed" else None

    def pid(name: str) -> int:
        return wait_for(
            f"{name}'s process", lambda: (kubelet_multinode.pids().get(f"{NS}/{name}") or [0])[0], 30
        )

    assert get_node(kube, node)["metadata"]["labels"][NODE_DOWN_LABEL] == "true"
    pinned = {HOSTNAME: node}
    apply(
        kube,
        pod_manifest("doomed", nodeSelector=pinned, restartPolicy="Never"),
        pod_manifest("survivor", nodeSelector=pinned, restartPolicy="Always"),
    )
    for name in ("doomed", "survivor"):
        assert running(kube, name)["spec"]["nodeName"] == node
    pids = [pid("doomed"), pid("survivor")]
    assert not any(pid_gone(p) for p in pids)

    t0 = time.monotonic()
    down = {NODE_DOWN_SECONDS: str(outage), NODE_DOWN_ID: f"lost-{uuid.uuid4().hex[:8]}"}
    kube.kubectl("annotate", "--overwrite", "node", node, *(f"{k}={v}" for k, v in down.items()))
    wait_for("the processes to die with the machine", lambda: all(pid_gone(p) for p in pids), 5)
    assert get_pod(kube, "doomed")["status"]["phase"] == "Running"

    # No heartbeat: Unknown after the grace, and the unreachable taint (NoSchedule at once, NoExecute by the
    # taint manager; the pod tolerates NoExecute for 300 s, DefaultTolerationSeconds).
    got = wait_for(f"{node} to go Unknown", lost, MULTINODE_NODE_GRACE + 10, every=0.5)
    lost_after = elapsed()
    assert lost_after < outage, f"{node} seen lost only after {lost_after:.1f} s"
    wait_for(f"{node}'s unreachable taint", unreachable, max(1.0, outage - elapsed()), every=0.5)
    assert node_ready(get_node(kube, "ecrec-local-0")) == "True"  # the other nodes beat on
    pod = get_pod(kube, "doomed")
    assert pod["status"]["phase"] == "Running" and not pod["metadata"].get("deletionTimestamp"), pod

    # Back up: Ready again, the lost pod Failed (NodeLost), the node takes pods again.
    wait_for(
        f"{node} Ready again",
        lambda: node_ready(get_node(kube, node)) == "True",
        outage - elapsed() + 15,
        every=0.5,
    )
    back_after = elapsed()
    assert back_after >= outage - 1, f"{node} Ready again after {back_after:.1f} s of a {outage} s outage"
    pod = wait_for("doomed to end Failed", failed, 15)
    assert pod["status"]["reason"] == "NodeLost", pod["status"]
    [cs] = pod["status"]["containerStatuses"]
    assert cs["state"]["terminated"]["exitCode"] == 137 and not cs["ready"], cs
    assert f"{NS}/doomed" not in kubelet_multinode.pids()
    # restartPolicy Always: started again, as after a kubelet restart (its object said Running all along)
    wait_for("survivor's restart", lambda: restarted(get_pod(kube, "survivor")), 15)
    assert pid("survivor") not in pids
    kube.wait_nodes_schedulable([node], 30)
    apply(kube, pod_manifest("reborn", nodeSelector={HOSTNAME: node}, restartPolicy="Never"))
    assert running(kube, "reborn", 30)["spec"]["nodeName"] == node
    assert get_pod(kube, "doomed")["status"]["phase"] == "Failed"  # not started again
    ready = next(c for c in got["status"]["conditions"] if c["type"] == "Ready")
    print(
        f"{node}: {ready['status']} ({ready.get('reason')}) after {lost_after:.1f} s, Ready after {back_after:.1f} s"
    )
    kube.kubectl("annotate", "node", node, *(f"{k}-" for k in down))
    kube.kubectl("delete", "pods", "doomed", "survivor", "reborn", "-n", NS, "--wait=false")


@pytest.mark.slow
def test_server_pods_are_spread_over_distinct_nodes_by_the_scheduler(kube_multinode: KubeTestEnv, operator):
    kube, name = kube_multinode, "spread"
    # Ballast: 60% of the CPU of nodes 1-3 requested. Resource scoring alone would then stack every pod of the
    # job on node 0 (7 x 100m stays below 60%); only the spread over kubernetes.io/hostname (score weight 2,
    # maxSkew 1) sends the servers to the other three.
    cpu = json.loads(kube.kubectl("get", "node", "ecrec-local-0", "-o", "json").stdout)["status"][
        "allocatable"
    ]["cpu"]
    ballast = [
        pod_manifest(f"ballast-{i}", nodeSelector={HOSTNAME: f"ecrec-local-{i}"})
        for i in range(1, MULTINODE_NODES)
    ]
    for pod in ballast:
        pod["spec"]["containers"][0]["resources"] = {"requests": {"cpu": f"{int(cpu) * 600}m"}}
    apply(kube, *ballast)
    for pod in ballast:
        running(kube, pod["metadata"]["name"])
    kube.kubectl("apply", "-f", "-", input=job_manifest(name, **{"servers.failureDomain": HOSTNAME}))
    servers = wait_for("4 bound server pods", lambda: bound_servers(kube, name, 4), 90)
    # The operator asked for the spread; the scheduler, not the kubelet, placed them: one server per node.
    spread = servers[0]["spec"]["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == HOSTNAME and spread["whenUnsatisfiable"] == "ScheduleAnyway", spread
    nodes = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in servers}
    assert len(set(nodes.values())) == 4, nodes
    for pod, node in nodes.items():
        assert_bound_by_scheduler(kube, pod, node)
    cond = wait_for("FailureDomainsAtRisk=False", lambda: domain_condition(kube, name, "False"), 60)
    assert cond["reason"] == "FailureDomainsSpread", cond
    # The job trains with its servers on four nodes.
    wait_for(
        "training to run",
        lambda: (util.get_job(kube, NS, name).get("status") or {}).get("step", 0) >= 20,
        180,
    )
    delete_job(kube, name)
    kube.kubectl("delete", "pods", "-n", NS, *(p["metadata"]["name"] for p in ballast), "--wait=false")


@pytest.mark.slow
def test_servers_pinned_to_one_node_set_failure_domains_at_risk(kube_multinode: KubeTestEnv, operator):
    kube, name = kube_multinode, "one-node"
    template = {"spec": {"nodeSelector": {HOSTNAME: "ecrec-local-1"}}}
    kube.kubectl("apply", "-f", "-", input=job_manifest(name, **{"servers.template": template}))
    servers = wait_for("4 bound server pods", lambda: bound_servers(kube, name, 4), 90)
    assert {p["spec"]["nodeName"] for p in servers} == {"ecrec-local-1"}
    cond = wait_for("FailureDomainsAtRisk=True", lambda: domain_condition(kube, name, "True"), 60)
    expected = (
        f"more than r=1 server(s) share a failure domain ({HOSTNAME}): ecrec-local-1 holds servers 0, 1, 2, 3"
    )
    assert cond["reason"] == "FailureDomainsAtRisk" and cond["message"] == expected, cond
    events = json.loads(
        kube.kubectl(
            "get", "events", "-n", NS, "-o", "json", "--field-selector", f"involvedObject.name={name}"
        ).stdout
    )["items"]
    warned = [e for e in events if e["reason"] == "FailureDomainsAtRisk"]
    assert warned and all(e["type"] == "Warning" and e["message"] == expected for e in warned), events
    delete_job(kube, name)


@pytest.mark.slow
def test_make_k8s_up_nodes_4_runs_kube_scheduler_and_four_nodes(tmp_path, monkeypatch):
    """`make k8s-up NODES=4` (hack/k8s-up with ECREC_K8S_NODES=4): kube-scheduler, four schedulable nodes
    served by one kubelet, a pod bound by the scheduler and run; `make k8s-down` stops it all."""
    from .test_hack_k8s_up import _kubectl, _script

    _need_built()
    monkeypatch.setenv("ECREC_K8S_NODES", str(MULTINODE_NODES))
    d = tmp_path / "k8s"
    try:
        up = _script("k8s-up", d, "local")
        assert "4 nodes (ecrec-local-0..3), bound by kube-scheduler" in up.stdout, up.stdout
        status = subprocess.run(
            [str(REPO / "hack" / "kube-testenv"), "status", str(d)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0 and "kube-scheduler           running" in status.stdout, status.stdout
        nodes = _kubectl(d, "get", "nodes")["items"]
        assert sorted(n["metadata"]["name"] for n in nodes) == [f"ecrec-local-{i}" for i in range(4)]
        # k8s-up returned once every node was schedulable: no not-ready taint left
        assert not [t for n in nodes for t in n["spec"].get("taints") or []], nodes
        pod = pod_manifest("hello", nodeSelector={HOSTNAME: "ecrec-local-2"})
        pod["metadata"]["namespace"] = "default"
        subprocess.run(
            [find_kubectl(), f"--kubeconfig={d}/kubeconfig", "apply", "-f", "-"],
            input=json.dumps(pod),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )

        def run():
            got = _kubectl(d, "get", "pod", "hello", "-n", "default")
            return got if got["status"].get("phase") == "Running" else None

        assert wait_for("pod hello to run", run, 60)["spec"]["nodeName"] == "ecrec-local-2"
        events = _kubectl(
            d, "get", "events", "-n", "default", "--field-selector", "involvedObject.name=hello"
        )
        assert [reporter(e) for e in events["items"] if e["reason"] == "Scheduled"] == [
            "default-scheduler"
        ], events
    finally:
        _script("k8s-down", d, check=False)
    assert (
        "kube-scheduler           not running"
        in subprocess.run(
            [str(REPO / "hack" / "kube-testenv"), "status", str(d)],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
