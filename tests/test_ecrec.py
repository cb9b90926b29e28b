"""ECRec end to end with real processes, real SIGKILL and loopback gRPC: invariants I1-I4 (design notes §4).

Deterministic mode (one worker, each step waits for its commit, xor code) makes a run a pure function of the
spec, so "a server was killed and rebuilt" must end with parameters bit-identical to "nothing happened" (I2);
every run also checks that each stripe's parity equals the encoding of its members (I1) and that no 2PC state
is left undecided.
"""

from __future__ import annotations

import pytest

from ecrec.local import run_local
from tests.conftest import make_ctx, start_background_job, stop_with_ctrl_c

pytestmark = pytest.mark.slow

DET = dict(
    servers__replicas=5,
    faultTolerance__strategy="ecrec",
    faultTolerance__ecrec__k=4,
    training__deterministic="true",
    training__steps=200,  # kills below are at steps: they land mid-training however fast the machine trains
    training__batchSize=64,
)
# r = 2 (P and Q) on six servers: the same logical model as DET (it depends neither on N nor on r)
R2 = dict(DET, servers__replicas=6, faultTolerance__ecrec__r=2)


def det_ctx(name: str, **extra):
    return make_ctx(name, **{**DET, **extra})


def assert_consistent(report: dict) -> None:
    pc = report["parity_check"]
    assert pc["stripes"] > 0 and pc["mismatches"] == 0, pc
    assert report["staged_after"] == 0
    if report["spec"]["training"]["deterministic"]:
        assert report["dense_replica_mismatches"] == 0


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> str:
    report = run_local(det_ctx("base"), tmp_path_factory.mktemp("base"), progress=False)
    assert_consistent(report)
    assert report["recoveries"] == []
    return report["params_sha256"]


@pytest.mark.parametrize("shard, at", [(1, "step:50"), (3, "step:110")])
def test_killed_and_rebuilt_server_leaves_parameters_bit_identical(tmp_path, baseline, shard, at):
    report = run_local(det_ctx(f"kill{shard}"), tmp_path, progress=False, kills=[(shard, at)])
    assert_consistent(report)
    assert len(report["recoveries"]) == 1, (
        f"the kill at {at} did not land during training: {report['events']}"
    )
    (rec,) = report["recoveries"]
    assert rec["shard"] == shard and rec["rows_recovered"] > 0
    assert rec["killed_at"] <= rec["detected_at"] <= rec["completed_at"]
    # where the rebuild's time went, by step kind (side by side): each within the rebuild's own span
    assert set(rec["seconds"]) == {"dense", "data", "parity"} and rec["seconds"]["data"] > 0, rec
    assert max(rec["seconds"].values()) <= rec["completed_at"] - rec["started_at"] + 0.002, rec
    assert report["params_sha256"] == baseline


def test_a_warm_spare_takes_over_a_killed_server_and_a_new_spare_replaces_it(tmp_path, baseline):
    # servers.spares=1: the spare registered before training; the killed shard is assigned to it at once,
    # it registers under the shard id and is rebuilt like any replacement, and then a new spare is started. No
    # process of the shard's own is started; the run still ends bit-identical to the one without failure.
    ctx = det_ctx("spare", servers__spares=1)
    report = run_local(ctx, tmp_path, progress=False, kills=[(2, "step:60")])
    assert_consistent(report)
    kinds = [e["kind"] for e in report["events"]]
    [assigned] = [e for e in report["events"] if e["kind"] == "spare_assigned"]
    [took] = [e for e in report["events"] if e["kind"] == "spare_took_over"]
    assert assigned["shard"] == took["shard"] == 2 and assigned["instance"] == took["instance"]
    assert took["instance"].startswith("spare-0-")
    assert kinds.count("spare_registered") >= 1  # (the one started in its place may come after training)
    (rec,) = report["recoveries"]
    assert rec["shard"] == 2 and rec["rows_recovered"] > 0
    assert report["replacements"] == 1  # the new spare; no server process was started for shard 2
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert "spare-1.log" in logs and "shard 2 (replacement" in (tmp_path / "logs" / "spare-0.log").read_text()
    assert report["params_sha256"] == baseline


def test_kill_during_second_half_of_recovery(tmp_path, baseline):
    # Small lock groups make the rebuild many steps; the replacement dies after its 10th group of 14.
    ctx = det_ctx("kill-recovery", faultTolerance__ecrec__lockGroupRows=64)
    report = run_local(
        ctx, tmp_path, progress=False, kills=[(2, "step:60")], fault="server-2:recover:after_group@10"
    )
    assert report["fault"]["fired"]
    assert_consistent(report)
    assert report["replacements"] >= 2
    assert report["params_sha256"] == baseline


# One point per distinct situation of docs/protocol.md's failure table; the others (a message or its answer
# lost, a death before the decisions) are driven step by step in-process by tests/test_store_protocol.py.
@pytest.mark.parametrize(
    "commit, point",
    [
        # rowLocks (the paper's 2PC)
        ("rowLocks", "server-1:stage:after_local@15"),  # a data server dies having staged, before answering
        ("rowLocks", "server-1:commit:after_apply@15"),  # ... having committed: committed on its behalf
        ("rowLocks", "server-3:delta:after_stage@15"),  # a parity server dies holding staged deltas
        # deltaLog: a data server dies having applied a part, before answering (its deltas never leave:
        # the rows are written again at their acting homes); a parity server dies having applied delivered
        # deltas, before answering (re-encoded from the data rows)
        ("deltaLog", "server-1:stage:after_local@15"),
        ("deltaLog", "server-3:delta:after_stage@15"),
    ],
)
def test_server_killed_at_each_protocol_step_keeps_i1_and_i2(tmp_path, baseline, commit, point):
    ctx = det_ctx("fault", faultTolerance__ecrec__commit=commit)
    report = run_local(ctx, tmp_path, progress=False, fault=point)
    assert report["fault"]["fired"], "the fault point was never reached"
    assert_consistent(report)
    assert report["params_sha256"] == baseline


@pytest.mark.parametrize(
    "commit, point", [("rowLocks", "commit:after_apply"), ("deltaLog", "stage:after_local")]
)
def test_a_server_hung_with_a_commit_unanswered_is_declared_failed_and_nothing_is_applied_twice(
    tmp_path, baseline, commit, point
):
    # Server 1 hangs (SIGSTOP) right after committing (rowLocks) or applying (deltaLog) a part, its answer
    # unsent. The worker keeps asking (an unanswered commit is not an abort) until the coordinator declares it
    # failed, then commits on its behalf (rowLocks) or writes the rows at their acting homes (deltaLog: the
    # hung process's deltas never left it); the supervisor kills the hung process. Bit-identical to the run
    # without a failure.
    ctx = det_ctx("hung", faultTolerance__ecrec__commit=commit)
    report = run_local(ctx, tmp_path, progress=False, fault=f"server-1:{point}@15!stop")
    assert report["fault"]["fired"]
    assert_consistent(report)
    assert report["params_sha256"] == baseline


def test_replacement_killed_mid_lock_group(tmp_path, baseline):
    ctx = det_ctx("mid-group", faultTolerance__ecrec__lockGroupRows=128)
    report = run_local(
        ctx, tmp_path, progress=False, kills=[(4, "step:60")], fault="server-4:recover:mid_group@3"
    )
    assert report["fault"]["fired"]
    assert_consistent(report)
    assert report["params_sha256"] == baseline


HOT = dict(
    servers__replicas=5,
    faultTolerance__strategy="ecrec",
    faultTolerance__ecrec__k=4,
    workers__replicas=4,
    training__steps=40,
    training__batchSize=256,
    data__zipfExponent=1.3,
)


@pytest.mark.parametrize("commit", ["deltaLog", "rowLocks"])
@pytest.mark.parametrize("kills", [[], [(2, "step:10")]])  # by step: a faster build must not finish first
def test_four_workers_on_hot_rows_keep_parity_exact(tmp_path, kills, commit):
    ctx = make_ctx("hot", **HOT, faultTolerance__ecrec__commit=commit)
    report = run_local(ctx, tmp_path, progress=False, kills=kills)
    assert_consistent(report)
    assert report["samples"] == 4 * 40 * 256
    assert len(report["recoveries"]) == len(kills)
    served = report["rpcs_served"]
    if not kills and commit == "deltaLog":  # every step stages; the deliveries ride on the next stages
        assert served.get("Stage", 0) >= 5 * 4 * 40, served
        # DeliverDeltas only to a server a step does not stage at, for a straggler held too long, and when a
        # worker stops (its last deltas and acknowledgements)
        assert served.get("DeliverDeltas", 0) < 4 * 40, served
        assert not {"Commit", "StageDeltas", "DecideMany", "Push"} & set(served), served
        # every part's deltas reach its k parity servers (one batch each, fewer for parts missing a slot)
        batches = report["delta_batches"]
        assert (
            4 * 40 <= batches["delivered"] <= 4 * 40 * 5 * 4 and 0 <= batches["held"] <= batches["delivered"]
        )
    if not kills and commit == "rowLocks":  # every step stages, delivers deltas, commits
        assert min(served.get(m, 0) for m in ("Stage", "StageDeltas", "Commit")) >= 4 * 40, served
        # Decisions ride on the next stage at the same server; they go alone (DecideMany) only to servers a
        # pass does not stage at, and at the end: each worker's last step's decisions had no stage to ride on.
        assert served.get("DecideMany", 0) >= 4, served
        assert not {"Push", "Delta"} & set(served), served  # no server-to-server difference propagation


def two_workers(name: str, commit: str):
    """HOT with 2 workers of 60 steps; staged updates of a lost worker are settled after 3 s."""
    overrides = {
        "workers__replicas": 2,
        "training__steps": 60,
        "faultTolerance__ecrec__txnTimeoutSeconds": 3,
        "faultTolerance__ecrec__commit": commit,
    }
    return make_ctx(name, **{**HOT, **overrides})


@pytest.mark.parametrize("commit, point", [("rowLocks", "mid_commit"), ("deltaLog", "after_stage")])
def test_killed_worker_is_replaced_resumes_its_rank_and_leaves_nothing_staged(tmp_path, commit, point):
    ctx = two_workers("lost-worker", commit)
    report = run_local(ctx, tmp_path, progress=False, fault=f"worker-1:worker:{point}@20")
    assert report["fault"]["fired"]
    kinds = [e["kind"] for e in report["events"]]
    assert "worker_lost" in kinds and "worker_replaced" in kinds and "training_finished" in kinds
    # The replacement resumed rank 1 where its predecessor's last report ended: both ranks trained every step.
    assert report["samples"] == 2 * 60 * 256
    assert_consistent(report)  # what it left staged was settled: aborted, or committed where decided


@pytest.mark.parametrize(
    "commit, point",
    [
        ("rowLocks", "after_stage"),
        ("rowLocks", "before_commit"),
        ("deltaLog", "after_stage"),
        ("deltaLog", "after_deliver"),
    ],
)
def test_a_killed_workers_staged_rows_are_released_when_it_is_known_gone_not_after_txn_timeout(
    commit, point, tmp_path
):
    # rowLocks: killed with its parts staged on every server (and, before_commit, their deltas at the parity
    # servers); hot rows are in every batch, so the other worker needs them at once. The supervisor reports
    # the death, the coordinator's heartbeats tell the servers, and they abort the dead process's parts: the
    # job goes on. With a 120 s txnTimeout, left to the timeout the other worker would have waited on those
    # rows until its progress timeout failed the job. deltaLog: killed with its parts applied on every server
    # and their deltas not delivered (after_stage) or delivered and not acknowledged (after_deliver): the
    # other worker's deltas of the same hot rows wait at the parity servers for the dead one's, which the
    # data servers forward themselves as soon as they know the worker is gone.
    ctx = make_ctx(
        "gone-worker",
        **{**HOT, "workers__replicas": 2, "training__steps": 60},
        faultTolerance__ecrec__commit=commit,
        faultTolerance__ecrec__txnTimeoutSeconds=120,
        coordinator__progressTimeoutSeconds=60,
    )
    report = run_local(ctx, tmp_path, progress=False, fault=f"worker-1:worker:{point}@20")
    assert report["fault"]["fired"]
    assert report["parts_expired"]["worker_gone"] >= 1 and report["parts_expired"]["timeout"] == 0
    assert report["samples"] == 2 * 60 * 256
    assert_consistent(report)


def test_verify_checks_a_running_job(tmp_path):
    import json
    import subprocess
    import sys
    import time

    import httpx

    out = tmp_path / "out"
    proc = start_background_job(out, "workers.replicas=2")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            url_file = out / "coordinator.url"
            if url_file.exists() and httpx.get(f"{url_file.read_text()}/v1/status").json()["samples"] > 0:
                break
            time.sleep(0.3)
        url = (out / "coordinator.url").read_text()

        def verify() -> tuple[int, dict]:
            res = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ecrec.cli",
                    "verify",
                    "--coordinator",
                    url,
                    "--token-file",
                    str(out / "job.token"),
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            return res.returncode, json.loads(res.stdout.strip().splitlines()[-1])

        code, result = verify()  # training is running: updates are in flight while we check
        assert code == 0 and result["stripes"] > 0 and result["mismatches"] == 0, result
        # (that the check catches a corrupted record is shown over gRPC in tests/test_server.py)
    finally:
        stop_with_ctrl_c(proc)


def test_chaos_kills_random_servers_one_at_a_time_and_recovers_each(tmp_path):
    import json
    import subprocess
    import sys

    from tests.test_local import REPO

    out = tmp_path / "out"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ecrec.cli",
            "local",
            "examples/local-small.yaml",
            "--set",
            "model.preset=tiny",
            "--set",
            "training.steps=700",
            "--set",
            "training.batchSize=256",
            "--chaos",
            "2",
            "--seed",
            "3",
            "--quiet",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads((out / "report.json").read_text())
    recs = report["recoveries"]
    assert len(recs) == 2 and report["replacements"] == 2
    # one at a time: the second kill comes after the first recovery completed
    assert recs[0]["completed_at"] <= recs[1]["killed_at"]
    assert_consistent(report)


@pytest.mark.parametrize(
    "kills",
    [[(1, "step:60"), (2, "step:60")], [(0, "step:50"), (4, "step:50")], [(3, "step:60")]],
    ids=["two-neighbours", "two-apart", "one"],
)
def test_r2_servers_killed_at_the_same_step_leave_parameters_bit_identical(tmp_path, baseline, kills):
    """faultTolerance.ecrec.r: 2 (P and Q): two servers SIGKILLed at the same step (or one) — degraded reads
    and writes go on at their acting homes, both replacements are rebuilt side by side — and the model ends
    bit-identical to the undisturbed run of the same job with r = 1 on five servers (the logical model does
    not depend on the number of servers or on r)."""
    report = run_local(make_ctx("r2", **R2), tmp_path, progress=False, kills=kills)
    assert_consistent(report)
    assert sorted(rec["shard"] for rec in report["recoveries"]) == sorted(s for s, _ in kills), report[
        "events"
    ]
    assert all(rec["rows_recovered"] > 0 for rec in report["recoveries"])
    assert report["params_sha256"] == baseline


def test_chaos_with_two_concurrent_kills_and_r2_recovers_both_each_time(tmp_path):
    """`ecrec local --chaos 2 --concurrent 2` on a job with r = 2: each chaos event SIGKILLs two random servers
    at the same moment; training goes on degraded, both are rebuilt side by side, then the next event."""
    import json
    import subprocess
    import sys

    from tests.test_local import REPO

    out = tmp_path / "out"
    argv = ["local", "examples/local-small.yaml", "--set", "model.preset=tiny", "--set", "training.steps=700"]
    argv += [
        "--set",
        "training.batchSize=256",
        "--set",
        "servers.replicas=6",
        "--set",
        "faultTolerance.ecrec.r=2",
    ]
    argv += ["--chaos", "2", "--concurrent", "2", "--seed", "5", "--quiet", "--out", str(out)]
    res = subprocess.run(
        [sys.executable, "-m", "ecrec.cli", *argv], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr
    report = json.loads((out / "report.json").read_text())
    recs = sorted(report["recoveries"], key=lambda r: r["killed_at"])
    assert len(recs) == 4 and report["replacements"] == 4, report["events"]
    for first, second in (recs[:2], recs[2:]):  # two at the same moment, then two more after both recovered
        assert first["shard"] != second["shard"] and abs(first["killed_at"] - second["killed_at"]) < 0.5
    assert max(r["completed_at"] for r in recs[:2]) <= min(r["killed_at"] for r in recs[2:])
    assert_consistent(report)


def test_kill_option_is_validated_before_starting(tmp_path, capsys):
    import subprocess
    import sys

    from ecrec.cli import main
    from tests.test_local import REPO

    argv = ["local", str(REPO / "examples/local-small.yaml"), "--out", str(tmp_path / "o"), "--kill"]
    # One as a user runs it (a new process), the others in this one: the same parser, without 2 s of imports.
    res = subprocess.run(
        [sys.executable, "-m", "ecrec.cli", *argv, "7@3"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2 and "--kill" in res.stderr, res.stderr
    for bad in ("x@1", "2", "1@step:x", "1@step:-4"):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, bad])
        assert exit_.value.code == 2 and "--kill" in capsys.readouterr().err, bad
    assert not (tmp_path / "o").exists()


def test_replace_after_is_validated_before_starting(tmp_path, capsys):
    from ecrec.cli import main
    from tests.test_local import REPO

    argv = ["local", str(REPO / "examples/local-small.yaml"), "--out", str(tmp_path / "o"), "--replace-after"]
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, bad])
        assert exit_.value.code == 2 and "--replace-after" in capsys.readouterr().err, bad
    assert not (tmp_path / "o").exists()


def test_kill_times_are_seconds_or_a_step():
    from ecrec.cli import _parse_kill

    assert _parse_kill("2@1.5", 5) == (2, 1.5)
    assert _parse_kill("1@step:100", 5) == (1, "step:100")
    assert _parse_kill("coordinator@3", 5) == ("coordinator", 3.0)
    assert _parse_kill("worker-1@step:20", 5, num_workers=2) == ("worker-1", "step:20")
    for bad in ("worker-2@1", "worker-x@1", "worker@1"):
        with pytest.raises(ValueError, match="--kill"):
            _parse_kill(bad, 5, num_workers=2)


def test_a_kill_the_job_finished_before_is_reported_as_missed(tmp_path):
    # A run meant to be disturbed that was not must say so (the tests' kills by step read the report).
    report = run_local(
        make_ctx(
            "late-kill", servers__replicas=3, faultTolerance__strategy="ecrec", faultTolerance__ecrec__k=2
        ),
        tmp_path,
        progress=False,
        kills=[(1, "step:999")],
    )
    assert report["kills_missed"] == ["1@step:999"] and report["recoveries"] == []


def test_a_hung_worker_is_found_out_by_its_silence_replaced_and_its_rank_resumed(tmp_path):
    # The worker SIGSTOPs itself mid-update: its process is there, its reports stop. The coordinator declares
    # it unresponsive after the failure timeout, the supervisor kills it and a replacement resumes the rank.
    ctx = two_workers("hung-worker", "deltaLog")
    report = run_local(ctx, tmp_path, progress=False, fault="worker-1:worker:after_stage@20!stop")
    assert report["fault"]["fired"]
    kinds = [e["kind"] for e in report["events"]]
    assert kinds.index("worker_unresponsive") < kinds.index("worker_lost") < kinds.index("worker_replaced")
    assert report["samples"] == 2 * 60 * 256
    assert_consistent(report)
