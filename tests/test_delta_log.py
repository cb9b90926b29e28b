"""commit: deltaLog step by step, in-process (tests/netsim.py's stores, no sockets): a part is applied when it
is staged, its deltas reach the parity servers in any order and are applied in version order, and every
failure leaves a consistent cut with each update applied exactly once (docs/protocol.md, "Update path").

Each scenario is compared with a reference network that applied the same updates without any failure:
bit-identical rows, versions and dense records, and parity exact (invariant I1).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ecrec.core.deltalog import DeltaLog
from ecrec.core.txn import DeltaBatch
from ecrec.store.state import NotOwner
from tests.conftest import make_ctx
from tests.netsim import WORKER, Net, assert_same_model, bits, logical_model, parity_check, wire_copy

N, K = 5, 4
S = 1  # the data server the scenarios update


@pytest.fixture(scope="module")
def ctx():
    return make_ctx(
        "deltalog", faultTolerance__strategy="ecrec", servers__replicas=N, faultTolerance__ecrec__k=K
    )


def rows(ctx, n: int = 12) -> torch.Tensor:
    """Global ids of n rows of shard S, spread over every stripe slot (so over k parity servers)."""
    return ctx.placement.global_id(S, torch.arange(n) * 3)


def grads(ctx, g: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(g.numel(), ctx.dim, generator=torch.Generator().manual_seed(seed))


def stage(net: Net, txn: str, g: torch.Tensor, gr: torch.Tensor, target: int = S, src: int = -1):
    """A worker's stage: (rows, deltas as they come back over the wire)."""
    n, batches = net.call(WORKER, target, "apply_part", txn, g, gr, src)
    return n, [wire_copy(b, b.parity_server) for b in batches]


def deliver(net: Net, batches: list[DeltaBatch], wait: bool = False) -> list:
    """DeliverDeltas to every parity server of `batches`; the refused rows, (txn, src, index) each."""
    out = []
    for server in sorted({b.parity_server for b in batches}):
        mine = [b for b in batches if b.parity_server == server]
        out += net.call(WORKER, server, "deliver", mine, wait)
    return out


def write_again(net: Net, txn: str, g: torch.Tensor, gr: torch.Tensor, src: int = S) -> None:
    """Rows of failed shard `src` written at their acting homes (degraded writes), as the worker does."""
    p = net.ctx.placement
    pserver, _ = p.parity_of(src, p.local_row(g))
    for home in pserver.unique().tolist():
        sel = pserver == home
        net.call(
            WORKER, home, "apply_part", txn.replace(f"/{src}.-1.", f"/{home}.{src}."), g[sel], gr[sel], src
        )


def reference(ctx, updates) -> Net:
    """The same updates, staged and delivered one after the other without failures."""
    ref = Net(ctx)
    for txn, g, gr in updates:
        deliver(ref, stage(ref, txn, g, gr)[1])
    assert parity_check(ref)["mismatches"] == 0
    return ref


def rebuilt(net: Net, s: int = S) -> Net:
    net.replace(s)
    net.recover(s, lock_group_rows=64)
    return net


def assert_consistent(net: Net) -> None:
    pc = parity_check(net)
    assert pc["mismatches"] == 0 and pc["in_flight"] == 0, pc


def test_the_log_acks_in_any_order_and_hands_out_due_parts_in_the_order_they_were_applied():
    log = DeltaLog()
    for i, t in enumerate(["w0-1/1.-1.0", "w1-1/1.-1.0", "w0-2/1.-1.0"]):
        log.add(t, rows=3, batches=[], now=float(i))
    assert log.ack(["w1-1/1.-1.0", "nope"]) == 1 and len(log) == 2
    assert log.due(now=10.0, timeout=5.0) == ["w0-1/1.-1.0", "w0-2/1.-1.0"]
    assert log.due(now=1.5, timeout=5.0, gone=lambda t: t.startswith("w0-2")) == ["w0-2/1.-1.0"]


def test_a_stage_applies_at_once_and_a_retry_is_answered_from_the_log(ctx):
    net, g = Net(ctx), rows(ctx)
    gr = grads(ctx, g, 1)
    n, first = stage(net, "w0-1/1.-1.0", g, gr)
    local = ctx.placement.local_row(g)
    assert n == g.numel() and bool((net[S].rows.versions[local] == 1).all())
    before = net[S].rows.records[local].clone()
    _, again = stage(net, "w0-1/1.-1.0", g, gr)  # the answer was lost: the worker asks again
    assert torch.equal(net[S].rows.records[local], before) and bool((net[S].rows.versions[local] == 1).all())
    assert [(b.parity_server, b.version.tolist()) for b in again] == [
        (b.parity_server, b.version.tolist()) for b in first
    ]
    assert deliver(net, again) == [] and net[S].deltalog.get("w0-1/1.-1.0") is not None
    net.call(WORKER, S, "apply_part", "w0-2/1.-1.0", g[:0], gr[:0], -1, None, 0, ["w0-1/1.-1.0"])
    assert net[S].deltalog.get("w0-1/1.-1.0") is None  # acknowledged on the next stage: forgotten
    assert_consistent(net)
    assert_same_model(logical_model(net), logical_model(reference(ctx, [("w0-1/1.-1.0", g, gr)])))


def test_deltas_delivered_out_of_order_wait_for_their_predecessor(ctx):
    net, g = Net(ctx), rows(ctx)
    a, b = grads(ctx, g, 1), grads(ctx, g, 2)
    _, da = stage(net, "w0-1/1.-1.0", g, a)  # worker 0 stages first: versions 1
    _, db = stage(net, "w1-1/1.-1.0", g, b)  # worker 1 second: versions 2, built on worker 0's update
    answers: list = []
    t = threading.Thread(target=lambda: answers.append(deliver(net, db, wait=True)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "worker 1's deltas were answered before worker 0's, which they build on, arrived"
    assert parity_check(net)["in_flight"] > 0
    assert deliver(net, da, wait=True) == []
    t.join(timeout=5)
    assert answers == [[]]
    assert_consistent(net)
    want = reference(ctx, [("w0-1/1.-1.0", g, a), ("w1-1/1.-1.0", g, b)])
    assert_same_model(logical_model(net), logical_model(want))


def test_a_stage_planned_before_a_replacement_registered_is_refused_once_the_rebuild_has_read(ctx):
    # Found as rare stalls of coordinator-failover runs: a worker whose map still had parity server q failed
    # staged rows of S (planned to skip q), the stage took S's lock only after q's replacement had read S's
    # rows for its re-encode. The rebuilt parity never got that delta, and every later update of those rows
    # was held at q for it, forever. S adopted the newer epoch with the read (netsim: every store does at
    # each map change), so the stage must be refused under the lock, whatever it was checked against before.
    net, g = Net(ctx), rows(ctx)
    gr = grads(ctx, g, 1)
    q = int(ctx.placement.parity_of(S, ctx.placement.local_row(g))[0][0])
    net.kill(q)
    planned = net.epoch  # the worker's map: q failed, its deltas are skipped
    net.replace(q)
    net.recover(q, lock_group_rows=64)  # q's parity re-encoded from S's rows as they are now
    with pytest.raises(NotOwner):
        net.call(WORKER, S, "apply_part", "w0-1/1.-1.0", g, gr, -1, None, planned)
    assert not bool(net[S].rows.versions[ctx.placement.local_row(g)].any())  # nothing applied
    # The worker refreshes its map and stages again: q is a parity server again, its deltas delivered too.
    _, batches = net.call(WORKER, S, "apply_part", "w0-1/1.-1.0", g, gr, -1, None, net.epoch)
    assert q in {b.parity_server for b in batches}
    assert deliver(net, [wire_copy(b, b.parity_server) for b in batches], wait=True) == []
    assert_consistent(net)
    assert_same_model(logical_model(net), logical_model(reference(ctx, [("w0-1/1.-1.0", g, gr)])))


def test_a_parity_server_says_what_a_held_delivery_waits_for(ctx):
    net, g = Net(ctx), rows(ctx)
    stage(net, "w0-1/1.-1.0", g, grads(ctx, g, 1))  # versions 1: never delivered
    _, later = stage(net, "w1-1/1.-1.0", g, grads(ctx, g, 2))  # versions 2
    ps = later[0].parity_server
    mine = [b for b in later if b.parity_server == ps]
    assert deliver(net, mine) == []  # accepted, held
    why = net[ps].parity.why_held(mine)
    assert f"txn w1-1/1.-1.0 from shard {S} wait for an earlier update" in why
    assert "at version 2, the record reflects version 0" in why


def test_a_data_server_dead_before_delivery_has_its_rows_written_again_once(ctx):
    net, g = Net(ctx), rows(ctx)
    a = grads(ctx, g, 1)
    _, da = stage(net, "w0-1/1.-1.0", g, a)
    net.kill(S)  # its applied rows die with it; its deltas are in the worker's hands
    refused = deliver(net, da, wait=True)
    assert sum(r[2].numel() for r in refused) == g.numel()  # every row: the shard is failed everywhere
    write_again(net, "w0-1/1.-1.0", g, a)
    assert_same_model(logical_model(rebuilt(net)), logical_model(reference(ctx, [("w0-1/1.-1.0", g, a)])))
    assert_consistent(net)


def test_deltas_delivered_before_the_failure_count_and_are_not_written_twice(ctx):
    net, g = Net(ctx), rows(ctx)
    a = grads(ctx, g, 1)
    _, da = stage(net, "w0-1/1.-1.0", g, a)
    first = da[0].parity_server
    assert deliver(net, [b for b in da if b.parity_server == first]) == []  # one parity server got them
    net.kill(S)
    refused = deliver(net, [b for b in da if b.parity_server != first], wait=True)
    p = ctx.placement
    pserver, pindex = p.parity_of(S, p.local_row(g))
    again = torch.zeros(g.numel(), dtype=torch.bool)
    for _txn, _src, index in refused:
        again |= torch.isin(pindex, index) & (pserver != first)
    assert not bool(again[pserver == first].any()) and bool(again[pserver != first].all())
    write_again(net, "w0-1/1.-1.0", g[again], a[again])
    assert_same_model(logical_model(rebuilt(net)), logical_model(reference(ctx, [("w0-1/1.-1.0", g, a)])))


def test_a_delivery_asked_again_after_its_data_server_failed_is_refused_only_where_it_was_not_applied(ctx):
    # The worker did not hear the first answer and asks again once the data server has failed: a batch
    # applied then is not refused now (written again, it would be applied twice); one never seen is.
    net, g = Net(ctx), rows(ctx)
    a = grads(ctx, g, 1)
    _, da = stage(net, "w0-1/1.-1.0", g, a)
    first = da[0].parity_server
    assert deliver(net, [b for b in da if b.parity_server == first]) == []  # its answer is lost
    net.kill(S)
    # asked again, every parity server: only those that never saw the batch refuse it, whole
    refused = {b.parity_server: deliver(net, [b], wait=True) for b in da}
    assert refused[first] == []
    assert all(sum(r[2].numel() for r in refused[b.parity_server]) == b.index.numel() for b in da[1:])
    p = ctx.placement
    pserver, _ = p.parity_of(S, p.local_row(g))
    again = pserver != first
    write_again(net, "w0-1/1.-1.0", g[again], a[again])
    assert_same_model(logical_model(rebuilt(net)), logical_model(reference(ctx, [("w0-1/1.-1.0", g, a)])))
    assert_consistent(net)


def test_held_deltas_of_a_server_that_fails_are_refused_to_their_deliverer(ctx):
    # Worker 1's update builds on worker 0's; worker 1 delivers first (held), then the data server dies and
    # worker 0's delivery is refused. Worker 1 must learn its held rows were dropped, or its update is lost.
    net, g = Net(ctx), rows(ctx)
    a, b = grads(ctx, g, 1), grads(ctx, g, 2)
    _, da = stage(net, "w0-1/1.-1.0", g, a)
    _, db = stage(net, "w1-1/1.-1.0", g, b)
    assert deliver(net, db) == []  # held, not applied
    net.kill(S)
    assert sum(r[2].numel() for r in deliver(net, da, wait=True)) == g.numel()
    held = deliver(net, db, wait=True)  # what worker 1's waiting delivery answers once the failure is known
    assert sum(r[2].numel() for r in held) == g.numel()
    write_again(net, "w0-1/1.-1.0", g, a)
    write_again(net, "w1-1/1.-1.0", g, b)
    want = reference(ctx, [("w0-1/1.-1.0", g, a), ("w1-1/1.-1.0", g, b)])
    assert_same_model(logical_model(rebuilt(net)), logical_model(want))
    assert_consistent(net)


@pytest.mark.parametrize("maps", ["known", "first_heard_replaced"])
def test_held_deltas_of_a_replaced_incarnation_are_dropped_and_written_again_at_the_replacement(ctx, maps):
    # Worker 1's held deltas, stamped with S's first incarnation, wait for worker 0's, which are refused once S
    # is replaced: kept, they would hold the rows for ever (the replacement's rebuild and worker 1's delivery
    # both wait for them); dropped, their deliverer writes them again, at the replacement, under the same txn.
    # "first_heard_replaced": a server's map knows a shard's incarnation only once it was needed (a real
    # server's, fetched when it registered, may predate the shard's own registration), and the parity servers
    # first hear of S after it was replaced: they can tell the stale deltas only by their stamps.
    net, g = Net(ctx), rows(ctx)
    a, b = grads(ctx, g, 1), grads(ctx, g, 2)
    parity = [q for q in range(N) if q != S]
    for q in parity if maps == "first_heard_replaced" else ():  # their maps say nothing of S yet
        net[q].peers.failure_key = lambda s: 0 if s == S else net.incarnation[s]
    _, da = stage(net, "w0-1/1.-1.0", g, a)
    _, db = stage(net, "w1-1/1.-1.0", g, b)
    assert {x.incarnation for x in da + db} == {1}  # the worker's stamp: S's own map
    assert deliver(net, db) == []  # held, not applied
    net.kill(S)
    net.replace(S)
    for q in parity if maps == "first_heard_replaced" else ():  # now they do: incarnation 2, up
        del net[q].peers.failure_key
    assert sum(r[2].numel() for r in deliver(net, db, wait=True)) == g.numel()  # dropped: write them again
    assert sum(r[2].numel() for r in deliver(net, da, wait=True)) == g.numel()  # refused
    net.recover(S, lock_group_rows=64)
    for txn, gr in (
        ("w0-1/1.-1.0", a),
        ("w1-1/1.-1.0", b),
    ):  # written again under the same txns, as workers do
        _, again = stage(net, txn, g, gr)
        assert deliver(net, again, wait=True) == []  # (not named refused again: that looped for ever)
    want = reference(ctx, [("w0-1/1.-1.0", g, a), ("w1-1/1.-1.0", g, b)])
    assert_same_model(logical_model(net), logical_model(want))
    assert_consistent(net)


def test_an_expiry_pass_drops_held_deltas_of_a_shard_failed_since_even_if_no_delivery_comes(ctx):
    # The deliveries waiting for the held rows do not look at the map themselves: expiry passes do, for every
    # shard this server has held from — also one whose incarnation its map did not know then (a live r = 2 job
    # hung for the progress timeout when such a shard was left out).
    net, g = Net(ctx), rows(ctx)
    a, b = grads(ctx, g, 1), grads(ctx, g, 2)
    parity = [q for q in range(N) if q != S]
    for q in parity:  # their maps never say S's incarnation
        net[q].peers.failure_key = lambda s: 0 if s == S else net.incarnation[s]
    stage(net, "w0-1/1.-1.0", g, a)  # never delivered
    _, db = stage(net, "w1-1/1.-1.0", g, b)
    assert deliver(net, db) == []  # held
    assert any(net[q].parity.holding() for q in parity)
    net.kill(S)
    for q in parity:
        net[q].expire()
    assert not any(net[q].parity.holding() for q in parity)
    assert sum(r[2].numel() for r in deliver(net, db, wait=True)) == g.numel()  # its worker is told


def test_deltas_of_a_replaced_incarnation_are_refused(ctx):
    net, g = Net(ctx), rows(ctx)
    a = grads(ctx, g, 1)
    _, da = stage(net, "w0-1/1.-1.0", g, a)  # stamped with incarnation 1
    net.kill(S)
    net.replace(S)  # incarnation 2 registered: S is no longer failed
    net.recover(S, lock_group_rows=64)
    assert sum(r[2].numel() for r in deliver(net, da, wait=True)) == g.numel()
    stage_n, again = stage(net, "w0-1/1.-1.0", g, a)  # the replacement never saw the txn: applied once
    assert stage_n == g.numel() and deliver(net, again) == []
    assert_same_model(logical_model(net), logical_model(reference(ctx, [("w0-1/1.-1.0", g, a)])))
    assert_consistent(net)


@pytest.mark.parametrize("how", ["worker_gone", "timeout"])
def test_a_silent_workers_parts_are_forwarded_by_their_data_server(ctx, how):
    net, g = Net(ctx), rows(ctx)
    a = grads(ctx, g, 1)
    stage(net, "w1-1/1.-1.0", g, a)  # worker 1 dies before delivering
    assert parity_check(net)["in_flight"] > 0
    if how == "worker_gone":
        net[S].fence_workers({1: 1})  # the coordinator says its process is gone
    else:
        net.clock.advance(net.txn_timeout + 1)
    net[S].expire()
    assert net[S].stats[f"expired_{how}"] == 1 and len(net[S].deltalog) == 0
    assert_consistent(net)
    assert_same_model(logical_model(net), logical_model(reference(ctx, [("w1-1/1.-1.0", g, a)])))


def test_a_member_ahead_of_its_parity_is_read_as_of_the_version_the_parity_reflects(ctx):
    """A decode meets members whose deltas are still on their way (every hot stripe, under deltaLog): the
    member answers its rows as of the versions the parity record reflects, undone through its delta log,
    so the cut is consistent at the first read instead of after the delivery."""
    net, g = Net(ctx), rows(ctx)
    local = ctx.placement.local_row(g)
    initial = net[S].rows.records[local].clone()
    deliver(net, stage(net, "w0-1/1.-1.0", g, grads(ctx, g, 1))[1])
    at_1 = net[S].rows.records[local].clone()
    stage(net, "w1-1/1.-1.0", g, grads(ctx, g, 2))  # versions 2 and 3 applied, their deltas not delivered
    stage(net, "w0-2/1.-1.0", g[:6], grads(ctx, g[:6], 3))
    now = net[S].rows.versions[local].clone()
    assert now[:6].tolist() == [3] * 6 and now[6:].tolist() == [2] * 6

    res = net[S].read_rows("data", local, as_of=torch.ones_like(local))
    assert torch.equal(bits(res.records), bits(at_1)) and res.versions.tolist() == [1] * 12
    res = net[S].read_rows("data", local, as_of=torch.zeros_like(local))
    assert torch.equal(bits(res.records), bits(initial)) and res.versions.tolist() == [0] * 12
    res = net[S].read_rows("data", local, as_of=now)  # nothing to undo
    assert torch.equal(bits(res.records), bits(net[S].rows.records[local])) and torch.equal(res.versions, now)
    assert net[S].read_rows("data", local, as_of=now + 1).versions.tolist() == [-1] * 12  # not reached yet

    # a decode of a neighbour's rows whose stripes hold these members: consistent in one round, exact
    stats = net[0].stats
    for t in range(N):
        if t == S:
            continue
        all_rows = torch.arange(ctx.placement.rows_on(t))
        recs, vers = net[0 if t != 0 else 2].decode_rows(t, all_rows)
        assert torch.equal(bits(recs), bits(net[t].rows.records)) and torch.equal(vers, net[t].rows.versions)
    assert stats["stripes_read_again"] == 0 and net[2].stats["stripes_read_again"] == 0

    # once the first update is acknowledged its deltas leave the log: version 0 can no longer be reached
    net.call(
        WORKER, S, "apply_part", "w1-2/1.-1.0", g[:0], grads(ctx, g[:0], 4), -1, None, 0, ["w0-1/1.-1.0"]
    )
    assert net[S].read_rows("data", local, as_of=torch.zeros_like(local)).versions.tolist() == [-1] * 12
    assert net[S].read_rows("data", local, as_of=torch.ones_like(local)).versions.tolist() == [1] * 12


def test_a_read_as_of_a_version_is_only_rolled_back_under_the_delta_log():
    rl = make_ctx(
        "rowlocks-asof",
        faultTolerance__strategy="ecrec",
        servers__replicas=N,
        faultTolerance__ecrec__k=K,
        faultTolerance__ecrec__commit="rowLocks",
    )
    net = Net(rl)
    local = torch.arange(4)
    versions = net[S].rows.versions[local]
    assert torch.equal(net[S].read_rows("data", local, as_of=versions).versions, versions)
    assert net[S].read_rows("data", local, as_of=versions - 1).versions.tolist() == [-1] * 4
