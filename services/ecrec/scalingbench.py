"""`ecrec bench scaling`: does ECRec keep up with No FT as workers are added?

For each worker count, No FT and ECRec (k=4, or each `--ks`) train the same job; every configuration of every
worker count runs once per round, rounds in alternating order (`bench.alternating`), so that a drift of the
machine's speed does not favour one configuration. Each row is one (configuration, workers): its steady
samples/s (the median over rounds), its throughput against No FT at the same worker count (the median of
the per-round ratios, each against No FT of the same round), and its own throughput against its own at the
first worker count — the two numbers issue #29 asks of it. AUC and the parity check of every run come along:
a speed-up that cost accuracy or broke parity is no speed-up. With `seed_per_round`, round r trains with
training.seed = r, so the AUCs of a row are those of different seeds (issue #29: accuracy within noise).
"""

from __future__ import annotations

from pathlib import Path

from ecrec.bench import (
    Column,
    _median,
    _round,
    _run,
    alternating,
    emit_table,
    load_job_with,
    overhead_row,
    run_summary,
)
from ecrec.jobctx import JobContext


def scaling_cases(ks: list[int]) -> list[tuple[str, list[str]]]:
    """(label, --set overrides) of each configuration: No FT first (the others' reference), then ECRec k."""
    cases = [("No FT", ["faultTolerance.strategy=none"])]
    for k in ks:
        cases.append((f"ECRec k={k}", ["faultTolerance.strategy=ecrec", f"faultTolerance.ecrec.k={k}"]))
    return cases


def bench_scaling(
    job: str,
    workers: list[int],
    steps: int,
    sets: list[str],
    out_dir: Path,
    ks: list[int] | None = None,
    zipf: float | None = None,
    rounds: int = 1,
    cpus: dict[str, str] | None = None,
    seed_per_round: bool = False,
) -> list[dict]:
    if not workers or min(workers) < 1:
        raise ValueError("--workers: one or more worker counts, each at least 1")
    if rounds < 1:
        raise ValueError("--rounds must be at least 1")
    cases = scaling_cases(ks or [4])
    extra = [*sets, f"training.steps={steps}", *([f"data.zipfExponent={zipf}"] if zipf is not None else [])]
    configs = [(w, label, case) for w in workers for label, case in cases]
    runs: dict[tuple[int, str], list[dict]] = {(w, label): [] for w, label, _ in configs}
    for r, (w, label, case) in alternating(configs, rounds):
        seed = [f"training.seed={r}"] if seed_per_round else []
        ctx = JobContext(load_job_with(job, [*extra, f"workers.replicas={w}", *case, *seed]))
        name = f"w{w}_" + label.replace(" ", "_").replace("=", "")
        report = _run(ctx, out_dir / name if rounds == 1 else out_dir / f"round{r + 1}" / name, cpus=cpus)
        runs[(w, label)].append(run_summary(report, {"work": float("nan"), "cpu": float("nan")}))
        print(f"  {w} workers, {label}: steady {runs[(w, label)][-1]['steady']:,.0f} samples/s", flush=True)
    rows = []
    for w in workers:
        base = runs[(w, cases[0][0])]
        for label, _ in cases:
            row = overhead_row(label, runs[(w, label)], base)
            first = runs[(workers[0], label)]
            own = [
                r["steady"] / f["steady"] if f["steady"] else float("nan")
                for r, f in zip(runs[(w, label)], first, strict=True)
            ]
            aucs = [r["auc"] for r in runs[(w, label)]]
            rows.append({**row, "workers": w, "vs_first": _median(own), "aucs": aucs})
    columns = [
        Column("configuration", lambda r: r["case"]),
        Column("workers", lambda r: r["workers"]),
        Column("steady samples/s", lambda r: _round(r["steady"]), "{:,}"),
        Column("mean samples/s", lambda r: _round(r["mean"]), "{:,}"),
        Column("throughput vs No FT (steady, same workers)", lambda r: _round(r["ratio"], 3), "{:.2f}"),
        Column("ratio per round", lambda r: " / ".join(f"{x:.2f}" for x in r["ratios"])),
        Column(f"own throughput vs {workers[0]} workers", lambda r: _round(r["vs_first"], 3), "{:.2f}"),
        Column("server RPCs per worker step", lambda r: _round(r["rpcs_per_step"], 2), "{:.1f}"),
        Column("eval AUC", lambda r: r["auc"], "{:.4f}"),
        Column("AUC per round", lambda r: " / ".join(f"{x:.4f}" for x in r["aucs"])),
        Column("parity mismatches (most in a run)", lambda r: r["parity_mismatches"], "{:,}"),
    ]
    title = (
        f"# ecrec bench scaling: {job} {' '.join(sets)} steps={steps} workers={','.join(map(str, workers))}"
    )
    if zipf is not None:
        title += f" zipf={zipf:g}"
    if cpus:
        title += " cpus " + " ".join(f"{role}={c}" for role, c in cpus.items())
    if rounds > 1:
        title += f" rounds={rounds} (medians)" + (", round r with training.seed=r" if seed_per_round else "")
    emit_table(title, columns, rows, out_dir)
    return rows
