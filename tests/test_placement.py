"""Closed-form placement (design notes §2): the data map is a bijection, stripe and parity maps agree in both
directions, every stripe sits on k + r distinct servers, and load is balanced for every N, gcd(N, k+1) > 1
included. Checks are vectorized per server so each property runs over whole tables."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ecrec.core.placement import Placement, chunk_bounds, dense_replicas

SETTINGS = settings(max_examples=40, deadline=None)
I64 = torch.int64


@st.composite
def placements(draw, rs: tuple[int, ...] = (1, 2)) -> Placement:
    """k in 1..6, N in k+r .. k+7, G hitting the edges: G < N, arbitrary G (mostly not a multiple of N), and
    whole blocks of N·k rows plus or minus one."""
    r = draw(st.sampled_from(rs))
    k = draw(st.integers(1, 6))
    n = draw(st.integers(k + r, k + 7))
    block = n * k
    g = draw(
        st.one_of(
            st.integers(0, n - 1),
            st.integers(0, 3 * block + n),
            st.integers(1, 3).flatmap(lambda b: st.sampled_from([b * block - 1, b * block, b * block + 1])),
        )
    )
    return Placement(num_servers=n, k=k, num_rows=g, r=r)


def blocks_of(p: Placement) -> int:
    return -(-p.rows_on(0) // p.k)


def real_rows(p: Placement, s: int) -> torch.Tensor:
    return torch.arange(p.rows_on(s), dtype=I64)


def stripe_table(p: Placement, blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """By stripe σ < blocks·N, built from the data side (every local row of the first `blocks` blocks of every
    server, real or padding): data servers [S, k], parity servers [S, r], live [S] (has a real row).
    Asserts that no stripe slot is claimed twice and none is left empty."""
    n, k = p.num_servers, p.k
    data = torch.full((blocks * n, k), -1, dtype=I64)
    parity = torch.full((blocks * n, p.r), -1, dtype=I64)
    live = torch.zeros(blocks * n, dtype=torch.bool)
    local = torch.arange(blocks * k, dtype=I64)
    for s in range(n):
        sigma, slot = p.stripe_of(s, local)
        assert (data[sigma, slot] == -1).all() and (sigma * k + slot).unique().numel() == local.numel()
        data[sigma, slot] = s
        live[sigma[local < p.rows_on(s)]] = True
        for j in range(p.r):
            server, index = p.parity_of(s, local, j)
            assert torch.equal(index, sigma // n)
            parity[sigma, j] = server
    assert (data >= 0).all()
    return data, parity, live


# -- the formulas, by hand ------------------------------------------------------------------------------------


def test_placement_matches_the_worked_example_of_the_formulas() -> None:
    """N=4, k=2: stripe 5 = block 1, offset 1: data on servers 1, 2 at local rows 2, 3; parity 0 on server 3
    and parity 1 on server 0 (1 + 2 + 1 mod 4), both at index 1. Global row 10 = shard 2, local 2."""
    p = Placement(num_servers=4, k=2, num_rows=20, r=2)
    assert p.data_shard(torch.tensor([10])).item() == 2 and p.local_row(torch.tensor([10])).item() == 2
    sigma, slot = p.stripe_of(2, torch.tensor([3]))
    assert (sigma.item(), slot.item()) == (5, 1)
    assert [t.item() for t in p.parity_of(2, torch.tensor([3]), 0)] == [3, 1]
    assert [t.item() for t in p.parity_of(2, torch.tensor([3]), 1)] == [0, 1]
    shards, locs, present = p.stripe_members(3, torch.tensor([1]), 0)
    assert shards.tolist() == [[1, 2]] and locs.tolist() == [[2, 3]] and present.tolist() == [[True, True]]


@pytest.mark.parametrize(("n", "k", "r"), [(1, 1, 1), (2, 2, 1), (3, 2, 2), (4, 0, 1), (4, 2, -1)])
def test_impossible_placements_are_rejected(n: int, k: int, r: int) -> None:
    with pytest.raises(ValueError):
        Placement(num_servers=n, k=k, num_rows=10, r=r)


# -- data rows ----------------------------------------------------------------------------------------------


@SETTINGS
@given(placements(rs=(0, 1, 2)))
@example(Placement(num_servers=6, k=2, num_rows=5))
def test_data_map_is_a_bijection_between_global_ids_and_real_local_rows(p: Placement) -> None:
    n = p.num_servers
    g = torch.arange(p.num_rows, dtype=I64)
    shard, local = p.data_shard(g), p.local_row(g)
    assert torch.equal(p.global_id(shard, local), g)
    rows = torch.tensor([p.rows_on(s) for s in range(n)])
    assert int(rows.sum()) == p.num_rows and int(rows.max() - rows.min()) <= 1
    # Every (s, l) with l < rows_on(s), each exactly once, maps to a distinct g in [0, G): together onto.
    all_shards = torch.repeat_interleave(torch.arange(n), rows)
    all_locals = torch.cat([real_rows(p, s) for s in range(n)])
    assert torch.equal(torch.sort(p.global_id(all_shards, all_locals)).values, g)
    # ...and the first local row past each server's end is outside [0, G): it really is padding.
    assert (p.global_id(torch.arange(n), rows) >= p.num_rows).all()


# -- stripes ------------------------------------------------------------------------------------------------


@SETTINGS
@given(placements())
@example(Placement(num_servers=6, k=2, num_rows=13))
def test_every_real_row_is_in_its_parity_records_members_at_its_slot(p: Placement) -> None:
    n, k = p.num_servers, p.k
    for s in range(n):
        local = real_rows(p, s)
        sigma, slot = p.stripe_of(s, local)
        assert ((slot >= 0) & (slot < k)).all()
        for j in range(p.r):
            for q, pos, index in p.group_by_parity(s, local, j):
                assert ((q - sigma[pos] - k - j) % n == 0).all()  # parity j of σ is on (σ + k + j) mod N ...
                assert torch.equal(index, sigma[pos] // n)  # ... at index σ div N
                assert (index < p.parity_rows_on(q)).all()
                shards, locs, present = p.stripe_members(q, index, j)
                at = slot[pos].view(-1, 1)
                assert (shards.gather(1, at) == s).all()
                assert torch.equal(locs.gather(1, at).squeeze(1), local[pos])
                assert present.gather(1, at).all()


@SETTINGS
@given(placements())
@example(Placement(num_servers=6, k=2, num_rows=41))
def test_every_parity_records_members_map_back_to_it(p: Placement) -> None:
    """For each stored parity record: present members are exactly the real rows, each reports the same σ and
    its own slot, and names this record as its parity j. Each real row is counted in exactly r records."""
    n, k = p.num_servers, p.k
    seen = 0
    for j in range(p.r):
        for q in range(n):
            index = torch.arange(p.parity_rows_on(q), dtype=I64)
            shards, locs, present = p.stripe_members(q, index, j)
            assert shards.shape == locs.shape == present.shape == (index.numel(), k)
            assert torch.equal(present, p.global_id(shards, locs) < p.num_rows)
            for s in range(n):
                mask = present & (shards == s)
                sigma, slot = p.stripe_of(s, locs[mask])
                assert torch.equal(slot, torch.arange(k).expand_as(mask)[mask])
                assert ((sigma + k + j) % n == q).all()
                server, pindex = p.parity_of(s, locs[mask], j)
                assert (server == q).all()
                assert torch.equal(pindex, index.view(-1, 1).expand_as(mask)[mask])
            seen += int(present.sum())
    assert seen == p.r * p.num_rows


@SETTINGS
@given(placements())
@example(Placement(num_servers=6, k=2, num_rows=12, r=2))
def test_the_k_data_and_r_parity_slots_of_every_stripe_are_on_distinct_servers(p: Placement) -> None:
    data, parity, _ = stripe_table(p, blocks_of(p) + 1)
    servers = torch.sort(torch.cat([data, parity], dim=1), dim=1).values
    assert servers.shape[1] == p.k + p.r
    assert (servers[:, 1:] != servers[:, :-1]).all()


@SETTINGS
@given(placements(rs=(1,)))
@example(Placement(num_servers=4, k=2, num_rows=1))
@example(Placement(num_servers=5, k=3, num_rows=31))  # rows_on(0) = 7 = 2·3 + 1: only slot-0 rows in block 2
def test_num_stripes_counts_exactly_the_stripes_with_a_real_row(p: Placement) -> None:
    _, _, live = stripe_table(p, blocks_of(p) + 1)
    assert torch.equal(torch.nonzero(live).view(-1), torch.arange(p.num_stripes()))


# -- load balance -------------------------------------------------------------------------------------------


def block_counts(data: torch.Tensor, parity: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of N consecutive stripes: data slots per server [B, N] and parity-j slots per server
    [B, r, N]."""
    blocks, k, r = data.shape[0] // n, data.shape[1], parity.shape[1]
    server = torch.arange(n)
    d = (data.view(blocks, n * k, 1) == server).sum(dim=1)
    pr = (parity.view(blocks, n, r, 1) == server).sum(dim=1)
    return d, pr


@SETTINGS
@given(placements())
@example(Placement(num_servers=6, k=2, num_rows=40))  # gcd(N, k+1) = 3
@example(Placement(num_servers=8, k=3, num_rows=50, r=1))  # gcd(N, k+1) = 4
@example(Placement(num_servers=9, k=2, num_rows=60, r=1))  # gcd(N, k+1) = 3
def test_each_block_of_n_stripes_gives_every_server_k_data_rows_and_r_parity_records(p: Placement) -> None:
    data, parity, _ = stripe_table(p, blocks_of(p) + 1)
    d, pr = block_counts(data, parity, p.num_servers)
    assert (d == p.k).all()
    assert (pr == 1).all()  # one record of each parity slot j, so r in all


@pytest.mark.parametrize(("n", "k"), [(6, 2), (8, 3), (9, 2)])
def test_the_balance_check_catches_parity_on_sigma_mod_k_plus_1(n: int, k: int) -> None:
    """Negative control for the check above: placing stripe σ on the k+1 servers from σ·(k+1) mod N with the
    parity last (so parity on σ·(k+1)+k mod N, only N / gcd(N, k+1) distinct servers) fails it when
    gcd(N, k+1) > 1, as for every N here."""
    sigma = torch.arange(3 * n).view(-1, 1)
    data = (sigma * (k + 1) + torch.arange(k)) % n
    parity = (sigma * (k + 1) + k) % n
    d, pr = block_counts(data, parity, n)
    assert not ((d == k).all() and (pr == 1).all())
    assert torch.unique(parity).numel() < n


@SETTINGS
@given(placements())
@example(Placement(num_servers=6, k=2, num_rows=41))
@example(Placement(num_servers=7, k=3, num_rows=3))
def test_over_a_whole_table_live_parity_records_per_server_differ_by_at_most_one(p: Placement) -> None:
    """Precisely: for each parity slot j, the number of live records (stripes with a real row) whose parity j
    a server holds differs by at most one between servers, sums to num_stripes(), and every server allocates
    parity_rows_on = B = ceil(rows_on(0) / k) records, at most one of them dead (all padding)."""
    n = p.num_servers
    blocks = blocks_of(p)
    _, parity, live = stripe_table(p, blocks + 1)
    for j in range(p.r):
        per_server = torch.bincount(parity[live, j], minlength=n)
        assert int(per_server.max() - per_server.min()) <= 1, per_server.tolist()
        assert int(per_server.sum()) == p.num_stripes()
        for q in range(n):
            assert p.parity_rows_on(q) == blocks
            assert blocks - 1 <= int(per_server[q]) <= blocks
    # Data rows per server: differ by at most one row (G mod N servers get the extra).
    rows = torch.tensor([p.rows_on(s) for s in range(n)])
    assert int(rows.max() - rows.min()) <= 1


def test_no_parity_slots_means_no_parity_records() -> None:
    p = Placement(num_servers=3, k=3, num_rows=10, r=0)
    assert [p.parity_rows_on(s) for s in range(3)] == [0, 0, 0]


# -- grouping -----------------------------------------------------------------------------------------------


def assert_ordered_partition(groups, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Keys ascending and distinct, positions partition 0..len-1 and ascend within a group (input order kept),
    and each group's values are the values at its positions."""
    assert [key for key, _, _ in groups] == sorted(set(keys.tolist()))
    if keys.numel():
        assert torch.equal(
            torch.sort(torch.cat([pos for _, pos, _ in groups])).values, torch.arange(keys.numel())
        )
    for key, pos, vals in groups:
        assert pos.numel() > 0 and (pos[1:] > pos[:-1]).all()
        assert (keys[pos] == key).all()
        assert torch.equal(vals, values[pos])


@SETTINGS
@given(placements(rs=(0, 1)), st.lists(st.integers(0, 10**6), max_size=60))
def test_group_by_shard_partitions_ids_and_keeps_their_order(p: Placement, raw: list[int]) -> None:
    g = torch.tensor(raw, dtype=I64) % max(p.num_rows, 1)  # duplicates and any order
    groups = p.group_by_shard(g)
    assert_ordered_partition(groups, p.data_shard(g), p.local_row(g))
    # Reassembling the groups by position gives back the ids.
    back = torch.full_like(g, -1)
    for s, pos, local in groups:
        back[pos] = p.global_id(s, local)
    assert torch.equal(back, g)


@SETTINGS
@given(placements(), st.data())
def test_group_by_parity_partitions_rows_and_keeps_their_order(p: Placement, data: st.DataObject) -> None:
    shard = data.draw(st.integers(0, p.num_servers - 1))
    j = data.draw(st.integers(0, p.r - 1))
    raw = data.draw(st.lists(st.integers(0, 10**6), max_size=60))
    local = torch.tensor(raw, dtype=I64) % max(p.rows_on(shard), 1)
    server, index = p.parity_of(shard, local, j)
    assert_ordered_partition(p.group_by_parity(shard, local, j), server, index)


def test_grouping_an_empty_batch_gives_no_groups() -> None:
    p = Placement(num_servers=4, k=2, num_rows=10)
    assert p.group_by_shard(torch.empty(0, dtype=I64)) == []
    assert p.group_by_parity(1, torch.empty(0, dtype=I64)) == []


# -- dense chunks -------------------------------------------------------------------------------------------


@SETTINGS
@given(st.integers(0, 5000), st.integers(1, 24))
@example(0, 3)
@example(5, 8)
def test_chunk_bounds_cover_the_range_contiguously_in_near_equal_parts(total: int, parts: int) -> None:
    bounds = chunk_bounds(total, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(hi == lo for (_, hi), (lo, _) in zip(bounds, bounds[1:], strict=False))
    sizes = [hi - lo for lo, hi in bounds]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1


@SETTINGS
@given(st.integers(1, 16), st.integers(1, 3))
def test_dense_replicas_are_the_owner_then_distinct_neighbours(n: int, wanted: int) -> None:
    holders = [dense_replicas(c, n, wanted) for c in range(n)]
    copies = min(wanted, n)  # r + 1 when replicated (1, 2 or 3), never two on one server
    for c, servers in enumerate(holders):
        assert servers[0] == c
        assert len(servers) == copies == len(set(servers))
        assert all(0 <= s < n for s in servers)
        assert list(servers) == [(c + i) % n for i in range(copies)]
    # Every server holds the same number of chunk copies.
    assert torch.bincount(torch.tensor([s for h in holders for s in h]), minlength=n).tolist() == [copies] * n
