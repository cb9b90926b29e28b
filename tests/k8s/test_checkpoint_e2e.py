"""A checkpoint strategy through the operator: the checkpoints go to a PersistentVolumeClaim mounted into the
coordinator and server pods (the test kubelet's stand-in for a ReadWriteMany volume: one directory per claim,
shared by the pods that mount it); a server pod deleted with kubectl is replaced, every shard reloads the last
checkpoint from the claim and the workers redo the steps since (docs/protocol.md, "Checkpoint strategies")."""

from __future__ import annotations

import json

import pytest
import yaml

from .test_operator_e2e import NS, get_job, job_manifest, operator, pods, wait_done, wait_for  # noqa: F401

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

CLAIM = "ecrec-checkpoints"
# Room for a checkpoint, a server's loss, its rollback, then the coordinator's loss: paced (util.paced), at
# least 40 s of training on any machine (every fault of these tests was over by step 300 in a measured run).
STEPS, PACE = 1200, 30.0


def claim_manifest() -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": CLAIM, "namespace": NS},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
        }
    )


def start(kube, name: str, strategy: str, settings: dict) -> None:
    """The claim and a job of STEPS steps under `strategy` whose checkpoints go to it."""
    kube.kubectl("apply", "-f", "-", input=claim_manifest())
    overrides = {
        "training.steps": STEPS,
        "training.maxStepsPerSecond": PACE,
        "faultTolerance.strategy": strategy,
        f"faultTolerance.{strategy}": {"intervalSteps": 100, "volumeClaim": CLAIM, **settings},
    }
    kube.kubectl("apply", "-f", "-", input=job_manifest(name, **overrides))


def checkpointing(kube, name: str) -> dict:
    """status.checkpointing of a job that has not failed."""
    st = get_job(kube, name).get("status") or {}
    assert st.get("phase") != "Failed", st
    return st.get("checkpointing") or {}


def delete_pod_while_training(kube, name: str, role: str, shard: int | None = None) -> None:
    """kubectl delete the job's pod of `role` (and shard), checking first that training is far from over: a
    kill after the final checkpoint tests nothing (with 600 steps a CI run's kill came after it)."""
    step = get_job(kube, name)["status"]["step"]
    assert step < STEPS - 100, f"training was nearly over (step {step}) before the {role} could go"
    selector = f"ecrec.dev/job={name},ecrec.dev/role={role}" + (
        f",ecrec.dev/shard={shard}" if shard is not None else ""
    )
    (victim,) = pods(kube, selector)
    kube.kubectl("delete", "pod", "-n", NS, victim["metadata"]["name"], "--wait=false")


def assert_recovered_and_trained(status: dict, shard: int) -> None:
    recs = [r for r in status["recoveries"] if r["shard"] == shard]
    assert recs and recs[-1]["state"] == "completed", status["recoveries"]
    assert status["step"] == status["totalSteps"] and 0.5 < status["eval"]["auc"] <= 1.0


def test_a_deleted_server_pod_rolls_the_job_back_to_the_checkpoint_on_the_claim(kube, kubelet, operator):  # noqa: F811
    name = "e2e-ckpt-kill"
    start(kube, name, "checkpoint", {})
    wait_for(
        "a first checkpoint", lambda: checkpointing(kube, name).get("lastCheckpoint", 0) >= 1, timeout=240
    )
    delete_pod_while_training(kube, name, "server", shard=2)

    def rolled_back():
        ckpt = checkpointing(kube, name)
        return ckpt.get("rollbacks", 0) >= 1 and get_job(kube, name)["status"]["phase"] == "Running"

    wait_for("the rollback", rolled_back, timeout=240)  # every shard up again
    # Then the coordinator: its successor takes over from the newest checkpoint on the claim and rolls back
    # to it (docs/protocol.md, "Checkpoint strategies", Coordinator failover).
    delete_pod_while_training(kube, name, "coordinator")
    status = wait_done(kube, name, timeout=600)

    ckpt = status["checkpointing"]
    assert ckpt["strategy"] == "checkpoint" and ckpt["rollbacks"] >= 2, ckpt
    assert ckpt["committed"]["full"] >= 2 and ckpt["bytesWritten"] > 0, ckpt
    assert ckpt["lastCheckpoint"] > 1 << 20, ckpt  # the final one, by the successor (ids above the old ones)
    assert status["coordinatorIncarnation"] >= 2
    assert_recovered_and_trained(status, 2)
    assert [r for r in status["recoveries"] if r["shard"] == 2][-1]["rowsRecovered"] > 0
    # The checkpoints are on the claim, under the job's own directory: the final one records every rank's end.
    root = kubelet.out_dir / "persistentvolumes" / f"{NS}_{CLAIM}" / name / "checkpoints"
    manifests = sorted(root.glob("ckpt-*/manifest.json"))
    assert manifests, sorted(root.parent.rglob("*"))
    last = json.loads(manifests[-1].read_text())
    assert last["final"] and {p["step"] for p in last["progress"]} == {STEPS}, last
    assert {f["shard"] for f in last["files"]} == set(range(5))
    events = kube.kubectl("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={name}").stdout
    assert "ReplacementCreated" in events, events


def test_a_deleted_server_pod_under_cpr_reloads_only_its_shard_and_training_goes_on(kube, kubelet, operator):  # noqa: F811
    # CPR through the operator: the replacement loads only its own shard's last checkpoint from the claim;
    # no rollback, and the samples it lost are counted (status.checkpointing.portionOfLostSamples).
    name = "e2e-cpr-kill"
    start(kube, name, "cpr", {"path": "cpr"})

    def checkpointed():
        # (a deletion landing inside a checkpoint's pause would lose nothing: the pauses are ~2% of the time)
        return (
            checkpointing(kube, name).get("lastCheckpoint", 0) >= 1
            and get_job(kube, name)["status"]["step"] >= 110
        )

    wait_for("a first checkpoint and some steps after it", checkpointed, timeout=240)
    refuses_callers_without_the_token(kube, name)
    delete_pod_while_training(kube, name, "server", shard=1)
    status = wait_done(kube, name, timeout=600)

    ckpt = status["checkpointing"]
    assert ckpt["strategy"] == "cpr" and ckpt["rollbacks"] == 0 and ckpt["stepsRedone"] == 0, ckpt
    assert 0 < ckpt["portionOfLostSamples"] < 1 / 5, ckpt  # at most one interval of one shard's five
    assert_recovered_and_trained(status, 1)
    root = kubelet.out_dir / "persistentvolumes" / f"{NS}_{CLAIM}" / name / "cpr"
    assert sorted(root.glob("ckpt-*/manifest.json")), sorted(root.parent.rglob("*"))


def test_a_deleted_server_pod_under_checknrun_rolls_back_to_baseline_plus_increment(kube, kubelet, operator):  # noqa: F811
    # Check-N-Run through the operator: increments of the rows changed since the last baseline, quantized to
    # 8 bits, written to the claim; a server pod deleted after an increment is replaced, and every shard rolls
    # back to baseline + increment (the same volume path as checkpoint's, a different writer and reader).
    name = "e2e-cnr-kill"
    start(kube, name, "checknrun", {"path": "cnr"})

    def incremented():
        return (checkpointing(kube, name).get("committed") or {}).get("increment", 0) >= 1

    wait_for("a baseline and an increment", incremented, timeout=240)
    delete_pod_while_training(kube, name, "server", shard=3)
    status = wait_done(kube, name, timeout=600)

    ckpt = status["checkpointing"]
    assert ckpt["strategy"] == "checknrun" and ckpt["rollbacks"] >= 1 and ckpt["stepsRedone"] > 0, ckpt
    assert ckpt["committed"]["full"] >= 1 and ckpt["committed"]["increment"] >= 1, ckpt
    assert_recovered_and_trained(status, 3)
    root = kubelet.out_dir / "persistentvolumes" / f"{NS}_{CLAIM}" / name / "cnr"
    manifests = [json.loads(m.read_text()) for m in root.glob("ckpt-*/manifest.json")]
    kinds = {
        "full" if m.get("base") is None else "increment" for m in manifests
    }  # an increment names its base
    assert kinds == {"full", "increment"}, (kinds, sorted(root.rglob("*"))[:20])


def refuses_callers_without_the_token(kube, name: str) -> None:
    """The job's own APIs on its real pods: a caller without the job's token (the Secret the operator made) is
    refused by the coordinator (401) and by a server (UNAUTHENTICATED), and nothing changes."""
    import grpc
    import httpx

    from ecrec import auth
    from ecrec.proto import ecrec_pb2 as pb
    from ecrec.proto import ecrec_pb2_grpc as pb_grpc
    from ecrec_operator import render

    (coordinator,) = pods(kube, f"ecrec.dev/job={name},ecrec.dev/role=coordinator")
    base = f"http://{coordinator['status']['podIP']}:{render.HTTP_PORT}"
    for headers in ({}, auth.headers("not-the-token")):
        r = httpx.post(f"{base}/v1/failures", json={"shard": 1}, headers=headers, timeout=10)
        assert r.status_code == 401, r.text
    shards = httpx.get(f"{base}/v1/status", timeout=10).json()["cluster"]["shards"]
    assert all(s["state"] == "up" for s in shards), shards  # the refused report changed nothing
    (server,) = pods(kube, f"ecrec.dev/job={name},ecrec.dev/role=server,ecrec.dev/shard=0")
    with auth.channel(f"{server['status']['podIP']}:{render.GRPC_PORT}", None) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.ParameterServerStub(ch).Info(pb.InfoRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
