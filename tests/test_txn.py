"""The 2PC participants and the recovery plan as plain state (core/txn.py, core/recovery.py): row locks,
staging and deciding a part on its data server, staged deltas and rebuilt records on a parity server."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ecrec.core import heldrows
from ecrec.core.codes import make_code
from ecrec.core.lineage import drop_orphans, proves_commit
from ecrec.core.optim import make_optimizer
from ecrec.core.placement import Placement
from ecrec.core.recovery import Step, plan_recovery
from ecrec.core.txn import DataParticipant, DeltaBatch, ParityParticipant, RowLocks, RowsBusy, UnknownTxn

N, K, DIM = 5, 4, 3
P = Placement(num_servers=N, k=K, num_rows=N * K * 3)  # 12 rows and 3 parity indices per server
CODE = make_code("xor")
OPT = make_optimizer("adagrad", 0.1)
W = OPT.record_width(DIM)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def rows(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def data_participant(shard: int = 1, seed: int = 0) -> DataParticipant:
    gen = torch.Generator().manual_seed(seed)
    n = P.rows_on(shard)
    records = OPT.init_records(torch.randn(n, DIM, generator=gen))
    return DataParticipant(shard, P, CODE, OPT, records, torch.randint(0, 5, (n,), generator=gen))


def grads_for(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))


# -- RowLocks -------------------------------------------------------------------------------------------------
def test_row_locks_are_all_or_nothing():
    locks = RowLocks(10)
    locks.lock("a", rows(1, 2))
    before = locks.owner.clone()
    with pytest.raises(RowsBusy):
        locks.lock("b", rows(5, 6, 2))  # row 2 is a's: none of b's rows may be taken
    assert torch.equal(locks.owner, before)
    assert locks.holders() == ["a"]
    assert not locks.busy(rows(5, 6))
    locks.lock("b", rows(5, 6))
    assert locks.holders() == ["a", "b"]


def test_row_locks_let_the_same_txn_lock_again_and_unlock_frees_exactly_its_rows():
    locks = RowLocks(10)
    locks.lock("a", rows(1, 2))
    locks.lock("b", rows(7))
    locks.lock("a", rows(2, 3))  # re-lock by the holder, overlapping its own rows: allowed
    assert locks.busy(rows(3), "b") and not locks.busy(rows(1, 2, 3), "a")
    freed = locks.unlock("a")
    assert sorted(set(freed.tolist())) == [1, 2, 3]
    assert not locks.busy(rows(0, 1, 2, 3, 4, 5, 6, 8, 9))
    assert locks.busy(rows(7)) and not locks.busy(rows(7), "b")
    assert locks.holders() == ["b"]
    assert locks.unlock("a").numel() == 0  # unknown/already unlocked: nothing to free
    locks.lock("c", rows(1, 2))  # a's former rows are free for others
    assert locks.busy(rows(1), "b")


def test_row_locks_busy_sees_other_holders_only():
    locks = RowLocks(6)
    assert not locks.busy(rows(0, 1, 2, 3, 4, 5))
    locks.lock("a", rows(4))
    assert locks.busy(rows(0, 4)) and locks.busy(rows(4), "other")
    assert not locks.busy(rows(4), "a") and not locks.busy(rows(0, 1), "other")


# -- DataParticipant -----------------------------------------------------------------------------------------
def test_stage_computes_records_deltas_and_batches_per_parity_server():
    dp = data_participant(shard=1)
    local = rows(0, 1, 2, 3, 5, 6, 11)
    old_records, old_versions = dp.records.clone(), dp.versions.clone()
    g = grads_for(local.numel())
    part = dp.stage("t1", local, g, now=10.0)

    want = OPT.apply(old_records[local], g)
    assert torch.equal(bits(part.new), bits(want))
    assert torch.equal(part.rows, local)
    # Nothing is applied by a stage.
    assert torch.equal(bits(dp.records), bits(old_records)) and torch.equal(dp.versions, old_versions)

    # Every row appears in exactly one batch, addressed to its parity server, with its delta and next version.
    servers, index = P.parity_of(1, local)
    seen = []
    for b in part.batches:
        assert b.txn == "t1" and b.src == 1
        back = b.index * K + b.slot  # local row of this shard in the stripe
        for row, idx, slot, delta, version in zip(back, b.index, b.slot, b.delta, b.version, strict=True):
            pos = int((local == row).nonzero())
            seen.append(int(row))
            assert int(servers[pos]) == b.parity_server and int(index[pos]) == int(idx)
            assert int(slot) == int(row) % K
            assert torch.equal(bits(delta), bits(CODE.delta(old_records[row], want[pos])))
            assert int(version) == int(old_versions[row]) + 1
    assert sorted(seen) == sorted(local.tolist())
    assert len({b.parity_server for b in part.batches}) == len(part.batches)  # one batch per server
    assert set(part.parity_servers) == set(servers.tolist())
    assert dp.locks.busy(local) and not dp.locks.busy(rows(4, 7))


def test_stage_of_a_busy_row_raises_rows_busy_and_changes_nothing():
    dp = data_participant()
    dp.stage("t1", rows(2, 3), grads_for(2), now=0.0)
    owner = dp.locks.owner.clone()
    with pytest.raises(RowsBusy):
        dp.stage("t2", rows(4, 3), grads_for(2), now=0.0)
    assert "t2" not in dp.staged and torch.equal(dp.locks.owner, owner)
    dp.stage("t3", rows(4), grads_for(1), now=0.0)  # disjoint rows stage concurrently


def test_repeated_stage_of_the_same_txn_returns_the_same_part():
    dp = data_participant()
    part = dp.stage("t1", rows(2, 3), grads_for(2, seed=1), now=0.0)
    again = dp.stage("t1", rows(2, 3), grads_for(2, seed=2), now=5.0)
    assert again is part and part.staged_at == 0.0
    dp.commit("t1")
    assert torch.equal(bits(dp.records[rows(2, 3)]), bits(part.new))


def test_commit_applies_records_bumps_versions_and_releases():
    dp = data_participant()
    local = rows(0, 5, 9)
    before, vers = dp.records.clone(), dp.versions.clone()
    part = dp.stage("t1", local, grads_for(3), now=0.0)
    changed = dp.commit("t1")
    assert torch.equal(changed, local)
    assert torch.equal(bits(dp.records[local]), bits(part.new))
    assert torch.equal(dp.versions[local], vers[local] + 1)
    others = torch.ones(dp.records.shape[0], dtype=torch.bool)
    others[local] = False
    assert torch.equal(bits(dp.records[others]), bits(before[others]))
    assert torch.equal(dp.versions[others], vers[others])
    assert not dp.locks.busy(local) and "t1" not in dp.staged
    with pytest.raises(UnknownTxn):
        dp.commit("t1")


def test_abort_releases_without_applying():
    dp = data_participant()
    local = rows(1, 2)
    before, vers = dp.records.clone(), dp.versions.clone()
    part = dp.stage("t1", local, grads_for(2), now=0.0)
    assert dp.abort("t1") is part
    assert torch.equal(bits(dp.records), bits(before)) and torch.equal(dp.versions, vers)
    assert not dp.locks.busy(local) and dp.staged == {}
    assert dp.abort("t1") is None  # twice: nothing left


def test_expired_lists_parts_older_than_the_timeout():
    dp = data_participant()
    dp.stage("old", rows(1), grads_for(1), now=100.0)
    dp.stage("new", rows(2), grads_for(1), now=104.0)
    assert dp.expired(now=105.0, timeout=10.0) == []
    assert dp.expired(now=110.5, timeout=10.0) == ["old"]
    assert sorted(dp.expired(now=200.0, timeout=10.0)) == ["new", "old"]
    dp.commit("old")
    assert dp.expired(now=200.0, timeout=10.0) == ["new"]


# -- ParityParticipant ---------------------------------------------------------------------------------------
def parity_participant(shard: int = 0, seed: int = 3, not_ready=()) -> ParityParticipant:
    """`not_ready`: records a replacement has not rebuilt yet (the store passes `ready` in the same way)."""
    n = P.parity_rows_on(shard)
    parity = torch.randn(n, W, generator=torch.Generator().manual_seed(seed))
    ready = torch.ones(n, dtype=torch.bool)
    ready[list(not_ready)] = False
    return ParityParticipant(shard, P, CODE, parity, torch.zeros(n, K, dtype=torch.int64), ready)


def batch(txn: str, src: int, index, slot, version, seed: int = 4, server: int = 0) -> DeltaBatch:
    index, slot, version = rows(*index), rows(*slot), rows(*version)
    delta = torch.randn(index.numel(), W, generator=torch.Generator().manual_seed(seed))
    return DeltaBatch(server, txn, src, index, slot, delta, version)


def xor_rows(parity: torch.Tensor, index: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    out = parity.clone()
    CODE.apply_delta_(out, index, delta)
    return out


def test_parity_stage_applies_nothing_until_commit_and_commit_is_idempotent():
    pp = parity_participant()
    pp.pver[0, 3] = 3  # record 0 reflects member 3 up to version 3: the delta of version 4 is next
    before, pver_before = pp.parity.clone(), pp.pver.clone()
    b = batch("t1", 2, index=[0, 2], slot=[3, 3], version=[4, 1])
    pp.stage(b)
    assert torch.equal(bits(pp.parity), bits(before)) and torch.equal(pp.pver, pver_before)
    assert [(t, i.tolist(), s.tolist()) for t, i, s in pp.staged_members(2)] == [("t1", [0, 2], [3, 3])]
    assert pp.staged_members(1) == []

    assert pp.commit("t1", 2) == "committed"
    want = xor_rows(before, b.index, b.delta)
    assert torch.equal(bits(pp.parity), bits(want))
    assert pp.pver[0].tolist() == [0, 0, 0, 4] and pp.pver[2].tolist() == [0, 0, 0, 1]
    assert pp.staged == {} and pp.staged_members(2) == []

    # Repeated decisions (a worker committing on behalf of a dead server, retries) change nothing.
    assert pp.commit("t1", 2) == "committed"
    assert pp.abort("t1", 2) == "committed"
    pp.stage(b)  # a late duplicate of a decided stage is ignored
    assert pp.commit("t1", 2) == "committed"
    assert torch.equal(bits(pp.parity), bits(want)) and pp.staged == {}


def test_parity_abort_drops_the_staged_deltas_for_good():
    pp = parity_participant()
    before = pp.parity.clone()
    pp.stage(batch("t1", 2, index=[1], slot=[3], version=[1]))
    pp.stage(batch("t1", 3, index=[1], slot=[0], version=[1], seed=5))  # same txn, another source shard
    assert pp.abort("t1", 2) == "aborted"
    assert pp.commit("t1", 2) == "aborted"  # the decision stands
    pp.stage(batch("t1", 2, index=[1], slot=[3], version=[1]))  # a delta that arrives after its abort
    assert pp.staged_members(2) == []
    assert torch.equal(bits(pp.parity), bits(before)) and int(pp.pver.abs().sum()) == 0
    assert pp.commit("t1", 3) == "committed"  # (txn, src) pairs are decided independently
    assert pp.pver[1].tolist() == [1, 0, 0, 0]


def test_parity_commit_of_an_unknown_part_is_unknown_and_records_nothing():
    pp = parity_participant()
    before = pp.parity.clone()
    assert pp.commit("never", 1) == "unknown"
    assert ("never", 1) not in pp.resolved
    assert torch.equal(bits(pp.parity), bits(before))


def test_parity_deltas_commute_under_xor():
    b1 = batch("t1", 1, index=[0, 1], slot=[0, 0], version=[1, 1], seed=6)
    b2 = batch("t2", 2, index=[1, 2], slot=[1, 1], version=[1, 1], seed=7)
    results = []
    for order in ((b1, b2), (b2, b1)):
        pp = parity_participant()
        for b in order:
            pp.stage(b)
        for b in order:
            pp.commit(b.txn, b.src)
        results.append((pp.parity, pp.pver))
    assert torch.equal(bits(results[0][0]), bits(results[1][0])) and torch.equal(results[0][1], results[1][1])


def test_not_ready_records_keep_committed_deltas_and_install_replays_only_newer_ones():
    pp = parity_participant(not_ready=[1, 2])
    pp.pver[0, 0] = 2  # record 0 reflects member 0 up to version 2
    start = pp.parity.clone()
    # One batch over a ready record (0) and two not-ready ones (1, 2).
    b1 = batch("t1", 1, index=[0, 1, 2], slot=[0, 0, 0], version=[3, 3, 3], seed=8)
    b2 = batch("t2", 2, index=[1], slot=[1], version=[6], seed=9)
    b3 = batch("t3", 2, index=[1], slot=[1], version=[7], seed=10)
    for b in (b1, b2, b3):
        pp.stage(b)
        assert pp.commit(b.txn, b.src) == "committed"
    # The ready record got its delta now; the others only wait in `pending`.
    assert torch.equal(bits(pp.parity[0]), bits(xor_rows(start, rows(0), b1.delta[:1])[0]))
    assert torch.equal(bits(pp.parity[1:]), bits(start[1:]))
    assert pp.pver[0].tolist() == [3, 0, 0, 0] and int(pp.pver[1:].abs().sum()) == 0
    assert sorted(int(i) for b in pp.pending for i in b.index) == [1, 1, 1, 2]

    # Rebuild record 1 from members that already reflect t1 (slot 0 at version 3) and t2 (slot 1 at 6), but
    # not t3 (version 7): only t3 must be replayed. Record 2 stays not ready with its delta kept.
    rebuilt = torch.randn(1, W, generator=torch.Generator().manual_seed(11))
    pp.install(rows(1), rebuilt, torch.tensor([[3, 6, 0, 2]]))
    assert torch.equal(bits(pp.parity[1]), bits(CODE.apply_delta(rebuilt[0], b3.delta[0])))
    assert pp.pver[1].tolist() == [3, 7, 0, 2]
    assert bool(pp.ready[1]) and not bool(pp.ready[2])
    assert [(b.txn, b.index.tolist()) for b in pp.pending] == [("t1", [2])]

    # Record 2 is rebuilt from members older than t1: its kept delta is replayed, then nothing is left.
    rebuilt2 = torch.randn(1, W, generator=torch.Generator().manual_seed(12))
    pp.install(rows(2), rebuilt2, torch.tensor([[2, 0, 0, 0]]))
    assert torch.equal(bits(pp.parity[2]), bits(CODE.apply_delta(rebuilt2[0], b1.delta[2])))
    assert pp.pver[2].tolist() == [3, 0, 0, 0]
    assert pp.pending == [] and bool(pp.ready.all())


def test_a_row_update_committed_ahead_of_its_predecessor_waits_for_it():
    """Decisions for one row can arrive out of order; pver must keep meaning "every update up to here"."""
    pp = parity_participant()
    before = pp.parity.clone()
    b1 = batch("t1", 2, index=[0, 1], slot=[3, 3], version=[1, 1], seed=13)
    b2 = batch("t2", 2, index=[0], slot=[3], version=[2], seed=14)  # built on t1's value of row 0
    pp.stage(b1)
    pp.stage(b2)
    assert pp.commit("t2", 2) == "committed"
    assert torch.equal(bits(pp.parity), bits(before)) and int(pp.pver.abs().sum()) == 0
    assert [h.txn for h in pp.held] == ["t2"]
    assert pp.commit("t1", 2) == "committed"  # the predecessor: both apply, in order
    want = xor_rows(xor_rows(before, b1.index, b1.delta), b2.index, b2.delta)
    assert torch.equal(bits(pp.parity), bits(want)) and pp.held == []
    assert pp.pver[0].tolist() == [0, 0, 0, 2] and pp.pver[1].tolist() == [0, 0, 0, 1]
    # A re-delivered or replayed delta the record already reflects is skipped.
    pp._apply_in_order(b1)
    assert torch.equal(bits(pp.parity), bits(want))


def test_held_rows_apply_as_soon_as_their_predecessor_does_and_the_marks_of_held_rows_follow_them():
    pp = parity_participant()
    before = pp.parity.clone()
    ahead = [batch(f"a{i}", 2, index=[i], slot=[3], version=[2], seed=20 + i) for i in range(3)]
    for b in ahead:
        assert pp.apply(b) is False  # each waits for its row's version 1
    assert len(pp.held) == 3 and int(pp.held_marks().sum()) == 3
    other = batch("o", 3, index=[0], slot=[0], version=[1], seed=30)  # another member of a held row's record
    assert pp.apply(other) is True
    assert len(pp.held) == 3 and int(pp.held_marks().sum()) == 3  # not a held row: nothing of them applies
    first = batch("p1", 2, index=[1], slot=[3], version=[1], seed=31)
    assert pp.apply(first) is True
    assert [h.txn for h in pp.held] == ["a0", "a2"] and int(pp.held_marks().sum()) == 2
    want = before
    for b in (other, first, ahead[1]):
        want = xor_rows(want, b.index, b.delta)
    assert torch.equal(bits(pp.parity), bits(want)) and pp.pver[1].tolist() == [0, 0, 0, 2]
    # Dropped with their server (it failed): nothing is marked held any more.
    assert [h.txn for h in pp.drop_held(2)] == ["a0", "a2"]
    assert pp.held == [] and not bool(pp.held_marks().any())


def test_a_data_participant_applies_a_part_at_once_as_stage_and_commit_would():
    staged, applied = data_participant(seed=3), data_participant(seed=3)
    local, grads = rows(0, 5, 9), grads_for(3, seed=4)
    part = staged.stage("t1", local, grads, now=0.0)
    staged.commit("t1")
    batches = applied.apply("t1", local, grads)
    assert torch.equal(bits(applied.records), bits(staged.records))
    assert torch.equal(applied.versions, staged.versions)
    assert [(b.parity_server, bits(b.delta).tolist(), b.version.tolist()) for b in batches] == [
        (b.parity_server, bits(b.delta).tolist(), b.version.tolist()) for b in part.batches
    ]
    assert not applied.locks.busy(local) and applied.staged == {}


def test_a_later_delta_of_the_same_row_from_the_same_server_proves_the_earlier_one_committed():
    pp = parity_participant()
    pp.stage(batch("t1", 2, index=[0, 1], slot=[3, 3], version=[1, 1], seed=13))
    assert not proves_commit(pp, "t1", 2)  # nothing later
    pp.stage(batch("d1", 2, index=[0], slot=[3], version=[2], seed=14))  # a degraded write, not 2's own
    pp.stage(batch("u1", 1, index=[0], slot=[1], version=[2], seed=15))  # another member of the record
    assert not proves_commit(pp, "t1", 2, exclude={"d1"})
    assert proves_commit(pp, "t1", 2)  # were d1 server 2's own, its stage would prove t1's commit
    pp.abort("d1", 2)
    pp.stage(batch("t2", 2, index=[1], slot=[3], version=[2], seed=16))
    assert pp.commit("t2", 2) == "committed" and [h.txn for h in pp.held] == ["t2"]
    assert proves_commit(pp, "t1", 2)  # held: committed on top of t1


def test_held_rows_that_no_staged_delta_can_complete_are_dropped_as_orphans():
    pp = parity_participant()
    before = pp.parity.clone()
    pp.stage(batch("t2", 2, index=[0, 1], slot=[3, 3], version=[2, 2], seed=13))
    pp.stage(batch("t1", 2, index=[1], slot=[3], version=[1], seed=14))  # row 1's predecessor only
    assert pp.commit("t2", 2) == "committed" and len(pp.held) == 1
    assert drop_orphans(pp) == 1  # record 0's version-2 delta: nothing staged brings it to version 1
    assert [h.index.tolist() for h in pp.held] == [[1]]
    assert pp.commit("t1", 2) == "committed" and pp.held == []
    assert pp.pver[0].tolist() == [0, 0, 0, 0] and pp.pver[1].tolist() == [0, 0, 0, 2]
    assert torch.equal(bits(pp.parity[0]), bits(before[0]))  # the record keeps the cut it had


def test_undecided_deltas_expire_for_the_adapter_to_resolve():
    pp = parity_participant()
    pp.stage(batch("t1", 2, index=[0], slot=[3], version=[1]), now=10.0)
    pp.stage(batch("t2", 1, index=[1], slot=[0], version=[1]), now=14.0)
    assert pp.expired(now=15.5, timeout=5.0) == [("t1", 2)]
    pp.abort("t1", 2)
    assert pp.expired(now=100.0, timeout=5.0) == [("t2", 1)]


def test_immediate_deltas_are_applied_once_per_txn():
    pp = parity_participant()
    b = batch("p1", 2, index=[0], slot=[3], version=[1])
    assert pp.apply_now(b) == "committed"
    once = pp.parity.clone()
    assert pp.apply_now(b) == "committed"  # its ack was lost and the data server sent it again
    assert torch.equal(bits(pp.parity), bits(once)) and pp.pver[0].tolist() == [0, 0, 0, 1]


def test_resolved_outcomes_are_bounded():
    pp = parity_participant()
    pp.max_resolved = 3
    for i in range(5):
        pp.stage(batch(f"t{i}", 1, index=[0], slot=[1], version=[1]))
        pp.abort(f"t{i}", 1)
    assert list(pp.resolved) == [("t2", 1), ("t3", 1), ("t4", 1)]


def test_a_stray_abort_leaves_no_trace_and_later_deltas_still_commit():
    pp = parity_participant()
    assert pp.abort("w0-3/1.-1.0", 1) == "unknown"
    assert not pp.resolved
    b = batch("w0-3/1.-1.0", 1, index=[0], slot=[1], version=[1])
    pp.stage(b)
    assert pp.commit("w0-3/1.-1.0", 1) == "committed"
    assert torch.equal(bits(pp.parity[0]), bits(xor_rows(parity_participant().parity, b.index, b.delta)[0]))


# -- plan_recovery -------------------------------------------------------------------------------------------
def test_plan_recovery_starts_with_dense_then_data_then_parity():
    steps = plan_recovery(10, 4, 4)
    assert steps == [
        Step("dense", 0, 0),
        Step("data", 0, 4),
        Step("data", 4, 4),
        Step("data", 8, 2),
        Step("parity", 0, 4),
    ]


@settings(max_examples=60, deadline=None)
@given(data_rows=st.integers(0, 300), parity_rows=st.integers(0, 100), group=st.integers(1, 64))
def test_plan_recovery_covers_every_row_and_parity_index_exactly_once(data_rows, parity_rows, group):
    steps = plan_recovery(data_rows, parity_rows, group)
    assert [s.kind for s in steps].count("dense") == 1 and steps[0].kind == "dense"
    for kind, total in (("data", data_rows), ("parity", parity_rows)):
        mine = [s for s in steps if s.kind == kind]
        covered = [i for s in mine for i in range(s.start, s.start + s.count)]
        assert covered == list(range(total))  # in order, each exactly once
        assert all(1 <= s.count <= group for s in mine)
        assert len(mine) == -(-total // group)
    kinds = [s.kind for s in steps]
    assert kinds == sorted(kinds, key=["dense", "data", "parity"].index)


@pytest.mark.parametrize("group", [0, -1])
def test_plan_recovery_rejects_empty_lock_groups(group):
    with pytest.raises(ValueError):
        plan_recovery(10, 2, group)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 7).flatmap(
        lambda n: st.tuples(
            st.just(n), st.integers(1, n - 1), st.integers(0, n - 1), st.sets(st.integers(0, 40), max_size=30)
        )
    )
)
def test_a_parts_delta_batches_are_its_rows_grouped_by_parity_server(case):
    # DataParticipant.delta_batches cuts a part by stripe slot; the definition is placement's parity_of.
    n, k, shard, local = case
    p = Placement(num_servers=n, k=k, num_rows=n * 45)
    dp = DataParticipant(
        shard,
        p,
        CODE,
        OPT,
        torch.zeros(p.rows_on(shard), W),
        torch.zeros(p.rows_on(shard), dtype=torch.int64),
    )
    part = torch.tensor(sorted(local), dtype=torch.int64)
    delta = torch.randn(part.numel(), W)
    version = torch.arange(part.numel()) + 1
    batches = dp.delta_batches("t", part, delta, version)
    expected = p.group_by_parity(shard, part)
    assert [b.parity_server for b in batches] == [server for server, _pos, _index in expected]
    _sigma, slot = p.stripe_of(shard, part)
    for b, (_server, pos, index) in zip(batches, expected, strict=True):
        assert torch.equal(b.index, index) and torch.equal(b.slot, slot[pos])
        assert torch.equal(bits(b.delta), bits(delta[pos])) and torch.equal(b.version, version[pos])
        assert b.src == shard and b.txn == "t"


FAST_PATHS = [
    "numpy",
    pytest.param(
        "c", marks=pytest.mark.skipif(not heldrows.AVAILABLE, reason="ecrec.core._heldrows not built")
    ),
]


@pytest.mark.parametrize("path", FAST_PATHS)
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_the_fast_paths_and_the_torch_path_apply_deliveries_to_the_same_state(path, seed):
    """Random deliveries of several members' updates, out of order, duplicated and re-delivered: each CPU xor
    fast path (numpy on the same memory; C with flat held rows) and the general torch path leave bit-identical
    records, versions, held rows and answers after every delivery."""
    gen = torch.Generator().manual_seed(seed)
    fast, slow = parity_participant(seed=seed % 7), parity_participant(seed=seed % 7)
    fast.choose_path(path)
    slow.choose_path("torch")
    n = fast.parity.shape[0]
    # Updates of random rows by the members of server 0's records, each row's versions counting up; delivered
    # mostly in order, with neighbours swapped (held rows) and some delivered again (skipped rows).
    batches, versions = [], torch.zeros(n, K, dtype=torch.int64)
    for i in range(12):
        slot = int(torch.randint(0, K, (1,), generator=gen))
        src = (slot + (0 - K) % N) % N  # the data server whose rows are member `slot` of server 0's records
        index = torch.randperm(n, generator=gen)[: int(torch.randint(1, n + 1, (1,), generator=gen))]
        versions[index, slot] += 1
        delta = torch.randn(index.numel(), W, generator=gen)
        batches.append(
            DeltaBatch(0, f"t{i}", src, index, torch.full_like(index, slot), delta, versions[index, slot])
        )
    order = list(range(len(batches)))
    for i in range(1, len(order) - 2, 3):  # windows of three reversed now and then: chains of held rows
        if float(torch.rand(1, generator=gen)) < 0.5:
            order[i : i + 3] = order[i : i + 3][::-1]
    order += torch.randint(0, len(batches), (3,), generator=gen).tolist()
    for j in order:
        b = batches[j]
        assert fast.apply(b) == slow.apply(b)
        assert torch.equal(bits(fast.parity), bits(slow.parity))
        assert torch.equal(fast.pver, slow.pver)
        assert held_rows(fast) == held_rows(slow)
        marks = fast.held_marks()  # True wherever a row is held (it may stay True where none is)
        assert all(bool(marks[k]) for _t, _s, k, _v in held_rows(fast))
    assert fast.held or not slow.held


@pytest.mark.parametrize("path", FAST_PATHS)
def test_a_chain_of_held_updates_applies_whole_when_its_first_arrives(path):
    """Versions 3 and 2 of a row held, then 1 arrives: 2 applies, and then 3 — in every path, nothing left."""
    fast, slow = parity_participant(), parity_participant()
    fast.choose_path(path)
    slow.choose_path("torch")
    chain = [batch(f"t{v}", 2, index=[0, 1], slot=[3, 3], version=[v, v], seed=40 + v) for v in (3, 2, 1)]
    for b in chain:
        assert fast.apply(b) == slow.apply(b) == (b.txn == "t1")
    assert fast.held == [] and slow.held == []
    assert torch.equal(bits(fast.parity), bits(slow.parity)) and fast.pver[0].tolist() == [0, 0, 0, 3]


def held_rows(pp: ParityParticipant) -> set[tuple[str, int, int, int]]:
    """(txn, src, record-member key, version) of every held row."""
    return {
        (h.txn, h.src, int(k), int(v))
        for h in pp.held
        for k, v in zip((h.index * K + h.slot).tolist(), h.version.tolist(), strict=True)
    }


def test_cpu_xor_records_take_the_c_path_where_it_is_built_and_the_numpy_path_where_not(monkeypatch):
    from ecrec.core import ordered_xor

    assert parity_participant().path == ("c" if heldrows.AVAILABLE else "numpy")
    calls = []
    real = ordered_xor.apply_in_order
    monkeypatch.setattr(ordered_xor, "apply_in_order", lambda pp, b: calls.append(b.txn) or real(pp, b))
    monkeypatch.setattr(heldrows, "AVAILABLE", False)
    pp = parity_participant()
    assert pp.path == "numpy"
    assert pp.apply(batch("t1", 2, index=[0, 1], slot=[3, 3], version=[1, 1])) is True
    assert calls == ["t1"]


def test_the_c_path_is_built_wherever_a_c_compiler_is():
    """`make` installs the package with its extension; only a machine without a compiler falls back."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the numpy path runs")
    assert heldrows.AVAILABLE
