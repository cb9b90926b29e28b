"""`ecrec bench scale`: how training, recovery and memory behave as the embedding tables grow.

For each `model.scale` three jobs train the same job: No FT (its steady samples/s, and the step rate the
checkpoint interval is set from); ECRec with server 2 SIGKILLed once training reached a step (at the same
point of the job on any machine: the launcher's `SHARD@step:N` kill), for its recovery and, read from /proc
while it trains, its servers' resident memory; and Ckpt short with the same kill, for its restore. Ckpt's
interval follows `ecrec bench paper`'s rule (ecrec.paperbench.jobs): one checkpoint's pause at ×1, measured
once by a calibration job, is 0.09 of the short interval, given to every scale in steps at its own No FT step
rate; its average-case loss is the measured restore plus half an interval redone (paperbench.metrics). An
empty server's memory is measured once, by the same ECRec job with tables of a few rows: what a server holds
beyond it is what its records cost. Every scale runs once per round, rounds in alternating order; each row
gives medians over the rounds.
"""

from __future__ import annotations

import math
import shutil
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from ecrec.bench import (
    Column,
    _median,
    _round,
    _run,
    alternating,
    emit_table,
    load_job_with,
    recovery_run,
    steady_rate,
)
from ecrec.jobctx import JobContext
from ecrec.local import write_report
from ecrec.paperbench.metrics import ckpt_recovery
from ecrec.paperbench.paper import CKPT_TIME_OVER_SHORT_INTERVAL
from ecrec.transportprobe import grpc_stream_rate

KILLED = 2  # the shard SIGKILLed, as in `bench recovery`
MIB = 2**20
NAN = float("nan")


def parse_scales(text: str) -> list[int]:
    """`--scales`: comma-separated positive integers (model.scale values)."""
    try:
        scales = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        scales = []
    if not scales or min(scales) < 1:
        raise ValueError(f"--scales {text!r}: comma-separated positive integers, e.g. 1,8,64")
    return scales


def vm_rss(pid: int) -> int | None:
    """Resident bytes of process `pid` (VmRSS in /proc/PID/status); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class JobWatch:
    """The `on_tick` hook of one job: when its servers had all registered, the samples trained as the status
    said them (paperbench's `progress_series`), and each first server's largest VmRSS while it trained before
    step `until_step` (before the kill: neither the dead server nor a rebuild's buffers count)."""

    def __init__(self, until_step: int):
        self.until_step = until_step
        self.launched = time.time()  # made just before the launcher: its start-up counts
        self.ready_at: float | None = None
        self.progress: list[list[float]] = []
        self.rss: dict[int, int] = {}

    def on_tick(self, cluster, status: dict) -> None:
        started = status.get("startedAt")
        if started is None:
            return
        if self.ready_at is None:
            # The report gives events before the start t = 0; the status keeps their wall times.
            walls = [
                e["wall"] for e in status["events"] if e["kind"] == "registered" and e["wall"] <= started
            ]
            self.ready_at = max(walls, default=started)
        self.progress.append([round(time.time() - started, 3), status["samples"]])
        if status["step"] >= self.until_step:
            return
        for child in list(cluster.history):
            if child.role == "server" and child.spare is None and child.incarnation == 1 and child.alive:
                rss = vm_rss(child.proc.pid)
                if rss is not None:
                    self.rss[child.index] = max(rss, self.rss.get(child.index, 0))

    def summary(self) -> dict:
        ready = self.ready_at - self.launched if self.ready_at is not None else NAN
        return {"servers_ready_s": ready, "progress": self.progress, "rss": dict(self.rss)}


def held(ctx: JobContext, shard: int) -> tuple[int, int]:
    """(records, raw bytes) server `shard` holds: its data records with an int64 version each, and its parity
    records with k versions each, every record `record_width` float32s."""
    p, width = ctx.placement, 4 * ctx.record_width
    rows, parity = p.rows_on(shard), p.r * p.parity_rows_on(shard)
    return rows + parity, rows * (width + 8) + parity * (width + 8 * p.k)


def memory(ctx: JobContext, rss: dict[int, int], empty: JobContext, empty_rss: float) -> dict:
    """What the servers' records cost in memory: each server's RSS above an empty server's (median over the
    servers), and the bytes of that per record it holds beyond the empty one's, alone and over their raw
    bytes (records, versions, parity)."""
    deltas, records, raw = [], 0, 0
    for shard, r in rss.items():
        (n, b), (n0, b0) = held(ctx, shard), held(empty, shard)
        deltas.append(r - empty_rss)
        records, raw = records + n - n0, raw + b - b0
    if not deltas or math.isnan(empty_rss) or records <= 0:
        return {"rss_mib": NAN, "bytes_per_record": NAN, "rss_over_raw": NAN}
    return {
        "rss_mib": statistics.median(deltas) / MIB,
        "bytes_per_record": sum(deltas) / records,
        "rss_over_raw": sum(deltas) / raw,
    }


def checkpoint_pause(report: dict) -> float:
    """The median pause of a checkpoint job's checkpoints during training (the final one is after it)."""
    events = report["events"]
    return _median(
        [e.get("pause_seconds") for e in events if e["kind"] == "checkpoint_committed" and not e.get("final")]
    )


def interval_steps(short_s: float, noft: dict) -> int:
    """The short interval in steps at this scale: `short_s` seconds at No FT's step rate per worker."""
    steps = noft["spec"]["training"]["steps"]
    return max(2, round(short_s * steps / noft["elapsed_s"]))


def scale_run(ctx: JobContext, noft: dict, ecrec: dict, ckpt: dict, interval: int, empty: dict) -> dict:
    """One round's numbers at one scale from its three reports, each with its `JobWatch.summary()` as
    `watch`; `empty`: {"ctx", "rss"} of the empty server."""
    rec = recovery_run(ecrec)
    killed = ecrec["recoveries"][0]["killed_at"]
    rows, rebuild = rec["rows_recovered"], rec["rebuild_s"]
    spec = ckpt["spec"]
    restore = ckpt_recovery(
        SimpleNamespace(
            name="ckpt",
            rows=ctx.model.num_rows,
            workers=spec["workers"]["replicas"],
            batch=spec["training"]["batchSize"],
            recoveries=ckpt.get("recoveries") or [],
            events=ckpt["events"],
            progress_series=ckpt["watch"]["progress"],
            checkpointing=ckpt.get("checkpointing"),
            throughput_series=ckpt["throughput_series"],
        ),
        interval,
    )
    return {
        "noft": steady_rate(noft),
        "ecrec": steady_rate(ecrec, 2.0, killed),
        "servers_ready_s": ecrec["watch"]["servers_ready_s"],
        "continue_s": rec["continue_s"],
        "rebuild_s": rebuild,
        "rows_recovered": rows,
        "rows_per_s": rows / rebuild if rebuild > 0 else NAN,
        "bytes_per_s": rows * 4 * ctx.record_width / rebuild if rebuild > 0 else NAN,
        # what a row's decode reads: its stripe's k − 1 other members and a parity record
        "read_bytes_per_s": rows * ctx.placement.k * 4 * ctx.record_width / rebuild if rebuild > 0 else NAN,
        "rebuild_ratio": rec["rebuild_ratio"],
        "lost_s": rec["lost_s"],
        "interval_steps": interval,
        "restore_s": restore["restore_s"],
        "ckpt_average_s": restore["average_s"],
        "final_checks_s": ecrec.get("final_checks_s", NAN),
        **memory(ctx, ecrec["watch"]["rss"], empty["ctx"], empty["rss"]),
        "parity_mismatches": rec["parity_mismatches"],
    }


def scale_row(scale: int, ctx: JobContext, runs: list[dict]) -> dict:
    """One scale's row: the medians of its rounds (the most parity mismatches of any)."""
    keys = [k for k in runs[0] if k != "parity_mismatches"]
    return {
        "scale": scale,
        "rows": ctx.model.num_rows,
        "rows_per_shard": ctx.model.num_rows / ctx.num_servers,
        **{k: _median([r[k] for r in runs]) for k in keys},
        "ecrec_vs_noft": _median([r["ecrec"] / r["noft"] if r["noft"] else NAN for r in runs]),
        "parity_mismatches": max(r["parity_mismatches"] for r in runs),
    }


def _watched(ctx: JobContext, out: Path, until_step: int, kill_step: int | None = None) -> dict:
    """Run one job with a `JobWatch` (and server 2 SIGKILLed at `kill_step`); its report, with `watch`."""
    watch = JobWatch(until_step)
    kills = [(KILLED, f"step:{kill_step}")] if kill_step is not None else []
    report = _run(ctx, out, kills=kills, on_tick=watch.on_tick)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # large, and read from the report already
    if kill_step is not None and not report.get("recoveries"):
        raise SystemExit(
            f"ecrec bench scale: the kill at step {kill_step} did not land in {out}: lower --kill-step"
        )
    report["watch"] = watch.summary()
    write_report(report, out / "report.json")
    return report


def bench_scale(
    job: str, scales: list[int], steps: int, kill_step: int, sets: list[str], out_dir: Path, rounds: int = 1
) -> list[dict]:
    def ctx_of(*overrides: str) -> JobContext:
        return JobContext(load_job_with(job, [*sets, f"training.steps={steps}", *overrides]))

    def ecrec_at(scale: int) -> JobContext:
        return ctx_of(f"model.scale={scale}", "faultTolerance.strategy=ecrec")

    # An empty server: the ECRec job with k rows per table on each server, watched up to the same step (it
    # trains no further: nothing after that step is read).
    base = ecrec_at(1)
    few = ",".join([str(base.num_servers * base.placement.k)] * len(base.model.table_sizes))
    empty_ctx = ctx_of(
        "faultTolerance.strategy=ecrec", f"model.tableSizes=[{few}]", f"training.steps={kill_step}"
    )
    rss = _watched(empty_ctx, out_dir / "empty", kill_step)["watch"]["rss"]
    empty = {"ctx": empty_ctx, "rss": statistics.median(rss.values()) if rss else NAN}
    # The paper's rule (ecrec.paperbench.jobs.Jobs.calibrate): one checkpoint's pause at ×1, at a provisional
    # interval, is CKPT_TIME_OVER_SHORT_INTERVAL of the short interval.
    calibration = ctx_of(
        "model.scale=1",
        "faultTolerance.strategy=checkpoint",
        f"faultTolerance.checkpoint.intervalSteps={max(2, steps // 8)}",
    )
    pause = checkpoint_pause(_watched(calibration, out_dir / "calibration", 0))
    short_s = pause / CKPT_TIME_OVER_SHORT_INTERVAL
    print(f"  checkpoint pause at ×1 {pause:.3f}s -> Ckpt short interval {short_s:.2f}s", flush=True)
    runs: dict[int, list[dict]] = {s: [] for s in scales}
    for r, scale in alternating(scales, rounds):
        out = (out_dir / f"round{r + 1}" if rounds > 1 else out_dir) / f"scale{scale}"
        at = f"model.scale={scale}"
        noft = _watched(ctx_of(at, "faultTolerance.strategy=none"), out / "noft", 0)
        ecrec = _watched(ecrec_at(scale), out / "ecrec", kill_step, kill_step)
        interval = interval_steps(short_s, noft)
        strategy = (
            "faultTolerance.strategy=checkpoint",
            f"faultTolerance.checkpoint.intervalSteps={interval}",
        )
        ckpt = _watched(ctx_of(at, *strategy), out / "ckpt", 0, kill_step)
        run = scale_run(ecrec_at(scale), noft, ecrec, ckpt, interval, empty)
        runs[scale].append(run)
        print(
            f"  scale {scale}: No FT {run['noft']:,.0f} samples/s, ECRec {run['ecrec']:,.0f}; continue "
            f"{run['continue_s']:.2f}s, rebuild {run['rebuild_s']:.2f}s; Ckpt short restore "
            f"{_median([run['restore_s']]):.2f}s",
            flush=True,
        )
    stream = grpc_stream_rate()  # on the quiet machine, after the jobs
    rows = [scale_row(s, ecrec_at(s), runs[s]) for s in scales]
    for row in rows:
        row["read_over_stream"] = row["read_bytes_per_s"] / stream
    title = (
        f"# ecrec bench scale: {job} {' '.join(sets)} steps={steps}, server {KILLED} SIGKILLed at step "
        f"{kill_step}; Ckpt short interval {short_s:.2f}s (pause at ×1 {pause:.3f}s / "
        f"{CKPT_TIME_OVER_SHORT_INTERVAL:.3f}); empty server RSS {empty['rss'] / MIB:.0f} MiB; one gRPC stream "
        f"of raw bytes moves {stream / 1e6:,.0f} MB/s"
    )
    emit_table(title + (f" rounds={rounds} (medians)" if rounds > 1 else ""), COLUMNS, rows, out_dir)
    return rows


COLUMNS = [
    Column("model scale", lambda r: r["scale"]),
    Column("model rows", lambda r: r["rows"], "{:,}"),
    Column("rows per shard", lambda r: _round(r["rows_per_shard"]), "{:,}"),
    Column("No FT steady samples/s", lambda r: _round(r["noft"]), "{:,}"),
    Column("ECRec steady samples/s before kill", lambda r: _round(r["ecrec"]), "{:,}"),
    Column("ECRec / No FT", lambda r: _round(r["ecrec_vs_noft"], 3), "{:.2f}"),
    Column("servers ready s", lambda r: _round(r["servers_ready_s"], 3), "{:.2f}"),
    Column("time to continue s", lambda r: _round(r["continue_s"], 3), "{:.2f}"),
    Column("rebuild s", lambda r: _round(r["rebuild_s"], 3), "{:.2f}"),
    Column("rows rebuilt", lambda r: _round(r["rows_recovered"]), "{:,}"),
    Column("rows rebuilt/s", lambda r: _round(r["rows_per_s"]), "{:,}"),
    Column("MB rebuilt/s", lambda r: _round(r["bytes_per_s"] / 1e6, 2), "{:.1f}"),
    Column("MB read/s", lambda r: _round(r["read_bytes_per_s"] / 1e6, 2), "{:.1f}"),
    Column("read / one gRPC stream", lambda r: _round(r["read_over_stream"], 3), "{:.2f}"),
    Column("throughput while rebuilding / normal", lambda r: _round(r["rebuild_ratio"], 3), "{:.2f}"),
    Column("ECRec training lost s (at normal throughput)", lambda r: _round(r["lost_s"], 3), "{:.2f}"),
    Column("Ckpt short interval steps", lambda r: _round(r["interval_steps"]), "{:,}"),
    Column("Ckpt short restore s", lambda r: _round(r["restore_s"], 3), "{:.2f}"),
    Column("Ckpt short average-case loss s", lambda r: _round(r["ckpt_average_s"], 3), "{:.2f}"),
    Column("final checks s", lambda r: _round(r["final_checks_s"], 3), "{:.2f}"),
    Column("server RSS above empty MiB", lambda r: _round(r["rss_mib"], 1), "{:,.1f}"),
    Column("RSS bytes per stored record", lambda r: _round(r["bytes_per_record"], 1), "{:,.1f}"),
    Column("RSS / raw bytes held", lambda r: _round(r["rss_over_raw"], 3), "{:.2f}"),
    Column("parity mismatches (most in a run)", lambda r: r["parity_mismatches"]),
]
