"""Strategy ecrec's checkpoint fallback end to end (`faultTolerance.ecrec.fallback`; real processes, SIGKILL,
loopback gRPC): ECRec rebuilds one lost server and nothing rolls back; two servers lost at once (more than
r = 1: stripes parity cannot rebuild) roll every rank back to the last checkpoint instead of failing the job
(without the fallback that fails it: tests/test_stray_jobs.py).
Deterministic mode makes a run a pure function of the spec, so either way the job ends bit-identical to the
run without failures, with parity exact."""

from __future__ import annotations

import pytest

from ecrec.local import run_local
from tests.conftest import make_ctx

pytestmark = pytest.mark.slow

DET = dict(
    servers__replicas=4,
    faultTolerance__strategy="ecrec",
    faultTolerance__ecrec__k=3,
    training__deterministic="true",
    training__steps=200,  # several seconds: the kills below land mid-training
    training__batchSize=64,
)


def fallback_ctx(name: str, **extra):
    return make_ctx(name, **DET, faultTolerance__ecrec__fallback__intervalSteps=40, **extra)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> str:
    """Strategy ecrec, no fallback, no failure: the parameters every run here must end with."""
    report = run_local(make_ctx("ecrec", **DET), tmp_path_factory.mktemp("ecrec"), progress=False)
    return report["params_sha256"]


def events(report: dict, kind: str) -> list[dict]:
    return [e for e in report["events"] if e["kind"] == kind]


def test_two_servers_lost_at_once_roll_back_to_the_last_checkpoint_and_the_replay_ends_bit_identical(
    tmp_path, baseline
):
    report = run_local(
        fallback_ctx("fb2"), tmp_path, progress=False, kills=[(1, "step:100"), (2, "step:100")]
    )
    assert report["kills_missed"] == []
    [fell] = events(report, "fallback_rollback")
    assert set(fell["shards"]) >= {1, 2}, fell
    [restored] = events(report, "checkpoint_restored")
    assert restored["shards"] == [0, 1, 2, 3]
    [rolled] = events(report, "rolled_back")
    # to the last checkpoint committed before the rollback was decided (one every 40 steps); "step:100" is when
    # the launcher sends the kills, which can land a checkpoint or two later on a fast run
    before = [e for e in events(report, "checkpoint_committed") if e["t"] <= fell["t"] and not e["final"]]
    assert before and rolled["steps"]["0"] == 40 * len(before), (rolled, before)
    assert report["checkpointing"]["rollbacks"] == 1
    assert report["parity_check"]["mismatches"] == 0 and report["parity_check"]["stripes"] > 0
    assert report["params_sha256"] == baseline


def test_one_server_lost_is_rebuilt_by_ecrec_and_nothing_rolls_back(tmp_path, baseline):
    report = run_local(fallback_ctx("fb1"), tmp_path, progress=False, kills=[(1, "step:100")])
    assert report["kills_missed"] == []
    assert events(report, "fallback_rollback") == [] and events(report, "rolled_back") == []
    [rec] = report["recoveries"]
    assert rec["shard"] == 1 and rec["rows_recovered"] > 0
    # Checkpoints were held off while shard 1 was down (none committed between its loss and its rebuild), and
    # went on after it.
    committed = [e["t"] for e in events(report, "checkpoint_committed")]
    [lost] = [e["t"] for e in events(report, "failure_detected")]
    [back] = [e["t"] for e in events(report, "recovered")]
    assert not [t for t in committed if lost < t < back], (committed, lost, back)
    assert [t for t in committed if t > back], (committed, back)
    assert report["checkpointing"]["rollbacks"] == 0
    assert report["parity_check"]["mismatches"] == 0
    assert report["params_sha256"] == baseline
