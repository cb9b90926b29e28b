"""The PNG figures of the report, drawn with matplotlib (Agg) from results.json alone."""

from __future__ import annotations

import statistics
from pathlib import Path

from ecrec.paperbench.paper import PAPER, paper_original
from ecrec.paperbench.runs import run_label


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


COLORS = {
    "none": "black",
    "ecrec": "tab:blue",
    "checkpoint": "tab:red",
    "checknrun": "tab:orange",
    "cpr": "tab:green",
}


def _save(plt, fig, path: Path) -> Path:
    """Every figure ends the same way: laid out, written at one resolution, its memory freed."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finish_bars(ax, baseline: float | None = 0, fontsize: int = 8, **legend) -> None:
    """The bar charts' common finish: a line at the baseline (0% overhead, ratio 1), a y grid, a legend."""
    if baseline is not None:
        ax.axhline(baseline, color="grey", linewidth=0.8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=fontsize, **legend)


def fig_overhead(results: dict, path: Path) -> Path:
    plt = _plt()
    rows = results["overhead"]
    configs = [c for c in dict.fromkeys(r["config"] for r in rows) if c != "No FT"]
    scales = sorted({r["scale"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(configs))
    for i, c in enumerate(configs):
        ys = [
            next((r["overhead"] * 100 for r in rows if r["config"] == c and r["scale"] == s), 0)
            for s in scales
        ]
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(scales))]
        ax.bar(xs, ys, width, label=c)
        for scale, paper, marker, what in (
            (1, paper_original(c), "kD", "paper, Criteo-Original"),
            (8, PAPER["overhead_8S"].get(c), "k*", "paper, Criteo-8S"),
        ):
            if paper is not None and scale in scales:
                j = scales.index(scale)
                labelled = what in ax.get_legend_handles_labels()[1]
                ax.plot(xs[j], paper * 100, marker, markersize=7, label=None if labelled else what)
    ax.set_xticks(range(len(scales)), [f"×{s}" for s in scales])
    ax.set_xlabel("model size (table rows × scale)")
    ax.set_ylabel("training-time overhead vs No FT (%)")
    ax.set_title("Training-time overhead vs model size (paper Fig. 5)")
    _finish_bars(ax)
    return _save(plt, fig, path)


def _series(run: dict, key: str) -> tuple[list, list]:
    pts = run[key]
    if not pts:
        return [], []
    t, v = zip(*pts, strict=True)
    if key == "throughput_series":
        v = [max(0.0, x) for x in v]  # a rollback shows as a negative rate: no progress
    return list(t), list(v)


def fig_timeline(results: dict, names: list[str], title: str, path: Path) -> Path:
    plt = _plt()
    runs = results["runs"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name in names:
        run = runs[name]
        label = run_label(run)
        style = "--" if "long" in label else "-"
        color = COLORS[run["strategy"]]
        if label.startswith("ECRec k=2"):
            color = "tab:cyan"
        t, v = _series(run, "throughput_series")
        top.plot(t, v, style, color=color, linewidth=1.1, label=label)
        mean = run["samples"] / run["train_s"] if run["train_s"] else 0
        top.axhline(mean, color=color, linestyle=":", linewidth=0.8)
        t, v = _series(run, "progress_series")
        bottom.plot(t, v, style, color=color, linewidth=1.1, label=label)
        for rec in run["recoveries"]:
            top.axvline(rec["killed_at"], color=color, linewidth=0.8, alpha=0.6)
            bottom.axvline(rec["killed_at"], color=color, linewidth=0.8, alpha=0.6)
    top.set_ylabel("samples / s")
    top.set_ylim(bottom=0)
    top.set_title(title)
    top.legend(fontsize=8, loc="lower right")
    bottom.set_ylabel("samples trained")
    bottom.set_xlabel("seconds since training started (vertical lines: kill; dotted: mean throughput)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def fig_recovery(results: dict, path: Path) -> Path:
    plt = _plt()
    rec = results["recovery"]
    scales = sorted({r["scale"] for r in rec["ecrec"]})
    series: list[tuple[str, list]] = []
    for k in sorted({r["k"] for r in rec["ecrec"]}):
        series.append(
            (
                f"ECRec k={k} full",
                [
                    next((r["full_s"] for r in rec["ecrec"] if r["k"] == k and r["scale"] == s), None)
                    for s in scales
                ],
            )
        )
    for case in ("best_s", "average_s", "worst_s"):
        series.append(
            (
                f"Ckpt short {case[:-2]}",
                [next((r.get(case) for r in rec["ckpt"] if r["scale"] == s), None) for s in scales],
            )
        )
        if any("long" in r for r in rec["ckpt"]):
            if case == "best_s":
                continue  # the same restore: best case does not depend on the interval
            series.append(
                (
                    f"Ckpt long {case[:-2]}",
                    [
                        next((r["long"].get(case) for r in rec["ckpt"] if r["scale"] == s), None)
                        for s in scales
                    ],
                )
            )
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(series))
    for i, (label, ys) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(scales))]
        ax.bar(xs, [y or 0 for y in ys], width, label=label, hatch="//" if "long" in label else None)
    ticks = []
    for s in scales:
        cont = [
            f"k={r['k']} {r['continue_s']:.2f}s"
            for r in rec["ecrec"]
            if r["scale"] == s and r.get("continue_s") is not None
        ]
        ticks.append(f"×{s}\nECRec continue: " + ", ".join(cont) if cont else f"×{s}")
    ax.set_xticks(range(len(scales)), ticks, fontsize=8)
    ax.set_ylabel("seconds from kill")
    ax.set_title("Time to fully recover a failed server (paper Fig. 12)")
    _finish_bars(ax, baseline=None, fontsize=7, ncol=2)
    return _save(plt, fig, path)


def fig_load(results: dict, path: Path) -> Path:
    plt = _plt()
    rows = results["load_balance"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    n = max(len(r["updates_per_server"]) for r in rows) if rows else 0
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        mean = statistics.mean(r["updates_per_server"]) if r["updates_per_server"] else 1
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(r["updates_per_server"]))]
        mm = r["max_over_mean"]
        ax.bar(
            xs,
            [w / mean for w in r["updates_per_server"]],
            width,
            label=f"{r['config']} (max/mean {mm:.2f})" if mm else r["config"],
        )
    ax.set_xticks(range(n), [f"server {j}" for j in range(n)])
    ax.set_ylabel("row updates / mean over servers")
    ax.set_title("Load per server, no failure (paper §5.2)")
    _finish_bars(ax, baseline=1)
    return _save(plt, fig, path)


def fig_baselines(results: dict, path: Path) -> Path:
    """Fig. 13: the paper's analytical model (Ckpt's overhead falls linearly with compression) drawn from our
    measured Ckpt and ECRec overheads, with the measured Check-N-Run and CPR points; right: accuracy."""
    plt = _plt()
    b = results["baselines"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ov = {r["config"]: r for r in b["overhead"]}
    ck = ov.get("Ckpt short")
    ec = next((r for c, r in ov.items() if c.startswith("ECRec")), None)
    if ck and ec:
        xs = [i / 100 for i in range(0, 101, 5)]
        left.plot(
            [x * 100 for x in xs],
            [ck["overhead"] * (1 - x) * 100 for x in xs],
            "r-",
            label="Ckpt short × (1 − compression) (paper's model)",
        )
        left.axhline(ec["overhead"] * 100, color="tab:blue", label=f"{ec['config']} (measured)")
        size = b.get("checknrun_size") or {}
        cn = ov.get("Check-N-Run short")
        if cn and size.get("size_reduction"):
            comp = 1 - 1 / size["size_reduction"]
            left.plot(
                comp * 100, cn["overhead"] * 100, "o", color="tab:orange", label="Check-N-Run (measured)"
            )
        cp = ov.get("CPR short")
        if cp:
            left.plot(0, cp["overhead"] * 100, "s", color="tab:green", label="CPR (measured, no compression)")
    left.set_xlabel("checkpoint compression (% smaller than full)")
    left.set_ylabel("training-time overhead (%)")
    left.set_title("Overhead vs compression (paper Fig. 13)")
    left.grid(alpha=0.3)
    if left.get_legend_handles_labels()[0]:
        left.legend(fontsize=7)
    acc = b["accuracy"]
    datasets = list(dict.fromkeys(r["dataset"] for r in acc))
    configs = list(dict.fromkeys(r["config"] for r in acc))
    width = 0.8 / max(1, len(datasets))
    for i, d in enumerate(datasets):
        ys = [
            next((r["auc_delta"] for r in acc if r["dataset"] == d and r["config"] == c), 0) for c in configs
        ]
        xs = [j + (i - (len(datasets) - 1) / 2) * width for j in range(len(configs))]
        right.bar(xs, ys, width, label=d)
    right.set_xticks(
        range(len(configs)), [c.replace(", no failure", "") for c in configs], rotation=20, fontsize=8
    )
    right.set_ylabel("AUC − AUC of No FT without failure")
    right.set_title("Final AUC after one failure")
    _finish_bars(right)
    return _save(plt, fig, path)


def fig_entry_width(results: dict, path: Path) -> Path:
    plt = _plt()
    ew = results["entry_width"]
    rows = ew["configs"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["overhead"] * 100 for r in rows], 0.4, label=f"ECRec k={ew['k']} (here)")
    adjusted = [r.get("cpu_adjusted_overhead") for r in rows]
    ax.bar(
        [x + 0.2 for x in xs],
        [(a or 0) * 100 for a in adjusted],
        0.4,
        label="here, CPU-adjusted",
        hatch="//",
        color="tab:cyan",
    )
    ax.plot([x - 0.2 for x in xs], [(r["paper"] or 0) * 100 for r in rows], "kD", label="paper, k=4")
    ax.set_xticks(list(xs), [f"{r['config']}\n{r['rows']:,} rows × {r['dim']}" for r in rows], fontsize=8)
    ax.set_ylabel("training-time overhead vs No FT (%)")
    ax.set_title("Effect of entry width (paper §5.2)")
    _finish_bars(ax)
    return _save(plt, fig, path)


FIGURES = {
    "fig5_overhead.png": fig_overhead,
    "fig12_recovery.png": fig_recovery,
    "load_balance.png": fig_load,
    "fig13_baselines.png": fig_baselines,
}


def write_figures(results: dict, out: Path) -> list[str]:
    names = []
    for name, fn in FIGURES.items():
        fn(results, out / name)
        names.append(name)
    if (results.get("entry_width") or {}).get("configs"):  # results.json of an older bench: no such section
        fig_entry_width(results, out / "entry_width.png")
        names.append("entry_width.png")
    tl = results["timelines"]
    fig_timeline(
        results,
        tl["no_failure"],
        f"No failure, model ×{tl['no_failure_scale']}: throughput (top) and progress (paper Figs. 6-9)",
        out / "fig6_9_no_failure.png",
    )
    fig_timeline(
        results,
        tl["failure"],
        f"Server killed mid-interval, model ×{tl['failure_scale']} (paper Figs. 10-11)",
        out / "fig10_11_failure.png",
    )
    return [*names, "fig6_9_no_failure.png", "fig10_11_failure.png"]
