"""`ecrec bench paper`: the quick plan end to end (structure, not speed), and the arithmetic of its numbers."""

from __future__ import annotations

import json
import math

import pytest
from conftest import processes_mentioning

from ecrec.cli import main
from ecrec.paperbench import FULL, QUICK, PaperBench, bench_paper, ckpt_cases, load_of, time_to_samples

SECTIONS = (
    "## Scaling rule",
    "(paper Fig. 5)",
    "(paper Figs. 6-11)",
    "(paper Fig. 12)",
    "Lock-group granularity",
    "(paper Fig. 13, §5.4)",
    "Server load balance",
    "## Effect of entry width",
    "Ablations: 2PC and dense replication",
    "## Noise and CPU contention",
    "## Departures from the papers",
)


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"{name} in results.json")

    return json.loads(text, parse_constant=refuse)


def test_quick_bench_writes_results_figures_and_a_report_with_every_section(tmp_path):
    out = tmp_path / "paper"
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "paper", "--quick", "--out", str(out), "--work", str(tmp_path / "work")])
    assert exit_.value.code == 0

    results = _strict_json((out / "results.json").read_text())
    assert {
        "plan",
        "machine",
        "intervals",
        "overhead",
        "timelines",
        "recovery",
        "load_balance",
        "ablations",
        "entry_width",
        "baselines",
        "noise",
        "paper",
        "runs",
    } <= results.keys()
    assert {"ecrec", "ckpt", "lock_groups"} <= results["recovery"].keys()
    assert {"overhead", "accuracy", "checknrun_size"} <= results["baselines"].keys()
    assert {r["config"] for r in results["overhead"]} >= {"No FT", "ECRec k=2", "Ckpt short"}
    configs = {r["config"] for r in results["baselines"]["accuracy"]}
    assert configs == {"No FT, no failure", "ECRec k=2", "Ckpt", "Check-N-Run", "CPR"}
    # (when a kill lands depends on the machine's load: the numbers may be missing, the rows may not)
    for r in results["recovery"]["ecrec"]:
        assert r["continue_s"] is None or r["full_s"] >= r["continue_s"]
        assert r["parity_mismatches"] in (0, None)
    (ckpt,) = results["recovery"]["ckpt"]
    assert {"restore_s", "best_s", "average_s", "worst_s"} <= ckpt.keys()
    assert all(len(r["updates_per_server"]) == 3 for r in results["load_balance"])
    for name in results["timelines"]["no_failure"] + results["timelines"]["failure"]:
        assert results["runs"][name]["progress_series"], name
    assert all(0 <= r["other_cpu_share"] <= 1 for r in results["runs"].values())
    # entry width: the same total size, half the rows at twice the dim; 4S's pair is Fig. 5's ×1 jobs
    narrow, wide = results["entry_width"]["configs"]
    assert (narrow["config"], wide["config"]) == ("4S", "2S-2D")
    assert (narrow["base_run"], narrow["run"]) == ("noft_x1", "ecrec_k2_x1")
    assert wide["dim"] == 2 * narrow["dim"] and 2 * wide["rows"] == narrow["rows"]
    assert wide["floats"] == narrow["floats"]
    fig5 = next(r for r in results["overhead"] if r["config"] == "ECRec k=2" and r["scale"] == 1)
    assert narrow["overhead"] == pytest.approx(fig5["overhead"])
    for r in (narrow, wide):
        base, run = results["runs"][r["base_run"]], results["runs"][r["run"]]
        assert (base["strategy"], run["strategy"]) == ("none", "ecrec")
        assert base["rows"] == run["rows"] == r["rows"]
        assert math.isfinite(r["overhead"]) and r["overhead"] > -1
        assert r["overhead"] == pytest.approx(run["train_s"] / base["train_s"] - 1)
        assert r["ecrec_samples_per_s"] > 0 and r["noft_samples_per_s"] > 0

    report = (out / "report.md").read_text()
    for section in SECTIONS:
        assert section in report, section
    figures = sorted(p.name for p in out.glob("*.png"))
    assert figures == sorted(
        [
            "fig5_overhead.png",
            "fig6_9_no_failure.png",
            "fig10_11_failure.png",
            "fig12_recovery.png",
            "fig13_baselines.png",
            "load_balance.png",
            "entry_width.png",
        ]
    )
    for name in figures:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name})" in report, name
    section = report.split("## Effect of entry width")[1].split("\n## ")[0]
    assert "| 4S | " in section and "| 2S-2D | " in section and "Paper: " in section
    assert processes_mentioning(str(tmp_path)) == []

    # re-rendering the results.json of a bench without the experiment: the report says so
    del results["entry_width"]
    (out / "results.json").write_text(json.dumps(results))
    (out / "entry_width.png").unlink()
    bench_paper(out, render_only=True, log=lambda *a: None)
    report = (out / "report.md").read_text()
    section = report.split("## Effect of entry width")[1].split("\n## ")[0]
    assert "Not run" in section and "entry_width.png" not in report
    assert not (out / "entry_width.png").exists()


@pytest.mark.parametrize("plan", [FULL, QUICK], ids=lambda p: p.name)
def test_entry_width_models_have_one_total_size_half_the_rows_at_twice_the_dim(plan, tmp_path):
    bench = PaperBench(plan, tmp_path, log=lambda *a: None)
    (narrow_name, narrow_scale, narrow_sets, _), (wide_name, wide_scale, wide_sets, _) = (
        bench.entry_width_models()
    )
    assert (narrow_name, wide_name) == ("4S", "2S-2D")
    narrow = bench.model_of([f"model.scale={narrow_scale}", *narrow_sets])
    wide = bench.model_of([f"model.scale={wide_scale}", *wide_sets])
    assert narrow_scale == plan.entry_width_scale and narrow.dim == bench.dim
    assert (wide.num_rows * 2, wide.dim) == (narrow.num_rows, narrow.dim * 2)
    assert wide.bottom_mlp[-1] == wide.dim  # the NN's input widens with the entries


def test_training_time_is_when_the_total_was_first_reported():
    progress = [[0.5, 100], [1.0, 300], [1.5, 400], [2.0, 250], [2.5, 400]]  # a rollback at 2.0
    assert time_to_samples(progress, 400, fallback=9.0) == 1.5
    assert time_to_samples(progress, 500, fallback=9.0) == 9.0


def test_checkpoint_cases_scale_the_measured_redo_to_no_half_and_one_interval():
    # 2 workers redid 20 steps each (40 rank-steps) in 4 s: 0.2 s per step; interval 100 steps
    measured = {"restore_s": 3.0, "redo_s": 4.0, "steps_redone": 40, "workers": 2}
    assert ckpt_cases(measured, 100) == pytest.approx({"best_s": 3.0, "average_s": 13.0, "worst_s": 23.0})
    # the kill landed on a checkpoint: nothing redone, the step rate before the kill stands in
    landed = {"restore_s": 3.0, "redo_s": 0.0, "steps_redone": 0, "workers": 2, "step_s_before": 0.1}
    assert ckpt_cases(landed, 100) == pytest.approx({"best_s": 3.0, "average_s": 8.0, "worst_s": 13.0})


def test_load_counts_pushes_or_staged_rows_plus_parity_deltas_per_server():
    from types import SimpleNamespace

    run = SimpleNamespace(
        name="r",
        server_rows=[{"shard": 0, "stage": 10, "delta": 10}, {"shard": 1, "stage": 30, "delta": 10}],
    )
    load = load_of("ECRec k=2", run)
    assert load["updates_per_server"] == [20, 40]
    assert load["max_over_mean"] == pytest.approx(40 / 30)
    assert load["max_over_min"] == 2.0
