"""The benchmarks' tables (ecrec.bench.emit_table): printed as markdown and written to summary.json."""

from __future__ import annotations

import json
import math

import pytest

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
    # protocol's (No FT: a pull, a push and a dense push per server; ECRec: a pull and a stage per server,
    # deliveries and acknowledgements riding on the next stages; with rowLocks a pull, a stage, a delta message
    # and a commit per server, decisions riding on the stages).
    from ecrec.handlerbench import bench_handlers

    rows = bench_handlers("examples/local-small.yaml", 3, ["training.batchSize=64"], tmp_path)
    by_case = {r["case"]: r for r in rows}
    assert list(by_case) == ["No FT", "ECRec k=2", "ECRec k=4", "ECRec k=4 rowLocks"]
    calls = {case: {m: v["calls_per_step"] for m, v in r["methods"].items()} for case, r in by_case.items()}
    assert calls["No FT"] == {"Pull": 5, "Push": 5, "PushDense": 5}
    for case in ("ECRec k=2", "ECRec k=4"):
        # The deltas ride on the next stages: no delivery of their own (only a stopping worker's last step
        # has one, and closing the clients is not measured).
        assert calls[case] == {"Pull": 5, "Stage": 5}
        # One worker's deltas of a row reach its parity server in version order: nothing is ever held.
        assert by_case[case]["delta_batches"]["held"] == 0 < by_case[case]["delta_batches"]["delivered"]
    two_pc = ("Pull", "Stage", "StageDeltas", "Commit")
    assert {m: calls["ECRec k=4 rowLocks"][m] for m in two_pc} == dict.fromkeys(two_pc, 5)
    assert "Push" not in calls["ECRec k=4 rowLocks"]
    assert all(r["handlers_ms"] > 0 and r["client_ms"] >= 0 for r in rows)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert [w["configuration"] for w in written] == list(by_case)


def test_bench_handlers_with_several_workers_in_shuffled_turns_holds_deltas_as_a_live_job_does(tmp_path):
    """Three clients, each step in a shuffled order: a parity server gets some rows' deltas before their
    predecessor's (another worker's earlier update, riding on that worker's later stage) and holds them, as
    on a live job; every worker's step still costs a pull and a stage per server; and every client's last
    deltas are delivered when they close together (a closing client's delivery may wait for another's)."""
    from ecrec.handlerbench import bench_handlers

    rows = bench_handlers("examples/local-small.yaml", 3, ["training.batchSize=64"], tmp_path, workers=3)
    by_case = {r["case"]: r for r in rows}
    for case in ("ECRec k=2", "ECRec k=4"):
        r = by_case[case]
        assert r["workers"] == 3
        assert {m: r["methods"][m]["calls_per_step"] for m in ("Pull", "Stage")} == {"Pull": 5, "Stage": 5}
        assert 0 < r["delta_batches"]["held"] < r["delta_batches"]["delivered"]
    assert by_case["No FT"]["delta_batches"] == {"delivered": 0, "held": 0}
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written[0]["configuration"] == "No FT" and written[0]["delta batches held"] == 0


def test_load_balance_is_the_most_loaded_server_over_the_mean():
    from ecrec.bench import load_balance

    load = [{"work": 100, "cpu_s": 2.0}, {"work": 300, "cpu_s": 2.0}, {"work": 200, "cpu_s": 2.0}]
    assert load_balance(load) == {"work": 1.5, "cpu": 1.0}
    dead = [{"work": 100, "cpu_s": None}, {"work": 0, "cpu_s": 1.0}]  # no CPU report; a server without work
    got = load_balance(dead)
    assert got["work"] == 2.0 and math.isnan(got["cpu"])
    assert all(math.isnan(v) for v in load_balance([]).values())


def test_bench_overhead_rounds_alternate_the_order_and_compare_each_round_with_its_own_no_ft(
    tmp_path, monkeypatch, capsys
):
    """A machine that slows down run after run: single runs would favour whichever ran first; the rounds
    alternate the order, and each round's ratio is against the No FT run of that round."""
    import ecrec.bench as bench

    order = []

    def speed(i: int) -> float:  # the i-th run's machine: 10% of its first speed slower per run
        return 1000.0 / (1 + 0.1 * i)

    def fake_run(ctx, out):
        ft = ctx.spec.fault_tolerance
        ec, streams = ft.ecrec, ctx.spec.workers.call_streams
        order.append(
            (ft.strategy, ec.k, ec.r, ec.two_phase_commit, ec.replicate_dense, streams, ctx.num_servers)
        )
        rate = speed(len(order) - 1) * (1.0 if ft.strategy == "none" else 0.5)
        return {
            "samples_per_s": rate,
            "throughput_series": [[t, rate] for t in range(2, 6)],
            "elapsed_s": 1000 / rate,
            "eval": {"auc": 0.7},
            "spec": {"training": {"steps": 10}, "workers": {"replicas": 2}},
            "rpcs_served": {"Pull": 100, "Stage": 60},
            "cpu": {"per_1000_samples": {"worker": 0.02, "server": 0.03, "coordinator": None}},
            "server_load": [{"work": 1.0, "cpu_s": 1.0}, {"work": 3.0, "cpu_s": 1.0}],
            **({"parity_check": {"mismatches": len(order) % 2}} if ft.strategy == "ecrec" else {}),
        }

    monkeypatch.setattr(bench, "_run", fake_run)
    rows = bench.bench_overhead("examples/local-small.yaml", 10, [], tmp_path, rounds=3)
    n = len(bench.OVERHEAD_CASES)
    first = order[:n]
    assert len(set(first)) == n and order[n : 2 * n] == first[::-1] and order[2 * n :] == first
    assert [r["case"] for r in rows] == [label for label, _ in bench.OVERHEAD_CASES]
    for c, row in enumerate(rows):
        # round 1 runs case c c-th, round 2 (backward) (n-1-c)-th, round 3 c-th again; No FT is case 0
        at = [c, n + (n - 1 - c), 2 * n + c]
        none = [0, n + (n - 1), 2 * n]
        expect = [(1.0 if c == 0 else 0.5) * speed(i) / speed(j) for i, j in zip(at, none, strict=True)]
        assert row["ratios"] == expect and row["ratio"] == sorted(expect)[1]
    k4 = rows[2]
    assert k4["rpcs_per_step"] == 8.0 and k4["load"]["work"] == 1.5 and k4["cpu"]["server"] == 0.03
    assert math.isnan(k4["cpu"]["coordinator"])
    # the most mismatches any of its runs had (k=4 ran 3rd, 14th, 19th: 1, 0, 1); none without parity
    assert k4["parity_mismatches"] == 1 and rows[0]["parity_mismatches"] is None
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary[2]["ratio per round"] == " / ".join(f"{x:.2f}" for x in k4["ratios"])
    assert summary[2]["throughput vs No FT (steady)"] == round(k4["ratio"], 3)
    assert "rounds=3 (medians)" in capsys.readouterr().out


def test_samples_rate_counts_every_sample_in_the_window():
    from ecrec.bench import samples_at, samples_rate

    report = {"samples_series": [[0.0, 0], [1.0, 1000], [2.0, 1000], [4.0, 5000]]}
    assert samples_at(report, 0.5) == 500 and samples_at(report, 3.0) == 3000
    assert samples_rate(report, 0.5, 3.0) == 2500 / 2.5  # a stall in the middle counts
    assert math.isnan(samples_at(report, 4.5)) and math.isnan(samples_rate(report, 2.0, 2.0))


def test_bench_recovery_rounds_alternate_the_order_and_take_medians(tmp_path, monkeypatch, capsys):
    import ecrec.bench as bench

    order = []

    def fake_run(ctx, out, kills):
        assert kills == [(2, 8.0)]
        scale, group = ctx.spec.model.scale, ctx.spec.fault_tolerance.ecrec.lock_group_rows
        order.append((scale, group))
        dip = {1: 0.5, 2: 0.7, 3: 0.9}[len([o for o in order if o == (scale, group)])]  # by round
        # 1000 samples/s, then `dip` of it from the kill (8 s) to full recovery (10 s)
        series = [[0.0, 0], [8.0, 8000], [10.0, 8000 + 2000 * dip], [12.0, 10000 + 2000 * dip]]
        return {
            "recoveries": [
                {
                    "killed_at": 8.0,
                    "detected_at": 8.2,
                    "continued_at": 8.3,
                    "completed_at": 10.0,
                    "rows_recovered": 100 * scale,
                }
            ],
            "events": [{"kind": "recovery_started", "t": 9.0}],
            "samples_series": series,
            "parity_check": {"mismatches": 0},
            "cpu": {"per_1000_samples": {"worker": 0.02, "server": 0.03, "coordinator": 0.001}},
        }

    monkeypatch.setattr(bench, "_run", fake_run)
    rows = bench.bench_recovery("examples/local-small.yaml", [1, 4], [4096], 8.0, 10, [], tmp_path, rounds=3)
    assert order == [(1, 4096), (4, 4096), (4, 4096), (1, 4096), (1, 4096), (4, 4096)]
    for row in rows:
        assert row["ratios"] == pytest.approx([0.5, 0.7, 0.9]) and row["during_ratio"] == pytest.approx(0.7)
        assert row["continue_s"] == pytest.approx(0.3) and row["full_s"] == pytest.approx(2.0)
        assert row["rebuild_s"] == pytest.approx(1.0) and row["normal"] == pytest.approx(1000.0)
        assert row["lost_s"] == pytest.approx(2.0 * (1 - 0.7))  # 600 of 2000 samples not trained
    assert rows[1]["rows"] == 4 * rows[0]["rows"] and rows[1]["rows_recovered"] == 400
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary[0]["ratio per round"] == "0.50 / 0.70 / 0.90"
    assert summary[0]["training lost s (at normal throughput)"] == pytest.approx(0.6)
    assert "rounds=3 (medians)" in capsys.readouterr().out


def test_bench_recovery_of_two_servers_lost_at_once_runs_r2_and_spans_both_rebuilds(
    tmp_path, monkeypatch, capsys
):
    import ecrec.bench as bench

    def fake_run(ctx, out, kills):
        assert kills == [(2, 8.0), (3, 8.0)]
        ec = ctx.spec.fault_tolerance.ecrec
        assert (ec.r, ctx.spec.servers.replicas) == (2, 6)
        # 1000 samples/s, half of it from the first kill (8 s) until the later of the two rebuilds ends (11 s)
        series = [[0.0, 0], [8.0, 8000], [11.0, 9500], [12.0, 10500]]
        rec = {"detected_at": 8.2, "rows_recovered": 100}
        return {
            "recoveries": [
                {**rec, "killed_at": 8.0, "continued_at": 8.3, "completed_at": 10.0},
                {**rec, "killed_at": 8.01, "continued_at": 8.4, "completed_at": 11.0},
            ],
            "events": [{"kind": "recovery_started", "t": 9.0}],
            "samples_series": series,
            "parity_check": {"mismatches": 0},
            "cpu": {"per_1000_samples": {"worker": 0.02, "server": 0.03, "coordinator": 0.001}},
        }

    monkeypatch.setattr(bench, "_run", fake_run)
    (row,) = bench.bench_recovery("examples/local-small.yaml", [1], [4096], 8.0, 10, [], tmp_path, lost=2)
    assert row["full_s"] == pytest.approx(3.0) and row["continue_s"] == pytest.approx(0.4)
    assert row["during_ratio"] == pytest.approx(0.5) and row["rows_recovered"] == 200
    assert "servers 2, 3 (r = 2) SIGKILLed at 8.0s" in capsys.readouterr().out


def test_recovery_timeline_bins_the_throughput_around_the_kill_and_lists_the_events():
    from ecrec.bench import format_timeline, recovery_timeline

    # 1000 samples/s; nothing from the kill (8.0) to 8.2; half rate to full recovery (8.6); then normal
    series = [[0.0, 0], [8.0, 8000], [8.2, 8000], [8.6, 8200], [9.5, 9100]]
    report = {
        "recoveries": [{"killed_at": 8.0, "completed_at": 8.6}],
        "samples_series": series,
        "events": [
            {"kind": "failure_detected", "t": 8.02},
            {"kind": "recovery_started", "t": 8.25},
            {"kind": "recovery_completed", "t": 8.6},
            {"kind": "failure_detected", "t": 8.9},  # outside the window
        ],
    }
    tl = recovery_timeline(report, before=0.2, after=0.2)
    assert [t for t, _ in tl["bins"]] == pytest.approx([-0.2, -0.1, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    assert [r for _, r in tl["bins"]] == pytest.approx([1, 1, 0, 0, 0.5, 0.5, 0.5, 0.5, 1, 1])
    assert tl["events"] == {"failure_detected": 0.02, "recovery_started": 0.25, "recovery_completed": 0.6}
    text = format_timeline(tl)
    assert (
        "by 0.1 s after the kill: -0.2:1.00" in text
        and "+0.2:0.50" in text
        and "recovery_started +0.25" in text
    )
