"""The benchmarks' tables (ecrec.bench.emit_table): printed as markdown and written to summary.json."""

from __future__ import annotations

import json
import math

from ecrec.bench import Column, _cpu, _round, cpu_columns, emit_table


def test_the_printed_columns_are_the_keys_of_summary_json_and_nan_is_null(tmp_path, capsys):
    rows = [
        {"case": "No FT", "steady": 1000.4, "cpu": {"worker": 1.5, "server": 0.5, "coordinator": 0.01}},
        {"case": "ECRec k=4", "steady": float("nan"), "cpu": _cpu({})},  # too short to have a steady window
    ]
    columns = [
        Column("configuration", lambda r: r["case"]),
        Column("steady samples/s", lambda r: _round(r["steady"]), "{:,}"),
        *cpu_columns(),
    ]
    summary = emit_table("# title", columns, rows, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written == summary
    assert written[0] == {
        "configuration": "No FT",
        "steady samples/s": 1000,
        "worker CPU s / 1k samples": 1.5,
        "server CPU s / 1k samples": 0.5,
        "coordinator CPU s / 1k samples": 0.01,
    }
    assert written[1]["steady samples/s"] is None and written[1]["worker CPU s / 1k samples"] is None
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# title" and lines[1].startswith("# machine: ")
    assert lines[2].split(" | ")[1:3] == ["steady samples/s", "worker CPU s / 1k samples"]
    assert lines[4] == "| No FT | 1,000 | 1.500 | 0.500 | 0.010 |"
    assert lines[5] == "| ECRec k=4 | — | — | — | — |"


def test_cpu_per_role_comes_from_the_report():
    report = {"cpu": {"per_1000_samples": {"worker": 2.0, "server": 1.0, "coordinator": None}}}
    cpu = _cpu(report)
    assert cpu["worker"] == 2.0 and cpu["server"] == 1.0 and math.isnan(cpu["coordinator"])


def test_bench_handlers_drives_real_steps_through_every_handler(tmp_path):
    # Structure, not speed: each case runs the real client and servicers, so the calls per step are the
    # protocol's (No FT: a pull, a push and a dense push per server; ECRec: a pull, a stage, a delta message
    # and a commit per server, decisions riding on the stages).
    from ecrec.handlerbench import bench_handlers

    rows = bench_handlers("examples/local-small.yaml", 3, ["training.batchSize=64"], tmp_path)
    by_case = {r["case"]: r for r in rows}
    assert list(by_case) == ["No FT", "ECRec k=2", "ECRec k=4"]
    calls = {case: {m: v["calls_per_step"] for m, v in r["methods"].items()} for case, r in by_case.items()}
    assert calls["No FT"] == {"Pull": 5, "Push": 5, "PushDense": 5}
    for case in ("ECRec k=2", "ECRec k=4"):
        assert {m: calls[case][m] for m in ("Pull", "Stage", "StageDeltas", "Commit")} == dict.fromkeys(
            ("Pull", "Stage", "StageDeltas", "Commit"), 5
        )
        assert "Push" not in calls[case]
    assert all(r["handlers_ms"] > 0 and r["client_ms"] >= 0 for r in rows)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert [w["configuration"] for w in written] == ["No FT", "ECRec k=2", "ECRec k=4"]


def test_load_balance_is_the_most_loaded_server_over_the_mean():
    from ecrec.bench import load_balance

    load = [{"work": 100, "cpu_s": 2.0}, {"work": 300, "cpu_s": 2.0}, {"work": 200, "cpu_s": 2.0}]
    assert load_balance(load) == {"work": 1.5, "cpu": 1.0}
    dead = [{"work": 100, "cpu_s": None}, {"work": 0, "cpu_s": 1.0}]  # no CPU report; a server without work
    got = load_balance(dead)
    assert got["work"] == 2.0 and math.isnan(got["cpu"])
    assert all(math.isnan(v) for v in load_balance([]).values())
