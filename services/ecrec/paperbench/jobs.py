"""The jobs the experiments share, named and sized by the scaling rule.

`Jobs` defines No FT, ECRec and checkpoint jobs of a model size (each run once through the `Runner`'s cache,
however many sections need it), calibrates one checkpoint's pause, and from it derives the short and long
intervals and the kill step of each model size; `PaperBench` (`ecrec.paperbench.experiments`) adds the
sections on top.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ecrec.bench import load_job_with
from ecrec.jobctx import JobContext
from ecrec.paperbench.paper import CKPT_TIME_OVER_SHORT_INTERVAL
from ecrec.paperbench.plan import KILL_LAG_S, Plan
from ecrec.paperbench.runner import Runner, job_path
from ecrec.paperbench.runs import Run


def _ecrec_sets(k: int, *extra: str) -> tuple[str, ...]:
    return (f"faultTolerance.ecrec.k={k}", *extra)


def ten_group_rows(rows: int, servers: int) -> int:
    return max(1, math.ceil(math.ceil(rows / servers) / 10))


class Jobs:
    """The shared jobs and the scaling rule (intervals, kill step) of one plan; `r` is the Runner."""

    def __init__(self, plan: Plan, work: Path, log=print, only_cached: bool = False):
        self.plan, self.log = plan, log
        self.r = Runner(plan, work, log, only_cached)
        self.intervals: dict = {}
        base = JobContext(load_job_with(job_path(plan.job), list(plan.sets)))
        self.servers = base.num_servers
        self.workers = base.spec.workers.replicas
        self.batch = base.spec.training.batch_size
        self.dim = base.model.dim
        self.table_sizes = list(base.spec.model.table_sizes or ())  # before scale

    def model_of(self, overrides: list[str]):
        """The model (rows, dim) of the plan's job with these overrides."""
        return JobContext(load_job_with(job_path(self.plan.job), [*self.plan.sets, *overrides])).model

    # -- the runs every section shares ----------------------------------------------------------------
    # `model`: overrides of the model's shape beyond `scale`, `tag` names them in the job's name (entry width)
    def noft(self, scale: int, model: tuple[str, ...] = (), tag: str = "") -> Run:
        return self.r.run(f"noft_x{scale}{tag}", strategy="none", scale=scale, sets=model)

    def ecrec(
        self,
        scale: int,
        k: int,
        kill: bool = False,
        groups: int = 1,
        extra: tuple = (),
        model: tuple[str, ...] = (),
        tag: str = "",
    ) -> Run:
        rows = self.model_of([f"model.scale={scale}", *model]).num_rows
        # one group: as large as the model, so one lock per shard (the paper's default)
        group_rows = rows if groups == 1 else ten_group_rows(rows, self.servers)
        sets = (*model, *_ecrec_sets(k, f"faultTolerance.ecrec.lockGroupRows={group_rows}", *extra))
        suffix = "".join(f"_{e.split('.')[-1].replace('=', '')}" for e in extra)
        name = f"ecrec_k{k}_x{scale}{tag}{suffix}" + (f"_kill_g{groups}" if kill else "")
        return self.r.run(
            name, strategy="ecrec", scale=scale, sets=sets, kill_step=self.kill_step(scale) if kill else None
        )

    def ckpt(self, scale: int, which: str = "short", strategy: str = "checkpoint", kill: bool = False) -> Run:
        name = f"{strategy}_{which}_x{scale}" + ("_kill" if kill else "")
        return self.r.run(
            name,
            strategy=strategy,
            scale=scale,
            interval_steps=self.interval_steps(scale, which),
            kill_step=self.kill_step(scale) if kill else None,
        )

    # -- the scaling rule ------------------------------------------------------------------------------
    def calibrate(self) -> dict:
        """Measure one checkpoint's pause at ×1; the short interval is pause / 0.09 seconds (the paper's
        checkpoint time / Ckpt-30 interval on Criteo-Original), the long one twice that."""
        noft = self.noft(1)
        provisional = max(2, self.plan.steps // 8)
        cal = self.r.run("checkpoint_calibration_x1", strategy="checkpoint", interval_steps=provisional)
        pauses = [
            e["pause_seconds"]
            for e in cal.events
            if e["kind"] == "checkpoint_committed"
            and not e.get("final")
            and e.get("pause_seconds") is not None
        ]
        pause = statistics.median(pauses) if pauses else float("nan")
        short_s = pause / CKPT_TIME_OVER_SHORT_INTERVAL
        self.intervals = {
            "calibration_pause_s": pause,
            "calibration_pauses_s": pauses,
            "ckpt_time_over_short_interval_paper": CKPT_TIME_OVER_SHORT_INTERVAL,
            "short_s": short_s,
            "long_s": 2 * short_s,
            "provisional_steps": provisional,
            "noft_x1_train_s": noft.train_s,
        }
        if not self.plan.calibrate:  # quick: the calibration run is Ckpt short, at its provisional interval
            self.r.runs["checkpoint_short_x1"] = cal
            self.intervals["quick_fixed_steps"] = provisional
        self.log(f"  checkpoint pause at ×1 {pause:.3f}s -> intervals {short_s:.2f}s / {2 * short_s:.2f}s")
        return self.intervals

    def step_rate(self, scale: int) -> float:
        """No FT steps per second per worker at this model size (the interval's seconds -> steps)."""
        n = self.noft(scale)
        return self.plan.steps / n.train_s

    def interval_steps(self, scale: int, which: str) -> int:
        if not self.plan.calibrate:
            return self.intervals["quick_fixed_steps"] * (2 if which == "long" else 1)
        seconds = self.intervals["short_s"] * (2 if which == "long" else 1)
        return max(2, round(seconds * self.step_rate(scale)))

    def kill_step(self, scale: int) -> int:
        """Mid-interval of the short interval, about a third into the run (paper: 15 min into 2 h, half of
        Ckpt-30's interval); the same step for every strategy at this model size. The launcher kills once the
        coordinator has seen the step, which it learns from reports every 0.5 s and polls every 0.25 s: aim
        KILL_LAG_S of steps early so that the kill lands mid-interval on average (the report says where each
        landed)."""
        i = self.interval_steps(scale, "short")
        m = max(1, int(0.3 * self.plan.steps / i))
        lag = round(KILL_LAG_S * self.step_rate(scale))
        return min(self.plan.steps - 1, m * i + max(1, i // 2 - lag))
