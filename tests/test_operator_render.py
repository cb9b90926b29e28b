"""The operator's pure parts without a cluster: pods and services rendered from a spec, pods observed back
into the reconciler's terms, and the status computed from the coordinator's."""

from __future__ import annotations

import datetime
from pathlib import Path

from ecrec.core.reconcile import Proc
from ecrec.spec import load_job
from ecrec_operator import render
from ecrec_operator.status import job_status, set_condition

REPO = Path(__file__).resolve().parents[1]


def k8s_job():
    return load_job(str(REPO / "examples/k8s-small.yaml"), ())


def test_server_pods_carry_shard_incarnation_and_bind_their_pod_ip():
    job = k8s_job()
    pod = render.pod(job, "ns", "server", 3, 2, replacement=True)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "k8s-small-server-3-2"
    assert meta["labels"] == {
        "ecrec.dev/job": "k8s-small",
        "ecrec.dev/role": "server",
        "ecrec.dev/shard": "3",
        "ecrec.dev/incarnation": "2",
    }
    (c,) = spec["containers"]
    assert c["command"] == ["python", "-m", "ecrec.server"]
    args = c["args"]
    assert args[args.index("--shard") + 1] == "3" and "--replacement" in args
    assert args[args.index("--bind") + 1] == f"$(POD_IP):{render.GRPC_PORT}"
    assert args[args.index("--instance") + 1] == "$(POD_NAME)"
    env = {e["name"]: e for e in c["env"]}
    assert env["ECREC_COORDINATOR"]["value"] == "http://k8s-small-coordinator.ns.svc:8080"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert spec["restartPolicy"] == "Never"
    assert c["resources"]["requests"]["cpu"] == "500m" and spec["nodeSelector"] == {
        "kubernetes.io/os": "linux"
    }
    assert spec["tolerations"][0]["key"] == "ecrec.dev/dedicated"
    assert c["image"] == "ecrec:latest" and c["imagePullPolicy"] == "IfNotPresent"


def test_first_servers_are_not_replacements_and_workers_resume_by_incarnation():
    job = k8s_job()
    assert "--replacement" not in render.pod(job, "ns", "server", 0, 1)["spec"]["containers"][0]["args"]
    args = render.pod(job, "ns", "worker", 1, 3, replacement=True)["spec"]["containers"][0]["args"]
    assert args[args.index("--rank") + 1] == "1" and args[args.index("--incarnation") + 1] == "3"
    assert "--replacement" in args


def test_the_coordinator_has_a_service_and_named_metrics_port():
    job = k8s_job()
    svc = render.coordinator_service(job, "ns")
    assert svc["metadata"]["name"] == "k8s-small-coordinator"
    assert svc["spec"]["selector"] == {"ecrec.dev/job": "k8s-small", "ecrec.dev/role": "coordinator"}
    pod = render.pod(job, "ns", "coordinator", 0, 1)
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert ports == {"http": render.HTTP_PORT, "metrics": render.METRICS_PORT}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(render.METRICS_PORT)


def test_pods_are_observed_back_with_their_state():
    job = k8s_job()
    pod = render.pod(job, "ns", "worker", 1, 2)
    pod["status"] = {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 137}}}]}
    assert render.observe_pod(pod) == Proc("worker", 1, 2, "failed", "k8s-small-worker-1-2", 137)
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert render.observe_pod(pod).state == "deleting"
    assert render.observe_pod({"metadata": {"labels": {"ecrec.dev/role": "other"}}}) is None


def test_status_follows_the_coordinator_and_keeps_transition_times():
    job = k8s_job()
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    coord = {
        "phase": "Degraded",
        "step": 40,
        "samplesPerSecond": 1000.0,
        "startedAt": now.timestamp() - 10,
        "cluster": {
            "shards": [
                {"shard": s, "state": "failed" if s == 2 else "up", "incarnation": 1} for s in range(5)
            ]
        },
        "recoveries": [{"shard": 2, "state": "waiting", "detected_at": 3.0, "rows_recovered": 0}],
    }
    procs = [Proc("server", s, 1, "running", f"k8s-small-server-{s}-1") for s in range(5) if s != 2]
    st = job_status(job.spec, coord, procs, {}, now, replacements=1)
    assert st["phase"] == "Degraded" and st["stepText"] == "40/300" and st["serversText"] == "4/5"
    assert st["recoveries"][0]["detectedAt"] == "2025-12-31T23:59:53Z"
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Degraded"]["status"] == "True" and conds["Running"]["status"] == "True"
    later = now + datetime.timedelta(seconds=30)
    coord["phase"] = "Running"
    st2 = job_status(job.spec, coord, procs, st, later, replacements=1)
    conds2 = {c["type"]: c for c in st2["conditions"]}
    assert conds2["Degraded"]["status"] == "False"
    assert conds2["Running"]["lastTransitionTime"] == conds["Running"]["lastTransitionTime"]
    assert st2["replicaStatuses"]["server"]["active"] == 4


def test_set_condition_changes_the_transition_time_only_on_a_change():
    c = set_condition([], "Running", "True", "R", "m", "t1")
    c = set_condition(c, "Running", "True", "R", "m", "t2")
    assert c[0]["lastTransitionTime"] == "t1" and c[0]["lastUpdateTime"] == "t2"
    c = set_condition(c, "Running", "False", "R", "m", "t3")
    assert c[0]["lastTransitionTime"] == "t3"
