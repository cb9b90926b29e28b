"""training.maxStepsPerSecond (ecrec.worker.Pace): step starts at least 1/rate apart, no burst after a late step;
a real job under it trains for at least steps / rate seconds, on any machine."""

from __future__ import annotations

import itertools

import pytest

from ecrec.local import run_local
from ecrec.spec import SpecError
from ecrec.worker import Pace
from tests.conftest import make_ctx


class Clock:
    def __init__(self):
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_unpaced_never_sleeps():
    clock = Clock()
    pace = Pace(None, clock, clock.sleep)
    assert [pace.wait() for _ in range(5)] == [0.0] * 5 and clock.slept == []


def test_steps_start_at_least_an_interval_apart():
    clock = Clock()
    pace = Pace(4.0, clock, clock.sleep)
    starts = []
    for work in (0.0, 0.1, 0.3, 0.0):  # each step's own time
        pace.wait()
        starts.append(clock.now)
        clock.now += work
    assert [round(b - a, 9) for a, b in itertools.pairwise(starts)] == [0.25, 0.25, 0.3]


def test_a_late_step_is_not_made_up_for_by_a_burst():
    clock = Clock()
    pace = Pace(10.0, clock, clock.sleep)
    pace.wait()
    clock.now += 5.0  # a step that waited on a recovery
    assert pace.wait() == 0.0
    clock.now += 0.01
    assert pace.wait() == pytest.approx(0.09)  # the next one is paced from the late one, not from the start


def test_the_rate_must_be_positive():
    for bad in ("0", "-1"):
        with pytest.raises(SpecError, match="maxStepsPerSecond"):
            make_ctx("bad", training__maxStepsPerSecond=bad)


@pytest.mark.slow
def test_a_paced_job_trains_for_at_least_steps_over_rate_seconds(tmp_path):
    steps, rate = 30, 20.0
    ctx = make_ctx(
        "paced",
        training__steps=steps,
        training__maxStepsPerSecond=rate,
        faultTolerance__strategy="ecrec",
        faultTolerance__ecrec__k=2,
        servers__replicas=3,
    )
    report = run_local(ctx, tmp_path / "run", progress=False)
    t = {e["kind"]: e["t"] for e in report["events"]}
    # The coordinator sees the start at the first report (after step 1) and the end at the last one.
    assert t["training_finished"] - t["training_started"] >= (steps - 2) / rate
    assert report["samples"] == steps * 64 and report["parity_check"]["mismatches"] == 0
