"""Two parity records per stripe (r = 2, issue #30) in the servers' stores, without failures: every server
starts with P and Q encoded, a worker's updates reach both parity servers of each row (riding on its next
stages or in a round of their own), and P and Q are exact after any interleaving of workers. Over
tests/netsim.py's stores and the worker's real DeltaLogDriver (tests/nettransport.py).

The spec does not accept r = 2 yet (degraded reads and the rebuild of two shards are not in the servers), so
these jobs are built from a valid r = 1 spec with r set afterwards."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ecrec.core.txn import DeltaBatch
from ecrec.delivery import DeltaLogDriver
from ecrec.jobctx import JobContext
from ecrec.wire import InvalidRequest
from tests.conftest import make_ctx
from tests.netsim import Net, assert_parity_ok, assert_same_model, logical_model, parity_check
from tests.nettransport import NetTransport, apply

N, K = 6, 4


def ecrec_job(deliveries: str = "ride", r: int = 2, commit: str = "deltaLog") -> JobContext:
    """A job on N servers with r parity records per stripe (r = 2 set past the spec, which refuses it)."""
    ctx = make_ctx(
        f"r{r}-{deliveries}-{commit}",
        faultTolerance__strategy="ecrec",
        servers__replicas=N,
        faultTolerance__ecrec__k=K,
        faultTolerance__ecrec__commit=commit,
        faultTolerance__ecrec__deliveries=deliveries,
    )
    if r == 1:
        return ctx
    ec = ctx.spec.fault_tolerance.ecrec.model_copy(update={"r": 2})
    ft = ctx.spec.fault_tolerance.model_copy(update={"ecrec": ec})
    job = dataclasses.replace(ctx.job, spec=ctx.spec.model_copy(update={"fault_tolerance": ft}))
    out = JobContext(job)
    assert out.placement.r == 2
    return out


def test_every_server_starts_with_p_and_q_of_its_stripes():
    net = Net(ecrec_job())
    p = net.ctx.placement
    assert net[0].parity.parity.shape[0] == 2 * p.parity_rows_on(0)
    assert_parity_ok(net)


@pytest.mark.parametrize("deliveries", ["ride", "own"])
def test_updates_reach_p_and_q_and_both_stay_exact(deliveries):
    ctx = ecrec_job(deliveries)
    net = Net(ctx)
    transport = NetTransport(net)
    driver = DeltaLogDriver(transport)
    for i in range(1, 6):
        apply(driver, f"w0-{i}", i)
    # riding, the P and Q deltas of a step went with the next step's stages (never a message of their own)
    assert ("DeliverDeltas" in transport.calls) == (deliveries == "own")
    driver.flush_decisions()
    assert_parity_ok(net)
    assert all(len(net[s].deltalog) == 0 for s in range(N))  # every part's P and Q deltas acknowledged
    # the same model as r = 1 with the same updates: parity changes nothing a worker reads
    net1 = Net(ecrec_job(deliveries, r=1))
    d1 = DeltaLogDriver(NetTransport(net1))
    for i in range(1, 6):
        apply(d1, f"w0-{i}", i)
    d1.flush_decisions()
    assert_same_model(logical_model(net), logical_model(net1))


def test_two_workers_on_the_same_rows_leave_p_and_q_exact():
    net = Net(ecrec_job())
    a, b = DeltaLogDriver(NetTransport(net)), DeltaLogDriver(NetTransport(net))
    for i in range(1, 5):  # the same rows in every step: deltas arrive ahead of their predecessors, held
        apply(a, f"w0-{i}", 10 + i)
        apply(b, f"w1-{i}", 20 + i)
    assert parity_check(net)["in_flight"] > 0  # the last steps' deltas still ride with their workers
    a.flush_decisions()
    b.flush_decisions()
    assert_parity_ok(net)
    assert all(not net[s].parity.held for s in range(N))


def test_a_batch_is_refused_unless_it_is_p_or_q_of_the_senders_rows_here():
    net = Net(ecrec_job())
    p = net.ctx.placement
    blocks = p.parity_rows_on(0)
    server = 5  # P of the stripes whose first member is server 1, Q of those whose first member is server 0
    w = net.ctx.record_width

    def batch(src: int, index: list[int], slot: int) -> DeltaBatch:
        n = len(index)
        ids = torch.tensor(index, dtype=torch.int64)
        return DeltaBatch(
            server,
            "w0-1/x",
            src,
            ids,
            torch.full((n,), slot),
            torch.zeros(n, w),
            torch.ones(n, dtype=torch.int64),
        )

    store = net[server]
    # server 1's rows at slot 0 of the stripes starting at 1 (P here), server 1's rows at slot 1 of those
    # starting at 0 (Q here): both fine
    store.check_deltas(batch(1, [0, 1], 0))
    store.check_deltas(batch(1, [blocks + 0, blocks + 1], 1))
    with pytest.raises(InvalidRequest, match="one parity record"):
        store.check_deltas(batch(1, [0, blocks], 0))  # P and Q rows in one batch
    with pytest.raises(InvalidRequest, match="not parity records"):
        store.check_deltas(batch(1, [blocks + 0], 0))  # Q's rows at P's slot of the sender
    with pytest.raises(InvalidRequest, match="out of range"):
        store.check_deltas(batch(1, [2 * blocks], 1))
