"""ecrec.core.ranges without I/O: a lock group's range decoded in bulk gives what the general stripe decode
gives, row for row, on the records of an in-memory cluster (tests/netsim.py) after some worker steps; rows a
commit was crossing come out not consistent; and placements of any size decode their whole shard."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ecrec.core.codes import SumCode, XorCode
from ecrec.core.placement import Placement
from ecrec.core.ranges import RangeDecode, members_by_slot
from ecrec.core.stripes import ReadResult, SecondFailure, StripeDecode
from ecrec.core.vec import as_range
from tests.netsim import Net, Worker, bits
from tests.test_store_protocol import ecrec_ctx, make_updates
from tests.test_stripes import answer

S = 2  # the shard decoded


@pytest.fixture(scope="module")
def net():
    """A cluster after some worker steps (another seed than tests/test_stripes.py's)."""
    net = Net(ecrec_ctx("ranges"))
    for u in make_updates(net.ctx, 4, seed=5):
        Worker(net).update(*u)
    return net


def test_a_range_decodes_as_the_stripe_decode_does(net):
    ctx, store = net.ctx, net[S]
    n = ctx.placement.rows_on(S)
    for lo, hi in [(0, n), (3, 17), (8, 9), (n - 5, n)]:
        plan = RangeDecode.plan(ctx.placement, S, lo, hi)
        assert S not in {r.server for r in plan.reads}
        assert all(as_range(r.index) is not None for r in plan.reads)  # contiguous reads only
        records, versions, consistent = plan.decode(store.code, ctx.record_width, answer(net, plan.reads))
        local = torch.arange(lo, hi)
        ref = StripeDecode(ctx.placement, S, local)
        want, want_v, want_ok = ref.decode(store.code, ctx.record_width, answer(net, ref.reads))
        assert bool(consistent.all()) and bool(want_ok.all())
        assert torch.equal(bits(records), bits(want)) and torch.equal(versions, want_v)
        assert torch.equal(bits(records), bits(store.rows.records[local]))
    assert bool((store.rows.versions > 0).any())  # the steps above did update some rows


def test_a_member_caught_mid_commit_leaves_its_rows_not_consistent(net):
    ctx, store = net.ctx, net[S]
    plan = RangeDecode.plan(ctx.placement, S, 0, 40)
    results = answer(net, plan.reads)
    member = next(i for i, r in enumerate(plan.reads) if r.kind == "data")
    results[member].versions = results[member].versions.clone()
    results[member].versions[5] += 1  # read after its commit, before the delta reached the parity
    records, _v, consistent = plan.decode(store.code, ctx.record_width, results)
    assert int((~consistent).sum()) == 1  # one member row is in exactly one stripe: one lost row
    ok = consistent.nonzero().squeeze(1)
    assert torch.equal(bits(records[ok]), bits(store.rows.records[ok]))


def test_a_parity_record_not_rebuilt_is_a_second_failure(net):
    ctx = net.ctx
    plan = RangeDecode.plan(ctx.placement, S, 0, 8)
    results = answer(net, plan.reads)
    results[1].ready = torch.zeros_like(results[1].ready)
    with pytest.raises(SecondFailure):
        plan.decode(net[S].code, ctx.record_width, results)


def test_no_range_plan_for_r2_an_empty_range_or_a_read_of_a_down_server():
    assert RangeDecode.plan(Placement(6, 4, 100, r=2), 1, 0, 8) is None
    p = Placement(5, 4, 100)
    assert RangeDecode.plan(p, 1, 5, 5) is None
    assert RangeDecode.plan(p, 1, 0, 8, down={3}) is None
    assert RangeDecode.plan(p, 1, 0, 8, down={1}) is not None  # the decoded shard itself is not read


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(2, 5),
    extra=st.integers(1, 5),
    rows=st.integers(1, 300),
    src=st.integers(0, 9),
    data=st.data(),
)
def test_any_placement_decodes_a_shard_s_range_from_its_stripes(k, extra, rows, src, data):
    """Random records on every server, parity encoded from them (xor and sum): the range decode gives the
    lost rows back, padding and partial last blocks included, for N from k + 1 to k + 5 servers."""
    p = Placement(k + extra, k, rows)
    src %= p.num_servers
    n = p.rows_on(src)
    if n == 0:
        return
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    gen = torch.Generator().manual_seed(rows * 31 + k)
    W = 3
    recs = [torch.randn(p.rows_on(s), W, generator=gen) for s in range(p.num_servers)]
    vers = [torch.randint(0, 9, (p.rows_on(s),), generator=gen) for s in range(p.num_servers)]
    blocks = p.parity_rows_on(0)
    for code in (XorCode(), SumCode()):
        parity, pver = [], []
        for s in range(p.num_servers):
            shards, locs, present = p.stripe_members(s, torch.arange(blocks))
            parity.append(code.encode(_gather(recs, shards, locs, present).permute(1, 0, 2)))
            pver.append(_gather(vers, shards, locs, present))
        plan = RangeDecode.plan(p, src, lo, hi)
        results = [
            ReadResult(parity[r.server][r.index], pver[r.server][r.index], ready(r))
            if r.kind == "parity"
            else ReadResult(recs[r.server][r.index], vers[r.server][r.index])
            for r in plan.reads
        ]
        out, v, ok = plan.decode(code, W, results)
        assert bool(ok.all()) and torch.equal(v, vers[src][lo:hi])
        if code.exact:
            assert torch.equal(bits(out), bits(recs[src][lo:hi]))
        else:
            assert torch.allclose(out, recs[src][lo:hi], atol=1e-4)


def ready(r) -> torch.Tensor:
    return torch.ones(r.index.numel(), dtype=torch.bool)


def _gather(tables, shards, locs, present) -> torch.Tensor:
    """tables[shard][local row] for each stripe slot [n, k] (padding slots zero): [n, k, ...]."""
    out = torch.zeros(*shards.shape, *tables[0].shape[1:], dtype=tables[0].dtype)
    for s in shards.unique().tolist():
        at = present & (shards == s)
        out[at] = tables[s][locs[at]]
    return out


@pytest.mark.parametrize(
    ("n", "k", "r", "rows"), [(5, 4, 1, 103), (6, 4, 2, 97), (9, 3, 1, 50), (4, 2, 2, 7)]
)
def test_members_by_slot_are_the_stripe_members_read_from_whole_tables(n, k, r, rows):
    p = Placement(n, k, rows, r)
    tables = [torch.arange(p.rows_on(s)) * 100 + s + 1 for s in range(n)]  # nonzero: padding shows as 0
    for server in range(n):
        for j in range(r):
            blocks = torch.arange(p.parity_rows_on(server))
            shards, locs, present = p.stripe_members(server, blocks, j)
            want = _gather(tables, shards, locs, present).T
            assert torch.equal(members_by_slot(p, server, j, tables), want)


def test_as_range_says_whether_an_index_is_one_slice():
    assert as_range(torch.arange(3, 9)) == (3, 9)
    assert as_range(torch.tensor([7])) == (7, 8)
    assert as_range(torch.empty(0, dtype=torch.int64)) is None
    assert as_range(torch.tensor([3, 5, 4])) is None  # the right span, out of order
    assert as_range(torch.tensor([3, 4, 4, 5])) is None
    assert as_range(torch.tensor([1, 2, 4])) is None
