"""`ecrec bench paper`: the ECRec paper's evaluation (§5, Figs. 5-13) in one run, scaled down to one machine.

One invocation runs every job it needs through `ecrec local`'s `run_local` (each job once: a run serves every
figure that needs it), then writes `results.json` (the numbers), PNG figures and `report.md` (the numbers
beside the paper's, the scaling rule, the departures) into `--out`. Ratios compare runs of one invocation;
absolute numbers hold only for the machine named in the report.

The scaling rule (README of the report says it again): the paper trains Criteo-Original (220 GB) and its
2S/4S/8S variants for two hours with checkpoints every 30 (Ckpt-30) or 60 minutes (Ckpt-60); its Fig. 5 puts
Ckpt-30's overhead at 65% on 8S, 7.2x what it is on Original, so one checkpoint of Original takes about
0.09 of a 30-minute interval. Here model ×1 is `examples/local-small.yaml` (×2, ×4, ×8 multiply every table,
as `model.scale`); a calibration run measures the pause of one checkpoint of ×1, and the short interval is
that pause / 0.09, the long one twice it: checkpoint time / interval of ×1 is the paper's. Intervals are
given to the jobs in steps (`intervalSteps`: the short interval's seconds at the No FT step rate of the same
model size), so every rank checkpoints at the same step and a failure "mid-interval" (the paper's failure at
15 minutes, half of Ckpt-30's interval) is a kill at a step: (m + 1/2) short intervals.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ecrec.bench import _run, load_job_with, rpcs_per_step, steady_rate
from ecrec.jobctx import JobContext
from ecrec.local import machine_description, row_work
from ecrec.local import server_rows as local_server_rows

# ---------------------------------------------------------------------------------------------------------
# The papers' own numbers, each with where it is stated. Nothing else in the report is typed in by hand.

PAPER = {
    "setup": "5 servers (r5n.8xlarge, 32 vCPU, 25 Gbps), 15 V100 workers, batch 2048, Criteo Terabyte (1 day "
    "sampled), MLPerf DLRM, SGD with momentum, 2-hour runs, checkpoints to HDFS (§5.1)",
    # Fig. 5 / §5.2 text: Criteo-8S overheads and the growth from Criteo-Original to Criteo-8S
    "overhead_8S": {"ECRec k=4": 0.22, "Ckpt short": 0.65, "Ckpt long": 0.31},
    "overhead_growth_1_to_8": {"ECRec k=4": 1.2, "Ckpt short": 7.2, "Ckpt long": 7.0},
    "overhead_original_ecrec_k4": 0.182,  # §5.2 ablation, Criteo-Original
    "ablation_original": {
        "ECRec k=4": 0.182,
        "no dense replication": 0.052,
        "no dense replication, no 2PC": 0.026,
    },
    "entry_width": {"ECRec k=4 on Criteo-4S": 0.22, "ECRec k=4 on Criteo-2S-2D": 0.27},
    # §5.2 load balance: most- over least-loaded server's updates, Criteo-Original
    "load_max_over_min": {"No FT": 2.28, "ECRec k=2": 1.64, "ECRec k=4": 1.58},
    # §5.3 / Fig. 10-12
    "recovery_throughput_drop": [0.07, 0.13],
    "continue_within_s": 30,
    "full_recovery_speedup_k4_vs_ckpt_long_avg": [1.2, 6.7],
    "full_recovery_speedup_k4_vs_ckpt_short_avg": [0.8, 3.5],
    "full_recovery_speedup_k2_max": 9.8,
    "lock10_increase": {"Criteo-8S": 0.065, "Criteo-Original": 0.248},
    # Fig. 13 / §5.4: analytical model, Criteo-8S
    "ckpt_short_compression_to_match_ecrec": 0.60,
    # Check-N-Run (Eisenman et al.), abstract and §6.3: write bandwidth and capacity vs full checkpoints
    "checknrun_write_bandwidth_reduction": [6, 17],
    "checknrun_capacity_reduction": [2.5, 8],
    # CPR (Maeng et al.), abstract: checkpoint-related overhead, full recovery vs CPR-MFU/SSU (emulation)
    "cpr_overhead_full_recovery": [0.082, 0.085],
    "cpr_overhead_cpr": [0.0053, 0.0068],
    "cpr_accuracy_drop_max": 0.00017,
}
# One checkpoint of Criteo-Original takes this fraction of Ckpt-30's interval (Fig. 5: 0.65 / 7.2).
CKPT_TIME_OVER_SHORT_INTERVAL = (
    PAPER["overhead_8S"]["Ckpt short"] / PAPER["overhead_growth_1_to_8"]["Ckpt short"]
)

# A job during which other processes used more than this share of the cores is flagged in the report.
CONTENDED = 0.10
# How long after a worker trains a step the launcher acts on it: reports every 0.5 s, status polled every 0.25 s.
KILL_LAG_S = 0.4


@dataclass(frozen=True)
class Plan:
    """What one invocation runs. `quick` is the reduced set the test suite runs."""

    name: str
    job: str = "examples/local-small.yaml"
    sets: tuple[str, ...] = ()
    scales: tuple[int, ...] = (1, 2, 4, 8)
    ks: tuple[int, ...] = (2, 4)
    steps: int = 300  # per worker, every model size
    failure_scale: int = 4  # Figs. 10-11 (paper: Criteo-4S)
    throughput_scale: int = 8  # Figs. 6-9 and 13 (paper: Criteo-8S)
    lock_scales: tuple[int, ...] = (1, 8)
    # §5.2 effect of entry width: "4S" is the model at this scale and the plan's dim (Fig. 5's jobs when the
    # scale is among `scales`), "2S-2D" half its rows at twice the dim: the same total size (paper: Criteo-4S
    # vs Criteo-2S-2D)
    entry_width_scale: int = 4
    ckpt_long: bool = True
    ablations: bool = True
    baselines_no_failure: bool = True  # Fig. 13's overheads: checknrun and cpr without failure
    accuracy_datasets: tuple[str, ...] = ("synthetic", "movielens100k")
    # Datasets whose accuracy jobs are their own, deterministic with one worker (no interleaving noise: a
    # strategy that recovers exactly ends bit-identical to No FT); the others reuse the ×1 jobs above.
    accuracy_deterministic: tuple[str, ...] = ("movielens100k",)
    accuracy_steps: dict = field(default_factory=lambda: {"movielens100k": 320})
    # Ckpt at the calibrated intervals (quick: no; the calibration job is Ckpt short, at its interval)
    calibrate: bool = True
    # Contention (the machine is shared): wait up to this long for a quiet machine before each job, and run a
    # job again (at most `retries` times in the invocation) when other processes took more than CONTENDED of
    # the cores while it ran; the job with less contention is kept.
    quiet_wait_s: float = 10.0
    retries: int = 4

    @property
    def k_main(self) -> int:
        return max(self.ks)


FULL = Plan("full")
QUICK = Plan(
    "quick",
    sets=("model.preset=tiny", "servers.replicas=3", "workers.replicas=1", "faultTolerance.ecrec.k=2"),
    scales=(1,),
    ks=(2,),
    steps=60,
    failure_scale=1,
    throughput_scale=1,
    lock_scales=(),
    entry_width_scale=1,  # 4S is the ×1 jobs above: two jobs more, the 2S-2D pair
    ckpt_long=False,
    ablations=False,
    baselines_no_failure=False,
    accuracy_datasets=("synthetic",),
    accuracy_deterministic=(),
    accuracy_steps={},
    calibrate=False,
    quiet_wait_s=0.0,
    retries=0,
)


# ---------------------------------------------------------------------------------------------------------
# Runs


def job_path(job: str) -> str:
    """The plan's job file, relative to the working directory or else to the source checkout."""
    if Path(job).exists():
        return job
    return str(Path(__file__).resolve().parents[2] / job)


def ckpt_label(strategy: str) -> str:
    return {"checkpoint": "Ckpt", "checknrun": "Check-N-Run", "cpr": "CPR"}[strategy]


@dataclass
class Run:
    """One job's numbers: what the report of `run_local` says, plus the progress the bench recorded."""

    name: str
    strategy: str
    scale: int
    rows: int
    workers: int
    batch: int
    overrides: list[str]
    kill_step: int | None
    wall_s: float  # this run's wall time, start-up and evaluation included
    train_s: float  # time to train every sample (first report of the total): the paper's training time
    elapsed_s: float
    samples: int
    samples_per_s: float
    steady: float
    rpcs_per_step: float
    throughput_series: list
    progress_series: list  # [t, samples] as the coordinator's status said, every ~0.25 s
    events: list
    recoveries: list
    checkpointing: dict | None
    eval: dict
    params_sha256: str
    parity_mismatches: int | None
    server_rows: list[dict]  # per shard: rows pulled/pushed/staged/deltas (ecrec_rows_total), end of training
    interval_steps: int | None = None
    # CPU-seconds that processes outside this job used per second of the job, over the cores: contention
    other_cpu_share: float | None = None
    attempts: int = 1  # runs of this job (more than one: the first were contended)


def machine_busy_seconds() -> float:
    """CPU-seconds every process of the machine has used (busy jiffies in /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_quiet(max_wait: float, window: float = 1.0) -> float:
    """Wait (at most `max_wait` s) until processes outside this one used less than CONTENDED of the cores over
    `window` s; the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_wait:
        busy0, own0 = machine_busy_seconds(), own_cpu_seconds()
        time.sleep(window)
        other = (machine_busy_seconds() - busy0) - (own_cpu_seconds() - own0)
        if other / (window * (os.cpu_count() or 1)) < CONTENDED:
            break
    return time.monotonic() - t0


def own_cpu_seconds() -> float:
    """CPU-seconds of this process and its waited-for children (every process of a finished job)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Skipped(Exception):
    """A job not run: --only-cached and it is not in runs.json."""


class Runner:
    """Runs jobs once each (by name) and keeps their numbers."""

    def __init__(self, plan: Plan, work: Path, log=print, only_cached: bool = False):
        self.plan, self.work, self.log = plan, work, log
        self.only_cached = only_cached
        self.skipped: list[str] = []  # only_cached: the jobs that were not in runs.json
        self.runs: dict[str, Run] = {}
        self.started = time.monotonic()
        # Jobs finished by an earlier invocation with the same --work and the same settings are not run again.
        self.saved = work / "runs.json"
        self.done: dict[str, dict] = json.loads(self.saved.read_text()) if self.saved.exists() else {}
        self.retries_left = plan.retries
        self.reused: list[str] = []  # jobs taken from an earlier invocation's runs.json

    def run(
        self,
        name: str,
        *,
        strategy: str,
        scale: int = 1,
        sets: tuple[str, ...] = (),
        kill_step: int | None = None,
        steps: int | None = None,
        interval_steps: int | None = None,
    ) -> Run:
        if name in self.runs:
            return self.runs[name]
        overrides = [
            *self.plan.sets,
            f"model.scale={scale}",
            f"training.steps={steps or self.plan.steps}",
            f"faultTolerance.strategy={strategy}",
            *sets,
        ]
        if interval_steps is not None:
            overrides.append(f"faultTolerance.{strategy}.intervalSteps={interval_steps}")
        old = self.done.get(name)
        if old is not None and old["overrides"] == overrides and old["kill_step"] == kill_step:
            self.runs[name] = Run(**old)
            self.reused.append(name)
            self.log(f"  {name}: from {self.saved}")
            return self.runs[name]
        if self.only_cached:
            if name not in self.skipped:
                self.skipped.append(name)
            raise Skipped(name)
        run = self._once(name, strategy, scale, overrides, kill_step, interval_steps)
        if run.other_cpu_share > CONTENDED and self.retries_left > 0:
            self.retries_left -= 1
            self.log(f"  {name}: other processes took {run.other_cpu_share:.0%} of the CPU; once more")
            again = self._once(name, strategy, scale, overrides, kill_step, interval_steps)
            again.attempts = run.attempts + 1
            run = (
                again
                if again.other_cpu_share < run.other_cpu_share
                else replace(run, attempts=again.attempts)
            )
        self.runs[name] = run
        self.done[name] = asdict(run)
        self.saved.write_text(json.dumps(self.done))
        minutes = (time.monotonic() - self.started) / 60
        self.log(
            f"  [{minutes:5.1f} min] {name}: train {run.train_s:.1f}s, steady {run.steady:,.0f} samples/s, "
            f"AUC {run.eval['auc']:.4f} (run {run.wall_s:.0f}s, other processes' CPU {run.other_cpu_share:.0%})"
        )
        return run

    def _once(
        self,
        name: str,
        strategy: str,
        scale: int,
        overrides: list[str],
        kill_step: int | None,
        interval_steps: int | None,
    ) -> Run:
        if self.plan.quiet_wait_s:
            wait_quiet(self.plan.quiet_wait_s)
        ctx = JobContext(load_job_with(job_path(self.plan.job), overrides))
        progress: list[list[float]] = []
        server_rows: list[dict] = []

        def on_tick(_cluster, status: dict) -> None:
            if status.get("startedAt"):
                progress.append([round(time.time() - status["startedAt"], 3), status["samples"]])
            if status["phase"] == "Succeeded" and not server_rows:
                server_rows.extend(local_server_rows(status["cluster"]))

        out = self.work / name
        kills = [(1, f"step:{kill_step}")] if kill_step is not None else []
        t0, busy0, own0 = time.monotonic(), machine_busy_seconds(), own_cpu_seconds()
        report = _run(ctx, out, kills=kills, on_tick=on_tick)
        wall = time.monotonic() - t0
        other = (machine_busy_seconds() - busy0) - (own_cpu_seconds() - own0)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)  # large, and read from the report already
        total = report["spec"]["training"]["steps"] * ctx.spec.workers.replicas * ctx.spec.training.batch_size
        run = Run(
            name=name,
            strategy=strategy,
            scale=scale,
            rows=ctx.model.num_rows,
            workers=ctx.spec.workers.replicas,
            batch=ctx.spec.training.batch_size,
            overrides=overrides,
            kill_step=kill_step,
            wall_s=round(wall, 1),
            train_s=time_to_samples(progress, total, report["elapsed_s"]),
            elapsed_s=report["elapsed_s"],
            samples=report["samples"],
            samples_per_s=report["samples_per_s"],
            steady=steady_rate(report),
            rpcs_per_step=rpcs_per_step(report),
            throughput_series=report["throughput_series"],
            progress_series=progress,
            events=[e for e in report["events"] if e["kind"] != "registered"],
            recoveries=report.get("recoveries", []),
            checkpointing=report.get("checkpointing"),
            eval=report["eval"],
            params_sha256=report["params_sha256"],
            parity_mismatches=report.get("parity_check", {}).get("mismatches"),
            server_rows=server_rows,
            interval_steps=interval_steps,
            other_cpu_share=round(min(1.0, max(0.0, other) / (wall * (os.cpu_count() or 1))), 3),
        )
        return run


def time_to_samples(progress: list, total: int, fallback: float) -> float:
    """Seconds from training start until the coordinator first reported every sample trained."""
    for t, n in progress:
        if n >= total:
            return t
    return fallback


# ---------------------------------------------------------------------------------------------------------
# The sections: each runs what it needs (through the Runner's cache) and returns its numbers.


def _ecrec_sets(k: int, *extra: str) -> tuple[str, ...]:
    return (f"faultTolerance.ecrec.k={k}", *extra)


def ten_group_rows(rows: int, servers: int) -> int:
    return max(1, math.ceil(math.ceil(rows / servers) / 10))


def _unless_skipped(fn, empty):
    """fn(), or `empty` where it needed a job that was not run (--only-cached)."""
    try:
        return fn()
    except Skipped:
        return empty


class PaperBench:
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


# ---------------------------------------------------------------------------------------------------------
# Numbers out of one run


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


# ---------------------------------------------------------------------------------------------------------
# Figures


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


def run_label(run: dict) -> str:
    if run["strategy"] == "none":
        return "No FT"
    if run["strategy"] == "ecrec":
        k = next(o for o in run["overrides"] if o.startswith("faultTolerance.ecrec.k=")).split("=")[1]
        return f"ECRec k={k}"
    which = "long" if "_long_" in run["name"] else "short"
    return f"{ckpt_label(run['strategy'])} {which}"


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


# ---------------------------------------------------------------------------------------------------------
# The report


def _pct(x) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 100:+.1f}%"


def _s(x, digits: int = 2) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f} s"


def _f(x, digits: int = 2) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _rate(x) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.0f}"


def write_report(results: dict, out: Path, figures: list[str], command: str) -> Path:
    plan, iv, m = results["plan"], results["intervals"], results["machine"]
    runs = results["runs"]
    L: list[str] = []
    add = L.append
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

    # Fig. 5
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

    write_entry_width(results, add, figures)

    # Figs. 6-11
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

    # Fig. 12
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

    # Fig. 13
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

    # §5.2 load and ablations
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
    add("## Departures from the papers\n")
    for d in DEPARTURES:
        add(f"- {d}")
    add(
        f"\nFigures: {', '.join(figures)}. Every number: results.json (`runs` holds each job's series and events).\n"
    )
    path = out / "report.md"
    path.write_text("\n".join(L))
    return path


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


def cpu_adjusted_overhead(runs: dict, row: dict) -> float | None:
    """Overhead with each job's training time scaled by the share of the cores it had (see the report)."""
    run, base = runs[row["run"]], runs[row.get("base_run") or f"noft_x{row['scale']}"]
    if run.get("other_cpu_share") is None or base.get("other_cpu_share") is None:
        return None
    own = run["train_s"] * (1 - run["other_cpu_share"])
    return own / (base["train_s"] * (1 - base["other_cpu_share"])) - 1


def paper_original(config: str) -> float | None:
    """The paper's overhead on Criteo-Original: ECRec k=4's from the ablation (§5.2), Ckpt's as 8S's divided by
    the growth the text states (Fig. 5 gives no other number)."""
    if config == "ECRec k=4":
        return PAPER["overhead_original_ecrec_k4"]
    p8, growth = PAPER["overhead_8S"].get(config), PAPER["overhead_growth_1_to_8"].get(config)
    return p8 / growth if p8 and growth else None


def _as_run(d: dict) -> Run:
    return Run(**d)


def _increase(before: float | None, after: float | None) -> float | None:
    return after / before - 1 if before and after is not None else None


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


# ---------------------------------------------------------------------------------------------------------


def bench_paper(
    out: Path,
    quick: bool = False,
    work: Path | None = None,
    render_only: bool = False,
    only_cached: bool = False,
    log=print,
) -> dict:
    """Run the plan, write results.json, the figures and report.md into `out`; return the results.
    `render_only`: no jobs, the figures and report again from OUT/results.json. `only_cached`: no jobs either,
    the results of the jobs in WORK/runs.json (a reduced run: the report lists what is missing)."""
    plan = QUICK if quick else FULL
    out.mkdir(parents=True, exist_ok=True)
    if render_only:
        results = json.loads((out / "results.json").read_text())
        quick = results["plan"]["name"] == "quick"
    else:
        tmp = None
        if work is None:
            tmp = tempfile.TemporaryDirectory(prefix="ecrec-bench-paper-")
            work = Path(tmp.name)
        work.mkdir(parents=True, exist_ok=True)
        try:
            log(f"# ecrec bench paper ({plan.name}): jobs under {work}")
            results = _finite(PaperBench(plan, work, log, only_cached).run_all())
        finally:
            if tmp is not None:
                tmp.cleanup()
        results["command"] = (
            "ecrec bench paper"
            + (" --quick" if quick else "")
            + f" --out {out}"
            + (f" --work {work}" if not tmp else "")
            + (" --only-cached" if only_cached else "")
        )
        (out / "results.json").write_text(json.dumps(results, indent=1))
    figures = write_figures(results, out)
    write_report(results, out, figures, results.get("command", "ecrec bench paper"))
    log(f"wrote {out / 'report.md'}, {out / 'results.json'} and {len(figures)} figures")
    return results


def _finite(o):
    """NaN (a window with no sample) as null: results.json stays valid JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    return o
