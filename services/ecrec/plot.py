"""Throughput-over-time plot of a run report, with failure/recovery phases marked."""

from __future__ import annotations

from pathlib import Path

EVENT_STYLE = {
    "server_killed": ("tab:red", "-"),
    "failure_detected": ("tab:orange", "--"),
    "training_continued": ("tab:green", "--"),
    "recovery_started": ("tab:purple", ":"),
    "recovery_completed": ("tab:blue", "-"),
}


def plot_report(report: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    series = report.get("throughput_series") or []
    fig, ax = plt.subplots(figsize=(9, 4))
    if series:
        t, rate = zip(*series, strict=True)
        ax.plot(t, rate, color="black", linewidth=1.2, label="throughput")
    ax.axhline(
        report.get("samples_per_s", 0),
        color="grey",
        linestyle=":",
        linewidth=1,
        label=f"mean {report.get('samples_per_s', 0):.0f} samples/s",
    )
    seen: set[str] = set()
    for ev in report.get("events", []):
        style = EVENT_STYLE.get(ev["kind"])
        if style is None:
            continue
        label = ev["kind"].replace("_", " ") if ev["kind"] not in seen else None
        seen.add(ev["kind"])
        ax.axvline(ev["t"], color=style[0], linestyle=style[1], linewidth=1.2, label=label)
    for rec in report.get("recoveries", []):
        if rec.get("detected_at") is not None and rec.get("completed_at") is not None:
            ax.axvspan(rec["detected_at"], rec["completed_at"], color="tab:purple", alpha=0.08)
    spec = report.get("spec", {})
    ft = spec.get("faultTolerance", {}).get("strategy", "?")
    ax.set_title(f"{report.get('job', '')}: training throughput (fault tolerance: {ft})")
    ax.set_xlabel("seconds since training started")
    ax.set_ylabel("samples / s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
