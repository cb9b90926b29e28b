"""`ecrec bench scaling` (ecrec.scalingbench): No FT and ECRec at several worker counts, in alternating rounds;
each row's ratio is against No FT at the same worker count, and its growth against its own first count."""

from __future__ import annotations

import json

import pytest

import ecrec.scalingbench as scaling


def test_each_worker_count_is_compared_with_its_own_no_ft_and_with_its_first_count(tmp_path, monkeypatch):
    seen = []

    def fake_run(ctx, out, cpus=None):
        spec = ctx.spec
        w, ft = spec.workers.replicas, spec.fault_tolerance
        seen.append((w, ft.strategy, ft.ecrec.k, spec.data.zipf_exponent, spec.training.steps))
        # No FT scales linearly; ECRec k=4 keeps 0.9 of it at 2 workers and 0.6 at 4
        rate = 1000.0 * w * (1.0 if ft.strategy == "none" else {2: 0.9, 4: 0.6}[w])
        return {
            "samples_per_s": rate,
            "throughput_series": [[t, rate] for t in range(2, 6)],
            "elapsed_s": 100.0 / rate,
            "eval": {"auc": 0.75},
            "spec": {"training": {"steps": 7}, "workers": {"replicas": w}},
            "rpcs_served": {"Pull": 10},
            **({"parity_check": {"mismatches": 0}} if ft.strategy == "ecrec" else {}),
        }

    monkeypatch.setattr(scaling, "_run", fake_run)
    rows = scaling.bench_scaling("examples/local-small.yaml", [2, 4], 7, [], tmp_path, zipf=1.3, rounds=2)
    # every (workers, configuration) once per round, the second round backwards; every run at zipf 1.3
    first = [(w, s, k) for w, s, k, _, _ in seen[:4]]
    assert first == [(2, "none", 4), (2, "ecrec", 4), (4, "none", 4), (4, "ecrec", 4)]
    assert [(w, s, k) for w, s, k, _, _ in seen[4:]] == first[::-1]
    assert {z for *_, z, _ in seen} == {1.3} and {n for *_, n in seen} == {7}
    by = {(r["workers"], r["case"]): r for r in rows}
    assert by[(2, "ECRec k=4")]["ratio"] == pytest.approx(0.9) and by[(4, "ECRec k=4")][
        "ratio"
    ] == pytest.approx(0.6)
    assert by[(4, "No FT")]["vs_first"] == pytest.approx(2.0)
    assert by[(4, "ECRec k=4")]["vs_first"] == pytest.approx(4 * 0.6 / (2 * 0.9))
    summary = json.loads((tmp_path / "summary.json").read_text())
    row = next(r for r in summary if r["configuration"] == "ECRec k=4" and r["workers"] == 4)
    ratio = next(v for k, v in row.items() if k.startswith("throughput vs No FT"))
    assert ratio == 0.6 and row["steady samples/s"] == 2400 and row["parity mismatches (most in a run)"] == 0


def test_bad_worker_counts_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="at least 1"):
        scaling.bench_scaling("examples/local-small.yaml", [0, 2], 5, [], tmp_path)
    assert [label for label, _ in scaling.scaling_cases([2, 4])] == ["No FT", "ECRec k=2", "ECRec k=4"]


def test_seed_per_round_trains_each_round_with_its_own_seed_and_keeps_every_auc(tmp_path, monkeypatch):
    seeds = []

    def fake_run(ctx, out, cpus=None):
        spec = ctx.spec
        seeds.append((spec.fault_tolerance.strategy, spec.training.seed))
        auc = 0.7 + 0.01 * spec.training.seed + (0.001 if spec.fault_tolerance.strategy == "ecrec" else 0.0)
        return {
            "samples_per_s": 100.0,
            "throughput_series": [[t, 100.0] for t in range(2, 6)],
            "elapsed_s": 1.0,
            "eval": {"auc": auc},
            "spec": {"training": {"steps": 7}, "workers": {"replicas": spec.workers.replicas}},
            "rpcs_served": {},
        }

    monkeypatch.setattr(scaling, "_run", fake_run)
    rows = scaling.bench_scaling(
        "examples/local-small.yaml", [2], 7, [], tmp_path, rounds=3, seed_per_round=True
    )
    assert sorted(seeds) == [("ecrec", 0), ("ecrec", 1), ("ecrec", 2), ("none", 0), ("none", 1), ("none", 2)]
    by = {r["case"]: r for r in rows}
    assert by["ECRec k=4"]["aucs"] == pytest.approx([0.701, 0.711, 0.721])
    assert by["No FT"]["auc"] == pytest.approx(0.71)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary[1]["AUC per round"] == "0.7010 / 0.7110 / 0.7210"
