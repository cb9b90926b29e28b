"""The protocol core without I/O: row locks, 2PC participants, recovery plans (deterministic, in memory)."""

from __future__ import annotations

import pytest
import torch

from ecrec.core.codes import make_code
from ecrec.core.optim import make_optimizer
from ecrec.core.placement import Placement
from ecrec.core.recovery import Step, plan_recovery
from ecrec.core.txn import DataParticipant, ParityParticipant, RowLocks, RowsBusy, UnknownTxn
from ecrec.core.update import DecisionQueue, MapView, StepUpdate

P = Placement(num_servers=5, k=4, num_rows=200)
XOR = make_code("xor")
OPT = make_optimizer("adagrad", 0.1)
DIM = 4


def participant(shard: int = 1) -> DataParticipant:
    n = P.rows_on(shard)
    recs = OPT.init_records(torch.randn(n, DIM, generator=torch.Generator().manual_seed(shard)))
    return DataParticipant(shard, P, XOR, OPT, recs, torch.zeros(n, dtype=torch.int64))


def parity_of_members(server: int) -> tuple[torch.Tensor, dict[int, DataParticipant]]:
    parts = {s: participant(s) for s in range(P.num_servers)}
    return _encode_now(server, parts)[0], parts


def test_row_locks_are_all_or_nothing_and_released_exactly():
    locks = RowLocks(10)
    locks.lock("a", torch.tensor([1, 2]))
    with pytest.raises(RowsBusy):
        locks.lock("b", torch.tensor([3, 2]))
    assert not locks.busy(torch.tensor([3]))  # nothing of b's request was taken
    locks.lock("a", torch.tensor([5]))  # the holder may extend its own lock
    assert locks.busy(torch.tensor([5])) and not locks.busy(torch.tensor([5]), txn="a")
    assert sorted(locks.unlock("a").tolist()) == [1, 2, 5]
    assert not locks.busy(torch.arange(10)) and locks.holders() == []


def test_stage_computes_records_deltas_and_versions_without_applying():
    dp = participant(1)
    rows = torch.tensor([0, 3, 7, 9])
    before = dp.records.clone()
    grads = torch.randn(4, DIM, generator=torch.Generator().manual_seed(5))
    part = dp.stage("t1", rows, grads, now=0.0)
    assert torch.equal(dp.records, before)  # phase 1 changes nothing visible
    assert torch.equal(part.new, OPT.apply(before[rows], grads))
    staged_rows = torch.cat([b.index * P.k + b.slot for b in part.batches])
    assert sorted(staged_rows.tolist()) == sorted(
        rows.tolist()
    )  # every row's delta goes to its parity server
    for b in part.batches:
        pos = torch.isin(rows, b.index * P.k + b.slot)
        assert torch.equal(XOR.apply_delta(before[rows][pos], b.delta), part.new[pos])
        assert bool((b.version == 1).all()) and bool((P.parity_of(1, rows[pos])[0] == b.parity_server).all())
    assert dp.stage("t1", rows, grads, now=1.0) is part  # a retried stage gets the same answer
    with pytest.raises(RowsBusy):
        dp.stage("t2", torch.tensor([7]), grads[:1], now=0.0)  # hot row: one staged txn at a time
    dp.commit("t1")
    assert torch.equal(dp.records[rows], part.new) and bool((dp.versions[rows] == 1).all())
    dp.stage("t2", torch.tensor([7]), grads[:1], now=0.0)  # released on commit
    with pytest.raises(UnknownTxn):
        dp.commit("t1")


def test_abort_releases_without_applying_and_expiry_finds_abandoned_parts():
    dp = participant(2)
    rows = torch.tensor([1, 2])
    before = dp.records.clone()
    dp.stage("old", rows, torch.ones(2, DIM), now=0.0)
    dp.stage("new", torch.tensor([5]), torch.ones(1, DIM), now=9.0)
    assert dp.expired(now=10.0, timeout=5.0) == ["old"]
    assert dp.abort("old") is not None
    assert torch.equal(dp.records, before) and not dp.locks.busy(rows)


def test_parity_follows_committed_parts_bit_exactly_in_any_order():
    server = 0
    parity, parts = parity_of_members(server)
    pp = ParityParticipant(
        server, P, XOR, parity.clone(), torch.zeros(parity.shape[0], P.k, dtype=torch.int64)
    )
    gen = torch.Generator().manual_seed(9)
    staged = []
    for s in (1, 2, 3, 4):  # the data servers whose rows have parity on server 0
        rows = torch.arange(P.rows_on(s))[P.parity_of(s, torch.arange(P.rows_on(s)))[0] == server][:6]
        part = parts[s].stage(f"t{s}", rows, torch.randn(rows.numel(), DIM, generator=gen), now=0.0)
        for b in part.batches:
            pp.stage(b)
        staged.append((f"t{s}", s))
    assert torch.equal(pp.parity, parity)  # staged deltas change nothing
    for txn, s in reversed(staged):  # decisions in another order than the stages
        assert pp.commit(txn, s) == "committed"
        parts[s].commit(txn)
    expected, _ = _encode_now(server, parts)
    assert torch.equal(pp.parity.view(torch.int32), expected.view(torch.int32))
    # pver records the member versions the parity reflects
    shards, locs, present = P.stripe_members(server, torch.arange(pp.parity.shape[0]))
    for i in range(P.k):
        for row in torch.nonzero(present[:, i]).squeeze(1).tolist():
            assert pp.pver[row, i] == parts[int(shards[row, i])].versions[locs[row, i]]


@pytest.mark.parametrize("case", ["distinct rows", "a row twice", "held delta", "with strays"])
def test_commit_many_equals_committing_one_by_one(case):
    """Decisions in one message (commit_many: one scatter where it can) end exactly where committing
    them one by one does: parity bits, pver, what is held, and each decision's outcome."""
    server = 0
    parity, parts = parity_of_members(server)
    gen = torch.Generator().manual_seed(3)

    def fresh() -> ParityParticipant:
        return ParityParticipant(
            server, P, XOR, parity.clone(), torch.zeros(parity.shape[0], P.k, dtype=torch.int64)
        )

    one, many = fresh(), fresh()
    keys = []
    for s in (1, 2, 3):
        rows = torch.arange(P.rows_on(s))[P.parity_of(s, torch.arange(P.rows_on(s)))[0] == server][:5]
        waves = 2 if (case == "a row twice" and s == 2) or (case == "held delta" and s == 3) else 1
        for w in range(waves):
            txn = f"t{s}-{w}"
            part = parts[s].stage(txn, rows, torch.randn(rows.numel(), DIM, generator=gen), now=0.0)
            parts[s].commit(txn)
            for pp in (one, many):
                for b in part.batches:
                    pp.stage(b)
            keys.append((txn, s))
    if case == "held delta":  # s=3's second update decided first: held until its predecessor comes
        for pp in (one, many):
            pp.commit("t3-1", 3)
        assert one.held and many.held
        keys.remove(("t3-1", 3))
    if case == "with strays":  # a duplicate, one never staged, one aborted before
        for pp in (one, many):
            pp.abort("t1-0", 1)
        keys += [keys[1], ("never", 4)]
    expected = [one.commit(txn, s) for txn, s in keys]
    assert many.commit_many(keys) == expected
    assert torch.equal(many.parity.view(torch.int32), one.parity.view(torch.int32))
    assert torch.equal(many.pver, one.pver) and many.staged.keys() == one.staged.keys()
    assert len(many.held) == len(one.held) == 0
    if case != "with strays":
        all_committed, _ = _encode_now(server, parts)
        assert torch.equal(many.parity.view(torch.int32), all_committed.view(torch.int32))


def _encode_now(server: int, parts: dict[int, DataParticipant]) -> tuple[torch.Tensor, None]:
    n = P.parity_rows_on(server)
    shards, locs, present = P.stripe_members(server, torch.arange(n))
    members = torch.zeros(P.k, n, OPT.record_width(DIM))
    for i in range(P.k):
        for row in range(n):
            if present[row, i]:
                members[i, row] = parts[int(shards[row, i])].records[locs[row, i]]
    return XOR.encode(members), None


def test_parity_decisions_are_idempotent_and_final():
    parity, parts = parity_of_members(0)
    pp = ParityParticipant(0, P, XOR, parity.clone(), torch.zeros(parity.shape[0], P.k, dtype=torch.int64))
    rows = torch.arange(P.rows_on(1))[P.parity_of(1, torch.arange(P.rows_on(1)))[0] == 0][:3]
    part = parts[1].stage("t", rows, torch.ones(3, DIM), now=0.0)
    for b in part.batches:
        pp.stage(b)
    assert pp.abort("t", 1) == "aborted"
    assert pp.commit("t", 1) == "aborted"  # a late commit cannot undo the abort
    for b in part.batches:
        pp.stage(b)  # nor can a duplicate of the stage
    assert pp.staged == {} and torch.equal(pp.parity, parity)
    assert pp.commit("never", 1) == "unknown"


def test_rebuilt_parity_replays_only_deltas_newer_than_the_rebuild():
    parity, parts = parity_of_members(0)
    n = parity.shape[0]
    pp = ParityParticipant(
        0,
        P,
        XOR,
        torch.zeros_like(parity),
        torch.zeros(n, P.k, dtype=torch.int64),
        ready=torch.zeros(n, dtype=torch.bool),
    )
    rows = torch.arange(P.rows_on(1))[P.parity_of(1, torch.arange(P.rows_on(1)))[0] == 0][:4]
    part = parts[1].stage("t", rows, torch.ones(4, DIM), now=0.0)
    for b in part.batches:
        pp.stage(b)
    pp.commit("t", 1)  # arrives before the record is rebuilt: kept, not applied to garbage
    assert len(pp.pending) == len(part.batches)
    parts[1].commit("t")
    # case 1: the rebuild read members *before* the commit reached them -> the kept delta is replayed
    pp.install(torch.arange(n), parity.clone(), torch.zeros(n, P.k, dtype=torch.int64))
    expected, _ = _encode_now(0, parts)
    assert torch.equal(pp.parity.view(torch.int32), expected.view(torch.int32)) and pp.pending == []


def test_recovery_plan_covers_everything_once_in_groups():
    plan = plan_recovery(data_rows=10, parity_rows=3, lock_group_rows=4)
    assert plan[0] == Step("dense", 0, 0)
    data = [s for s in plan if s.kind == "data"]
    assert [(s.start, s.count) for s in data] == [(0, 4), (4, 4), (8, 2)]
    assert [(s.start, s.count) for s in plan if s.kind == "parity"] == [(0, 3)]
    with pytest.raises(ValueError):
        plan_recovery(10, 3, 0)


def test_rebuilt_parity_skips_deltas_the_rebuild_already_reflects():
    parity, parts = parity_of_members(0)
    n = parity.shape[0]
    pp = ParityParticipant(
        0,
        P,
        XOR,
        torch.zeros_like(parity),
        torch.zeros(n, P.k, dtype=torch.int64),
        ready=torch.zeros(n, dtype=torch.bool),
    )
    rows = torch.arange(P.rows_on(1))[P.parity_of(1, torch.arange(P.rows_on(1)))[0] == 0][:4]
    part = parts[1].stage("t", rows, torch.ones(4, DIM), now=0.0)
    for b in part.batches:
        pp.stage(b)
    pp.commit("t", 1)
    parts[1].commit("t")
    # case 2: the rebuild read members *after* the commit (versions 1): replaying would apply it twice
    current, _ = _encode_now(0, parts)
    shards, locs, present = P.stripe_members(0, torch.arange(n))
    vers = torch.zeros(n, P.k, dtype=torch.int64)
    for i in range(P.k):
        for row in torch.nonzero(present[:, i]).squeeze(1).tolist():
            vers[row, i] = parts[int(shards[row, i])].versions[locs[row, i]]
    pp.install(torch.arange(n), current.clone(), vers)
    assert torch.equal(pp.parity.view(torch.int32), current.view(torch.int32)) and pp.pending == []


# -- a worker step's update (StepUpdate) ---------------------------------------------------------------------
DENSE = [(c, (c + 1) % P.num_servers) for c in range(P.num_servers)]  # two replicas per chunk


def by_target(parts) -> dict[tuple[int, int], object]:
    return {(q.target, q.src): q for q in parts}


def test_step_update_routes_rows_by_the_map_and_names_parts_by_step_target_src_and_pass():
    g = torch.arange(0, 200, 7)
    up = StepUpdate("w0-3", P, g, DENSE)
    parts = up.plan(MapView(epoch=4))
    assert sorted(torch.cat([q.pos for q in parts]).tolist()) == list(range(g.numel()))
    for q in parts:
        assert q.src == -1 and q.epoch == 4 and q.txn == f"w0-3/{q.target}.-1.0"
        assert bool((P.data_shard(g[q.pos]) == q.target).all())
        assert sorted(q.dense) == [c for c, hs in enumerate(DENSE) if q.target in hs]
    # Shard 2 fails: its rows go to the parity servers of their stripes, tagged with src = 2.
    up = StepUpdate("w0-3", P, g, DENSE)
    parts = by_target(up.plan(MapView(epoch=5, failed_shards=frozenset({2}))))
    mine = (P.data_shard(g) == 2).nonzero().reshape(-1)
    acting = [q for (t, src), q in parts.items() if src == 2]
    assert acting and sorted(torch.cat([q.pos for q in acting]).tolist()) == mine.tolist()
    for q in acting:
        assert bool((P.parity_of(2, P.local_row(g[q.pos]))[0] == q.target).all())
    assert all(q.target != 2 for q in parts.values())  # nothing, dense chunks included, goes to it
    with pytest.raises(ValueError, match="must not contain '/'"):
        StepUpdate("a/b", P, g, DENSE)


def test_step_update_replans_only_what_is_not_committed_and_finishes():
    g = torch.arange(0, 200, 5)
    up = StepUpdate("s", P, g, DENSE)
    view = MapView(epoch=1)
    first = up.plan(view)
    for q in first[1:]:
        up.committed(q)
    again = up.plan(view)
    assert [(q.target, q.src) for q in again] == [(first[0].target, -1)]
    assert torch.equal(again[0].pos, first[0].pos) and again[0].dense == first[0].dense
    assert again[0].txn.endswith(".1")  # a new pass: a new txn id
    up.committed(again[0])
    assert up.finished(view) and up.plan(view) == []


def test_step_update_sends_a_dense_chunk_again_to_a_replica_whose_process_was_replaced():
    """Done-ness of a dense chunk is per incarnation: a new process has only what it copied."""
    g = torch.empty(0, dtype=torch.int64)
    up = StepUpdate("s", P, g, [(0, 1)])
    parts = by_target(up.plan(MapView(1, incarnations={0: 1, 1: 1})))
    up.committed(parts[(1, -1)])  # replica 1 applied the step; replica 0's part failed (busy)
    # Replica 1 dies: the step needs only replica 0 now.
    parts = by_target(up.plan(MapView(2, frozenset({1}), {0: 1, 1: 1})))
    assert list(parts) == [(0, -1)]
    up.committed(parts[(0, -1)])
    assert up.finished(MapView(2, frozenset({1}), {0: 1, 1: 1}))
    # Its replacement (incarnation 2) may have copied the chunk from replica 0 before replica 0 applied the
    # step: it gets the step too (and skips it if its copy already had it).
    view = MapView(3, incarnations={0: 1, 1: 2})
    assert not up.finished(view)
    assert [(q.target, q.dense, q.incarnation) for q in up.plan(view)] == [(1, [0], 2)]


def test_step_update_counts_rows_but_not_dense_chunks_of_a_target_that_acked_and_died():
    g = torch.tensor([P.num_servers * 3 + 0])  # one row of shard 0, which also holds dense chunk 0
    up = StepUpdate("s", P, g, [(0, 1)])
    parts = by_target(up.plan(MapView(1)))
    up.committed_by_dead_target(parts[(0, -1)])
    up.committed(parts[(1, -1)])
    assert bool(up.rows_done.all())
    assert up.finished(MapView(2, frozenset({0})))  # the survivor holds the chunk
    assert [q.target for q in up.plan(MapView(3, incarnations={0: 2}))] == [0]  # a replacement gets it


def test_decision_queue_keeps_each_servers_decisions_in_order_across_take_and_put_back():
    q = DecisionQueue()
    assert not q and q.take(3) == []
    q.add([(1, "a1"), (2, "a2"), (1, "b1")])
    q.add([(1, "c1")])
    assert q
    taken = q.take(1)
    assert taken == ["a1", "b1", "c1"] and q.take(1) == []
    q.add([(1, "d1")])  # decided while the first message was in flight
    q.put_back(1, taken)  # that message failed: resend its decisions ahead of the newer one
    assert q.take_all() == {1: ["a1", "b1", "c1", "d1"], 2: ["a2"]}
    assert not q and q.take_all() == {}
