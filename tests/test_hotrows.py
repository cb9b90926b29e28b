"""CPR's hot-row trackers (ecrec.core.hotrows)."""

from __future__ import annotations

import torch

from ecrec.core.hotrows import MfuTracker, SsuTracker, make_tracker


def test_mfu_takes_the_most_read_rows_and_restarts_their_counts():
    t = MfuTracker(10)
    for rows in ([1, 2, 3], [2, 3], [3], [7]):
        t.access(torch.tensor(rows))
    assert t.take(2).tolist() == [2, 3]
    assert t.take(5).tolist() == [1, 7]  # only rows read since: no zero-count row is ever taken
    assert t.take(5).tolist() == []


def test_ssu_samples_every_period_th_read_and_never_lists_more_than_its_capacity():
    t = SsuTracker(1000, capacity=50, period=2, seed=1)
    hot = torch.arange(10)
    for i in range(400):
        cold = torch.randint(10, 1000, (20,), generator=torch.Generator().manual_seed(i)).unique()
        t.access(torch.cat([hot, cold]))
        assert int(t.listed.sum()) <= 50
    taken = t.take()
    assert taken.numel() == 50 and int(t.listed.sum()) == 0
    # Rows read by every request are far more likely to be listed than rows read once in a while.
    assert int(torch.isin(hot, taken).sum()) >= 5


def test_ssu_ignores_the_reads_between_samples_and_make_tracker_picks_by_name():
    t = SsuTracker(10, capacity=5, period=3)
    t.access(torch.tensor([1]))
    t.access(torch.tensor([2]))
    assert t.take().tolist() == []
    t.access(torch.tensor([3]))
    assert t.take().tolist() == [3]
    assert make_tracker("none", 10, 0.1) is None
    assert isinstance(make_tracker("mfu", 10, 0.1), MfuTracker)
    assert make_tracker("ssu", 100, 0.1).capacity == 10
