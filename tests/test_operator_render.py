"""The operator's pure parts without a cluster: pods and services rendered from a spec, pods observed back
into the reconciler's terms, and the status computed from the coordinator's."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

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
    assert c["command"] == ["ecrec", "server"]
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
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
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
    # status.resume is sent as a merge patch, where null deletes a field: it is sent without them, so the
    # stored status equals what was sent and an unchanged one is not patched again.
    coord["resume"] = {"generation": 1, "finishedAt": None, "recoveries": [{"shard": 2, "killed_at": None}]}
    st3 = job_status(job.spec, coord, procs, st2, later, replacements=1)
    assert st3["resume"] == {"generation": 1, "recoveries": [{"shard": 2}]}


def test_a_trained_job_is_checking_until_its_final_checks_and_only_then_succeeded():
    # The reconcile pass shows the job as Checking while the final checks run (handlers.reconcile_job): the
    # Succeeded condition is not there yet, so `kubectl wait --for=condition=Succeeded` does not return.
    job = k8s_job()
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    coord = {"phase": "Checking", "step": 300, "cluster": {"shards": []}}
    st = job_status(job.spec, coord, [], {}, now, replacements=0)
    conds = {c["type"]: c for c in st["conditions"]}
    assert st["phase"] == "Checking" and "Succeeded" not in conds and not st.get("completionTime")
    assert conds["Running"]["status"] == "True" and conds["Checking"]["status"] == "True"
    done = job_status(job.spec, {**coord, "phase": "Succeeded"}, [], st, now, replacements=0)
    conds = {c["type"]: c for c in done["conditions"]}
    assert conds["Succeeded"]["status"] == "True" and conds["Running"]["status"] == "False"
    assert conds["Checking"]["status"] == "False"


def test_set_condition_changes_the_transition_time_only_on_a_change():
    c = set_condition([], "Running", "True", "R", "m", "t1")
    c = set_condition(c, "Running", "True", "R", "m", "t2")
    assert c[0]["lastTransitionTime"] == "t1" and c[0]["lastUpdateTime"] == "t2"
    c = set_condition(c, "Running", "False", "R", "m", "t3")
    assert c[0]["lastTransitionTime"] == "t3"


# -- job-pod defaults (the chart's config) -------------------------------------------------------------------
def test_every_pod_is_hardened_by_default_with_a_writable_tmp():
    job = k8s_job()
    for role, index in (("coordinator", 0), ("server", 1), ("worker", 0)):
        spec = render.pod(job, "ns", role, index, 1)["spec"]
        (c,) = spec["containers"]
        assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        assert spec["automountServiceAccountToken"] is False  # ECRec's processes never call the API
        assert "serviceAccountName" not in spec
        # The root filesystem is read-only: /tmp is an emptyDir and everything that writes points there.
        assert {"name": "tmp", "emptyDir": {}} in spec["volumes"]
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        for var in ("HOME", "MPLCONFIGDIR", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME"):
            assert env[var] == "/tmp" or env[var].startswith("/tmp/"), var


def test_servers_and_workers_share_the_member_flags():
    job = k8s_job()
    for role in ("server", "worker"):
        args = render.pod(job, "ns", role, 0, 2, replacement=True)["spec"]["containers"][0]["args"]
        pairs = dict(zip(args, args[1:], strict=False))
        assert pairs["--coordinator"] == "$(ECREC_COORDINATOR)" and pairs["--instance"] == "$(POD_NAME)"
        assert pairs["--metrics-addr"] == "$(POD_IP)" and pairs["--metrics-port"] == str(render.METRICS_PORT)
        assert args.count("--replacement") == 1 and args.count("--coordinator") == 1


def test_configured_defaults_replace_only_the_default_image_and_add_labels():
    job = k8s_job()  # every role names ecrec:latest, the spec's default
    d = render.PodDefaults.from_dict(
        {
            "images": {
                "coordinator": "reg/ecrec:0.1.0",
                "server": "reg/ecrec:0.1.0",
                "worker": "reg/ecrec:0.1.0-cuda",
            },
            "imagePullPolicy": "Always",
            "imagePullSecrets": ["regcred"],
            "labels": {"team": "recsys", "ecrec.dev/role": "not-this"},
            "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 10001},
        }
    )
    server = render.pod(job, "ns", "server", 0, 1, defaults=d)
    worker = render.pod(job, "ns", "worker", 0, 1, defaults=d)
    assert server["spec"]["containers"][0]["image"] == "reg/ecrec:0.1.0"
    assert worker["spec"]["containers"][0]["image"] == "reg/ecrec:0.1.0-cuda"
    # The spec's own pull policy wins over the configured one.
    assert server["spec"]["containers"][0]["imagePullPolicy"] == "IfNotPresent"
    assert server["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert server["metadata"]["labels"]["team"] == "recsys"
    assert server["metadata"]["labels"]["ecrec.dev/role"] == "server"  # the operator's own labels win
    assert server["spec"]["securityContext"] == {"runAsNonRoot": True, "runAsUser": 10001}
    # A container context left out of the config keeps the restricted default.
    assert server["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True

    own = load_job(
        str(REPO / "examples/k8s-small.yaml"),
        ("servers.image=mine/ecrec:dev", "servers.serviceAccountName=data-reader"),
    )
    # A role with a ServiceAccount of its own (e.g. a cloud identity for the data) keeps its token.
    assert "automountServiceAccountToken" not in render.pod(own, "ns", "server", 0, 1, defaults=d)["spec"]
    assert (
        render.pod(own, "ns", "server", 0, 1, defaults=d)["spec"]["containers"][0]["image"]
        == "mine/ecrec:dev"
    )
    # A role whose spec sets no pull policy gets the configured one.
    no_policy = load_job(str(REPO / "examples/k8s-small.yaml"), ("coordinator.imagePullPolicy=null",))
    c = render.pod(no_policy, "ns", "coordinator", 0, 1, defaults=d)["spec"]["containers"][0]
    assert c["imagePullPolicy"] == "Always"


def test_a_bad_operator_config_is_refused_with_the_key(tmp_path):
    with pytest.raises(ValueError, match="podSecurityContex"):
        render.PodDefaults.from_dict({"podSecurityContex": {}})
    with pytest.raises(ValueError, match="roles"):
        render.PodDefaults.from_dict({"images": {"servers": "x"}})
    (tmp_path / "c.yaml").write_text("images:\n  worker: ecrec:1-cuda\nnetworkPolicy: {enabled: false}\n")
    d = render.PodDefaults.load(tmp_path / "c.yaml")
    assert d.images == {"worker": "ecrec:1-cuda"} and d.network_policy is None
    assert d.pod_security_context == render.RESTRICTED_POD_SECURITY_CONTEXT


def test_the_job_network_policy_admits_its_own_pods_and_the_operator_only():
    job = k8s_job()
    assert render.network_policy(job, "ns") is None  # built-in defaults: none
    operator_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ecrec-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
    }
    d = render.PodDefaults.from_dict(
        {
            "networkPolicy": {
                "enabled": True,
                "operatorPeers": [operator_peer],
                "extraEgress": [{"ports": [{"port": 443}]}],
            }
        }
    )
    np = render.network_policy(job, "ns", defaults=d)
    spec = np["spec"]
    own = {"podSelector": {"matchLabels": {"ecrec.dev/job": "k8s-small"}}}
    assert np["metadata"]["namespace"] == "ns" and spec["policyTypes"] == ["Ingress", "Egress"]
    # The policy selects every pod of this job (all roles), and no pod of another job.
    for role in ("coordinator", "server", "worker"):
        labels = render.pod(job, "ns", role, 0, 1, defaults=d)["metadata"]["labels"]
        assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert not spec["podSelector"]["matchLabels"].items() <= render.labels("other", "coordinator").items()
    ingress = spec["ingress"]
    assert ingress[0] == {"from": [own]} and ingress[1] == {"from": [operator_peer]}
    assert ingress[2] == {"ports": [{"protocol": "TCP", "port": render.METRICS_PORT}]}  # metrics: anyone
    assert len(ingress) == 3
    egress = spec["egress"]
    assert egress[0] == {"to": [own]} and {p["port"] for p in egress[1]["ports"]} == {53}
    assert egress[2] == {"ports": [{"port": 443}]} and len(egress) == 3


def checkpoint_job(**settings):
    import dataclasses

    from ecrec.spec import JobSpec

    job = k8s_job()
    doc = job.spec.to_dict()
    doc["faultTolerance"] = {"strategy": "checkpoint", "checkpoint": {"intervalSteps": 50, **settings}}
    return dataclasses.replace(job, spec=JobSpec.model_validate(doc))


def test_a_checkpoint_strategy_needs_a_volume_claim_and_a_relative_path_on_kubernetes():
    assert render.kubernetes_problems(k8s_job()) == []  # ecrec needs neither
    [problem] = render.kubernetes_problems(checkpoint_job())
    assert problem.startswith("spec.faultTolerance.checkpoint.volumeClaim: required on Kubernetes")
    for path in ("/data/ckpt", "../other-job"):
        [problem] = render.kubernetes_problems(checkpoint_job(volumeClaim="ckpt", path=path))
        assert f"path {path!r}: must be relative" in problem
    assert render.kubernetes_problems(checkpoint_job(volumeClaim="ckpt", path="runs/a")) == []


def test_the_claim_is_mounted_where_the_coordinator_and_servers_read_the_checkpoint_path():
    import json

    job = checkpoint_job(volumeClaim="ckpt", path="runs/a")
    expected = f"{render.CHECKPOINT_DIR}/k8s-small/runs/a"
    for role in ("coordinator", "server", "worker"):
        spec = render.pod(job, "ns", role, 0, 1)["spec"]
        (c,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        # Every process reads the same job (the checkpoint manifest names its hash).
        assert json.loads(env["ECREC_JOB"])["spec"]["faultTolerance"]["checkpoint"]["path"] == expected
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        if role == "worker":  # workers never touch checkpoint files
            assert render.CHECKPOINT_VOLUME not in mounts and render.CHECKPOINT_VOLUME not in volumes
        else:
            assert expected.startswith(mounts[render.CHECKPOINT_VOLUME] + "/")
            assert volumes[render.CHECKPOINT_VOLUME]["persistentVolumeClaim"] == {"claimName": "ckpt"}


def fallback_job(**settings):
    import dataclasses

    from ecrec.spec import JobSpec

    job = k8s_job()
    doc = job.spec.to_dict()
    doc["faultTolerance"]["ecrec"]["fallback"] = {"intervalSeconds": 600, **settings}
    return dataclasses.replace(job, spec=JobSpec.model_validate(doc))


def test_the_ecrec_fallback_needs_its_claim_and_mounts_it_as_a_checkpoint_strategy_does():
    import json

    [problem] = render.kubernetes_problems(fallback_job())
    assert problem.startswith("spec.faultTolerance.ecrec.fallback.volumeClaim: required on Kubernetes")
    job = fallback_job(volumeClaim="ckpt", path="runs/b")
    assert render.kubernetes_problems(job) == []
    expected = f"{render.CHECKPOINT_DIR}/k8s-small/runs/b"
    for role in ("coordinator", "server", "worker"):
        spec = render.pod(job, "ns", role, 0, 1)["spec"]
        (c,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        ft = json.loads(env["ECREC_JOB"])["spec"]["faultTolerance"]
        assert ft["strategy"] == "ecrec" and ft["ecrec"]["fallback"]["path"] == expected
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert (render.CHECKPOINT_VOLUME in volumes) == (role != "worker")


def test_the_status_carries_the_checkpoint_account():
    job = checkpoint_job(volumeClaim="ckpt")
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    stats = {
        "strategy": "checkpoint",
        "intervalSeconds": None,
        "intervalSteps": 50,
        "phase": "training",
        "lastCheckpoint": 3,
        "lastPauseSeconds": 0.2,
        "rollbacks": 1,
        "stepsRedone": 17,
        "portionOfLostSamples": 0.0,
        "committed": {"full": 3, "increment": 0, "hot": 0},
        "bytesWritten": 4096,
        "pausedSeconds": 0.5,
    }
    st = job_status(job.spec, {"phase": "Running", "checkpointing": stats}, [], {}, now, replacements=1)
    assert st["checkpointing"] == {
        k: v for k, v in stats.items() if k not in ("intervalSeconds", "intervalSteps", "lastPauseSeconds")
    }


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("k8s-*.yaml")))
def test_every_kubernetes_example_runs_on_kubernetes_as_it_is(example):
    job = load_job(str(REPO / "examples" / example), ())
    assert render.kubernetes_problems(job) == []


def test_a_spare_pod_is_a_server_without_a_shard_until_it_is_relabelled_as_one():
    job = k8s_job()
    pod = render.pod(job, "ns", "spare", 1, 1)
    meta, (c,) = pod["metadata"], pod["spec"]["containers"]
    assert meta["name"] == "k8s-small-spare-1-1"
    assert meta["labels"] == {
        "ecrec.dev/job": "k8s-small",
        "ecrec.dev/role": "spare",
        "ecrec.dev/spare": "1",
        "ecrec.dev/incarnation": "1",
    }
    args = c["args"]
    assert c["command"] == ["ecrec", "server"] and "--shard" not in args and "--replacement" not in args
    assert args[args.index("--spare") + 1] == "1" and args[args.index("--instance") + 1] == "$(POD_NAME)"
    assert args[args.index("--bind") + 1] == f"$(POD_IP):{render.GRPC_PORT}"
    assert "readinessProbe" not in c  # it serves gRPC only once it has a shard
    server = render.pod(job, "ns", "server", 0, 1)["spec"]["containers"][0]
    assert c["image"] == server["image"] and c["resources"] == server["resources"]
    pod["status"] = {"phase": "Running"}
    assert render.observe_pod(pod) == Proc("spare", 1, 1, "running", "k8s-small-spare-1-1")
    # The operator's adopt action merges these labels into the pod: from then on it is shard 3's server.
    pod["metadata"]["labels"].update(render.labels("k8s-small", "server", 3, 2))
    # (the merge keeps the spare label: the reconciler numbers new spares past it, as the pod's name has it)
    assert render.observe_pod(pod) == Proc("server", 3, 2, "running", "k8s-small-spare-1-1", spare=1)
