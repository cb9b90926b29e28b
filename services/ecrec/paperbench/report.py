"""report.md: the numbers of results.json beside the papers', section by section, with the scaling rule and
the departures. Each section is a function that appends its lines through `add`; `write_report` puts them in
order. Reads results.json (dicts) only, so `--render-only` redraws a report without running a job."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ecrec.paperbench.metrics import ckpt_recovery, cpu_adjusted_overhead, ecrec_recovery
from ecrec.paperbench.paper import PAPER, paper_original
from ecrec.paperbench.plan import CONTENDED
from ecrec.paperbench.runs import Run, run_label


def _pct(x) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 100:+.1f}%"


def _s(x, digits: int = 2) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f} s"


def _f(x, digits: int = 2) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _rate(x) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.0f}"


def write_report(results: dict, out: Path, figures: list[str], command: str) -> Path:
    """report.md: each section's numbers beside the paper's, in the order of the paper's evaluation."""
    L: list[str] = []
    add = L.append
    _header(results, add, command)
    _scaling_rule(results, add)
    _overhead(results, add)
    write_entry_width(results, add, figures)
    _timelines(results, add)
    _recovery(results, add)
    _baselines(results, add)
    _load_and_ablations(results, add)
    _noise(results, add)
    _departures(add, figures)
    path = out / "report.md"
    path.write_text("\n".join(L))
    return path


def _header(results: dict, add, command: str) -> None:
    """The command, the machine, what was run or reused, and the setup beside the paper's."""
    plan, m, runs = results["plan"], results["machine"], results["runs"]
    add("# ECRec paper benchmark (`ecrec bench paper`)\n")
    add(
        f"Command: `{command}` ({plan['name']} plan): {len(runs)} jobs, one after the other, "
        f"{sum(r['wall_s'] for r in runs.values()) / 60:.1f} minutes of jobs (start-up and evaluation included). "
        f"Machine: {m['platform']}, {m['cpus']} CPUs, Python {m['python']}, "
        f"torch {m['torch']}, GPU: {m['cuda'] or 'none'}. Every process of every job (coordinator, "
        f"servers, workers) shares these cores; compare runs of this report only, by their ratios.\n"
    )
    if results.get("skipped_jobs"):
        add(
            f"**Reduced run.** {len(results['skipped_jobs'])} jobs of the plan were not run (the machine was "
            f"shared and the time was up): {', '.join(results['skipped_jobs'])}. The sections that needed them "
            'are shorter or say "not run".\n'
        )
    if results.get("reused_jobs") and len(results["reused_jobs"]) == len(runs):
        add(
            "Every job is from WORK/runs.json, run by earlier invocations of this command with the same "
            "settings (the jobs list below is in the order they ran); this one computed the numbers, figures "
            "and report from them.\n"
        )
    elif results.get("reused_jobs"):
        add(
            f"{len(results['reused_jobs'])} jobs ({', '.join(results['reused_jobs'])}) are from an earlier "
            "invocation with the same `--work` and the same settings (the command reuses finished jobs); the "
            "minutes above are this invocation's.\n"
        )
    add(
        f"Paper setup: {PAPER['setup']}. Ours: `{plan['job']}` "
        f"{' '.join(plan['sets'])} ({runs['noft_x' + str(plan['scales'][0])]['rows']:,} embedding rows at ×1, "
        f"dim and optimizer as in the file), {plan['steps']} steps per worker per job, scales "
        f"{', '.join('×' + str(s) for s in plan['scales'])} (`model.scale`, the paper's Original/2S/4S/8S).\n"
    )


def _scaling_rule(results: dict, add) -> None:
    """How checkpoint intervals and kill steps follow from one measured checkpoint pause."""
    plan, iv, runs = results["plan"], results["intervals"], results["runs"]
    add("## Scaling rule\n")
    add(
        "Checkpoint time / interval is the paper's, the rest scales with it. The paper's Fig. 5 gives Ckpt-30 "
        f"an overhead of {PAPER['overhead_8S']['Ckpt short']:.0%} on Criteo-8S, "
        f"{PAPER['overhead_growth_1_to_8']['Ckpt short']}× its overhead on Criteo-Original: one checkpoint of "
        f"Original takes about {iv['ckpt_time_over_short_interval_paper']:.3f} of a 30-minute interval. A "
        f"calibration job (Ckpt at ×1, checkpoint every {iv['provisional_steps']} steps) measured the pause of "
        f"one checkpoint (first worker paused → manifest written; median of "
        f"{len(iv['calibration_pauses_s'])}): **{_s(iv['calibration_pause_s'], 3)}**. "
    )
    cal = runs.get("checkpoint_calibration_x1", {})
    if (cal.get("other_cpu_share") or 0) > CONTENDED:
        add(
            f"(The calibration job itself ran while other processes took {cal['other_cpu_share']:.0%} of the "
            "cores: its pause, and so the intervals, are those of a loaded machine.) "
        )
    if plan["calibrate"]:
        add(
            f"So **Ckpt short** (the paper's Ckpt-30) checkpoints every {iv['short_s']:.2f} s and **Ckpt long** "
            f"(Ckpt-60) every {iv['long_s']:.2f} s, at every model size, as the paper keeps 30/60 minutes at "
            "every size. The jobs get the interval in steps (`intervalSteps`): those seconds at the No FT step "
            "rate of the same model size, so every rank pauses at the same step. A failure is a SIGKILL of "
            "server 1 at step (m + ½) × the short interval, m ≈ a third of the run: mid-interval like the "
            "paper's failure 15 minutes into a 30-minute interval; every strategy at one model size is killed "
            "at the same step. Training time is the time until the coordinator first reports every sample "
            'trained (the paper\'s "time to train a certain number of samples"; ±0.25 s polling), so the '
            "final checkpoint a checkpoint strategy writes after the last step is not counted. A run is "
            f"{plan['steps']} steps, not two hours: more intervals than the paper's four, less noise per ratio.\n"
        )
    else:
        add(
            f"**--quick**: no calibrated re-runs; Ckpt short is the calibration job itself (every "
            f"{iv['provisional_steps']} steps), there is no Ckpt long. The numbers only show the command works.\n"
        )
    add("| model | rows | No FT train time | short interval (steps) | long interval (steps) | kill at step |")
    add("|---|---:|---:|---:|---:|---:|")
    for s in plan["scales"]:
        n = runs[f"noft_x{s}"]
        short = next(
            (
                r["interval_steps"]
                for r in results["overhead"]
                if r["scale"] == s and r["config"] == "Ckpt short"
            ),
            None,
        )
        long_ = next(
            (
                r["interval_steps"]
                for r in results["overhead"]
                if r["scale"] == s and r["config"] == "Ckpt long"
            ),
            None,
        )
        kill = next(
            (
                r["kill_step"]
                for r in runs.values()
                if r["scale"] == s and r["kill_step"] and not r["name"].startswith("acc_")
            ),
            None,
        )
        add(
            f"| ×{s} | {n['rows']:,} | {_s(n['train_s'], 1)} | {short or '—'} | {long_ or '—'} | {kill or '—'} |"
        )
    add("")


def _overhead(results: dict, add) -> None:
    """Fig. 5: training-time overhead vs model size, raw and CPU-adjusted."""
    plan, runs = results["plan"], results["runs"]
    add("## Training-time overhead vs model size (paper Fig. 5)\n")
    add(f"![overhead]({'fig5_overhead.png'})\n")
    cfgs = list(dict.fromkeys(r["config"] for r in results["overhead"]))
    add(
        "| config | "
        + " | ".join(f"×{s}" for s in plan["scales"])
        + " | paper Criteo-Original | paper Criteo-8S |"
    )
    add("|---|" + "---:|" * (len(plan["scales"]) + 2))
    for c in cfgs:
        cells = []
        for s in plan["scales"]:
            r = next((x for x in results["overhead"] if x["config"] == c and x["scale"] == s), None)
            if r is None:
                cells.append("—")
                continue
            extra = (
                f" (pauses {_pct(r.get('pause_overhead'))}: {r['checkpoints']} × {r['mean_pause_s']:.2f} s)"
                if r.get("mean_pause_s")
                else ""
            )
            cells.append(_pct(r["overhead"]) + extra)
        p8, p1 = PAPER["overhead_8S"].get(c), paper_original(c)
        add(f"| {c} | " + " | ".join(cells) + f" | {_pct(p1) if p1 else '—'} | {_pct(p8) if p8 else '—'} |")
    add(
        "\nA cell is the training time over the No FT job's of the same size, minus 1. For Ckpt, in brackets: "
        "the overhead from the job's own pauses (their sum before the last step over the training time "
        "without them), which no other job's speed enters: with the machine shared, the better measure of the "
        "two. (Paper Criteo-Original for Ckpt is Criteo-8S's overhead divided by the growth the text states, "
        "7.2× and 7×; ECRec k=4's is the ablation's 18.2%. The paper states k=2 equal to k=4.)\n"
    )
    growth = _growth(results)
    if growth:
        add(
            "Growth of the overhead from the smallest to the largest model here (paper, Original → 8S: ECRec "
            "k=4 1.2×, Ckpt-30 7.2×, Ckpt-60 7×): "
            + ", ".join(f"{c} {_f(v)}×" for c, v in growth.items())
            + ".\n"
        )
    adjusted = [r for r in results["overhead"] if cpu_adjusted_overhead(runs, r) is not None]
    if adjusted:
        add(
            "The same, each job's training time multiplied by the share of the cores it had (1 − the share other "
            'processes took while it ran, see "Noise and CPU contention"): a first-order correction for the '
            "contention, assuming a job's speed is proportional to the CPU it gets — an estimate, not a "
            "measurement:\n"
        )
        add("| config | " + " | ".join(f"×{s}" for s in plan["scales"]) + " |")
        add("|---|" + "---:|" * len(plan["scales"]))
        for c in cfgs:
            cells = [
                _pct(
                    next(
                        (
                            cpu_adjusted_overhead(runs, r)
                            for r in adjusted
                            if r["config"] == c and r["scale"] == s
                        ),
                        None,
                    )
                )
                for s in plan["scales"]
            ]
            add(f"| {c} | " + " | ".join(cells) + " |")
        add("")


def _timelines(results: dict, add) -> None:
    """Figs. 6-11: throughput and progress without and with a failure."""
    runs = results["runs"]
    tl = results["timelines"]
    add("## Throughput and progress over time (paper Figs. 6-11)\n")
    add(f"No failure, model ×{tl['no_failure_scale']} (paper: Criteo-8S, Figs. 6-9):\n")
    add("![no failure](fig6_9_no_failure.png)\n")
    add("| run | mean samples/s (train time) | steady samples/s | vs No FT |")
    add("|---|---:|---:|---:|")
    base = runs[tl["no_failure"][0]]
    for name in tl["no_failure"]:
        r = runs[name]
        mean = r["samples"] / r["train_s"] if r["train_s"] else float("nan")
        ratio = r["steady"] / base["steady"] if r["steady"] and base["steady"] else None
        steady = f"{r['steady']:,.0f}" if r["steady"] else "—"
        add(f"| {run_label(r)} | {mean:,.0f} | {steady} | {_f(ratio)} |")
    add(
        f"\nServer 1 killed mid-interval, model ×{tl['failure_scale']} (paper: failure at 15 min on Criteo-4S, "
        "Figs. 10-11):\n"
    )
    add("![failure](fig10_11_failure.png)\n")
    add(
        "| run | kill at | training resumed after kill | full recovery after kill | train time | samples/s kill→recovered / before |"
    )
    add("|---|---:|---:|---:|---:|---:|")
    for name in tl["failure"]:
        r = runs[name]
        if r["strategy"] == "ecrec":
            e = ecrec_recovery(_as_run(r))
            add(
                f"| {run_label(r)} | step {r['kill_step']} ({_s(e.get('killed_at'), 1)}) | {_s(e['continue_s'])} | "
                f"{_s(e['full_s'])} | {_s(r['train_s'], 1)} | {_f(e['during_ratio'])} |"
            )
        else:
            c = ckpt_recovery(_as_run(r), r["interval_steps"])
            add(
                f"| {run_label(r)} | step {r['kill_step']} ({_s(c.get('killed_at'), 1)}) | {_s(c['restore_s'])} "
                f"(lost {(c.get('steps_redone') or 0) // r['workers']} steps per worker, "
                f"{_f(c.get('lost_fraction_of_interval'))} of its interval) | {_s(c.get('measured_full_s'))} "
                "(progress regained) | "
                f"{_s(r['train_s'], 1)} | 0 until resumed |"
            )
    add(
        f"\nPaper: ECRec keeps throughput within {PAPER['recovery_throughput_drop'][0]:.0%}–"
        f"{PAPER['recovery_throughput_drop'][1]:.0%} of normal during recovery and continues within "
        f"{PAPER['continue_within_s']} s; checkpointing cannot train until it has restored.\n"
    )


def _recovery(results: dict, add) -> None:
    """Fig. 12: time to continue and to full recovery; lock-group granularity."""
    plan = results["plan"]
    rec = results["recovery"]
    add("## Time to continue and to full recovery (paper Fig. 12)\n")
    add("![recovery](fig12_recovery.png)\n")
    add(
        "| model | rows | config | time to continue | time to full recovery | of which: replacement process "
        "started | rebuild | throughput kill→recovered / before | parity mismatches |"
    )
    add("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rec["ecrec"]:
        add(
            f"| ×{r['scale']} | {r.get('rows', 0):,} | ECRec k={r['k']}, 1 lock group | {_s(r['continue_s'])} | "
            f"{_s(r['full_s'])} | {_s(r.get('replacement_s'))} | {_s(r['rebuild_s'])} | {_f(r['during_ratio'])}"
            f"{' (training ended first)' if r.get('training_ended_before_recovery') else ''} | "
            f"{r.get('parity_mismatches')} |"
        )
    add(
        "\nCheckpoint recovery (restore = kill → training resumes from the checkpoint, of which the replacement "
        "process's start is the first part; redo = until the samples trained at the kill are trained again):\n"
    )
    head = (
        "| model | replacement process started | restore (best case) | redo measured (steps per worker, of the interval) | Ckpt short average |"
        " Ckpt short worst |"
    )
    if plan["ckpt_long"]:
        head += " Ckpt long average | Ckpt long worst |"
    add(head)
    add("|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if plan["ckpt_long"] else ""))
    for r in rec["ckpt"]:
        line = (
            f"| ×{r['scale']} | {_s(r.get('replacement_s'))} | {_s(r.get('best_s'))} | {_s(r.get('redo_s'))} "
            f"({(r.get('steps_redone') or 0) // r.get('workers', 1)}, {_f(r.get('lost_fraction_of_interval'))}) | "
            f"{_s(r.get('average_s'))} | {_s(r.get('worst_s'))} |"
        )
        if plan["ckpt_long"]:
            line += f" {_s(r['long'].get('average_s'))} | {_s(r['long'].get('worst_s'))} |"
        add(line)
    add(
        "\nBest case: a failure right after a checkpoint (restore only); average: mid-interval; worst: right "
        "before the next checkpoint (a whole interval redone). The redo is measured once per model size (the "
        "mid-interval kill) and scaled to ½ and 1 interval by its rate per step (where the kill landed on a "
        "checkpoint and nothing was redone: the run's step rate before the kill); the long interval's cases use "
        "the same restore and rate with the long interval.\n"
    )
    sp = _speedups(results)
    if sp:
        add(
            "ECRec full recovery vs Ckpt's average case, speed-up ×(Ckpt average / ECRec full): "
            + "; ".join(f"{k}: {v}" for k, v in sp.items())
            + f". Paper: k=4 {PAPER['full_recovery_speedup_k4_vs_ckpt_long_avg'][0]}–"
            f"{PAPER['full_recovery_speedup_k4_vs_ckpt_long_avg'][1]}× vs Ckpt-60 and "
            f"{PAPER['full_recovery_speedup_k4_vs_ckpt_short_avg'][0]}–{PAPER['full_recovery_speedup_k4_vs_ckpt_short_avg'][1]}× "
            f"vs Ckpt-30, up to {PAPER['full_recovery_speedup_k2_max']}× with k=2.\n"
        )
    add("### Lock-group granularity (1 vs 10 groups)\n")
    add(
        "| model | k | full recovery, 1 group | full recovery, 10 groups | increase | rebuild, 1 group | rebuild, 10 groups | increase |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rec["lock_groups"]:
        add(
            f"| ×{r['scale']} | {r['k']} | {_s(r['one_group']['full_s'])} | {_s(r['ten_groups']['full_s'])} | "
            f"{_pct(r['full_increase'])} | {_s(r['one_group']['rebuild_s'])} | {_s(r['ten_groups']['rebuild_s'])} | "
            f"{_pct(r['rebuild_increase'])} |"
        )
    add(
        f"\nPaper (k=4, 10 locks vs 1): +{PAPER['lock10_increase']['Criteo-8S']:.1%} on Criteo-8S, "
        f"+{PAPER['lock10_increase']['Criteo-Original']:.1%} on Criteo-Original. Full recovery here includes "
        'starting the replacement process; "rebuild" is recovery_started → completed.\n'
    )


def _baselines(results: dict, add) -> None:
    """Fig. 13: ECRec vs Check-N-Run and CPR, overheads and accuracy after one failure."""
    plan = results["plan"]
    b = results["baselines"]
    add("## ECRec vs Check-N-Run and CPR (paper Fig. 13, §5.4)\n")
    add("![baselines](fig13_baselines.png)\n")
    if b["overhead"]:
        add(f"Without failure, model ×{plan['throughput_scale']}, short interval:\n")
        add(
            "| config | training-time overhead | from its pauses | checkpoints | mean pause | bytes written |"
        )
        add("|---|---:|---:|---:|---:|---:|")
        for r in b["overhead"]:
            add(
                f"| {r['config']} | {_pct(r['overhead'])} | {_pct(r.get('pause_overhead'))} | "
                f"{r['checkpoints'] or '—'} | {_s(r['mean_pause_s'], 3)} | "
                + (f"{r['bytes_written'] / 1e6:,.1f} MB |" if r["bytes_written"] else "— |")
            )
        cnr = b.get("checknrun_size") or {}
        add(
            f"\nCheck-N-Run vs full checkpoints: {_f((cnr.get('checknrun_bytes_per_checkpoint') or 0) / 1e6, 1)} MB "
            f"vs {_f((cnr.get('full_bytes_per_checkpoint') or 0) / 1e6, 1)} MB per checkpoint "
            f"(**{_f(cnr.get('size_reduction'))}× smaller**), write bandwidth "
            f"{_f((cnr.get('checknrun_write_bytes_per_s') or 0) / 1e6, 1)} vs "
            f"{_f((cnr.get('full_write_bytes_per_s') or 0) / 1e6, 1)} MB/s of training "
            f"(**{_f(cnr.get('bandwidth_reduction'))}× less**); committed {cnr.get('checknrun_committed')}. "
            f"Check-N-Run paper: {PAPER['checknrun_write_bandwidth_reduction'][0]}–"
            f"{PAPER['checknrun_write_bandwidth_reduction'][1]}× less write bandwidth, "
            f"{PAPER['checknrun_capacity_reduction'][0]}–{PAPER['checknrun_capacity_reduction'][1]}× less capacity. "
            f"ECRec paper (Fig. 13, analytical): Ckpt-30 needs more than "
            f"{PAPER['ckpt_short_compression_to_match_ecrec']:.0%} compression to match ECRec's overhead"
            + (
                f"; with our measured training-time overheads (first column) it needs "
                f"{_f(_compression_to_match(b) * 100, 0)}%"
                if _compression_to_match(b) is not None
                else ""
            )
            + ".\n"
        )
    else:
        add("(Not run: no jobs without failure for Check-N-Run and CPR in this plan or run.)\n")
    add("Accuracy after one failure, against No FT without failure.\n")
    for d in plan["accuracy_datasets"]:
        if d in plan["accuracy_deterministic"]:
            add(
                f"- {d}: jobs of their own, deterministic training with one worker: two runs that train the same "
                "updates end bit-identical (column \"params = No FT's\"), so a difference is the strategy's, not "
                "the interleaving's. Interval: a quarter of the run (the paper's four Ckpt-30 intervals in two "
                "hours), kill at 1½ intervals."
            )
        else:
            add(
                f"- {d}: the model ×{plan['scales'][0]} jobs above (two asynchronous workers, short interval, "
                "the same kill step): their AUC also differs by the interleaving of the workers' updates, "
                "about ±0.01 run to run here (docs/benchmarks.md)."
            )
    add("")
    add(
        "| data | config | failure | AUC | log-loss | ΔAUC vs No FT | Δlog-loss | params = No FT's | train time vs No FT | steps redone | CPR lost samples (PLS) |"
    )
    add("|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in b["accuracy"]:
        add(
            f"| {r['dataset']} | {r['config']} | {'step ' + str(r['kill_step']) if r['failure'] else 'none'} | "
            f"{r['auc']:.4f} | {r['logloss']:.4f} | {r['auc_delta']:+.4f} | {r['logloss_delta']:+.4f} | "
            f"{'yes' if r['same_params_as_noft'] else 'no'} | {_pct(r['time_vs_noft'])} | {r['steps_redone'] if r['steps_redone'] is not None else '—'} | "
            f"{_f(r['pls'], 4) if r['pls'] is not None else '—'} |"
        )
    refs = [r for r in b["accuracy"] if r.get("reference") and r["config"].startswith("No FT")]
    for r in refs:
        add(
            f"\nReference models on the {r['dataset']} split: "
            + "; ".join(
                f"{n.upper()} AUC {v['auc']:.4f}, log-loss {v['logloss']:.4f}"
                for n, v in r["reference"].items()
            )
            + "."
        )
    add(
        f"\nCPR paper: full recovery's checkpoint overhead {PAPER['cpr_overhead_full_recovery'][0]:.1%}–"
        f"{PAPER['cpr_overhead_full_recovery'][1]:.1%} vs CPR's {PAPER['cpr_overhead_cpr'][0]:.2%}–"
        f"{PAPER['cpr_overhead_cpr'][1]:.2%}, accuracy at most {PAPER['cpr_accuracy_drop_max']:.3%} worse. ECRec's "
        "accuracy claim: the same model as without failure.\n"
    )


def _load_and_ablations(results: dict, add) -> None:
    """§5.2: load per server, and the ablations of 2PC and dense replication."""
    add("## Server load balance (paper §5.2)\n")
    add("![load](load_balance.png)\n")
    add("| config | row updates per server | max/mean | max/min | paper max/min (Criteo-Original) |")
    add("|---|---|---:|---:|---:|")
    for r in results["load_balance"]:
        add(
            f"| {r['config']} | {', '.join(f'{w:,}' for w in r['updates_per_server'])} | {_f(r['max_over_mean'])} | "
            f"{_f(r['max_over_min'])} | {_f(r['paper_max_over_min'])} |"
        )
    add(
        "\nUpdates: embedding rows pushed (No FT) or staged plus parity deltas applied (ECRec), from each "
        'server\'s `ecrec_rows_total` at the end of training. The paper counts "updates" per server.\n'
    )
    add("## Ablations: 2PC and dense replication (paper §5.2)\n")
    if results["ablations"]:
        add("| config | training-time overhead | server RPCs per worker step | paper (Criteo-Original) |")
        add("|---|---:|---:|---:|")
        for r in results["ablations"]:
            add(
                f"| {r['config']} | {_pct(r['overhead'])} | {_f(r['rpcs_per_step'], 1)} | {_pct(r['paper']) if r['paper'] is not None else '—'} |"
            )
        add("")
    else:
        add("(Not run in this plan or run.)\n")


def _noise(results: dict, add) -> None:
    """The same job twice, and the CPU other processes took while each job ran."""
    plan, runs = results["plan"], results["runs"]
    add("## Noise and CPU contention\n")
    nz = results.get("noise")
    if nz:
        add(
            f"The same job twice (No FT ×{plan['scales'][0]}, first and last job of the invocation): training "
            f"times {nz['train_s'][0]:.2f} s and {nz['train_s'][1]:.2f} s ({_pct(nz['difference'])}). Differences "
            "of this size between two rows above are noise."
        )
    shares = [r.get("other_cpu_share") for r in runs.values() if r.get("other_cpu_share") is not None]
    busy = [n for n, r in runs.items() if (r.get("other_cpu_share") or 0) > CONTENDED]
    if shares:
        add(
            f"\nCPU used by processes outside the jobs while they ran (another engineer's test suite shares this "
            f"machine), as a share of both cores: median {statistics.median(shares):.0%}, max {max(shares):.0%}; "
            f"{len(busy)} of {len(shares)} jobs above {CONTENDED:.0%}"
            + (f" ({', '.join(busy)})" if busy else "")
            + ". Those jobs ran slower than they would alone; their ratios to the other rows are less reliable.\n"
        )
    add("| job | wall | training time | steady samples/s | other processes' CPU |")
    add("|---|---:|---:|---:|---:|")
    for n, r in runs.items():
        share = r.get("other_cpu_share")
        steady = f"{r['steady']:,.0f}" if r.get("steady") else "—"
        add(
            f"| {n} | {r['wall_s']:.0f} s | {r['train_s']:.1f} s | {steady} | "
            f"{f'{share:.0%}' if share is not None else '—'} |"
        )
    add("")


def _departures(add, figures: list[str]) -> None:
    """Where this bench departs from the papers, and the files."""
    add("## Departures from the papers\n")
    for d in DEPARTURES:
        add(f"- {d}")
    add(
        f"\nFigures: {', '.join(figures)}. Every number: results.json (`runs` holds each job's series and events).\n"
    )


def write_entry_width(results: dict, add, figures: list[str]) -> None:
    add("## Effect of entry width (paper §5.2)\n")
    ew = results.get("entry_width")
    if not ew or not ew.get("configs"):
        add("(Not run: the results are from a bench without this experiment, or its jobs were not run.)\n")
        return
    if "entry_width.png" in figures:
        add("![entry width](entry_width.png)\n")
    rows, k = ew["configs"], ew["k"]
    scale = results["plan"].get("entry_width_scale")
    add(
        f"ECRec k={k} on two models of one total size: 4S (model ×{scale} here) and 2S-2D (half its rows, each "
        "entry twice as wide; the bottom MLP's output widens with it, as the paper's NN input does). Each "
        "against a No FT job of the same model, with Fig. 5's measure (training time over No FT's, minus 1; "
        "the same samples, so No FT's samples/s over ECRec's, minus 1).\n"
    )
    add(
        f"| config | rows | dim | total floats | No FT samples/s | ECRec k={k} samples/s | overhead | "
        "CPU-adjusted | paper (k=4) |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        add(
            f"| {r['config']} | {r['rows']:,} | {r['dim']} | {r['floats']:,} | {_rate(r['noft_samples_per_s'])} | "
            f"{_rate(r['ecrec_samples_per_s'])} | {_pct(r['overhead'])} | {_pct(r.get('cpu_adjusted_overhead'))} | "
            f"{_pct(r['paper'])} |"
        )
    diff = ew.get("wide_minus_narrow")
    paper = PAPER["entry_width"]
    p_diff = paper["ECRec k=4 on Criteo-2S-2D"] - paper["ECRec k=4 on Criteo-4S"]
    text = (
        f"\nPaper: wider entries cost more, {p_diff * 100:+.0f} points (Criteo-2S-2D vs Criteo-4S): difference "
        "propagation moves every entry and its gradient, twice the bytes per entry. "
    )
    if diff is None:
        text += "Here one of the two configs is missing, so there is no comparison."
    else:
        text += f"Here 2S-2D's overhead is {diff * 100:+.1f} points vs 4S's: " + (
            "the same direction as the paper's" if diff > 0 else "not the paper's direction"
        )
        nz = results.get("noise")
        if nz and nz.get("difference") is not None and abs(diff) <= abs(nz["difference"]):
            text += (
                f', but within the noise of one job run twice ({_pct(nz["difference"])}, see "Noise and CPU '
                'contention"): this run does not resolve the direction'
            )
        text += "."
    add(text + "\n")


DEPARTURES = [
    "Scale: one 2-core machine runs the coordinator, 5 servers and 2 workers of every job as processes, where "
    "the paper had 5 32-vCPU servers and 15 V100 workers; a server's CPU is taken from the workers here, so "
    "ECRec's extra server work costs more throughput than in the paper (docs/benchmarks.md).",
    "Model and data: `examples/local-small.yaml` (107,200 rows × 16 at ×1, Adagrad) on synthetic Criteo-shaped "
    "data (Zipf ids, a random teacher's labels), not the 13-table MLPerf DLRM on Criteo Terabyte with SGD + "
    "momentum; MovieLens-100k for the accuracy comparison on real data.",
    "Time: jobs of seconds, not two hours; intervals and failure times scaled by the rule above.",
    "Checkpoints go to the local disk (the page cache, mostly), not HDFS: a checkpoint's time here is mostly "
    "serialization and the pause protocol.",
    "Check-N-Run and CPR run as implemented here (docs/protocol.md): Check-N-Run with 8-bit quantization and "
    "increments over baselines, decoupled; CPR without hot-row saves (hotRows none: they follow intervalSeconds "
    "and the jobs here use intervalSteps) and without its benefit analysis. The paper models them analytically; "
    "we run them, and draw the paper's analytical line from our measured Ckpt overhead.",
    "Check-N-Run's bandwidth is bytes written per second of training here; its paper's 6-17× also counts "
    "fewer checkpoints kept.",
    "Load balance: the paper reports most/least loaded server; we report that and max/mean.",
    "Time to full recovery for ECRec includes starting the replacement process (Python and torch on the same "
    "two cores); the paper's replacement server was already running.",
    "MovieLens accuracy jobs use one worker in deterministic mode (no asynchronous interleaving), so a strategy "
    "that recovers exactly ends bit-identical to No FT without failure; the paper trains asynchronously.",
]


def _as_run(d: dict) -> Run:
    return Run(**d)


def _growth(results: dict) -> dict:
    rows = results["overhead"]
    scales = sorted({r["scale"] for r in rows})
    if len(scales) < 2:
        return {}
    out = {}
    for c in dict.fromkeys(r["config"] for r in rows):
        if c == "No FT":
            continue
        a = next((r["overhead"] for r in rows if r["config"] == c and r["scale"] == scales[0]), None)
        z = next((r["overhead"] for r in rows if r["config"] == c and r["scale"] == scales[-1]), None)
        if a and z and a > 0:
            out[c] = z / a
    return out


def _speedups(results: dict) -> dict:
    rec = results["recovery"]
    out = {}
    for r in rec["ecrec"]:
        ck = next((c for c in rec["ckpt"] if c["scale"] == r["scale"]), None)
        if not ck or not r.get("full_s"):
            continue
        parts = []
        if ck.get("average_s"):
            parts.append(f"short {ck['average_s'] / r['full_s']:.2f}×")
        if ck.get("long", {}).get("average_s"):
            parts.append(f"long {ck['long']['average_s'] / r['full_s']:.2f}×")
        if parts:
            out[f"×{r['scale']} k={r['k']}"] = ", ".join(parts)
    return out


def _compression_to_match(b: dict) -> float | None:
    ov = {r["config"]: r for r in b["overhead"]}
    ck = ov.get("Ckpt short")
    ec = next((r for c, r in ov.items() if c.startswith("ECRec")), None)
    if not ck or not ec or ck["overhead"] <= 0:
        return None
    return max(0.0, 1 - ec["overhead"] / ck["overhead"])
