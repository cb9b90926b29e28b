"""`ecrec bench scale` (ecrec.scalebench): one row per model scale from its No FT, ECRec and Ckpt short runs;
the numbers from synthetic reports, the launcher hook that reads the servers' memory, and the command line."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

import ecrec.scalebench as sb
from ecrec.bench import load_job_with
from ecrec.cli import main
from ecrec.jobctx import JobContext
from ecrec.local import Child

JOB = "examples/local-small.yaml"
MIB = 2**20


def ctx_of(*overrides: str) -> JobContext:
    return JobContext(load_job_with(JOB, ["faultTolerance.strategy=ecrec", *overrides]))


EMPTY = ctx_of("model.tableSizes=[20,20,20,20,20,20,20,20]")


def reports(scale: int = 1) -> tuple[dict, dict, dict]:
    """(No FT, ECRec, Ckpt) reports of one scale: 1000 samples/s No FT, 800 for ECRec before its kill at 4 s,
    400 while its replacement rebuilds (5-7 s); Ckpt restores 0.3 s after its kill and redoes 20 steps."""
    spec = {"training": {"steps": 300, "batchSize": 512}, "workers": {"replicas": 2}}
    noft = {"throughput_series": [[t, 1000.0] for t in range(2, 10)], "spec": spec, "elapsed_s": 10.0}
    ecrec = {
        "recoveries": [
            {
                "killed_at": 4.0,
                "detected_at": 4.1,
                "continued_at": 4.25,
                "completed_at": 7.0,
                "rows_recovered": 5000,
            }
        ],
        "events": [{"kind": "recovery_started", "t": 5.0}],
        # 800/s to the kill, nothing to 5 s, 400/s while rebuilding (5-7 s), 800/s after
        "samples_series": [[0.0, 0], [4.0, 3200], [5.0, 3200], [7.0, 4000], [9.0, 5600]],
        "throughput_series": [[2.0, 790.0], [3.0, 800.0], [3.5, 810.0], [5.0, 0.0]],
        "parity_check": {"mismatches": 0},
        "final_checks_s": 1.5,
        "cpu": {"per_1000_samples": {}},
        "watch": {"servers_ready_s": 2.5, "progress": [], "rss": {}},
    }
    ckpt = {
        "spec": spec,
        "recoveries": [{"killed_at": 4.0, "completed_at": 4.2}],
        "events": [{"kind": "rolled_back", "t": 4.3}],
        "checkpointing": {"stepsRedone": 20},  # over both workers: 10 steps each, redone in 1.2 s
        "throughput_series": [[t, 900.0] for t in range(2, 10)],
        "watch": {"progress": [[3.9, 9000], [4.3, 8000], [5.0, 8500], [5.5, 9000], [6.0, 9500]]},
    }
    return noft, ecrec, ckpt


def test_a_scale_s_numbers_come_from_its_three_reports():
    ctx = ctx_of()
    assert ctx.record_width == 32  # adagrad: the embedding and its accumulator, 16 floats each
    noft, ecrec, ckpt = reports()
    run = sb.scale_run(ctx, noft, ecrec, ckpt, 30, {"ctx": EMPTY, "rss": float("nan")})
    assert run["noft"] == 1000.0 and run["ecrec"] == 800.0  # steady before the kill only
    assert run["continue_s"] == pytest.approx(0.25) and run["rebuild_s"] == pytest.approx(2.0)
    assert run["rows_per_s"] == pytest.approx(2500.0) and run["bytes_per_s"] == pytest.approx(2500 * 128)
    assert run["read_bytes_per_s"] == pytest.approx(2500 * 4 * 128)  # k − 1 members and a parity record
    assert run["rebuild_ratio"] == pytest.approx(0.5)
    # kill -> recovered: 800 samples in 3 s against 2400 at 800/s, so 2 s of training lost
    assert run["lost_s"] == pytest.approx(2.0)
    # Ckpt short: restore 0.3 s, then 0.12 s per step redone: half of a 30-step interval is 1.8 s more
    assert run["restore_s"] == pytest.approx(0.3) and run["ckpt_average_s"] == pytest.approx(2.1)
    assert run["interval_steps"] == 30 and run["final_checks_s"] == 1.5 and run["servers_ready_s"] == 2.5
    assert run["parity_mismatches"] == 0
    assert math.isnan(run["rss_mib"]) and math.isnan(run["bytes_per_record"])  # no memory read


def test_memory_is_what_a_server_holds_beyond_an_empty_one_per_record_and_over_its_raw_bytes():
    ctx = ctx_of()
    # ×1: 21,440 rows and 5,360 parity records (one per 4 rows) per server; empty: 32 rows and 8
    assert sb.held(ctx, 0) == (26_800, 21_440 * (128 + 8) + 5_360 * (128 + 4 * 8))
    assert sb.held(EMPTY, 0) == (40, 32 * (128 + 8) + 8 * (128 + 4 * 8))
    records, raw = 26_800 - 40, (21_440 - 32) * 136 + (5_360 - 8) * 160
    empty = 200 * MIB
    rss = {0: empty + 2 * raw, 1: empty + 2 * raw + MIB, 3: empty + 2 * raw - MIB}  # server 2: not read
    mem = sb.memory(ctx, rss, EMPTY, empty)
    assert mem["rss_mib"] == pytest.approx(2 * raw / MIB)
    assert mem["bytes_per_record"] == pytest.approx(2 * raw / records)
    assert mem["rss_over_raw"] == pytest.approx(2.0)
    assert math.isnan(sb.memory(ctx, {}, EMPTY, empty)["rss_mib"])


def test_rounds_give_medians_and_the_most_parity_mismatches():
    ctx = ctx_of("model.scale=8")
    runs = [
        {"noft": 1000.0, "ecrec": 800.0, "rebuild_s": 1.0, "restore_s": None, "parity_mismatches": 0},
        {"noft": 2000.0, "ecrec": 1000.0, "rebuild_s": 3.0, "restore_s": 0.4, "parity_mismatches": 2},
        {"noft": 1500.0, "ecrec": 1050.0, "rebuild_s": 2.0, "restore_s": 0.2, "parity_mismatches": 0},
    ]
    row = sb.scale_row(8, ctx, runs)
    assert row["rows"] == 8 * 107_200 and row["rows_per_shard"] == 8 * 107_200 / 5
    assert row["noft"] == 1500.0 and row["rebuild_s"] == 2.0 and row["parity_mismatches"] == 2
    assert row["restore_s"] == pytest.approx(0.3)  # of the rounds whose kill landed
    assert row["ecrec_vs_noft"] == pytest.approx(0.7)  # per round: 0.8, 0.5, 0.7


def test_the_short_interval_is_its_seconds_at_no_ft_s_step_rate_and_the_pause_skips_the_final_checkpoint():
    noft = {"spec": {"training": {"steps": 300}}, "elapsed_s": 10.0}  # 30 steps/s per worker
    assert sb.interval_steps(0.5, noft) == 15 and sb.interval_steps(0.01, noft) == 2
    events = [{"kind": "checkpoint_committed", "final": False, "pause_seconds": p} for p in (0.05, 0.07, 0.3)]
    events += [{"kind": "checkpoint_committed", "final": True, "pause_seconds": 9.0}, {"kind": "rolled_back"}]
    assert sb.checkpoint_pause({"events": events}) == 0.07


class FakeProc:
    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        return None


def server(index: int, pid: int, incarnation: int = 1, spare: int | None = None) -> Child:
    return Child(
        f"server-{index}",
        [],
        Path("/dev/null"),
        FakeProc(pid),
        role="server",
        index=index,
        incarnation=incarnation,
        spare=spare,
    )


@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/status").exists(), reason="reads /proc")
def test_the_hook_reads_the_first_servers_memory_until_the_kill_step_and_when_they_registered():
    watch = sb.JobWatch(until_step=100)
    me = os.getpid()
    cluster = type("Cluster", (), {})()
    # a replacement (incarnation 2) and an adopted spare are not the servers the job started with
    cluster.history = [server(0, me), server(2, me, incarnation=2), server(3, me, spare=0)]
    events = [
        {"kind": "registered", "wall": watch.launched + 1.0},
        {"kind": "registered", "wall": watch.launched + 2.0},
        {"kind": "training_started", "wall": watch.launched + 3.0},
    ]
    watch.on_tick(cluster, {"startedAt": None, "events": events, "step": 0, "samples": 0})  # not started
    assert watch.ready_at is None and not watch.rss and not watch.progress
    watch.on_tick(cluster, {"startedAt": watch.launched + 3.0, "events": events, "step": 5, "samples": 10})
    summary = watch.summary()
    assert summary["servers_ready_s"] == pytest.approx(2.0)
    assert list(summary["rss"]) == [0] and summary["rss"][0] > MIB
    assert summary["rss"][0] == pytest.approx(sb.vm_rss(me), rel=0.5)
    watch.rss[0] = 1  # read again, it would be this process's RSS
    watch.on_tick(cluster, {"startedAt": watch.launched + 3.0, "events": events, "step": 100, "samples": 20})
    assert watch.rss == {0: 1} and len(watch.progress) == 2  # from the kill step on, memory is not read
    assert sb.vm_rss(2**31) is None  # no such process


def test_bench_scale_runs_each_scale_s_jobs_with_the_kill_at_a_step_and_writes_one_row_each(
    tmp_path, monkeypatch, capsys
):
    seen = []

    def fake_run(ctx, out, kills, on_tick):
        ft, model = ctx.spec.fault_tolerance, ctx.spec.model
        seen.append((out.relative_to(tmp_path).as_posix(), ft.strategy, model.scale, ctx.spec.training.steps))
        assert kills == ([] if out.name in ("noft", "empty", "calibration") else [(2, "step:100")])
        noft, ecrec, ckpt = reports()
        if ft.strategy == "none":
            return {**noft, "elapsed_s": 10.0 / model.scale}
        if ft.strategy == "checkpoint":
            assert ft.checkpoint.interval_steps == (37 if out.name == "calibration" else 15 * model.scale)
            pauses = [{"kind": "checkpoint_committed", "final": False, "pause_seconds": 0.045}]
            return {**ckpt, "events": [*ckpt["events"], *pauses]}
        # ECRec: the hook sees its first three servers; memory is read from this process
        cluster = type("Cluster", (), {"history": [server(i, os.getpid()) for i in range(3)]})()
        on_tick(cluster, {"startedAt": time.time(), "events": [], "step": 1, "samples": 1})
        return ecrec

    monkeypatch.setattr(sb, "_run", fake_run)
    monkeypatch.setattr(sb, "grpc_stream_rate", lambda: 4e6)
    rows = sb.bench_scale(JOB, [1, 2], 300, 100, [], tmp_path)
    assert seen == [
        ("empty", "ecrec", 1, 100),
        ("calibration", "checkpoint", 1, 300),
        *[(f"scale{s}/{name}", strategy, s, 300) for s in (1, 2) for name, strategy in JOBS],
    ]
    # pause 0.045 s is 0.09 of a 0.5 s interval: 15 steps at ×1's 30 steps/s, 30 at ×2's 60
    assert [r["interval_steps"] for r in rows] == [15, 30]
    # 2,500 rows/s, each reading k = 4 records of 128 bytes: 1.28 MB/s, against a stream of 4 MB/s
    assert [r["read_over_stream"] for r in rows] == [pytest.approx(0.32)] * 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["model scale"] for r in summary] == [1, 2] and summary[1]["model rows"] == 2 * 107_200
    assert summary[0]["RSS / raw bytes held"] is not None  # both jobs' servers read: this process's RSS
    assert summary[0]["parity mismatches (most in a run)"] == 0
    assert json.loads((tmp_path / "scale2" / "ecrec" / "report.json").read_text())["watch"]["rss"]
    assert "server 2 SIGKILLed at step 100; Ckpt short interval 0.50s" in capsys.readouterr().out


JOBS = [("noft", "none"), ("ecrec", "ecrec"), ("ckpt", "checkpoint")]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scales", "1,x"], "--scales '1,x': comma-separated positive integers"),
        (["--scales", "0,8"], "--scales '0,8': comma-separated positive integers"),
        (["--scales", ""], "comma-separated positive integers"),
        (["--steps", "300", "--kill-step", "300"], "--kill-step 300: a step in [1, --steps 300)"),
        (["--rounds", "0"], "--rounds must be at least 1"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(argv, message, monkeypatch):
    monkeypatch.setattr(sb, "bench_scale", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit) as e:
        main(["bench", "scale", *argv])
    assert message in str(e.value.code)


def test_the_command_line_passes_the_scales_the_job_and_a_third_of_the_steps_as_the_kill_step(monkeypatch):
    calls = []
    monkeypatch.setattr(sb, "bench_scale", lambda *a, **k: calls.append((a, k)))
    for argv in (["--scales", "1, 8,64"], ["--job", JOB, "--scales", "1,8,64"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", "scale", *argv, "--steps", "90", "--out", "/tmp/x"])
        assert e.value.code == 0
    assert calls[0] == calls[1] == ((JOB, [1, 8, 64], 90, 30, [], Path("/tmp/x")), {"rounds": 1})


def test_the_transport_probe_moves_bytes_over_a_real_grpc_stream():
    from ecrec.transportprobe import grpc_stream_rate

    assert grpc_stream_rate(seconds=0.2, size=1 << 20) > 0
