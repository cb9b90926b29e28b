"""Running the jobs: `Runner` runs each job once (by name) through `ecrec local`'s launcher, records its numbers
as a `Run`, reuses the jobs of an earlier invocation from WORK/runs.json, and runs a job again when other
processes took more than `CONTENDED` of the cores while it ran. Single-threaded: one job at a time."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

from ecrec.bench import _run, load_job_with, rpcs_per_step, steady_rate
from ecrec.jobctx import JobContext
from ecrec.local import server_rows as local_server_rows
from ecrec.paperbench.plan import CONTENDED, Plan
from ecrec.paperbench.runs import Run, time_to_samples


def job_path(job: str) -> str:
    """The plan's job file, relative to the working directory or else to the source checkout."""
    if Path(job).exists():
        return job
    return str(Path(__file__).resolve().parents[3] / job)


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
