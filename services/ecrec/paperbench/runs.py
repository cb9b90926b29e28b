"""`Run`: one job's numbers as results.json and runs.json hold them, the labels of a run and of a checkpoint
strategy, and the training time read off a job's progress. Pure data and arithmetic: no job is run here."""

from __future__ import annotations

from dataclasses import dataclass


def ckpt_label(strategy: str) -> str:
    return {"checkpoint": "Ckpt", "checknrun": "Check-N-Run", "cpr": "CPR"}[strategy]


def run_label(run: dict) -> str:
    if run["strategy"] == "none":
        return "No FT"
    if run["strategy"] == "ecrec":
        k = next(o for o in run["overrides"] if o.startswith("faultTolerance.ecrec.k=")).split("=")[1]
        return f"ECRec k={k}"
    which = "long" if "_long_" in run["name"] else "short"
    return f"{ckpt_label(run['strategy'])} {which}"


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


def time_to_samples(progress: list, total: int, fallback: float) -> float:
    """Seconds from training start until the coordinator first reported every sample trained."""
    for t, n in progress:
        if n >= total:
            return t
    return fallback
