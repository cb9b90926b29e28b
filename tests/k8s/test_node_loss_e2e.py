"""A node lost, end to end, on the 4-node test cluster (`kube_multinode`: the real kube-scheduler and node
lifecycle controller, one test kubelet serving four nodes): `ecrec chaos --node` as a user runs it, with the
annotation injector (the test kubelet kills the node's processes and stops its heartbeat, as a dead machine
would). The node lifecycle controller marks it NotReady (Ready Unknown), the operator deletes the job's pods
there (their phase still says Running) and replaces them on other nodes, and the job rebuilds its servers.

- servers spread over the nodes (`servers.failureDomain`): any node may go, the job goes on and succeeds with
  parity exact; the same with the taint injector (any cluster's: cordon, NoExecute taint, the job's pods there
  deleted);
- servers sharing a node (FailureDomainsAtRisk): losing it loses more than r shards at once, and the job fails
  at once with a reason naming them; with the checkpoint fallback (`faultTolerance.ecrec.fallback`, its
  checkpoints on a PersistentVolumeClaim) it rolls back to the last checkpoint instead and succeeds.
"""

from __future__ import annotations

import json

import pytest
import yaml

from . import util
from .conftest import MULTINODE_NODES
from .test_operator_e2e import running_operator
from .testenv import KubeTestEnv, schedulable_nodes
from .util import wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NS = "node-loss-e2e"
HOSTNAME = "kubernetes.io/hostname"
SMALL = {"requests": {"cpu": "100m", "memory": "128Mi"}}
OTHER = "ecrec-local-0"  # where a pinned job's coordinator and workers run


@pytest.fixture(scope="module")
def ns(kube_multinode: KubeTestEnv, kubelet_multinode) -> str:
    kube_multinode.kubectl("create", "namespace", NS)
    yield NS
    # The cluster is the session's: leave every node it lost back and schedulable for the modules after this.
    kube_multinode.wait_nodes_schedulable(kubelet_multinode.node_names, timeout=120)


@pytest.fixture(scope="module")
def operator(kube_multinode: KubeTestEnv, ns: str, tmp_path_factory):
    with running_operator(kube_multinode, tmp_path_factory.mktemp("operator-node-loss"), NS) as op:
        yield op


def start(kube: KubeTestEnv, name: str, seconds: float, **overrides) -> None:
    """A job of four servers, one per node, that trains for at least `seconds` (util.paced): a node lost once
    it trained 10 steps is lost mid-training, however fast the machine."""
    spec = {
        "servers.replicas": 4,
        "faultTolerance.ecrec.k": 3,
        "servers.failureDomain": HOSTNAME,
        "servers.resources": SMALL,
        "workers.resources": SMALL,
        "coordinator.resources": SMALL,
        **util.paced(seconds),
        **overrides,
    }
    kube.kubectl("apply", "-f", "-", input=util.job_manifest(name, NS, **spec))
    wait_for(
        "training to run",
        lambda: (util.get_job(kube, NS, name).get("status") or {}).get("step", 0) >= 10,
        timeout=180,
    )


def start_pinned(kube: KubeTestEnv, name: str, node: str, seconds: float, **overrides) -> None:
    """A job whose servers all run on `node` (FailureDomainsAtRisk), everything else on ecrec-local-0: losing
    `node` is the servers' loss alone."""
    assert node != OTHER and MULTINODE_NODES >= 3
    pin = {
        f"{role}.template": {"spec": {"nodeSelector": {HOSTNAME: node if role == "servers" else OTHER}}}
        for role in ("servers", "coordinator", "workers")
    }
    start(kube, name, seconds, **pin, **overrides)


def domain_condition(kube: KubeTestEnv, name: str, status: str) -> dict | None:
    conds = (util.get_job(kube, NS, name).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "FailureDomainsAtRisk" and c["status"] == status), None)


def chaos_json(kube: KubeTestEnv, name: str, *args: str) -> tuple[int, dict]:
    proc = util.chaos(kube.kubeconfig, NS, "--job", name, "-o", "json", *args)
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {}


def node_of(kube: KubeTestEnv, pod: str) -> str:
    return json.loads(kube.kubectl("get", "pod", pod, "-n", NS, "-o", "json").stdout)["spec"]["nodeName"]


def events_of(kube: KubeTestEnv, name: str) -> list[dict]:
    out = kube.kubectl(
        "get", "events", "-n", NS, "-o", "json", "--field-selector", f"involvedObject.name={name}"
    )
    return json.loads(out.stdout)["items"]


def test_a_job_spread_over_the_nodes_survives_a_random_node_loss(kube_multinode: KubeTestEnv, operator):
    kube, name = kube_multinode, "spread-loss"
    # The node's outage (40 s) outlasts the node lifecycle controller's grace (12 s) and the rebuild.
    start(kube, name, seconds=75)
    wait_for("FailureDomainsAtRisk=False", lambda: domain_condition(kube, name, "False"), 60)
    code, out = chaos_json(
        kube, name, "--node", "random", "--duration", "40", "--seed", "3", "--timeout", "300"
    )
    faults = out["faults"]
    assert code == 0, out
    node = faults[0]["node"]
    assert node.startswith("ecrec-local-") and all(f["node"] == node for f in faults), faults
    assert all(f["action"] == "node-loss" and f["outcome"] == "recovered" for f in faults), faults
    # Four servers on four nodes: whichever node went took one server (and maybe more of the job's pods).
    servers = [f for f in faults if f["role"] == "server"]
    assert len(servers) == 1 and servers[0]["rowsRecovered"] > 0, faults
    shard = servers[0]["index"]
    # The operator deleted the silent pods of the lost node (phase still Running: nobody reported otherwise)
    # and their replacements run elsewhere.
    lost = [e for e in events_of(kube, name) if e["reason"] == "NodeLost"]
    assert {f["pod"] for f in faults} <= {e["message"].split(":")[0].removeprefix("pod ") for e in lost}, lost
    assert all(f"node {node} stopped reporting" in e["message"] for e in lost), lost
    replacement = [
        p
        for p in util.pods(kube, NS, f"ecrec.dev/job={name},ecrec.dev/role=server,ecrec.dev/shard={shard}")
        if not p["metadata"].get("deletionTimestamp")
    ]
    assert replacement and all(p["spec"]["nodeName"] != node for p in replacement), replacement
    status = util.wait_done(kube, NS, name, timeout=600)
    assert util.completed_recoveries(status, shard), status.get("recoveries")
    assert status["parityCheck"]["mismatches"] == 0
    # The node came back (the outage lasted 40 s) and takes pods again.
    wait_for(
        f"{node} Ready again",
        lambda: node in schedulable_nodes(json.loads(kube.kubectl("get", "nodes", "-o", "json").stdout)),
        90,
    )
    kube.kubectl("delete", "ecj", name, "-n", NS, "--wait=false")
    wait_for("the job's pods to go", lambda: util.pods(kube, NS, f"ecrec.dev/job={name}") == [], 90)


def test_the_taint_injector_loses_a_node_on_any_cluster_and_lifts_it_after(
    kube_multinode: KubeTestEnv, operator
):
    """`--injector taint`, what a cluster without the test kubelet gets: the node cordoned and tainted NoExecute,
    the job's pods there deleted at once, replaced elsewhere; after the duration the node takes pods again."""
    kube, name, node = kube_multinode, "taint-loss", "ecrec-local-2"
    start(kube, name, seconds=45)
    wait_for("FailureDomainsAtRisk=False", lambda: domain_condition(kube, name, "False"), 60)
    code, out = chaos_json(kube, name, "--node", node, "--injector", "taint", "--duration", "15")
    faults = out["faults"]
    assert code == 0 and faults and all(f["outcome"] == "recovered" for f in faults), faults
    assert {f["injector"] for f in faults} == {"taint"} and "server" in {f["role"] for f in faults}, faults
    replaced = [
        p
        for p in util.pods(kube, NS, f"ecrec.dev/job={name}")
        if int(p["metadata"]["labels"]["ecrec.dev/incarnation"]) > 1
    ]
    assert replaced and all(p["spec"].get("nodeName") != node for p in replaced), replaced
    spec = json.loads(kube.kubectl("get", "node", node, "-o", "json").stdout)["spec"]
    assert not spec.get("unschedulable") and not [t for t in spec.get("taints") or [] if "chaos" in t["key"]]
    status = util.wait_done(kube, NS, name, timeout=600)
    assert status["parityCheck"]["mismatches"] == 0
    kube.kubectl("delete", "ecj", name, "-n", NS, "--wait=false")
    wait_for("the job's pods to go", lambda: util.pods(kube, NS, f"ecrec.dev/job={name}") == [], 90)


def test_servers_sharing_a_node_fail_the_job_naming_the_shards_when_it_is_lost(
    kube_multinode: KubeTestEnv, operator
):
    kube, name, shared = kube_multinode, "shared-loss", "ecrec-local-2"
    start_pinned(kube, name, shared, seconds=90)  # it fails at the loss; paced, it cannot end before
    code, out = chaos_json(kube, name, "--node", shared, "--duration", "30", "--timeout", "300")
    assert code == 1, out
    faults = out["faults"]
    assert sorted((f["role"], f["index"]) for f in faults) == [("server", s) for s in range(4)], faults
    assert {f["outcome"] for f in faults} == {"job failed"}, faults

    def failed():
        st = util.get_job(kube, NS, name).get("status") or {}
        return st if st.get("phase") == "Failed" else None

    reason = wait_for("the job to fail", failed, 120)["reason"]
    # At least two of the four are lost by the time the coordinator decides: it names those it knows of.
    assert "servers lost at once, more than r=1 can rebuild: shards " in reason, reason
    named = reason.split("shards ")[1].split(";")[0]
    assert len([s for s in range(4) if f"{s} (failed)" in named]) >= 2, reason
    kube.kubectl("delete", "ecj", name, "-n", NS, "--wait=false")


CLAIM = "node-loss-checkpoints"


def test_servers_sharing_a_node_survive_its_loss_by_rolling_back_to_the_fallback_checkpoint(
    kube_multinode: KubeTestEnv, operator
):
    kube, name = kube_multinode, "shared-fallback"
    shared = "ecrec-local-3"
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": CLAIM, "namespace": NS},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(claim))
    fallback = {"intervalSteps": 150, "volumeClaim": CLAIM}
    # A checkpoint every 15 s of training at the pace: the node goes after the first and well before the end.
    start_pinned(kube, name, shared, seconds=60, **{"faultTolerance.ecrec.fallback": fallback})
    cond = wait_for("FailureDomainsAtRisk=True", lambda: domain_condition(kube, name, "True"), 60)
    assert f"{shared} holds servers 0, 1, 2, 3" in cond["message"], cond
    wait_for(
        "a fallback checkpoint",
        lambda: ((util.get_job(kube, NS, name).get("status") or {}).get("checkpointing") or {}).get(
            "lastCheckpoint"
        ),
        120,
    )
    code, out = chaos_json(kube, name, "--node", shared, "--duration", "20", "--timeout", "400")
    faults = out["faults"]
    assert sorted((f["role"], f["index"]) for f in faults) == [("server", s) for s in range(4)], faults
    assert code == 0 and {f["outcome"] for f in faults} == {"recovered"}, faults
    status = util.wait_done(kube, NS, name, timeout=900)
    assert status["checkpointing"]["rollbacks"] == 1, status["checkpointing"]
    assert status["checkpointing"]["stepsRedone"] > 0, status["checkpointing"]
    assert status["parityCheck"]["mismatches"] == 0
    kube.kubectl("delete", "ecj", name, "-n", NS, "--wait=false")
