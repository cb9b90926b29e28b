"""ecrec.core.stripes with r = 2 (issue #30): the reads a decode plans when one or two of a stripe's records
are lost, what their answers give, and the versions that make a cut consistent with two parity records.

The answers come from `Cluster`, an in-memory stand-in for the servers: data rows of random bits (NaN payloads
and infinities included, as in tests/test_raid6.py) with versions, and P and Q encoded stripe by stripe from the
placement's formula with the P + Q code, so the plans are checked against records built without them."""

from __future__ import annotations

import itertools

import pytest
import torch

from ecrec.core.codes import SumCode, XorCode, make_code
from ecrec.core.placement import Placement
from ecrec.core.raid6 import PQCode
from ecrec.core.stripes import Read, ReadResult, SecondFailure, StripeDecode, StripeEncode, StripesLost
from tests.test_raid6 import bits, records

K, W = 4, 5


class Cluster:
    """Every server's data rows with versions, and its parity records (j = 0 .. r-1) with pver and ready."""

    def __init__(self, p: Placement, seed: int = 0) -> None:
        self.p, self.code = p, make_code("xor", p.r, p.k)
        gen = torch.Generator().manual_seed(seed)
        n = p.num_servers
        self.rows = {s: records(seed * 100 + s, p.rows_on(s), W) for s in range(n)}
        self.vers = {s: torch.randint(1, 1000, (p.rows_on(s),), generator=gen) for s in range(n)}
        self.past: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # rows before each `update`: as_of
        blocks = p.parity_rows_on(0)
        self.parity = {s: torch.zeros(p.r, blocks, W) for s in range(n)}
        self.pver = {s: torch.zeros(p.r, blocks, p.k, dtype=torch.int64) for s in range(n)}
        self.ready = {s: torch.ones(p.r, blocks, dtype=torch.bool) for s in range(n)}
        for j in range(p.r):
            self.deliver(j)

    def deliver(self, j: int) -> None:
        """Parity j of every stripe encoded from its members as they are now: every delta delivered."""
        p, n, k = self.p, self.p.num_servers, self.p.k
        stripes = p.num_stripes()
        members = torch.zeros(k, stripes, W, dtype=torch.int32)
        vers = torch.zeros(stripes, k, dtype=torch.int64)
        for sigma, i in itertools.product(range(stripes), range(k)):
            server, loc = (sigma + i) % n, (sigma // n) * k + i
            if loc < p.rows_on(server):
                members[i, sigma] = bits(self.rows[server][loc])
                vers[sigma, i] = self.vers[server][loc]
        members = members.view(torch.float32)
        parity = self.code.encode(members, j) if isinstance(self.code, PQCode) else self.code.encode(members)
        for sigma in range(stripes):
            server = (sigma + k + j) % n
            bits(self.parity[server][j])[sigma // n] = bits(parity[sigma])
            self.pver[server][j, sigma // n] = vers[sigma]

    def update(self, server: int, seed: int) -> None:
        """Every row of `server` changes (version + 1); no delta reaches a parity record until `deliver`."""
        self.past.setdefault(server, []).append((self.rows[server].clone(), self.vers[server].clone()))
        self.rows[server] = records(seed, *self.rows[server].shape)
        self.vers[server] = self.vers[server] + 1

    def read(self, r: Read) -> ReadResult:
        s = r.server
        if r.kind == "parity":
            j = torch.zeros_like(r.index) if r.j is None else r.j
            return ReadResult(self.parity[s][j, r.index], self.pver[s][j, r.index], self.ready[s][j, r.index])
        recs, vers = bits(self.rows[s][r.index]), self.vers[s][r.index]
        if r.as_of is None:
            return ReadResult(recs.clone().view(torch.float32), vers.clone())
        found = vers == r.as_of
        for old_recs, old_vers in self.past.get(s, []):  # a delta log that reaches back to every update
            back = ~found & (old_vers[r.index] == r.as_of)
            recs = torch.where(back.view(-1, 1), bits(old_recs[r.index]), recs)  # selected as bits
            found |= back
        return ReadResult(recs.view(torch.float32), torch.where(found, r.as_of, -1))

    def answer(self, reads: list[Read]) -> list[ReadResult]:
        return [self.read(r) for r in reads]


def lost_positions(p: Placement, src: int, local: int, down: set[int]) -> list[int]:
    """The stripe positions (data slots, then k + j) of src's row `local` on servers that cannot be read,
    from the placement's formula: data slot i of stripe σ on (σ+i) mod N, parity j on (σ+k+j) mod N."""
    n, k = p.num_servers, p.k
    i, b = local % k, local // k
    sigma = b * n + (src - i) % n
    out = [m for m in range(k) if (sigma + m) % n in down | {src} and b * k + m < p.rows_on((sigma + m) % n)]
    return out + [k + j for j in range(p.r) if (sigma + k + j) % n in down]


def holds_member(p: Placement, src: int, local: int, server: int) -> bool:
    """Whether `server` holds a real data member, other than src's row `local`, of that row's stripe."""
    return sum(pos < p.k for pos in lost_positions(p, src, local, {server})) == 2


def expected_parity_reads(
    p: Placement, src: int, local: torch.Tensor, down: set[int]
) -> list[tuple[int, int, int]]:
    """(server, parity index, j) a decode should read: as many parity records as data records lost, the first
    readable ones."""
    n, k = p.num_servers, p.k
    out = []
    for loc in local.tolist():
        lost = lost_positions(p, src, loc, down)
        need = sum(pos < k for pos in lost)
        i, b = loc % k, loc // k
        sigma = b * n + (src - i) % n
        readable = [j for j in range(p.r) if k + j not in lost]
        out += [((sigma + k + j) % n, b, j) for j in readable[:need]]
    return sorted(out)


def parity_reads_of(plan: StripeDecode) -> list[tuple[int, int, int]]:
    out = []
    for r in plan.reads:
        if r.kind == "parity":
            js = [0] * r.index.numel() if r.j is None else r.j.tolist()
            out += [(r.server, int(i), j) for i, j in zip(r.index.tolist(), js, strict=True)]
    return sorted(out)


def placement(n: int, r: int = 2) -> Placement:
    # a last block only partly filled: padding slots in some stripes
    return Placement(num_servers=n, k=K, num_rows=n * K * 3 - 5, r=r)


@pytest.fixture(scope="module", params=[6, 7], ids=lambda n: f"N={n}")
def cluster(request) -> Cluster:
    return Cluster(placement(request.param), seed=request.param)


# -- degraded reads with one or two shards lost -------------------------------------------------------------


def test_any_one_or_two_lost_shards_decode_every_row_bit_exactly_reading_no_lost_server(cluster):
    p = cluster.p
    for src in range(p.num_servers):
        local = torch.arange(p.rows_on(src))
        for failed in [(), *((o,) for o in range(p.num_servers) if o != src)]:
            plan = StripeDecode(p, src, local, failed=failed)
            servers = [(r.server, r.kind) for r in plan.reads]
            assert not {s for s, _ in servers} & {src, *failed}
            assert len(servers) == len(set(servers))  # one batched read per server and kind
            assert parity_reads_of(plan) == expected_parity_reads(p, src, local, set(failed))
            recs, vers, consistent = plan.decode(cluster.code, W, cluster.answer(plan.reads))
            assert bool(consistent.all()), (src, failed)
            assert torch.equal(bits(recs), bits(cluster.rows[src])), (src, failed)
            assert torch.equal(vers, cluster.vers[src])


def test_with_only_the_decoded_shard_lost_a_decode_reads_p_and_the_other_members_as_with_r1(cluster):
    p, src = cluster.p, 1
    local = torch.arange(p.rows_on(src))
    plan = StripeDecode(p, src, local)
    parity = [r for r in plan.reads if r.kind == "parity"]
    assert all(r.j is None for r in parity) and sum(r.index.numel() for r in parity) == local.numel()
    r1 = StripeDecode(Placement(p.num_servers, p.k, p.num_rows, r=1), src, local)
    assert [(r.server, r.kind, r.index.tolist()) for r in plan.reads] == [
        (r.server, r.kind, r.index.tolist()) for r in r1.reads
    ]


def test_a_second_lost_member_makes_the_decode_read_p_and_q_and_one_member_fewer():
    p = placement(6)
    cluster = Cluster(p, seed=11)
    src, other = 0, 1
    # the rows whose stripes hold a real data member on server 1 (in the others it holds P or Q)
    local = torch.tensor([loc for loc in range(2 * K) if holds_member(p, src, loc, other)])
    assert 0 < local.numel() < 2 * K
    plan = StripeDecode(p, src, local, failed={other})
    parity = parity_reads_of(plan)
    assert sorted(j for _s, _i, j in parity) == [0] * local.numel() + [1] * local.numel()
    assert sum(r.index.numel() for r in plan.reads if r.kind == "data") == local.numel() * (K - 2)
    recs, _v, consistent = plan.decode(cluster.code, W, cluster.answer(plan.reads))
    assert bool(consistent.all()) and torch.equal(bits(recs), bits(cluster.rows[src][local]))


def test_the_rest_of_a_decode_keeps_its_lost_servers():
    p = placement(7)
    plan = StripeDecode(p, 2, torch.arange(8), failed={4})
    again = plan.rest(torch.tensor([True, False] * 4))
    assert again.failed == {4} and again.local.tolist() == [1, 3, 5, 7]
    assert 4 not in {r.server for r in again.reads}


def test_an_empty_decode_reads_nothing_and_gives_nothing():
    p = placement(6)
    cluster = Cluster(p)
    plan = StripeDecode(p, 3, torch.arange(0), failed={5})
    assert plan.reads == []
    recs, vers, consistent = plan.decode(cluster.code, W, [])
    assert recs.shape == (0, W) and vers.numel() == 0 and consistent.numel() == 0


# -- more than r lost ----------------------------------------------------------------------------------------


def test_a_third_lost_shard_ends_the_decode_naming_the_shards():
    p = placement(6)  # k + 2 = N: every stripe spans every server
    for src, a, b in [(0, 1, 2), (3, 0, 5), (5, 4, 1)]:
        with pytest.raises(StripesLost, match="r = 2.*shards") as e:
            StripeDecode(p, src, torch.arange(K), failed={a, b})
        assert e.value.shards == tuple(sorted({src, a, b})) and e.value.stripes == K


def test_three_lost_shards_end_a_decode_only_where_a_stripe_of_its_rows_spans_all_three():
    p = placement(7)  # a stripe spans 6 of the 7 servers
    for src, a, b in itertools.product(range(7), repeat=3):
        if len({src, a, b}) < 3:
            continue
        local = torch.arange(p.rows_on(src))
        over = [loc for loc in local.tolist() if len(lost_positions(p, src, loc, {a, b})) > 2]
        if not over:
            StripeDecode(p, src, local, failed={a, b})
            continue
        with pytest.raises(StripesLost) as e:
            StripeDecode(p, src, local, failed={a, b})
        assert src in e.value.shards and set(e.value.shards) <= {src, a, b} and e.value.stripes == len(over)


def test_with_r1_a_second_lost_member_or_parity_server_is_stripes_lost():
    p = placement(5, r=1)
    local = torch.arange(K)
    with pytest.raises(StripesLost) as e:
        StripeDecode(p, 0, local, failed={1})
    assert e.value.shards == (0, 1)
    pserver = int(p.parity_of(0, torch.tensor([0]))[0])
    with pytest.raises(StripesLost):
        StripeDecode(p, 0, torch.tensor([0]), failed={pserver})
    assert StripeDecode(p, 0, local, failed={0}).failed == frozenset()  # src itself is not "another"


def test_a_parity_record_not_rebuilt_is_a_second_failure_with_r2():
    p = placement(6)
    cluster = Cluster(p)
    plan = StripeDecode(p, 0, torch.arange(K), failed={1})
    q_server = next(
        r.server for r in plan.reads if r.kind == "parity" and r.j is not None and bool(r.j.any())
    )
    cluster.ready[q_server][1] = False
    with pytest.raises(SecondFailure, match=f"shard {q_server}"):
        plan.decode(cluster.code, W, cluster.answer(plan.reads))


# -- versions: a consistent cut with two parity records ------------------------------------------------------


def test_members_ahead_of_p_and_q_are_read_as_of_the_versions_both_reflect():
    p = placement(6)
    cluster = Cluster(p, seed=5)
    src, other, ahead = 0, 1, 2
    want_recs, want_vers = cluster.rows[src].clone(), cluster.vers[src].clone()
    cluster.update(ahead, seed=99)  # committed at server 2, deltas not delivered to P or Q
    local = torch.arange(p.rows_on(src))
    plan = StripeDecode(p, src, local, failed={other})
    _r, _v, consistent = plan.decode(cluster.code, W, cluster.answer(plan.reads))
    stale = torch.tensor([holds_member(p, src, loc, ahead) for loc in local.tolist()])
    both = torch.tensor([holds_member(p, src, loc, other) for loc in local.tolist()])  # P and Q read
    assert bool((stale & both).any()) and torch.equal(consistent, ~stale)
    again = plan.catch_up()
    assert [r.server for r in again] == [ahead] and again[0].as_of is not None
    assert torch.equal(again[0].as_of, cluster.past[ahead][0][1][again[0].index])
    recs, vers, consistent = plan.decode_caught_up(cluster.code, cluster.answer(again))
    assert bool(consistent.all())
    assert torch.equal(bits(recs), bits(want_recs)) and torch.equal(vers, want_vers)


@pytest.mark.parametrize("other", [4, 5])  # 5: P and Q read, or P alone; 4: Q alone, or P alone
def test_p_and_q_reflecting_different_versions_is_not_a_consistent_stripe_and_is_read_again_whole(other):
    p = placement(6)
    cluster = Cluster(p, seed=6)
    src, ahead = 0, 2
    cluster.update(ahead, seed=77)
    cluster.deliver(0)  # P has server 2's update, Q not yet
    cluster.update(ahead, seed=78)  # and a second one neither has
    local = torch.arange(p.rows_on(src))
    plan = StripeDecode(p, src, local, failed={other})
    _r, _v, consistent = plan.decode(cluster.code, W, cluster.answer(plan.reads))
    stale = torch.tensor([holds_member(p, src, loc, ahead) for loc in local.tolist()])
    both = stale & torch.tensor([holds_member(p, src, loc, other) for loc in local.tolist()])  # P and Q read
    assert (
        bool((stale & ~both).any()) and bool(both.any()) == (other == 5) and torch.equal(consistent, ~stale)
    )
    # catching up to P's versions would leave Q behind: only the stripes that read one parity record catch up
    again = plan.catch_up()
    caught = torch.zeros(local.numel(), dtype=torch.bool)
    for r in again:
        stripe = p.stripe_of(ahead, r.index)[0]
        caught |= torch.isin(p.stripe_of(src, local)[0], stripe)
    assert torch.equal(caught, stale & ~both)
    recs, _v, consistent = plan.decode_caught_up(cluster.code, cluster.answer(again))
    assert torch.equal(consistent, ~both)
    assert torch.equal(bits(recs[consistent]), bits(cluster.rows[src][local[consistent]]))
    cluster.deliver(0)
    cluster.deliver(1)
    plan = plan.rest(consistent)
    recs, vers, consistent = plan.decode(cluster.code, W, cluster.answer(plan.reads))
    assert bool(consistent.all()) and torch.equal(bits(recs), bits(cluster.rows[src][plan.local]))
    assert torch.equal(vers, cluster.vers[src][plan.local])


def test_p_and_q_disagreeing_only_on_the_lost_members_slot_is_not_a_consistent_stripe():
    p = placement(6)
    cluster = Cluster(p, seed=8)
    src, other = 0, 5
    cluster.update(other, seed=55)  # the second lost member's last update reached P only
    cluster.deliver(0)
    local = torch.arange(p.rows_on(src))
    plan = StripeDecode(p, src, local, failed={other})
    recs, _v, consistent = plan.decode(cluster.code, W, cluster.answer(plan.reads))
    both = torch.tensor([holds_member(p, src, loc, other) for loc in local.tolist()])  # P and Q read
    assert bool(both.any()) and torch.equal(consistent, ~both)  # every member read agrees with P and Q
    assert plan.catch_up() == []
    assert torch.equal(bits(recs[~both]), bits(cluster.rows[src][local[~both]]))


# -- re-encoding P or Q ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("j", [0, 1])
def test_a_re_encode_of_p_or_q_equals_the_pq_code_and_reflects_the_member_versions(cluster, j):
    p = cluster.p
    for server in range(p.num_servers):
        index = torch.arange(p.parity_rows_on(server))
        plan = StripeEncode(p, server, index, j)
        assert server not in {r.server for r in plan.reads} and all(r.src == server for r in plan.reads)
        recs, vers = plan.encode(cluster.code, W, cluster.answer(plan.reads))
        assert torch.equal(bits(recs), bits(cluster.parity[server][j])) and torch.equal(
            vers, cluster.pver[server][j]
        )


def test_a_re_encode_refuses_a_parity_slot_past_r():
    with pytest.raises(ValueError, match="j=1"):
        StripeEncode(placement(5, r=1), 0, torch.arange(2), j=1)


# -- the code ----------------------------------------------------------------------------------------------


def test_make_code_gives_the_pq_code_for_xor_with_r2_and_refuses_sum_saying_why():
    assert isinstance(make_code("xor"), XorCode) and isinstance(make_code("sum", 1), SumCode)
    pq = make_code("xor", 2, K)
    assert isinstance(pq, PQCode) and pq.k == K
    with pytest.raises(ValueError, match="'sum' has no r = 2.*Vandermonde.*unbounded.*bit-exact"):
        make_code("sum", 2, K)
    with pytest.raises(ValueError, match="r = 3"):
        make_code("xor", 3, K)


def test_a_code_that_does_not_fit_the_stripes_is_refused():
    p = placement(6)
    cluster = Cluster(p)
    plan = StripeDecode(p, 0, torch.arange(K))
    for code in (XorCode(), PQCode(K + 1)):
        with pytest.raises(ValueError, match="does not fit"):
            plan.decode(code, W, cluster.answer(plan.reads))
