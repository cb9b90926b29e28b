"""Numbers out of one run (or a pair): checkpoint pauses, recovery times, best/average/worst checkpoint cases,
load per server, Check-N-Run's sizes, the CPU-adjusted overhead. Pure functions of `Run`s and their dicts."""

from __future__ import annotations

import math
import statistics

from ecrec.bench import steady_rate
from ecrec.local import row_work
from ecrec.paperbench.paper import PAPER
from ecrec.paperbench.runs import Run


def _committed(run: Run) -> int | None:
    c = (run.checkpointing or {}).get("committed")
    return sum(c.values()) if c else None


def pause_overhead(run: Run) -> float | None:
    """A checkpoint strategy's overhead from its own accounting, within one job: the pauses before the last
    step over the training time without them. Unlike train time / No FT's, no other job's speed enters."""
    p = [
        e["pause_seconds"]
        for e in run.events
        if e["kind"] == "checkpoint_committed" and e.get("pause_seconds") is not None and not e.get("final")
    ]
    if not p:
        return None
    return sum(p) / (run.train_s - sum(p))


def _mean_pause(run: Run) -> float | None:
    p = [
        e["pause_seconds"]
        for e in run.events
        if e["kind"] == "checkpoint_committed" and e.get("pause_seconds") is not None and not e.get("final")
    ]
    return statistics.mean(p) if p else None


def _event_t(run: Run, kind: str, after: float = -1.0) -> float | None:
    return next((e["t"] for e in run.events if e["kind"] == kind and e["t"] >= after), None)


def ecrec_recovery(run: Run) -> dict:
    """Time to continue, to full recovery, and throughput while degraded/recovering vs before the kill."""
    if not run.recoveries:  # the kill came too late on a loaded machine: the same row, without numbers
        return {
            "run": run.name,
            "rows": run.rows,
            "continue_s": None,
            "full_s": None,
            "rebuild_s": None,
            "during_ratio": None,
            "parity_mismatches": run.parity_mismatches,
        }
    rec = run.recoveries[0]
    started = _event_t(run, "recovery_started", rec["killed_at"])
    series = {"throughput_series": run.throughput_series}
    normal = steady_rate(series, 2.0, rec["killed_at"])
    during = steady_rate(series, rec["detected_at"], rec["completed_at"])
    return {
        "run": run.name,
        "rows": run.rows,
        "killed_at": rec["killed_at"],
        "continue_s": rec["continued_at"] - rec["killed_at"] if rec["continued_at"] is not None else None,
        "full_s": rec["completed_at"] - rec["killed_at"],
        "rebuild_s": rec["completed_at"] - started if started is not None else None,
        "replacement_s": _replacement_s(run, rec),
        "rows_recovered": rec["rows_recovered"],
        "during_ratio": during / normal if normal and not math.isnan(during) else None,
        "training_ended_before_recovery": (run.train_s < rec["completed_at"]),
        "parity_mismatches": run.parity_mismatches,
    }


def _replacement_s(run: Run, rec: dict) -> float | None:
    """Kill -> the replacement process registered: starting a process, not the strategy's recovery."""
    t = _event_t(run, "replacement_registered", rec["killed_at"])
    return t - rec["killed_at"] if t is not None else None


def ckpt_recovery(run: Run, interval: int) -> dict:
    """Checkpoint's recovery from a mid-interval kill: restore (kill -> training resumes from the checkpoint),
    redo (resume -> the samples trained at the kill are trained again); best/average/worst case for a
    failure right after a checkpoint, mid-interval and right before the next one (redo of 0, 1/2 and 1
    interval at the measured redo rate)."""
    if not run.recoveries:  # the kill did not land before training ended
        return {"run": run.name, "restore_s": None, "best_s": None, "average_s": None, "worst_s": None}
    rec = run.recoveries[0]
    resumed = _event_t(run, "rolled_back", rec["killed_at"])
    before = [
        n for t, n in run.progress_series if t <= (resumed if resumed is not None else rec["completed_at"])
    ]
    at_kill = max(before) if before else 0
    regained = next(
        (t for t, n in run.progress_series if resumed is not None and t > resumed and n >= at_kill), None
    )
    redone = (run.checkpointing or {}).get("stepsRedone") or 0
    before = steady_rate({"throughput_series": run.throughput_series}, 2.0, rec["killed_at"])
    out = {
        "run": run.name,
        "rows": run.rows,
        "killed_at": rec["killed_at"],
        "restore_s": (resumed - rec["killed_at"]) if resumed is not None else None,
        "restore_completed_s": rec["completed_at"] - rec["killed_at"],
        "replacement_s": _replacement_s(run, rec),
        "redo_s": (regained - resumed) if regained is not None and resumed is not None else None,
        "steps_redone": redone,
        "workers": run.workers,
        "interval_steps": interval,
        "measured_full_s": (regained - rec["killed_at"]) if regained is not None else None,
        # seconds per worker step before the kill: the redo rate when the kill landed on a checkpoint
        "step_s_before": run.batch * run.workers / before if before and not math.isnan(before) else None,
        "lost_fraction_of_interval": redone / run.workers / interval,
    }
    out.update(ckpt_cases(out, interval))
    return out


def ckpt_cases(measured: dict, interval: int) -> dict:
    restore, redo, n = measured.get("restore_s"), measured.get("redo_s"), measured.get("steps_redone")
    if redo is not None and n:
        per_step = redo / (n / measured["workers"])  # steps redone are summed over ranks, redone in parallel
    else:
        per_step = measured.get("step_s_before")
    if restore is None or per_step is None:
        return {"best_s": restore, "average_s": None, "worst_s": None}
    return {
        "best_s": restore,
        "average_s": restore + per_step * interval / 2,
        "worst_s": restore + per_step * interval,
    }


def load_of(label: str, run: Run) -> dict:
    """Updates per server (rows pushed, or staged + parity deltas): max/mean and max/min over servers."""
    work = [row_work(r) for r in run.server_rows]
    ok = work and min(work) > 0
    return {
        "config": label,
        "run": run.name,
        "updates_per_server": work,
        "max_over_mean": max(work) / statistics.mean(work) if ok else None,
        "max_over_min": max(work) / min(work) if ok else None,
        "total": sum(work),
        "paper_max_over_min": PAPER["load_max_over_min"].get(label),
    }


def checknrun_size(full: Run, cnr: Run) -> dict:
    """Check-N-Run's checkpoints against full ones of the same model and interval: bytes per checkpoint and
    write bandwidth (bytes per second of training)."""
    f, c = full.checkpointing or {}, cnr.checkpointing or {}
    fn, cn = _committed(full) or 0, _committed(cnr) or 0
    per_full = f.get("bytesWritten", 0) / fn if fn else None
    per_cnr = c.get("bytesWritten", 0) / cn if cn else None
    bw_full = f.get("bytesWritten", 0) / full.train_s
    bw_cnr = c.get("bytesWritten", 0) / cnr.train_s
    return {
        "full_run": full.name,
        "checknrun_run": cnr.name,
        "full_bytes_per_checkpoint": per_full,
        "checknrun_bytes_per_checkpoint": per_cnr,
        "size_reduction": per_full / per_cnr if per_full and per_cnr else None,
        "full_write_bytes_per_s": bw_full,
        "checknrun_write_bytes_per_s": bw_cnr,
        "bandwidth_reduction": bw_full / bw_cnr if bw_cnr else None,
        "checknrun_committed": c.get("committed"),
        "quantize_bits": None,
    }


def cpu_adjusted_overhead(runs: dict, row: dict) -> float | None:
    """Overhead with each job's training time scaled by the share of the cores it had (see the report)."""
    run, base = runs[row["run"]], runs[row.get("base_run") or f"noft_x{row['scale']}"]
    if run.get("other_cpu_share") is None or base.get("other_cpu_share") is None:
        return None
    own = run["train_s"] * (1 - run["other_cpu_share"])
    return own / (base["train_s"] * (1 - base["other_cpu_share"])) - 1


def _increase(before: float | None, after: float | None) -> float | None:
    return after / before - 1 if before and after is not None else None
