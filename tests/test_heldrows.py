"""The C path of a parity server's version-ordered xor apply (ecrec.core.heldrows): what the differential tests in
tests/test_txn.py do not reach — many held rows (the arrays grow), held rows read back and replaced as batches
(a failed server's dropped), duplicates held twice, and bad input refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ecrec.core import heldrows
from ecrec.core.txn import DeltaBatch
from tests.test_txn import K, W, batch, bits, parity_participant, xor_rows

pytestmark = pytest.mark.skipif(not heldrows.AVAILABLE, reason="ecrec.core._heldrows not built")


def c_and_torch():
    fast, slow = parity_participant(), parity_participant()
    fast.choose_path("c")
    slow.choose_path("torch")
    return fast, slow


def test_many_held_rows_outgrow_the_arrays_and_all_apply_once_their_predecessors_do():
    fast, slow = c_and_torch()
    n = fast.parity.shape[0]
    index = list(range(n))
    # versions 2..200 of every row of member 1 arrive first (n * 199 held rows, past the first 256), then 1
    for v in range(200, 1, -1):
        b = batch(f"t{v}", 1, index=index, slot=[1] * n, version=[v] * n, seed=v)
        assert fast.apply(b) is slow.apply(b) is False
    assert len(fast._rows) == n * 199 > 256 and fast._rows.key.size >= n * 199
    assert int(fast.held_marks().sum()) == n
    first = batch("t1", 1, index=index, slot=[1] * n, version=[1] * n, seed=1)
    assert fast.apply(first) is slow.apply(first) is True
    assert torch.equal(bits(fast.parity), bits(slow.parity)) and torch.equal(fast.pver, slow.pver)
    assert fast.pver[:, 1].tolist() == [200] * n and fast.held == [] and not bool(fast.held_marks().any())
    assert fast.held_parts() == set()


def test_held_rows_read_back_as_batches_by_part_and_a_failed_servers_rows_drop():
    fast, slow = c_and_torch()
    ahead = [
        batch("a", 1, index=[0, 2], slot=[1, 1], version=[2, 2], seed=5),
        batch("b", 2, index=[1], slot=[2], version=[3], seed=6),
        batch("c", 1, index=[1], slot=[1], version=[2], seed=7),
    ]
    for b in ahead:
        assert fast.apply(b) is slow.apply(b) is False
    got = fast.held
    assert [(h.txn, h.src) for h in got] == [("a", 1), ("b", 2), ("c", 1)]
    for h, b in zip(got, ahead, strict=True):  # rows by key: here the order they came in
        assert torch.equal(h.index, b.index) and torch.equal(h.slot, b.slot)
        assert torch.equal(bits(h.delta), bits(b.delta)) and torch.equal(h.version, b.version)
    assert fast.held_parts() == slow.held_parts() == {("a", 1), ("b", 2), ("c", 1)}
    assert [h.txn for h in fast.drop_held(1)] == [h.txn for h in slow.drop_held(1)] == ["a", "c"]
    assert [(h.txn, h.src) for h in fast.held] == [("b", 2)] and fast.held_parts() == {("b", 2)}
    assert fast.held_marks().nonzero().view(-1).tolist() == [1 * K + 2]
    # what stays held still applies when its predecessors come
    for v in (1, 2):
        b = batch(f"p{v}", 2, index=[1], slot=[2], version=[v], seed=10 + v)
        assert fast.apply(b) is slow.apply(b) is True
    assert torch.equal(bits(fast.parity), bits(slow.parity)) and fast.pver[1, 2] == 3 and fast.held == []


def test_held_rows_dropped_for_an_incarnation_keep_that_incarnations_and_the_unsaid():
    fast, slow = c_and_torch()
    ahead = [
        batch(t, 1, index=[i], slot=[1], version=[2], seed=i) for i, t in enumerate(("old", "new", "unsaid"))
    ]
    for b, inc in zip(ahead, (1, 2, 0), strict=True):
        b.incarnation = inc
        assert fast.apply(b) is slow.apply(b) is False
    dropped = [[h.txn for h in pp.drop_held(1, incarnation=2)] for pp in (fast, slow)]
    assert dropped == [["old"], ["old"]]
    assert fast.held_parts() == slow.held_parts() == {("new", 1), ("unsaid", 1)}
    assert [h.txn for h in fast.drop_held(1)] == ["new", "unsaid"] and fast.held == []


def test_a_row_held_twice_applies_once_and_leaves_nothing_behind():
    """The same delta delivered by its worker and forwarded by its data server, both ahead of version 1."""
    pp = parity_participant()
    pp.choose_path("c")
    before = pp.parity.clone()
    twice = batch("t2", 1, index=[2], slot=[1], version=[2], seed=8)
    assert pp.apply(twice) is False and pp.apply(twice) is False
    assert len(pp._rows) == 2
    first = batch("t1", 1, index=[2], slot=[1], version=[1], seed=9)
    assert pp.apply(first) is True
    want = xor_rows(xor_rows(before, first.index, first.delta), twice.index, twice.delta)
    assert torch.equal(bits(pp.parity), bits(want)) and len(pp._rows) == 0 and not bool(pp.held_marks().any())


def test_rows_out_of_range_are_refused_before_anything_is_written():
    pp = parity_participant()
    pp.choose_path("c")
    before, n = pp.parity.clone(), pp.parity.shape[0]
    bad = batch("t1", 1, index=[0, n], slot=[1, 1], version=[1, 1])
    with pytest.raises(ValueError, match="out of range"):
        pp.apply(bad)
    assert torch.equal(bits(pp.parity), bits(before)) and int(pp.pver.abs().sum()) == 0
    # a delta as wide as no record is refused too
    narrow = DeltaBatch(
        0, "t2", 1, torch.tensor([0]), torch.tensor([1]), torch.zeros(1, W - 1), torch.tensor([1])
    )
    with pytest.raises(ValueError, match="disagree"):
        pp.apply(narrow)
    assert torch.equal(bits(pp.parity), bits(before))


def test_held_rows_replaced_wholesale_keep_exact_marks():
    """`held = ...` (what drop_orphans does) loads the rows given, counts the marks anew."""
    pp = parity_participant()
    pp.choose_path("c")
    for v in (3, 2):
        pp.apply(batch(f"t{v}", 1, index=[0, 1], slot=[1, 1], version=[v, v], seed=v))
    held = pp.held
    assert sorted(h.txn for h in held) == ["t2", "t3"]
    pp.held = [h for h in held if h.txn == "t2"]
    assert np.count_nonzero(pp._rows.marks) == 2 and int(pp._rows.marks.sum()) == 2
    assert pp.held_parts() == {("t2", 1)}
    pp.held = []
    assert len(pp._rows) == 0 and not pp._rows.marks.any() and pp.held_parts() == set()
