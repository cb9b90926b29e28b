"""Deliveries riding on the next step's stages (faultTolerance.ecrec.deliveries: ride; ecrec.riding and
ecrec.delivery.DeltaLogDriver) over tests/netsim.py's stores: a step's deltas reach the parity servers with
the worker's next stages, answered at once; held parts are asked about on the stage after; a failure in
between writes refused rows again exactly once."""

from __future__ import annotations

import pytest
import torch

from ecrec.delivery import DeltaLogDriver
from ecrec.riding import MAX_RIDES
from tests.conftest import make_ctx
from tests.netsim import Net, assert_same_model, logical_model, parity_check
from tests.nettransport import NetTransport, apply, dense_grad, rows_and_grads

N, K = 5, 4
S = 1  # the data server of the rows every step updates


def job(optimizer: str = "adagrad", deliveries: str = "ride"):
    return make_ctx(
        f"riding-{optimizer}-{deliveries}",
        faultTolerance__strategy="ecrec",
        servers__replicas=N,
        faultTolerance__ecrec__k=K,
        faultTolerance__ecrec__commit="deltaLog",
        faultTolerance__ecrec__deliveries=deliveries,
        training__optimizer=optimizer,
        training__momentum=0.0,
    )


@pytest.fixture(scope="module")
def ctx():
    return job()


def in_order(ctx, steps) -> Net:
    """The same updates, one at a time, each delivered in a round of its own before the next is staged."""
    own = job(ctx.spec.training.optimizer, "own")
    net = Net(own)
    driver = DeltaLogDriver(NetTransport(net))
    for step, seed in steps:
        g, grads = rows_and_grads(own, seed)
        driver.apply(step, g, grads, dense_grad(own))
    return net


def logs_empty(net: Net) -> bool:
    return all(len(net[s].deltalog) == 0 for s in net.live())


def test_a_steps_deltas_ride_on_the_next_stages_and_land_as_if_delivered_at_once(ctx):
    net = Net(ctx)
    transport = NetTransport(net)
    driver = DeltaLogDriver(transport)
    for i in range(1, 5):
        apply(driver, f"w0-{i}", i)
        # the step's deltas wait with the worker: S's rows are ahead of their parity records until the next step
        assert parity_check(net)["in_flight"] > 0
    assert "DeliverDeltas" not in transport.calls  # every delivery rode on a stage
    assert transport.calls["Stage"] > 0
    driver.flush_decisions()  # the worker stops: the last step's deltas go on their own
    check = parity_check(net)
    assert check["mismatches"] == 0 and check["in_flight"] == 0
    assert logs_empty(net)  # every part acknowledged: nothing left for the data servers to forward
    assert_same_model(logical_model(net), logical_model(in_order(ctx, [(f"w0-{i}", i) for i in range(1, 5)])))


def test_a_part_held_for_another_workers_update_is_asked_about_on_the_next_stage(ctx):
    net = Net(ctx)
    a, b = DeltaLogDriver(NetTransport(net)), DeltaLogDriver(NetTransport(net))
    apply(a, "w0-1", 1)  # version 1 of every row, carried by a
    apply(b, "w1-1", 2)  # version 2, carried by b
    apply(b, "w1-2", 3)  # b's version 2 reaches the parity servers before a's version 1: held there
    assert any(c.held for c in b._carried), "b's first update was not held"
    held = sum(net[s].stats["deltas_held"] for s in net.live())  # the servers count it (a metric)
    assert 0 < held <= sum(net[s].stats["deltas_delivered"] for s in net.live())
    apply(a, "w0-2", 4)  # a's version 1 arrives: b's held rows apply
    apply(b, "w1-3", 5)  # b asks: applied
    assert not any(c.held for c in b._carried[:-1])
    a.flush_decisions()
    b.flush_decisions()
    assert parity_check(net)["mismatches"] == 0
    assert logs_empty(net)
    order = [("w0-1", 1), ("w1-1", 2), ("w1-2", 3), ("w0-2", 4), ("w1-3", 5)]  # the data servers' order
    assert_same_model(logical_model(net), logical_model(in_order(ctx, order)))


def test_a_held_part_asked_about_too_often_is_waited_for_the_old_way(ctx):
    net = Net(ctx)
    a, tb = DeltaLogDriver(NetTransport(net)), NetTransport(net)
    b = DeltaLogDriver(tb)
    apply(a, "w0-1", 1)
    apply(b, "w1-1", 2)
    for i in range(2, MAX_RIDES + 1):
        apply(b, f"w1-{i}", i + 1)  # b's first update stays held: a does not step
    first = b._carried[0]
    assert first.held and first.rides == MAX_RIDES - 1
    assert "DeliverDeltas" not in tb.calls
    # The next ride is the last: b then delivers the held part again and waits for it (DeliverDeltas, not
    # early), as without riding; a delivers its update meanwhile (as a worker stepping on would).
    for server in range(N):
        tb.before_deliver[server] = a.flush_decisions
    apply(b, f"w1-{MAX_RIDES + 1}", 99)
    assert first not in b._carried
    assert tb.calls["DeliverDeltas"] >= 1
    b.flush_decisions()
    assert parity_check(net)["mismatches"] == 0
    assert logs_empty(net)


def test_deltas_refused_on_arrival_after_their_data_server_failed_are_written_again_once(ctx):
    net = Net(ctx)
    transport = NetTransport(net)
    driver = DeltaLogDriver(transport)
    apply(driver, "w0-1", 1)  # applied at S; its deltas ride with the next step
    net.kill(S)  # S's rows of step 1 now exist only in this worker's carried deltas
    apply(driver, "w0-2", 2)  # the parity servers refuse them: written again at the acting homes, then step 2
    g, _ = rows_and_grads(ctx, 1)
    assert transport.degraded_writes == 2 * g.numel()  # step 1's rows again, and step 2's
    driver.flush_decisions()
    net.replace(S)
    net.recover(S, lock_group_rows=64)
    assert parity_check(net)["mismatches"] == 0
    assert_same_model(logical_model(net), logical_model(in_order(ctx, [("w0-1", 1), ("w0-2", 2)])))


def test_held_rows_dropped_when_their_data_server_fails_are_written_again_by_their_worker():
    ctx = job("sgd")  # the rows are written again in another order than they were first: sums commute
    net = Net(ctx)
    a, b = DeltaLogDriver(NetTransport(net)), DeltaLogDriver(NetTransport(net))
    apply(a, "w0-1", 1)
    apply(b, "w1-1", 2)
    apply(b, "w1-2", 3)  # b's w1-1 held at the parity servers for a's w0-1
    assert any(c.held for c in b._carried)
    net.kill(S)  # a's w0-1 will be refused, so b's held deltas are dropped
    apply(a, "w0-2", 4)
    apply(b, "w1-3", 5)  # b asks about w1-1: its rows were dropped; b writes them again
    a.flush_decisions()
    b.flush_decisions()
    net.replace(S)
    net.recover(S, lock_group_rows=64)
    assert parity_check(net)["mismatches"] == 0
    got = logical_model(net)
    want = logical_model(in_order(ctx, [("w0-1", 1), ("w1-1", 2), ("w1-2", 3), ("w0-2", 4), ("w1-3", 5)]))
    assert torch.equal(got.versions, want.versions)  # every update applied exactly once
    assert torch.allclose(got.rows, want.rows, atol=1e-6)


def test_a_ride_whose_answer_is_lost_is_asked_again_and_never_applied_twice(ctx):
    net = Net(ctx)
    transport = NetTransport(net)
    driver = DeltaLogDriver(transport)
    apply(driver, "w0-1", 1)
    g, _ = rows_and_grads(ctx, 1)
    p = ctx.placement
    pserver, _ = p.parity_of(S, p.local_row(g))
    victim = int(pserver[0])
    # The stage carrying step 1's deltas to `victim` is applied there, but its answer is lost.
    net.lose_at("deliver_early", server=victim, phase="after")
    apply(driver, "w0-2", 2)
    driver.flush_decisions()
    assert parity_check(net)["mismatches"] == 0
    assert logs_empty(net)
    assert_same_model(logical_model(net), logical_model(in_order(ctx, [("w0-1", 1), ("w0-2", 2)])))


def test_the_sum_code_and_deterministic_training_deliver_in_a_round_of_their_own():
    for overrides in ({"faultTolerance__ecrec__code": "sum"}, {"training__deterministic": "true"}):
        ctx = make_ctx(
            "riding-off",
            faultTolerance__strategy="ecrec",
            servers__replicas=N,
            faultTolerance__ecrec__k=K,
            **overrides,
        )
        assert ctx.spec.fault_tolerance.ecrec.deliveries == "ride"
        transport = NetTransport(Net(ctx))
        driver = DeltaLogDriver(transport)
        apply(driver, "w0-1", 1)
        assert transport.calls.get("DeliverDeltas", 0) > 0 and not driver._carried


def test_the_answers_to_a_ride_mark_each_row_applied_held_refused_or_unknown(ctx):
    """ecrec.riding's bookkeeping on its own: one part over four parity servers, each answering differently."""
    from ecrec.core.update import StepUpdate
    from ecrec.proto import ecrec_pb2 as pb
    from ecrec.riding import Carried, Rides
    from ecrec.wire import ids_to_bytes

    p = ctx.placement
    g, grads = rows_and_grads(ctx, 1)
    update = StepUpdate("w0-1", p, g, stable_txns=True)
    (part,) = [q for q in update.plan(Net(ctx).view()) if q.target == S]
    pserver, pindex = p.parity_of(S, p.local_row(g[part.pos]))
    applied_s, held_s, refused_s, lost_s = sorted(pserver.unique().tolist())
    deltas = [
        pb.DeltaRequest(txn=part.txn, src=S, parity_server=s) for s in (applied_s, held_s, refused_s, lost_s)
    ]
    carried = Carried(update, g, grads, dense_grad(ctx), [(part, deltas)])
    rides = Rides([carried], failed=lambda s: False)
    assert rides.servers() == sorted([applied_s, held_s, refused_s, lost_s])
    assert [d.parity_server for d in rides.fields(held_s)[0]] == [held_s]
    bad = pindex[pserver == refused_s][:1]  # one of the rows at `refused_s`
    rides.answered(applied_s, pb.StageResponse())
    rides.answered(held_s, pb.StageResponse(held=[pb.PartRef(txn=part.txn, src=S)]))
    rides.answered(
        refused_s, pb.StageResponse(refused=[pb.RefusedRows(txn=part.txn, src=S, index=ids_to_bytes(bad))])
    )
    rides.lost(lost_s)
    (settled,) = rides.settle(p)

    done = update.rows_done[part.pos]
    waiting = update.rows_waiting[part.pos]
    redo = (pserver == refused_s) & torch.isin(pindex, bad)
    assert torch.equal(done, (pserver == applied_s) | ((pserver == refused_s) & ~redo))
    assert torch.equal(waiting, (pserver == held_s) | (pserver == lost_s))
    assert settled.refused and [d.parity_server for _p, ds in settled.trouble for d in ds] == [lost_s]
    assert [d.parity_server for _p, d in carried.held] == [held_s] and not carried.fresh
    assert settled.done == [] and settled.needs_finish
    # the refused row is planned again (a degraded write once the map has its data server failed)
    (again,) = [q for q in update.plan(Net(ctx).view()) if q.target == S]
    assert torch.equal(g[again.pos], g[part.pos][redo])

    # Asked on the next ride, the held part is applied; a failed parity server's rows count as applied.
    update2 = StepUpdate("w0-2", p, g, stable_txns=True)
    (part2,) = [q for q in update2.plan(Net(ctx).view()) if q.target == S]
    carried2 = Carried(
        update2,
        g,
        grads,
        dense_grad(ctx),
        [
            (
                part2,
                [
                    pb.DeltaRequest(txn=part2.txn, src=S, parity_server=s)
                    for s in (applied_s, held_s, refused_s, lost_s)
                ],
            )
        ],
    )
    rides2 = Rides([carried2], failed=lambda s: s != held_s)
    assert rides2.servers() == [held_s]
    rides2.answered(held_s, pb.StageResponse())
    (settled2,) = rides2.settle(p)
    assert bool(update2.rows_done[part2.pos].all()) and settled2.done == [part2] and not settled2.needs_finish


def test_carried_updates_are_all_asked_again_before_any_is_finished(ctx):
    """Several carried updates to finish at once (their rides failed, or parts held too long): each one's deltas
    are asked for again before the first one's rows go anywhere else, since that write's decode can need a
    later one's deltas at a parity server that missed them (tests/test_degraded_r2.py, the parity server that
    heard of the failure first). Asked in step order, so the records still take each row's updates in order."""
    net = Net(ctx)
    driver = DeltaLogDriver(NetTransport(net))
    carried = []
    for i in (1, 2):  # two steps whose deltas are still with the worker, neither carried by the other
        apply(driver, f"w0-{i}", i)
        carried += driver._take_carried()
    assert len(carried) == 2
    order = []
    ask, run = driver._ask_again, driver._run
    driver._ask_again = lambda unanswered, g, update, *a: (
        order.append(("ask", update.step)) or ask(unanswered, g, update, *a)
    )
    driver._run = lambda update, *a, **kw: order.append(("run", update.step)) or run(update, *a, **kw)
    driver._finish(carried)
    assert order == [("ask", "w0-1"), ("ask", "w0-2"), ("run", "w0-1"), ("run", "w0-2")]
    assert parity_check(net)["mismatches"] == 0
    assert_same_model(logical_model(net), logical_model(in_order(ctx, [("w0-1", 1), ("w0-2", 2)])))
