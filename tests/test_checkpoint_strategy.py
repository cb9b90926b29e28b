"""The checkpoint strategies end to end with real processes, SIGKILL and loopback gRPC (docs/protocol.md,
"Checkpoint strategies"). Deterministic mode makes a run a pure function of the spec: checkpoints only pause
training, and a rollback replays the same steps from an exact copy, so a run with a kill ends bit-identical to
one without (and to strategy none)."""

from __future__ import annotations

import json

import pytest

from ecrec.local import run_local
from tests.conftest import make_ctx

pytestmark = pytest.mark.slow

DET = dict(
    servers__replicas=3,
    training__deterministic="true",
    training__steps=200,  # several seconds: the kills below land mid-training
    training__batchSize=64,
)


def ckpt_ctx(name: str, strategy: str = "checkpoint", **extra):
    base = {**DET, "faultTolerance__strategy": strategy, f"faultTolerance__{strategy}__intervalSteps": 40}
    return make_ctx(name, **{**base, **extra})


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> str:
    """Strategy none, no failure: the parameters every checkpoint run must end with."""
    report = run_local(make_ctx("none", **DET), tmp_path_factory.mktemp("none"), progress=False)
    return report["params_sha256"]


def events(report: dict, kind: str) -> list[dict]:
    return [e for e in report["events"] if e["kind"] == kind]


def test_checkpoints_pause_training_and_change_nothing(tmp_path, baseline):
    report = run_local(ckpt_ctx("ckpt"), tmp_path, progress=False)
    committed = events(report, "checkpoint_committed")
    assert len(committed) >= 4 and committed[-1]["final"], committed  # every 40 steps, then the final one
    assert report["params_sha256"] == baseline
    # The manifest records each rank's step; only the newest `keep` (2) checkpoints are left.
    dirs = sorted((tmp_path / "checkpoints").glob("ckpt-*"))
    assert len(dirs) == 2
    manifest = json.loads((dirs[-1] / "manifest.json").read_text())
    assert manifest["final"] and manifest["progress"] == [{"rank": 0, "step": 200, "samples": 200 * 64}]
    assert {f["shard"] for f in manifest["files"]} == {0, 1, 2}


def test_a_killed_server_rolls_every_shard_back_and_the_replay_ends_bit_identical(tmp_path, baseline):
    report = run_local(ckpt_ctx("ckpt-kill"), tmp_path, progress=False, kills=[(1, "step:100")])
    [rolled] = events(report, "rolled_back")
    [restored] = events(report, "checkpoint_restored")
    assert restored["shards"] == [0, 1, 2]
    assert rolled["steps"]["0"] % 40 == 0  # back to a checkpoint's step (0: the initial state)
    [rec] = report["recoveries"]
    assert rec["shard"] == 1 and rec["rows_recovered"] > 0 and rec["completed_at"] >= rec["detected_at"]
    assert report["checkpointing"]["rollbacks"] == 1
    assert report["params_sha256"] == baseline


def test_a_crash_between_the_shard_files_and_the_manifest_falls_back_to_the_checkpoint_before(
    tmp_path, baseline
):
    # Server 2 dies right after writing its part of the third checkpoint: no manifest is ever written for it,
    # so the rollback restores the second one (step 80) and the replay still ends where the run without
    # failures does.
    ctx = ckpt_ctx("ckpt-torn")
    report = run_local(ctx, tmp_path, progress=False, fault="server-2:checkpoint:after_write@3")
    assert report["fault"]["fired"]
    written = events(report, "checkpoint_written")
    assert any(e["checkpoint"] == 3 and not e["ok"] for e in written), written
    assert 3 not in [e["checkpoint"] for e in events(report, "checkpoint_committed")]
    [restored] = events(report, "checkpoint_restored")
    assert restored["checkpoint"] == 2
    assert events(report, "rolled_back")[0]["steps"] == {"0": 80}
    assert report["params_sha256"] == baseline


def test_cpr_restores_only_the_lost_shard_and_training_never_rolls_back(tmp_path, baseline):
    # One checkpoint at step 100, the kill 10 steps after it: the kill lands while the supervisor's view of
    # the step catches up (it was at step 120 in one CI run, just after the next checkpoint of a 40-step
    # interval, so nothing was lost); here 90 steps of margin before the final checkpoint. The supervisor
    # sees the step the worker last reported: once in a CI run, with reports 0.5 s apart, the report after
    # step 100 was the last, and the kill never came (reports now follow the heartbeat interval, 0.2 s here).
    ctx = ckpt_ctx("cpr", "cpr", faultTolerance__cpr__intervalSteps=100)
    report = run_local(ctx, tmp_path, progress=False, kills=[(1, "step:110")])
    assert report["kills_missed"] == []
    [restored] = events(report, "checkpoint_restored")
    assert restored["shards"] == [1] and restored["checkpoint"] == 1, restored
    assert events(report, "rolled_back") == []
    assert report["samples"] == 200 * 64
    # CPR's portion of lost samples: the samples since the checkpoint (at most 100 steps'), over all samples
    # and 3 servers.
    assert 0 < report["checkpointing"]["portionOfLostSamples"] < 100 / (200 * 3)
    # Shard 1 lost its updates since the checkpoint: the model differs from the run without failure, and
    # still trains (the benchmark reports the accuracy cost).
    assert report["params_sha256"] != baseline
    assert report["eval"]["auc"] > 0.6


def test_checknrun_increments_restore_exactly_at_full_precision(tmp_path, baseline):
    # Check-N-Run without quantization: baseline + increment restores bit-exact state, so the replay after
    # a kill ends where the run without failure does. Training resumed right after each copy (decoupled).
    ctx = ckpt_ctx("cnr32", "checknrun", faultTolerance__checknrun__quantizeBits=32)
    report = run_local(ctx, tmp_path, progress=False, kills=[(2, "step:100")])
    committed = events(report, "checkpoint_committed")
    assert committed[0]["baseline"] and any(not c["baseline"] for c in committed), committed
    assert len(events(report, "checkpoint_snapshot")) >= len(committed)
    assert len(events(report, "rolled_back")) >= 1  # (more only if a loaded machine delayed heartbeats)
    assert report["params_sha256"] == baseline
    # Every increment kept names a baseline that is kept too (prune never orphans one).
    root = tmp_path / "checkpoints"
    for manifest in root.glob("ckpt-*/manifest.json"):
        doc = json.loads(manifest.read_text())
        if doc["base"] is not None:
            assert (root / f"ckpt-{doc['base']:08d}" / "manifest.json").is_file()


def test_checknrun_quantized_to_4_bits_recovers_and_still_trains(tmp_path, baseline):
    ctx = ckpt_ctx("cnr4", "checknrun", faultTolerance__checknrun__quantizeBits=4)
    report = run_local(ctx, tmp_path, progress=False, kills=[(2, "step:100")])
    [restored] = events(report, "checkpoint_restored")
    assert restored["checkpoint"] > 0
    # The restore dequantized the embeddings: not the run without failure, yet a model that learned.
    assert report["params_sha256"] != baseline
    assert report["eval"]["auc"] > 0.6


@pytest.mark.parametrize("hot", ["mfu", "ssu"])
def test_cpr_saves_hot_rows_between_full_checkpoints_and_restores_them_after_a_kill(tmp_path, hot):
    ctx = make_ctx(
        f"cpr-{hot}",
        # Paced: at most 50 steps a second, so the kill at step 150 comes at least 3 s into training (after a
        # full checkpoint and hot-row saves) and 250 steps, at least 5 s, before its end on any machine.
        **{**DET, "training__steps": 400, "training__maxStepsPerSecond": 50},
        faultTolerance__strategy="cpr",
        faultTolerance__cpr__intervalSeconds=1.0,
        faultTolerance__cpr__hotRows=hot,
        faultTolerance__cpr__hotRowFraction=0.25,  # hot-row saves every 0.25 s, of at most a quarter of the rows
    )
    report = run_local(ctx, tmp_path, progress=False, kills=[(1, "step:150")])
    committed = events(report, "checkpoint_committed")
    hot_saves = [c for c in committed if c.get("hot")]
    assert hot_saves and all("pause_seconds" not in c for c in hot_saves), committed  # training never paused
    assert [c["final"] for c in committed].count(True) == 1
    [restored] = events(report, "checkpoint_restored")
    detected = events(report, "failure_detected")[0]
    assert restored["shards"] == [1]
    # The restore point is the newest save before the failure: the full checkpoint, then its hot-row saves.
    before = [c["checkpoint"] for c in committed if c["t"] <= detected["t"]]
    assert before and restored["checkpoint"] == before[-1], (restored, committed)
    assert report["eval"]["auc"] > 0.6 and report["samples"] == 400 * 64


def test_a_killed_coordinator_is_replaced_and_its_successor_rolls_back_to_the_stores_newest_checkpoint(
    tmp_path, baseline
):
    # The successor cannot know whether a checkpoint or a rollback was under way: it rolls back to the newest
    # checkpoint committed on disk, and the replay still ends where the run without failures does. Check-N-Run
    # at full precision: the restore reads a baseline + increment chain the dead coordinator committed, and
    # the successor's first checkpoint must be a baseline. (Strategy checkpoint takes the same path, simpler;
    # on Kubernetes, tests/k8s/test_checkpoint_e2e.py.)
    ctx = ckpt_ctx("coord-cnr", "checknrun", faultTolerance__checknrun__quantizeBits=32)
    report = run_local(ctx, tmp_path, progress=False, kills=[("coordinator", "step:100")])
    [taken] = events(report, "checkpoints_taken_over")
    assert taken["checkpoint"] >= 1 and taken["rollback"] == (1 << 20) + 1, taken
    rolled = [e for e in events(report, "rolled_back") if e["t"] >= taken["t"]]
    assert rolled and rolled[0]["steps"]["0"] % 40 == 0, rolled
    later = [e["checkpoint"] for e in events(report, "checkpoint_committed") if e["t"] >= taken["t"]]
    assert later and min(later) > 1 << 20, later  # above every id the dead coordinator could have used
    first = next(e for e in events(report, "checkpoint_committed") if e["t"] >= taken["t"])
    assert first["baseline"], first
    assert report["checkpointing"]["rollbacks"] >= 1
    assert report["params_sha256"] == baseline


def test_a_killed_coordinator_under_cpr_is_replaced_and_training_goes_on(tmp_path):
    report = run_local(
        ckpt_ctx("coord-cpr", "cpr"), tmp_path, progress=False, kills=[("coordinator", "step:100")]
    )
    [taken] = events(report, "checkpoints_taken_over")
    assert "rollback" not in taken and events(report, "rolled_back") == []
    assert report["samples"] == 200 * 64 and report["eval"]["auc"] > 0.6


def test_chaos_under_checknrun_rolls_back_after_every_kill_and_still_ends_bit_identical(tmp_path):
    # `ecrec local --chaos 2` with Check-N-Run at full precision: two random servers killed one at a time
    # (the next once the previous is rebuilt); each loss rolls every shard back to the last baseline +
    # increment, and the replays end where the run without failures does. 1500 steps: room for both kills and
    # their replacements' start-up (seconds each) before training ends — 600 steps finished before the second
    # kill on a quiet machine (the next kill waits for the previous shard to be up again).
    steps = 1500
    ctx = ckpt_ctx(
        "cnr-chaos", "checknrun", faultTolerance__checknrun__quantizeBits=32, training__steps=steps
    )
    report = run_local(ctx, tmp_path, progress=False, chaos=2, seed=4)
    killed = events(report, "server_killed")
    assert len(killed) == 2, killed
    assert len(events(report, "rolled_back")) == 2 and report["checkpointing"]["rollbacks"] == 2
    assert report["samples"] == steps * 64
    undisturbed = run_local(
        make_ctx("none600", **{**DET, "training__steps": steps}), tmp_path / "none", progress=False
    )
    assert report["params_sha256"] == undisturbed["params_sha256"]
