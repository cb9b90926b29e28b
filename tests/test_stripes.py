"""ecrec.core.stripes without I/O: the reads a decode or a re-encode plans, and what their answers give.

The answers come from the stores of an in-memory cluster (tests/netsim.py) after some worker steps, read
in-process, so the plans are checked against the same records a server would serve."""

from __future__ import annotations

import pytest
import torch

from ecrec.core.stripes import ReadResult, SecondFailure, StripeDecode, StripeEncode
from tests.netsim import Net, Worker, bits
from tests.test_store_protocol import ecrec_ctx, make_updates

S = 2  # the shard decoded


@pytest.fixture(scope="module")
def net():
    ctx = ecrec_ctx("stripes")
    net = Net(ctx)
    for u in make_updates(ctx, 4, seed=3):
        Worker(net).update(*u)
    return net


def answer(net: Net, reads) -> list[ReadResult]:
    return [net[r.server].read_rows(r.kind, r.index) for r in reads]


def test_a_decode_reads_each_server_once_and_gives_the_rows_and_their_versions(net):
    ctx, store = net.ctx, net[S]
    local = torch.arange(ctx.placement.rows_on(S))
    plan = StripeDecode(ctx.placement, S, local)
    assert S not in {r.server for r in plan.reads}  # the row decoded is never read
    kinds = [(r.server, r.kind) for r in plan.reads]
    assert len(kinds) == len(set(kinds))  # one batched read per server and kind
    records, versions, consistent = plan.decode(store.code, ctx.record_width, answer(net, plan.reads))
    assert bool(consistent.all())
    assert torch.equal(bits(records), bits(store.rows.records)) and torch.equal(versions, store.rows.versions)
    assert bool((versions > 0).any())  # the steps above did update some of them


def test_a_stripe_a_commit_is_crossing_is_not_consistent_and_is_read_again(net):
    ctx, store = net.ctx, net[S]
    local = torch.arange(12)
    plan = StripeDecode(ctx.placement, S, local)
    results = answer(net, plan.reads)
    # a member read after its commit, whose delta has not reached the parity record yet: ahead of pver
    member = next(i for i, r in enumerate(plan.reads) if r.kind == "data")
    results[member].versions = results[member].versions.clone()
    results[member].versions[0] += 1
    records, versions, consistent = plan.decode(store.code, ctx.record_width, results)
    assert int((~consistent).sum()) == 1
    ok = consistent.nonzero().squeeze(1)
    assert torch.equal(bits(records[ok]), bits(store.rows.records[local[ok]]))
    again = plan.rest(consistent)
    assert torch.equal(again.local, local[~consistent])
    records, _v, now = again.decode(store.code, ctx.record_width, answer(net, again.reads))
    assert bool(now.all()) and torch.equal(bits(records), bits(store.rows.records[local[~consistent]]))


def test_a_parity_record_not_rebuilt_is_a_second_failure(net):
    ctx = net.ctx
    plan = StripeDecode(ctx.placement, S, torch.arange(4))
    results = answer(net, plan.reads)
    results[0].ready = torch.zeros_like(results[0].ready)
    with pytest.raises(SecondFailure):
        plan.decode(net[S].code, ctx.record_width, results)


def test_a_re_encode_gives_the_parity_records_and_the_versions_they_reflect(net):
    ctx = net.ctx
    for server in range(ctx.num_servers):
        store = net[server]
        index = torch.arange(store.parity.parity.shape[0])
        plan = StripeEncode(ctx.placement, server, index)
        assert server not in {r.server for r in plan.reads} and all(r.src == server for r in plan.reads)
        records, vers = plan.encode(store.code, ctx.record_width, answer(net, plan.reads))
        assert torch.equal(bits(records), bits(store.parity.parity)) and torch.equal(vers, store.parity.pver)


def test_catch_up_reads_only_members_ahead_of_their_parity_as_of_the_version_it_reflects(net):
    ctx, store = net.ctx, net[S]
    local = torch.arange(12)
    plan = StripeDecode(ctx.placement, S, local)
    results = answer(net, plan.reads)
    members = [i for i, r in enumerate(plan.reads) if r.kind == "data"]
    ahead, behind = results[members[0]], results[members[1]]
    true_version = int(ahead.versions[0])
    ahead.versions = ahead.versions.clone()
    ahead.versions[0] += 2  # its deltas not delivered yet
    behind.versions = behind.versions.clone()
    behind.versions[0] -= 1  # a parity ahead of its member: rowLocks between commit and decision
    _r, _v, consistent = plan.decode(store.code, ctx.record_width, results)
    assert int((~consistent).sum()) == 2
    (read,) = plan.catch_up()  # the stripe with a member behind is read again whole, later
    assert read.server == plan.reads[members[0]].server and read.kind == "data"
    assert read.index.tolist() == [int(plan.reads[members[0]].index[0])] and read.as_of.tolist() == [
        true_version
    ]
    (answered,) = answer(net, [read])
    records, versions, consistent = plan.decode_caught_up(store.code, [answered])
    assert int((~consistent).sum()) == 1
    ok = consistent.nonzero().squeeze(1)
    assert torch.equal(bits(records[ok]), bits(store.rows.records[local[ok]]))
    assert torch.equal(versions[ok], store.rows.versions[local[ok]])
