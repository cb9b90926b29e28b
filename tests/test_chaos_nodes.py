"""`ecrec chaos --node`: which node is lost, how (annotation or taint), the faults it makes (one per pod of the
job that ran there) and how they are measured; the injection against a recording stand-in for the API."""

from __future__ import annotations

import random

import pytest

from ecrec.chaos import (
    NODE_DOWN_ID,
    NODE_DOWN_LABEL,
    NODE_DOWN_SECONDS,
    ChaosError,
    Options,
    driver,
    run,
    table_rows,
)
from ecrec.chaos import nodes as chaos_nodes
from tests.test_chaos import JOB, T0, look, pod, rec, status


def on(node: str, p: dict) -> dict:
    return {**p, "spec": {"nodeName": node}}


PODS = [
    on("a", pod("coordinator")),
    on("a", pod("server", 0)),
    on("b", pod("server", 1)),
    on("b", pod("worker", 0)),
    on("b", pod("server", 2, incarnation=1, deleting=True)),  # going already: not the node's to lose
    on("c", pod("worker", 1, phase="Pending")),
]


def test_a_random_node_is_one_running_a_pod_of_the_job_and_a_seed_picks_the_same():
    picks = {
        chaos_nodes.choose_node("random", PODS, ["a", "b", "c", "d"], random.Random(s)) for s in range(20)
    }
    assert picks == {"a", "b"}
    again = [
        chaos_nodes.choose_node("random", list(reversed(PODS)), ["a"], random.Random(7)) for _ in range(2)
    ]
    assert again == [chaos_nodes.choose_node("random", PODS, ["a"], random.Random(7))] * 2
    with pytest.raises(ChaosError, match="no node runs a pod of the job"):
        chaos_nodes.choose_node("random", [], ["a"], random.Random(0))


def test_a_named_node_must_exist_and_may_run_nothing_of_the_job():
    assert chaos_nodes.choose_node("d", PODS, ["a", "d"], random.Random(0)) == "d"
    with pytest.raises(ChaosError, match="--node x: no such node"):
        chaos_nodes.choose_node("x", PODS, ["a", "d"], random.Random(0))


def test_injector_annotation_where_the_node_honours_it_else_taint():
    assert chaos_nodes.choose_node_injector("auto", {NODE_DOWN_LABEL: "true"}) == "annotation"
    assert chaos_nodes.choose_node_injector("auto", {}) == "taint"
    assert chaos_nodes.choose_node_injector("taint", {NODE_DOWN_LABEL: "true"}) == "taint"
    with pytest.raises(ChaosError, match="node loss takes one of auto, annotation, taint"):
        chaos_nodes.choose_node_injector("chaos-mesh", {})


def test_the_taint_patch_cordons_and_keeps_the_nodes_other_taints():
    other = {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}
    node = {"spec": {"taints": [other]}}
    down = chaos_nodes.taint_patch(node, down=True)
    assert down["spec"]["unschedulable"] is True
    assert down["spec"]["taints"] == [
        other,
        {"key": chaos_nodes.NODE_TAINT_KEY, "value": "true", "effect": "NoExecute"},
    ]
    back = chaos_nodes.taint_patch({"spec": down["spec"]}, down=False)
    assert back == {"spec": {"unschedulable": None, "taints": [other]}}
    assert chaos_nodes.taint_patch({"spec": {}}, down=False) == {
        "spec": {"unschedulable": None, "taints": None}
    }


def test_a_node_loss_is_one_fault_per_running_pod_of_the_job_on_it():
    faults = chaos_nodes.node_faults(3, "b", PODS, status(recoveries=[rec(1)]), T0, 60.0, "annotation")
    assert [(f.role, f.index, f.action, f.node, f.n) for f in faults] == [
        ("server", 1, "node-loss", "b", 3),
        ("worker", 0, "node-loss", "b", 3),
    ]
    assert table_rows(faults)[0][1] == "node-loss b (60s): server 1"
    assert chaos_nodes.node_faults(1, "d", PODS, status(), T0, 60.0, "taint") == []


def test_each_pod_of_a_lost_node_is_measured_as_its_own_recovery():
    server, worker = chaos_nodes.node_faults(1, "b", PODS, status(), T0, 60.0, "annotation")
    # Until the operator has deleted the silent pods and replaced them, the job is not healthy.
    pods = [p for p in PODS if p["metadata"]["name"] != "j-server-1-1"]
    look(server, status(up=4, recoveries=[rec(1, state="running", completed=None)]), pods, T0 + 20)
    assert not server.over and server.detected_at == T0 + 1
    replaced = [
        on("a", pod("coordinator")),
        on("a", pod("server", 0)),
        on("c", pod("server", 1, incarnation=2)),
        on("d", pod("server", 2, incarnation=2)),
        on("c", pod("worker", 0, incarnation=2)),
        on("c", pod("worker", 1)),
        on("a", pod("server", 3)),
        on("a", pod("server", 4)),
    ]
    look(server, status(recoveries=[rec(1)]), replaced, T0 + 30)
    assert server.outcome == "recovered" and server.recovered_at == T0 + 9
    look(worker, status(step=100), replaced, T0 + 30)
    look(worker, status(step=101), replaced, T0 + 31)
    assert worker.outcome == "recovered" and worker.note == "replaced"


class FakeCluster:
    """The calls `ecrec chaos` makes, answered from a script of job statuses; records what it changes."""

    namespace = "ns"

    def __init__(self, statuses: list[dict], labels: dict[str, str]):
        self._statuses, self.labels = list(statuses), labels
        self.patches: list[tuple[str, dict]] = []
        self.deleted: list[tuple[str, int]] = []
        self.taints: list[dict] = [{"key": "keep", "effect": "NoSchedule"}]

    def job(self, name):
        st = self._statuses.pop(0) if len(self._statuses) > 1 else self._statuses[0]
        return {
            "metadata": {"name": name},
            "spec": {
                "model": {"preset": "tiny"},
                "faultTolerance": {"strategy": "ecrec"},
                "servers": {"replicas": 5},
            },
            "status": st,
        }

    def pods(self, job):
        return AFTER if self.patches else BEFORE

    def nodes(self):
        return [{"metadata": {"name": n}} for n in ("a", "b", "c")]

    def node(self, name):
        return {"metadata": {"name": name, "labels": self.labels}, "spec": {"taints": self.taints}}

    def patch_node(self, name, body):
        self.patches.append((name, body))
        if "spec" in body:
            self.taints = body["spec"]["taints"] or []

    def delete_pod(self, name, grace):
        self.deleted.append((name, grace))

    def has_chaos_mesh(self):
        return False


# A healthy job over nodes a, b, c; after node b is lost its pods are replaced elsewhere.
BEFORE = [
    on("a", pod("coordinator")),
    *(on("abcca"[s], pod("server", s)) for s in range(5)),
    on("b", pod("worker", 0)),
    on("c", pod("worker", 1)),
]
AFTER = [
    *(p for p in BEFORE if p["spec"]["nodeName"] != "b"),
    on("c", pod("server", 1, incarnation=2)),
    on("a", pod("worker", 0, incarnation=2)),
]


def healthy_and_replaced(step: int) -> dict:
    return status(step=step, recoveries=[rec(1, detected=2e9, completed=2e9 + 5)])


def chaos(cluster: FakeCluster, **opts) -> tuple[list, int]:
    o = Options(job=JOB, action="node-loss", node="b", interval=0, poll=0, duration=1, timeout=30, **opts)
    faults, _, code = driver._run(o, cluster, random.Random(0), 0, lambda line: None)
    return faults, code


def test_the_taint_injector_cordons_taints_and_deletes_the_jobs_pods_there_then_lifts_it(monkeypatch):
    clock = iter(range(10**6))
    monkeypatch.setattr(driver.time, "time", lambda: 2e9 - 10 + next(clock))
    fc = FakeCluster([status(), status(), healthy_and_replaced(101), healthy_and_replaced(102)], {})
    faults, code = chaos(fc)
    assert [(f.role, f.index, f.injector) for f in faults] == [("server", 1, "taint"), ("worker", 0, "taint")]
    assert fc.deleted == [("j-server-1-1", 0), ("j-worker-0-1", 0)]
    down, back = fc.patches
    assert down[0] == "b" and down[1]["spec"]["unschedulable"] is True
    assert {"key": chaos_nodes.NODE_TAINT_KEY, "value": "true", "effect": "NoExecute"} in down[1]["spec"][
        "taints"
    ]
    assert back == (
        "b",
        {"spec": {"unschedulable": None, "taints": [{"key": "keep", "effect": "NoSchedule"}]}},
    )
    assert code == 0 and all(f.outcome == "recovered" for f in faults)


def test_a_node_whose_pods_cannot_be_deleted_is_not_left_tainted(monkeypatch):
    monkeypatch.setattr(driver.time, "time", lambda: 2e9)

    class Refusing(FakeCluster):
        def delete_pod(self, name, grace):
            raise RuntimeError(f"403 deleting {name}")

    fc = Refusing([status()], {})
    with pytest.raises(RuntimeError, match="403 deleting j-server-1-1"):
        chaos(fc)
    assert [body["spec"]["unschedulable"] for _, body in fc.patches] == [True, None]
    assert fc.taints == [{"key": "keep", "effect": "NoSchedule"}]


def test_deleting_a_pod_that_is_already_gone_is_not_an_error():
    """A NoExecute taint's eviction may delete the node's pods before chaos does (it did on a CI run)."""
    from kubernetes.client.exceptions import ApiException

    from ecrec.chaos.cluster import Cluster

    class Core:
        def __init__(self, status):
            self.status = status

        def delete_namespaced_pod(self, name, namespace, grace_period_seconds):
            if self.status:
                raise ApiException(
                    status=self.status, reason="Not Found" if self.status == 404 else "Forbidden"
                )

    cluster = object.__new__(Cluster)  # the API calls only: no kubeconfig
    cluster.namespace = "ns"
    cluster.core = Core(None)
    assert cluster.delete_pod("p", 0) is True
    cluster.core = Core(404)
    assert cluster.delete_pod("p", 0) is False
    cluster.core = Core(403)
    with pytest.raises(ApiException):
        cluster.delete_pod("p", 0)


def test_a_tainted_node_without_pods_of_the_job_stays_down_for_the_duration(monkeypatch):
    clock = iter(range(10**6))
    monkeypatch.setattr(driver.time, "time", lambda: 2e9 + next(clock))

    class Idle(FakeCluster):  # node d runs no pod of the job; when was the node patched
        def __init__(self, statuses, labels):
            super().__init__(statuses, labels)
            self.at: list[float] = []

        def nodes(self):
            return [*super().nodes(), {"metadata": {"name": "d"}}]

        def patch_node(self, name, body):
            self.at.append(driver.time.time())
            super().patch_node(name, body)

    fc = Idle([status(), status(step=101)], {})
    o = Options(job=JOB, action="node-loss", node="d", interval=0, poll=0, duration=5, timeout=30)
    faults, _, code = driver._run(o, fc, random.Random(0), 0, lambda line: None)
    assert faults == [] and fc.deleted == [] and [name for name, _ in fc.patches] == ["d", "d"]
    down, back = fc.at
    assert back - down >= 5, "the taint was lifted before --duration was over"


def test_the_annotation_injector_only_annotates_the_node():
    fc = FakeCluster([status(), status(), status(phase="Failed")], {NODE_DOWN_LABEL: "true"})
    fc._statuses[2]["reason"] = "2 servers lost at once"
    faults, code = chaos(fc)
    assert fc.deleted == []
    ((name, body),) = fc.patches
    ann = body["metadata"]["annotations"]
    assert name == "b" and ann[NODE_DOWN_SECONDS] == "1" and ann[NODE_DOWN_ID].startswith("1-")
    assert code == 1 and {f.outcome for f in faults} == {"job failed"}


def test_node_loss_goes_with_a_node_and_a_node_with_node_loss():
    with pytest.raises(ChaosError, match="--node goes with --action node-loss"):
        run(Options(job=JOB, action="pod-kill", node="a"))
    with pytest.raises(ChaosError, match="--node goes with --action node-loss"):
        run(Options(job=JOB, action="node-loss"))
