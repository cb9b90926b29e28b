"""Failure domains (ecrec_operator.domains: which domains hold more than r servers) and the operator's
FailureDomainsAtRisk condition and runPolicy.suspend, driven through `reconcile_job` without an API server
(the Kubernetes API classes replaced by recorders, as tests/test_operator_events.py replaces kopf's events)."""

from __future__ import annotations

import datetime
import json

import kopf
import pytest

from ecrec.spec import job_from_spec
from ecrec_operator import domains, handlers, nodes, pinning, render, suspend

NS, JOB = "ns", "j"
NOW = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)


# -- the pure decision ---------------------------------------------------------------------------------------
def test_a_domain_with_more_than_r_servers_is_at_risk():
    nodes = {"n1": {"zone": "a"}, "n2": {"zone": "a"}, "n3": {"zone": "b"}}
    placement = domains.at_risk({0: "n1", 1: "n2", 2: "n3", 3: "n3"}, nodes, "zone", r=1)
    assert placement.at_risk == {"a": (0, 1), "b": (2, 3)}
    assert domains.at_risk({0: "n1", 1: "n2", 2: "n3"}, nodes, "zone", r=2).at_risk == {}
    assert placement.message("zone", 1) == (
        "more than r=1 server(s) share a failure domain (zone): a holds servers 0, 1; b holds servers 2, 3"
    )


def test_five_servers_on_three_hosts_put_two_domains_at_risk():
    nodes = {f"n{i}": {"kubernetes.io/hostname": f"n{i}"} for i in range(3)}
    where = {s: f"n{s % 3}" for s in range(5)}
    assert domains.at_risk(where, nodes, "kubernetes.io/hostname", 1).at_risk == {"n0": (0, 3), "n1": (1, 4)}


def test_nodes_without_the_label_are_in_no_known_domain():
    placement = domains.at_risk({0: "n1", 1: "n2"}, {"n1": {}, "n2": {}}, "zone", 1)
    assert placement.at_risk == {} and placement.unlabelled == ("n1", "n2")
    assert placement.message("zone", 1) == "no zone holds more than 1 server(s); nodes without zone: n1, n2"
    assert domains.at_risk({0: "gone"}, {}, "zone", 1).unlabelled == ("gone",)


def pod(role: str, index: int, incarnation: int = 1, node: str | None = None, **extra) -> dict:
    labels = render.labels(JOB, role, index, incarnation)
    return {
        "metadata": {"name": render.pod_name(JOB, role, index, incarnation), "labels": labels, **extra},
        "spec": {"nodeName": node},
        "status": {"phase": "Running" if node else "Pending"},
    }


def test_server_nodes_takes_each_shards_newest_live_scheduled_server():
    pods = [
        pod("server", 0, 1, "old"),
        pod("server", 0, 2, "new"),
        pod("server", 1, 1, None),  # not scheduled yet
        pod("server", 2, 1, "gone", deletionTimestamp="2025-01-01T00:00:00Z"),
        pod("worker", 0, 1, "w"),
        pod("spare", 0, 1, "s"),  # holds no shard
    ]
    assert domains.server_nodes(pods) == {0: "new"}


def test_nodes_are_read_once_per_ttl_and_an_unreadable_one_is_asked_again():
    reads: list[str] = []

    def read(n: str) -> nodes.NodeInfo | None:
        reads.append(n)
        if n == "flaky":
            raise nodes.Unreadable(n)
        return nodes.NodeInfo({"zone": "a"}) if n != "gone" else None

    cache = nodes.NodeCache(read, ttl=60)
    assert cache.labels(["n1", "n1", "gone", "flaky"]) == {"n1": {"zone": "a"}}
    assert cache.get(["n1", "gone", "flaky"]) == {"n1": nodes.NodeInfo({"zone": "a"}), "gone": None}
    assert sorted(reads) == ["flaky", "flaky", "gone", "n1"]


# -- through the handler -------------------------------------------------------------------------------------
class Core:
    """What reconcile_job asks of CoreV1Api, recorded."""

    def __init__(self, nodes: dict[str, dict] | None = None):
        self.deleted: list[str] = []
        self.created: list[str] = []
        self.nodes = nodes or {}  # name -> labels; a node not here is gone (404)
        self.ready: dict[str, str] = {}  # name -> its Ready condition's status (default True)
        self.graces: dict[str, int | None] = {}  # pod -> the grace period it was deleted with

    def delete_namespaced_pod(self, name, namespace, grace_period_seconds=None):
        self.deleted.append(name)
        self.graces[name] = grace_period_seconds

    def create_namespaced_pod(self, namespace, body):
        self.created.append(body["metadata"]["name"])

    def create_namespaced_service(self, namespace, body):
        pass

    def read_namespaced_secret(self, name, namespace):
        from base64 import b64encode

        return type("S", (), {"data": {"token": b64encode(b"t").decode()}})()

    def read_node(self, name):
        if name not in self.nodes:
            raise handlers.ApiException(status=404, reason="Not Found")
        meta = type("M", (), {"labels": self.nodes[name]})()
        ready = type("C", (), {"type": "Ready", "status": self.ready.get(name, "True")})()
        return type("N", (), {"metadata": meta, "status": type("S", (), {"conditions": [ready]})()})()


class Custom:
    def __init__(self):
        self.patches: list[dict] = []

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body):
        self.patches.append(body)


@pytest.fixture
def cluster(monkeypatch):
    core, custom, events = Core(), Custom(), []
    monkeypatch.setattr(handlers.k8s, "CoreV1Api", lambda: core)
    monkeypatch.setattr(handlers.k8s, "CustomObjectsApi", lambda: custom)
    monkeypatch.setattr(handlers, "_nodes", nodes.NodeCache(handlers._read_node, ttl=0))
    monkeypatch.setattr(handlers, "_released", set())
    monkeypatch.setattr(handlers, "_get_status", lambda base: None)
    for fn in ("info", "warn"):
        monkeypatch.setattr(kopf, fn, lambda obj, reason, message: events.append((reason, message)))
    monkeypatch.setattr(handlers.kopf, "adopt", lambda obj, owner: None)
    return core, custom, events


SPEC = {"model": {"preset": "tiny"}, "faultTolerance": {"strategy": "ecrec"}, "servers": {"replicas": 5}}


def run(spec: dict, status: dict, pods: list[dict], pinned: bool = True) -> kopf.Patch:
    job = job_from_spec(JOB, spec)
    annotations = {pinning.ANNOTATION: pinning.pin(job)} if pinned else {}
    meta = {"name": JOB, "namespace": NS, "uid": "u", "annotations": annotations, "generation": 1}
    body = {"apiVersion": "ecrec.dev/v1alpha1", "kind": "ECRecJob", "metadata": meta, "spec": spec}
    patch = kopf.Patch()
    handlers.reconcile_job(
        name=JOB,
        namespace=NS,
        spec=json.loads(json.dumps(spec)),
        status=status,
        meta=meta,
        body=body,
        patch=patch,
        pods_by_job={(NS, JOB): pods},
        logger=handlers.log,
    )
    return patch


def condition(patch: kopf.Patch, ctype: str) -> dict | None:
    return next((c for c in patch.status.get("conditions") or [] if c["type"] == ctype), None)


def test_at_risk_is_true_with_a_warning_naming_the_domain_and_shards(cluster):
    core, _, events = cluster
    core.nodes = {f"n{i}": {"kubernetes.io/hostname": f"n{i}"} for i in range(3)}
    pods = [pod("coordinator", 0, 1, "n0"), *(pod("server", s, 1, f"n{s % 3}") for s in range(5))]
    patch = run(SPEC, {"coordinatorIncarnation": 1}, pods)
    cond = condition(patch, "FailureDomainsAtRisk")
    assert cond["status"] == "True" and cond["reason"] == "FailureDomainsAtRisk"
    assert "n0 holds servers 0, 3; n1 holds servers 1, 4" in cond["message"]
    assert [m for r, m in events if r == "FailureDomainsAtRisk"] == [cond["message"]]
    # Still at risk next pass: no second event.
    run(SPEC, {"coordinatorIncarnation": 1, "conditions": patch.status["conditions"]}, pods)
    assert len([r for r, _ in events if r == "FailureDomainsAtRisk"]) == 1


def test_at_risk_is_false_once_every_shard_is_scheduled_apart_and_absent_before(cluster):
    core, _, events = cluster
    core.nodes = {f"n{i}": {"kubernetes.io/hostname": f"n{i}"} for i in range(5)}
    pods = [
        pod("coordinator", 0, 1, "n0"),
        *(pod("server", s, 1, f"n{s}") for s in range(4)),
        pod("server", 4),
    ]
    assert condition(run(SPEC, {"coordinatorIncarnation": 1}, pods), "FailureDomainsAtRisk") is None
    pods[-1] = pod("server", 4, 1, "n4")
    cond = condition(run(SPEC, {"coordinatorIncarnation": 1}, pods), "FailureDomainsAtRisk")
    assert cond["status"] == "False" and cond["reason"] == "FailureDomainsSpread"
    assert not [r for r, _ in events if r == "FailureDomainsAtRisk"]


def test_at_risk_is_not_evaluated_for_other_strategies(cluster):
    core, _, _ = cluster
    core.nodes = {"n0": {"kubernetes.io/hostname": "n0"}}
    spec = {**SPEC, "faultTolerance": {"strategy": "none"}}
    pods = [pod("coordinator", 0, 1, "n0"), *(pod("server", s, 1, "n0") for s in range(5))]
    assert condition(run(spec, {"coordinatorIncarnation": 1}, pods), "FailureDomainsAtRisk") is None


def suspended(spec: dict) -> dict:
    return {**spec, "runPolicy": {"suspend": True}}


def test_a_jobs_pod_deletions_are_the_suspends_while_suspended_and_until_resumed():
    def index(spec: dict, status: dict) -> dict:
        return {key: [value] for key, value in suspend.suspended_jobs(NS, JOB, spec, status).items()}

    assert suspend.is_suspended(index(suspended(SPEC), {"phase": "Running"}), NS, JOB)
    assert suspend.is_suspended(index(SPEC, {"phase": "Suspended"}), NS, JOB)  # resuming: pods still going
    assert not suspend.is_suspended(index(SPEC, {"phase": "Running"}), NS, JOB)
    assert not suspend.is_suspended({}, NS, JOB)


def test_a_job_created_suspended_creates_nothing_and_pins_nothing(cluster):
    core, custom, events = cluster
    patch = run(suspended(SPEC), {}, [], pinned=False)
    assert core.created == [] and custom.patches == []
    assert patch.status["phase"] == "Suspended"
    assert condition(patch, "Suspended")["status"] == "True"
    assert [r for r, _ in events] == ["ECRecJobSuspended"]


def test_suspending_a_running_job_deletes_its_pods_quietly_and_resets_its_start(cluster):
    core, _, events = cluster
    pods = [pod("coordinator", 0, 1, "n0"), pod("server", 0, 1, "n0"), pod("worker", 0, 2, "n0")]
    pods.append(pod("server", 1, 1, "n0", deletionTimestamp="2025-01-01T00:00:00Z"))
    status = {
        "phase": "Running",
        "startTime": "2025-01-01T00:00:00Z",
        "coordinatorIncarnation": 1,
        "conditions": [{"type": "Running", "status": "True", "reason": "ECRecJobRunning"}],
    }
    patch = run(suspended(SPEC), status, pods)
    assert sorted(core.deleted) == sorted(p["metadata"]["name"] for p in pods[:3])
    assert patch.status["phase"] == "Suspended" and patch.status["startTime"] is None
    assert patch.status["coordinatorIncarnation"] is None and patch.status["resume"] is None
    assert condition(patch, "Running")["status"] == "False"
    # The deleted server pods are no failures: no ServerLost, nothing reported to the coordinator.
    handlers.server_pod_event(
        event={"type": "DELETED"},
        name=pods[1]["metadata"]["name"],
        namespace=NS,
        labels=pods[1]["metadata"]["labels"],
        meta={},
        status={},
        pods_by_job={(NS, JOB): pods},
        suspended_jobs={(NS, JOB): [suspend.suspended_jobs(NS, JOB, suspended(SPEC), {})[(NS, JOB)]]},
    )
    assert "ServerLost" not in [r for r, _ in events]


def test_resuming_waits_for_the_pods_to_go_then_unpins_and_starts_over(cluster):
    core, custom, events = cluster
    status = {"phase": "Suspended", "step": 120, "conditions": [{"type": "Suspended", "status": "True"}]}
    terminating = [pod("server", 0, 1, "n0", deletionTimestamp="2025-01-01T00:00:00Z")]
    patch = run(SPEC, status, terminating)
    assert patch.status == {} and custom.patches == [] and core.created == []
    patch = run(SPEC, status, [])
    assert custom.patches == [{"metadata": {"annotations": {pinning.ANNOTATION: None}}}]
    assert patch.status["phase"] == "Pending" and patch.status["step"] is None
    assert condition(patch, "Suspended")["status"] == "False"
    assert "ECRecJobResumed" in [r for r, _ in events]
    # The next pass (Pending, no coordinator yet) starts the job afresh: every pod its first incarnation.
    run(SPEC, {"phase": "Pending"}, [])
    assert core.created[0] == render.pod_name(JOB, "coordinator", 0, 1)
    assert all(name.endswith("-1") for name in core.created) and len(core.created) == 1 + 5 + 1


# -- lost nodes (ecrec_operator.nodes) -------------------------------------------------------------------
def test_pods_on_a_node_that_stopped_reporting_or_is_gone_are_lost():
    pods = [
        pod("server", 0, 1, "up"),
        pod("server", 1, 1, "silent"),
        pod("worker", 0, 1, "gone"),
        pod("coordinator", 0, 1, "sick"),  # Ready False: its kubelet is alive and said so
        pod("server", 2, 1, "unread"),  # not looked at (the read failed): nothing decided
        pod("server", 3),  # not scheduled
        {**pod("worker", 1, 1, "silent"), "status": {"phase": "Succeeded"}},  # finished: left alone
        {"metadata": {"name": "other", "labels": {}}, "spec": {"nodeName": "silent"}, "status": {}},
    ]
    seen = {
        "up": nodes.NodeInfo(),
        "silent": nodes.NodeInfo(ready="Unknown"),
        "gone": None,
        "sick": nodes.NodeInfo(ready="False"),
    }
    lost = nodes.pods_on_lost_nodes(pods, seen)
    assert [(p["metadata"]["name"], why) for p, why in lost] == [
        (render.pod_name(JOB, "server", 1, 1), "node silent stopped reporting (Ready Unknown)"),
        (render.pod_name(JOB, "worker", 0, 1), "node gone is gone"),
    ]
    assert nodes.bound_nodes(pods) == {"up", "silent", "gone", "sick", "unread"}


def test_the_operator_deletes_pods_on_a_lost_node_at_once_with_one_event_each(cluster):
    core, _, events = cluster
    core.nodes = {f"n{i}": {"kubernetes.io/hostname": f"n{i}"} for i in range(3)}
    core.ready["n1"] = "Unknown"
    core.ready["n2"] = "False"
    pods = [
        pod("coordinator", 0, 1, "n0"),
        *(pod("server", s, 1, f"n{s % 3}") for s in range(5)),
        pod("worker", 0, 1, "n1"),
    ]
    run(SPEC, {"coordinatorIncarnation": 1}, pods)
    on_n1 = [render.pod_name(JOB, "server", s, 1) for s in (1, 4)] + [render.pod_name(JOB, "worker", 0, 1)]
    assert sorted(core.deleted) == sorted(on_n1)
    assert all(core.graces[name] == 0 for name in on_n1)
    lost_events = [m for r, m in events if r == nodes.LOST_EVENT]
    assert len(lost_events) == 3 and all("node n1 stopped reporting" in m for m in lost_events)
    # The API keeps them until the deletion lands: the next pass deletes again, without a second event.
    run(SPEC, {"coordinatorIncarnation": 1}, pods)
    assert len(core.deleted) == 6 and len([r for r, _ in events if r == nodes.LOST_EVENT]) == 3
