"""The experiments (the report's sections): each runs what it needs (through the Runner's cache) and returns
its numbers; `PaperBench.run_all` runs every one and gathers results.json."""

from __future__ import annotations

import math
import time
from dataclasses import asdict

from ecrec.bench import load_job_with
from ecrec.jobctx import JobContext
from ecrec.local import machine_description
from ecrec.paperbench.jobs import Jobs, _ecrec_sets
from ecrec.paperbench.metrics import (
    _committed,
    _increase,
    _mean_pause,
    checknrun_size,
    ckpt_cases,
    ckpt_recovery,
    cpu_adjusted_overhead,
    ecrec_recovery,
    load_of,
    pause_overhead,
)
from ecrec.paperbench.paper import PAPER
from ecrec.paperbench.runner import Skipped, job_path
from ecrec.paperbench.runs import ckpt_label


def _unless_skipped(fn, empty):
    """fn(), or `empty` where it needed a job that was not run (--only-cached)."""
    try:
        return fn()
    except Skipped:
        return empty


class PaperBench(Jobs):
    """The paper's evaluation: Fig. 5's overheads, Figs. 6-13, load balance, ablations, entry width, the
    baselines' accuracy, and the noise of one job run twice."""

    # -- Fig. 5 ------------------------------------------------------------------------------------------
    def configs(self) -> list[tuple[str, callable]]:
        out = [("No FT", self.noft)]
        out += [(f"ECRec k={k}", lambda s, k=k: self.ecrec(s, k)) for k in self.plan.ks]
        out.append(("Ckpt short", lambda s: self.ckpt(s, "short")))
        if self.plan.ckpt_long:
            out.append(("Ckpt long", lambda s: self.ckpt(s, "long")))
        return out

    def overhead(self) -> list[dict]:
        rows = []
        for scale in self.plan.scales:
            base = self.noft(scale)
            for label, fn in self.configs():
                run = fn(scale)
                rows.append(
                    {
                        "config": label,
                        "scale": scale,
                        "rows": run.rows,
                        "run": run.name,
                        "train_s": run.train_s,
                        "overhead": run.train_s / base.train_s - 1,
                        "steady_vs_noft": run.steady / base.steady if base.steady else float("nan"),
                        "interval_steps": run.interval_steps,
                        "checkpoints": _committed(run),
                        "mean_pause_s": _mean_pause(run),
                        "pause_overhead": pause_overhead(run),
                        "rpcs_per_step": run.rpcs_per_step,
                    }
                )
        return rows

    # -- Figs. 6-11 ----------------------------------------------------------------------------------------
    def timelines(self) -> dict:
        s = self.plan.throughput_scale
        normal = [fn(s).name for _label, fn in self.configs()]
        f = self.plan.failure_scale
        jobs = [lambda: self.ecrec(f, self.plan.k_main, kill=True), lambda: self.ckpt(f, "short", kill=True)]
        if self.plan.ckpt_long:
            jobs.append(lambda: self.ckpt(f, "long", kill=True))
        failure = [r.name for r in (_unless_skipped(j, None) for j in jobs) if r is not None]
        return {"no_failure_scale": s, "no_failure": normal, "failure_scale": f, "failure": failure}

    # -- Fig. 12 -----------------------------------------------------------------------------------------
    def recovery(self) -> dict:
        ecrec, ckpt = [], []
        for scale in self.plan.scales:
            for k in self.plan.ks:
                run = _unless_skipped(lambda scale=scale, k=k: self.ecrec(scale, k, kill=True), None)
                if run is not None:
                    ecrec.append({"k": k, "scale": scale, **ecrec_recovery(run)})
            run = _unless_skipped(lambda scale=scale: self.ckpt(scale, "short", kill=True), None)
            if run is None:
                continue
            row = {"scale": scale, **ckpt_recovery(run, self.interval_steps(scale, "short"))}
            if self.plan.ckpt_long:
                long_i = self.interval_steps(scale, "long")
                row["long"] = ckpt_cases(row, long_i)
            ckpt.append(row)
        locks = []
        for scale in self.plan.lock_scales:
            pair = _unless_skipped(
                lambda scale=scale: [
                    self.ecrec(scale, self.plan.k_main, kill=True, groups=g) for g in (1, 10)
                ],
                None,
            )
            if pair is None:
                continue
            one, ten = pair
            a, b = ecrec_recovery(one), ecrec_recovery(ten)
            locks.append(
                {
                    "scale": scale,
                    "k": self.plan.k_main,
                    "one_group": a,
                    "ten_groups": b,
                    "full_increase": _increase(a["full_s"], b["full_s"]),
                    "rebuild_increase": _increase(a["rebuild_s"], b["rebuild_s"]),
                }
            )
        return {"ecrec": ecrec, "ckpt": ckpt, "lock_groups": locks}

    # -- §5.2 load balance and ablations -------------------------------------------------------------------
    def load_balance(self) -> list[dict]:
        scale = self.plan.scales[0]
        out = [load_of("No FT", self.noft(scale))]
        out += [load_of(f"ECRec k={k}", self.ecrec(scale, k)) for k in self.plan.ks]
        return out

    def ablations(self) -> list[dict]:
        if not self.plan.ablations:
            return []
        scale, k = self.plan.scales[0], self.plan.k_main
        base = self.noft(scale)
        cases = [
            ("ECRec k=4", self.ecrec(scale, k)),
            (
                "no dense replication",
                self.ecrec(scale, k, extra=("faultTolerance.ecrec.replicateDense=false",)),
            ),
            (
                "no dense replication, no 2PC",
                self.ecrec(
                    scale,
                    k,
                    extra=(
                        "faultTolerance.ecrec.replicateDense=false",
                        "faultTolerance.ecrec.twoPhaseCommit=false",
                    ),
                ),
            ),
        ]
        return [
            {
                "config": label.replace("k=4", f"k={k}"),
                "run": r.name,
                "overhead": r.train_s / base.train_s - 1,
                "rpcs_per_step": r.rpcs_per_step,
                "paper": PAPER["ablation_original"].get(label),
            }
            for label, r in cases
        ]

    # -- §5.2 effect of entry width -------------------------------------------------------------------------
    def entry_width_models(self) -> list[tuple[str, int, tuple[str, ...], str]]:
        """(config, scale, model overrides, job-name tag) of the two models of one total size: "4S" (the
        plan's model at `entry_width_scale`) and "2S-2D" (half its rows, entries twice as wide)."""
        s, wide_dim = self.plan.entry_width_scale, 2 * self.dim
        # the preset's bottom MLP follows embeddingDim (its last width is the entry's): the NN's input
        # widens with the entries, as in the paper's Criteo-2S-2D
        wide = (f"model.embeddingDim={wide_dim}",)
        if s % 2 == 0:
            return [("4S", s, (), ""), ("2S-2D", s // 2, wide, f"_dim{wide_dim}")]
        # an odd scale has no half in model.scale: halve the tables themselves (quick: model ×1 is "4S")
        half = ",".join(str(math.ceil(n / 2)) for n in self.table_sizes)
        return [
            ("4S", s, (), ""),
            ("2S-2D", s, (f"model.tableSizes=[{half}]", *wide), f"_halfrows_dim{wide_dim}"),
        ]

    def entry_width(self) -> dict:
        """ECRec's overhead on 4S and 2S-2D, each against a No FT job of the same model, as Fig. 5's."""
        k = self.plan.k_main
        configs = []
        for config, scale, model, tag in self.entry_width_models():
            pair = _unless_skipped(
                lambda scale=scale, model=model, tag=tag: (
                    self.noft(scale, model, tag),
                    self.ecrec(scale, k, model=model, tag=tag),
                ),
                None,
            )
            if pair is None:
                continue
            base, run = pair
            m = JobContext(load_job_with(job_path(self.plan.job), base.overrides)).model
            row = {
                "config": config,
                "paper_config": f"Criteo-{config}",
                "scale": scale,
                "rows": m.num_rows,
                "dim": m.dim,
                "floats": m.num_rows * m.dim,  # embedding values, optimizer state aside
                "base_run": base.name,
                "run": run.name,
                "noft_samples_per_s": base.samples / base.train_s if base.train_s else None,
                "ecrec_samples_per_s": run.samples / run.train_s if run.train_s else None,
                # Fig. 5's measure: train time over No FT's (the same samples), minus 1
                "overhead": run.train_s / base.train_s - 1,
                "throughput_loss": 1 - base.train_s / run.train_s,
                "rpcs_per_step": run.rpcs_per_step,
                "paper": PAPER["entry_width"].get(f"ECRec k=4 on Criteo-{config}"),
            }
            row["cpu_adjusted_overhead"] = cpu_adjusted_overhead(
                {base.name: asdict(base), run.name: asdict(run)}, row
            )
            configs.append(row)
        by = {r["config"]: r for r in configs}
        diff = by["2S-2D"]["overhead"] - by["4S"]["overhead"] if len(by) == 2 else None
        return {"k": k, "configs": configs, "wide_minus_narrow": diff}

    # -- Fig. 13, Check-N-Run, CPR -------------------------------------------------------------------------
    def baselines(self) -> dict:
        out: dict = {"overhead": [], "accuracy": [], "checknrun_size": None}
        if self.plan.baselines_no_failure:
            out.update(_unless_skipped(self.baseline_overheads, {}))
        for dataset in self.plan.accuracy_datasets:
            out["accuracy"].extend(_unless_skipped(lambda d=dataset: self.accuracy(d), []))
        return out

    def baseline_overheads(self) -> dict:
        out: dict = {"overhead": []}
        s = self.plan.throughput_scale
        base = self.noft(s)
        for label, run in [
            (f"ECRec k={self.plan.k_main}", self.ecrec(s, self.plan.k_main)),
            ("Ckpt short", self.ckpt(s, "short")),
            ("Check-N-Run short", self.ckpt(s, "short", strategy="checknrun")),
            ("CPR short", self.ckpt(s, "short", strategy="cpr")),
        ]:
            out["overhead"].append(
                {
                    "config": label,
                    "run": run.name,
                    "overhead": run.train_s / base.train_s - 1,
                    "bytes_written": (run.checkpointing or {}).get("bytesWritten"),
                    "checkpoints": _committed(run),
                    "mean_pause_s": _mean_pause(run),
                    "pause_overhead": pause_overhead(run),
                }
            )
        full, cnr = self.ckpt(s, "short"), self.ckpt(s, "short", strategy="checknrun")
        out["checknrun_size"] = checknrun_size(full, cnr)
        return out

    def accuracy(self, dataset: str) -> list[dict]:
        """Final AUC/log-loss with a failure against No FT without one. Deterministic (one worker): a run
        that must equal No FT does so bit for bit, and a difference is the strategy's, not noise."""
        plan = self.plan
        sets: tuple[str, ...] = ()
        if dataset == "movielens100k":
            sets = ("model.preset=movielens100k", "data.source=movielens100k", "data.evalSamples=20000")
        deterministic = dataset in plan.accuracy_deterministic
        if deterministic:
            sets = (*sets, "training.deterministic=true", "workers.replicas=1")
        k = plan.k_main
        if not deterministic:
            assert dataset == "synthetic", "only the synthetic data has jobs above to reuse"
            # the same jobs as the figures above (quick): model ×1, the short interval, the same kill step
            s = plan.scales[0]
            runs = [("No FT, no failure", self.noft(s)), (f"ECRec k={k}", self.ecrec(s, k, kill=True))]
            runs += [
                (ckpt_label(st), self.ckpt(s, "short", strategy=st, kill=True))
                for st in ("checkpoint", "checknrun", "cpr")
            ]
        else:
            steps = plan.accuracy_steps[dataset]
            interval = max(2, steps // 4)  # the paper's run: four Ckpt-30 intervals in two hours
            kill = int(1.5 * interval)  # mid-interval, after the first checkpoint
            tag = f"acc_{dataset}"
            runs = [("No FT, no failure", self.r.run(f"{tag}_noft", strategy="none", sets=sets, steps=steps))]
            ecrec_sets = (*sets, *_ecrec_sets(k))
            runs.append(
                (
                    f"ECRec k={k}",
                    self.r.run(
                        f"{tag}_ecrec", strategy="ecrec", sets=ecrec_sets, steps=steps, kill_step=kill
                    ),
                )
            )
            for strategy in ("checkpoint", "checknrun", "cpr"):
                run = self.r.run(
                    f"{tag}_{strategy}",
                    strategy=strategy,
                    sets=sets,
                    steps=steps,
                    interval_steps=interval,
                    kill_step=kill,
                )
                runs.append((ckpt_label(strategy), run))
        base = runs[0][1]
        out = []
        for label, r in runs:
            ck = r.checkpointing or {}
            out.append(
                {
                    "dataset": dataset,
                    "deterministic": deterministic,
                    "config": label,
                    "run": r.name,
                    "failure": r.kill_step is not None,
                    "kill_step": r.kill_step,
                    "interval_steps": r.interval_steps,
                    "auc": r.eval["auc"],
                    "logloss": r.eval["logloss"],
                    "auc_delta": r.eval["auc"] - base.eval["auc"],
                    "logloss_delta": r.eval["logloss"] - base.eval["logloss"],
                    "same_params_as_noft": r.params_sha256 == base.params_sha256,
                    "train_s": r.train_s,
                    "time_vs_noft": r.train_s / base.train_s - 1,
                    "steps_redone": ck.get("stepsRedone"),
                    "pls": ck.get("portionOfLostSamples"),
                    "reference": r.eval.get("reference"),
                }
            )
        return out

    def noise(self) -> dict:
        """No FT ×1 once more, last: how much the same job's training time moves within one invocation."""
        s = self.plan.scales[0]
        first = self.noft(s)
        again = self.r.run(f"noft_x{s}_repeat", strategy="none", scale=s)
        return {
            "runs": [first.name, again.name],
            "train_s": [first.train_s, again.train_s],
            "difference": again.train_s / first.train_s - 1,
        }

    # -- everything --------------------------------------------------------------------------------------
    def run_all(self) -> dict:
        t0 = time.monotonic()
        intervals = self.calibrate()
        results = {
            "plan": asdict(self.plan),
            "machine": machine_description(),
            "intervals": intervals,
            "overhead": self.overhead(),
            "timelines": self.timelines(),
            "recovery": self.recovery(),
            "load_balance": self.load_balance(),
            "ablations": _unless_skipped(self.ablations, []),
            "entry_width": self.entry_width(),
            "baselines": self.baselines(),
            "noise": _unless_skipped(self.noise, None),
            "paper": PAPER,
        }
        results["runs"] = {name: asdict(r) for name, r in self.r.runs.items()}
        results["reused_jobs"] = self.r.reused
        results["skipped_jobs"] = self.r.skipped
        results["wall_s"] = round(time.monotonic() - t0, 1)
        return results
