"""SamplesTimeline: samples placed by when their steps completed, in bins that stay bounded."""

import pytest

from ecrec.core.timeline import SamplesTimeline


def at(series, t):
    """The total at wall time t, linear between points (as `ecrec.bench.samples_at` reads the series)."""
    for (t0, n0), (t1, n1) in zip(series, series[1:], strict=False):
        if t0 <= t <= t1:
            return n0 + (n1 - n0) * (t - t0) / (t1 - t0) if t1 > t0 else n1
    raise AssertionError(f"{t} outside the series")


def test_samples_go_where_their_steps_completed_not_where_the_report_arrived():
    tl = SamplesTimeline(width=0.1)
    tl.start(100.0)
    # one report at 100.5 for five steps of 100 samples that completed at 100.05, 100.15, ... 100.45
    tl.update(500, now=100.5, step_times=[100.05 + 0.1 * i for i in range(5)], steps=5)
    # a stall: the next report (at 101.0) has no new steps; then two steps just before 101.5
    tl.update(500, now=101.0)
    tl.update(700, now=101.5, step_times=[101.32, 101.41], steps=2)
    s = tl.series()
    assert s[0] == (100.0, 0.0) and s[-1][1] == 700
    assert at(s, 100.2) == pytest.approx(200) and at(s, 100.5) == pytest.approx(500)
    # nothing trained from 100.5 to 101.3: the stall is flat, not spread over the reports' interval
    assert at(s, 100.9) == pytest.approx(500) and at(s, 101.3) == pytest.approx(500)
    assert at(s, 101.4) == pytest.approx(600) and at(s, 101.5) == pytest.approx(700)


def test_steps_whose_times_the_report_dropped_count_at_the_earliest_time_it_kept():
    tl = SamplesTimeline(width=0.1)
    tl.start(0.0)
    tl.update(1000, now=1.0, step_times=[0.55, 0.95], steps=10)  # 100 per step, 8 steps without a time
    s = tl.series()
    assert at(s, 0.5) == 0 and at(s, 0.6) == pytest.approx(900) and at(s, 1.0) == pytest.approx(1000)


def test_without_step_times_or_when_the_total_goes_down_the_change_is_put_at_now():
    tl = SamplesTimeline(width=0.1)
    tl.start(0.0)
    tl.update(300, now=0.35)
    tl.update(100, now=0.75, step_times=[0.7], steps=1)  # a rollback: times are ignored
    s = tl.series()
    assert at(s, 0.3) == 0 and at(s, 0.4) == pytest.approx(300)
    assert at(s, 0.7) == pytest.approx(300) and at(s, 0.8) == pytest.approx(100)


def test_a_restored_timeline_starts_from_its_total_and_takes_earlier_steps_at_its_start():
    tl = SamplesTimeline(width=0.1)
    tl.update(50, now=1.0)  # before the start: nothing to place
    assert tl.series() == []
    tl.start(10.0, total=5000)
    tl.update(5200, now=10.5, step_times=[9.8, 10.25], steps=2)  # a step trained while no coordinator ran
    s = tl.series()
    assert (
        s[0] == (10.0, 5000) and at(s, 10.1) == pytest.approx(5100) and s[-1] == (pytest.approx(10.3), 5200)
    )


def test_the_bins_widen_to_stay_under_the_cap_and_keep_the_total():
    tl = SamplesTimeline(width=0.1, max_bins=8)
    tl.start(0.0)
    total = 0
    for i in range(40):  # a step every 0.1 s for 4 s: 40 bins at 0.1 s
        total += 10
        tl.update(total, now=0.1 * i + 0.05, step_times=[0.1 * i + 0.05], steps=1)
    assert len(tl.bins) <= 8 and tl.width == pytest.approx(0.8)
    s = tl.series()
    assert s[-1][1] == pytest.approx(400) and at(s, 1.6) == pytest.approx(160)


def test_invalid_parameters_are_refused():
    with pytest.raises(ValueError):
        SamplesTimeline(width=0)
    with pytest.raises(ValueError):
        SamplesTimeline(max_bins=1)
