"""What one invocation of `ecrec bench paper` runs: the `Plan` (`FULL`, and `QUICK` for the test suite), and
the two thresholds every part shares (when a job counts as contended, how late a kill lands)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
