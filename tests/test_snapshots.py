"""ecrec.core.snapshots without a store: the baselines it tracks, the hot rows it copies, what it loads."""

from __future__ import annotations

import pytest
import torch

from ecrec.core.snapshots import MAX_BASELINE_MASKS, ShardSnapshots
from ecrec.wire import InvalidRequest


def state(n: int = 6, width: int = 2):
    rows = torch.arange(n * width, dtype=torch.float32).view(n, width)
    return rows, torch.arange(n, dtype=torch.int64), {3: torch.ones(4, 2)}


def test_baselines_tracked_are_bounded_and_an_increment_drops_older_ones():
    snaps = ShardSnapshots(0, 6)
    rows, versions, dense = state()
    for c in range(1, MAX_BASELINE_MASKS + 3):
        snaps.copy(rows, versions, dense, checkpoint=c)
    assert sorted(snaps.modified_since) == list(range(3, MAX_BASELINE_MASKS + 3))
    with pytest.raises(InvalidRequest, match="baseline checkpoint 1 was not copied"):
        snaps.copy(rows, versions, dense, base=1)
    snaps.written(torch.tensor([5, 2]))
    inc = snaps.copy(rows, versions, dense, base=4)
    assert inc["index"].tolist() == [2, 5] and torch.equal(inc["rows"], rows[[2, 5]])
    assert sorted(snaps.modified_since) == list(range(4, MAX_BASELINE_MASKS + 3))  # 3 is older than the base
    # A full copy is a copy: changing the state afterwards leaves it alone.
    full = snaps.copy(rows, versions, dense)
    rows[0] = -1.0
    dense[3][0] = -1.0
    assert full["rows"][0].tolist() == [0.0, 1.0] and full["dense.3"][0].tolist() == [1.0, 1.0]


def test_hot_copy_takes_the_rows_read_most_and_no_tracker_takes_none():
    snaps = ShardSnapshots(0, 10, hot_rows="mfu", hot_fraction=0.2)
    rows, versions, dense = state(10)
    for local in ([1, 7], [7], [7, 3], [1]):
        snaps.read(torch.tensor(local))
    hot = snaps.hot_copy(rows, versions, dense)
    assert hot["index"].tolist() == [1, 7] and torch.equal(hot["versions"], versions[[1, 7]])
    assert "dense.3" in hot
    plain = ShardSnapshots(0, 10)
    plain.read(torch.tensor([1]))
    assert plain.hot is None and plain.hot_copy(rows, versions, dense)["index"].numel() == 0


def test_merge_applies_increments_in_order_and_refuses_another_shape():
    snaps = ShardSnapshots(0, 6)
    rows, versions, dense = state()
    full = {"rows": rows, "versions": versions, "dense.3": dense[3]}
    expect = {"rows": (6, 2), "versions": (6,), "dense.3": (4, 2)}
    first = {"index": torch.tensor([1, 2]), "rows": torch.zeros(2, 2), "versions": torch.tensor([10, 10])}
    second = {"index": torch.tensor([2]), "rows": torch.full((1, 2), 9.0), "versions": torch.tensor([11])}
    t = snaps.merge(full, (first, second), expect)
    assert t["rows"][1].tolist() == [0.0, 0.0] and t["rows"][2].tolist() == [9.0, 9.0]
    assert t["versions"].tolist() == [0, 10, 11, 3, 4, 5] and t["modified"].nonzero().squeeze(1).tolist() == [
        1,
        2,
    ]
    assert rows[1].tolist() == [2.0, 3.0]  # the checkpoint it was given is not changed
    snaps.loaded(7, t["modified"])
    assert list(snaps.modified_since) == [7]
    with pytest.raises(InvalidRequest, match="rows is \\(6, 3\\), expected \\(6, 2\\)"):
        snaps.merge({**full, "rows": torch.zeros(6, 3)}, (), expect)
    with pytest.raises(InvalidRequest, match="dense.3 is missing"):
        snaps.merge({"rows": rows, "versions": versions}, (), expect)
    with pytest.raises(InvalidRequest, match="outside the table"):
        snaps.merge(full, ({"index": torch.tensor([6]), "rows": rows[:1], "versions": versions[:1]},), expect)
