"""The worker's driver of commit: deltaLog (ecrec.delivery.DeltaLogDriver) over tests/netsim.py's stores, with
the messages and answers of gRPC (protobufs, RpcErrors) but no sockets: every row applied exactly once when a
parity server's answer does not come while the data server fails.

The race CI found (tests/test_coordinator_failover.py, two flaky cases): a step's deltas from data server S
reached parity server A, which applied them before it learned that S had failed, while parity server B,
which had learned it, refused the whole delivery (a stale epoch). The driver took the part as undelivered,
and once its map had S failed it wrote every row of the part again, as degraded writes at the acting homes:
A's rows were applied twice (params_sha256 off, parity still exact).
"""

from __future__ import annotations

import grpc
import pytest
import torch

from ecrec.delivery import DeltaLogDriver
from tests.conftest import make_ctx
from tests.netsim import Net, assert_same_model, logical_model, parity_check
from tests.nettransport import NetTransport, Refusal, dense_grad, rows_and_grads

N, K = 5, 4
S = 1  # the data server whose part is caught in the race


@pytest.fixture(scope="module")
def ctx():
    return make_ctx(
        "delivery",
        faultTolerance__strategy="ecrec",
        servers__replicas=N,
        faultTolerance__ecrec__k=K,
        faultTolerance__ecrec__commit="deltaLog",
        faultTolerance__ecrec__deliveries="own",  # riding: tests/test_riding.py
    )


def undisturbed(ctx, steps) -> Net:
    net = Net(ctx)
    driver = DeltaLogDriver(NetTransport(net))
    for step, g, gr in steps:
        driver.apply(step, g, gr, dense_grad(ctx))
    return net


def test_a_part_whose_failure_one_parity_server_learned_first_is_applied_once(ctx):
    net = Net(ctx)
    transport = NetTransport(net)
    driver = DeltaLogDriver(transport)
    g, a = rows_and_grads(ctx, 1)
    driver.apply("w0-1", g, a, dense_grad(ctx))  # rows at version 1 everywhere
    g, b = rows_and_grads(ctx, 2)
    p = ctx.placement
    pserver, _ = p.parity_of(S, p.local_row(g))
    first, second = sorted(pserver.unique().tolist())[:2]

    # The step's deltas reach `first` (applied), then S dies and `second` hears of it before the delivery
    # arrives: it refuses the message (stale epoch) while this worker's map still has S up.
    transport.before_deliver[second] = lambda: net.kill(S)
    driver.apply("w0-2", g, b, dense_grad(ctx))

    # `first`'s rows were applied by the delivery; the rest were written at their acting homes.
    assert transport.degraded_writes == int((pserver != first).sum())
    net.replace(S)
    net.recover(S, lock_group_rows=64)
    assert parity_check(net)["mismatches"] == 0
    want = undisturbed(ctx, [("w0-1", g, a), ("w0-2", g, b)])
    assert_same_model(logical_model(net), logical_model(want))


def test_a_delivery_whose_answer_was_lost_is_asked_again_and_never_written_twice(ctx):
    # `second` applied the deltas, but its answer never came; S dies meanwhile. Asked again, `second` says
    # it has them (it does not refuse a batch it accepted): written again, they would be applied twice.
    net = Net(ctx)
    transport = NetTransport(net)
    driver = DeltaLogDriver(transport)
    g, a = rows_and_grads(ctx, 3)
    p = ctx.placement
    pserver, _ = p.parity_of(S, p.local_row(g))
    second = sorted(pserver.unique().tolist())[1]
    real = transport.DeliverDeltas
    late: set[int] = set()  # parity servers whose delivery came after S died: they refuse it

    def lost_answer(shard: int, req):
        if S in net.failed:
            late.add(shard)
            return real(shard, req)
        if shard != second:
            return real(shard, req)
        real(shard, req)  # applied there
        net.kill(S)
        raise Refusal(grpc.StatusCode.ABORTED, "busy: the answer did not come")

    transport.DeliverDeltas = lost_answer
    driver.apply("w0-1", g, a, dense_grad(ctx))
    # Only the rows refused at their first delivery are written again; `second`'s, asked again, are not.
    assert second in late
    first_time = late - {second}
    assert transport.degraded_writes == int(torch.isin(pserver, torch.tensor(sorted(first_time))).sum())
    net.replace(S)
    net.recover(S, lock_group_rows=64)
    assert parity_check(net)["mismatches"] == 0
    assert_same_model(logical_model(net), logical_model(undisturbed(ctx, [("w0-1", g, a)])))
