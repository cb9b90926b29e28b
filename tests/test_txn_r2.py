"""Difference propagation with r = 2 (issue #30) in the protocol core: every data server's updates go out as P
and Q deltas (ΔP = new ⊕ old, ΔQ = g^slot·ΔP) to the two parity servers of each row, whose participants apply
them by xor in version order, at P's and Q's rows of their parity tables (`Placement.parity_index`). After any
sequence of updates, delivered in any order, every parity record must equal the P + Q code's encoding of its
stripe as it is now — and any two lost members then decode bit-exactly from what the parity servers hold.

Records start as random bits (NaN payloads and infinities included), so nothing here is float arithmetic."""

from __future__ import annotations

import itertools

import pytest
import torch

from ecrec.core.codes import make_code
from ecrec.core.optim import make_optimizer
from ecrec.core.placement import Placement
from ecrec.core.txn import DataParticipant, DeltaBatch, ParityParticipant
from ecrec.core.update import ParityTargets
from tests.test_raid6 import bits, records

K, DIM = 4, 3
OPT = make_optimizer("adagrad", 0.1)
W = OPT.record_width(DIM)


class Stripes:
    """N data participants and N parity participants (r = 2), parity encoded from the members at the start."""

    def __init__(self, n: int, rows: int, seed: int = 0) -> None:
        self.p = Placement(num_servers=n, k=K, num_rows=rows, r=2)
        self.code = make_code("xor", 2, K)
        gen = torch.Generator().manual_seed(seed)
        self.data = {
            s: DataParticipant(
                s,
                self.p,
                self.code,
                OPT,
                records(seed * 100 + s, self.p.rows_on(s), W),
                torch.randint(1, 50, (self.p.rows_on(s),), generator=gen),
            )
            for s in range(n)
        }
        blocks = self.p.parity_rows_on(0)
        self.parity = {}
        for s in range(n):
            pp = ParityParticipant(
                s,
                self.p,
                self.code,
                torch.zeros(2 * blocks, W),
                torch.zeros(2 * blocks, K, dtype=torch.int64),
            )
            self.parity[s] = pp
        for j, s in itertools.product(range(2), range(n)):  # what a rebuild from the members would install
            parity, pver = self.encoded(s, j)
            index = self.p.parity_index(j, torch.arange(blocks))
            bits(self.parity[s].parity)[index] = bits(parity)
            self.parity[s].pver[index] = pver

    def encoded(self, server: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Parity j of the stripes whose parity j `server` holds, encoded from their members now, and the
        members' versions."""
        blocks = self.p.parity_rows_on(0)
        shards, locs, present = self.p.stripe_members(server, torch.arange(blocks), j)
        members = torch.zeros(K, blocks, W)
        vers = torch.zeros(blocks, K, dtype=torch.int64)
        for b, i in itertools.product(range(blocks), range(K)):
            if present[b, i]:
                d = self.data[int(shards[b, i])]
                bits(members[i])[b] = bits(d.records[locs[b, i]])
                vers[b, i] = d.versions[locs[b, i]]
        return self.code.encode(members, j), vers

    def update(self, server: int, rows: torch.Tensor, seed: int) -> list[DeltaBatch]:
        grads = torch.randn(rows.numel(), DIM, generator=torch.Generator().manual_seed(seed))
        return self.data[server].apply(f"t{seed}", rows, grads)

    def assert_exact(self) -> None:
        blocks = self.p.parity_rows_on(0)
        for s, j in itertools.product(self.parity, range(2)):
            parity, vers = self.encoded(s, j)
            index = self.p.parity_index(j, torch.arange(blocks))
            assert torch.equal(bits(self.parity[s].parity[index]), bits(parity)), (s, j)
            assert torch.equal(self.parity[s].pver[index], vers), (s, j)


def test_parity_index_puts_q_after_p_and_inverts():
    p = Placement(num_servers=6, k=K, num_rows=6 * K * 5, r=2)
    blocks = p.parity_rows_on(0)
    b = torch.arange(blocks)
    assert torch.equal(p.parity_index(0, b), b)
    assert torch.equal(p.parity_index(1, b), b + blocks)
    for j in range(2):
        jj, bb = p.parity_slot(p.parity_index(j, b))
        assert bool((jj == j).all()) and torch.equal(bb, b)


def test_a_row_update_sends_p_and_q_deltas_to_its_two_parity_servers():
    st = Stripes(n=6, rows=6 * K * 4)
    p, server = st.p, 2
    local = torch.arange(p.rows_on(server))
    old = st.data[server].records.clone()
    batches = st.update(server, local, seed=1)
    new = st.data[server].records
    by_server: dict[int, list[DeltaBatch]] = {}
    for b in batches:
        by_server.setdefault(b.parity_server, []).append(b)
    for j in range(2):
        want_servers, want_index = p.parity_of(server, local, j)
        slot = torch.remainder(local, K)
        for i in range(K):  # one batch per (stripe slot, parity j)
            rows = slot == i
            target = int(want_servers[rows][0])
            (b,) = [b for b in by_server[target] if int(b.slot[0]) == i and p.parity_slot(b.index)[0][0] == j]
            assert torch.equal(b.index, p.parity_index(j, want_index[rows]))
            p_delta = (bits(old[local[rows]]) ^ bits(new[local[rows]])).view(torch.float32)
            want = st.code.for_parity(p_delta, i, j)
            assert torch.equal(bits(b.delta), bits(want))
    assert len(batches) == 2 * K  # every slot has rows: K batches for P, K for Q


@pytest.mark.parametrize("n", [6, 7])
def test_p_and_q_stay_exact_through_updates_delivered_out_of_order(n):
    st = Stripes(n=n, rows=n * K * 3 + 5, seed=n)  # a last block only partly filled: padding members
    st.assert_exact()
    gen = torch.Generator().manual_seed(7)
    pending: list[DeltaBatch] = []
    for step in range(30):
        server = int(torch.randint(0, n, (1,), generator=gen))
        m = st.p.rows_on(server)
        rows = torch.randperm(m, generator=gen)[: int(torch.randint(1, m + 1, (1,), generator=gen))]
        pending += st.update(server, rows.sort().values, seed=100 + step)
        if (
            step % 7 == 6
        ):  # deliver what is pending in a shuffled order: held rows wait for their predecessors
            for i in torch.randperm(len(pending), generator=gen).tolist():
                st.parity[pending[i].parity_server].apply(pending[i])
            pending = []
    for b in reversed(pending):
        st.parity[b.parity_server].apply(b)
    assert all(not pp.held for pp in st.parity.values())
    st.assert_exact()


def test_two_lost_members_decode_from_the_parity_the_deltas_kept():
    st = Stripes(n=6, rows=6 * K * 2)
    for step, server in enumerate([0, 3, 5, 1, 0, 2]):
        for b in st.update(server, torch.arange(st.p.rows_on(server)), seed=step):
            st.parity[b.parity_server].apply(b)
    p, blocks = st.p, st.p.parity_rows_on(0)
    sigma = 0  # stripe 0: members on servers 0..3, P on 4, Q on 5
    index = torch.tensor([sigma // p.num_servers])
    shards, locs, _present = p.stripe_members(4, index, 0)
    members = torch.stack([st.data[int(shards[0, i])].records[int(locs[0, i])] for i in range(K)])
    pq = torch.stack(
        [st.parity[4].parity[p.parity_index(0, index)][0], st.parity[5].parity[p.parity_index(1, index)][0]]
    )
    assert blocks >= 1
    for lost in itertools.combinations(range(K), 2):
        stripe = torch.cat([members, pq]).unsqueeze(1).clone()  # [k + 2, 1, W]: positions k, k+1 are P, Q
        stripe[list(lost)] = torch.zeros(W)
        decoded = st.code.decode(stripe, list(lost))
        for pos, i in enumerate(lost):
            assert torch.equal(bits(decoded[pos, 0]), bits(members[i])), lost


def test_parity_targets_name_both_parity_servers_of_each_row():
    """What a worker uses to turn parity servers' answers into rows (ecrec.core.update.ParityTargets)."""
    p = Placement(num_servers=6, k=K, num_rows=6 * K * 3, r=2)
    local = torch.arange(p.rows_on(2))
    targets = ParityTargets(p, 2, local)
    (ps, pb), (qs, qb) = (p.parity_of(2, local, j) for j in range(2))
    for s in range(6):
        assert torch.equal(targets.at(s), (ps == s) | (qs == s))
        assert torch.equal(targets.at([s, (s + 1) % 6]), targets.at(s) | targets.at((s + 1) % 6))
    assert not bool(targets.at(2).any())  # a row's parity is never on its own data server
    # a refusal names parity indices on one server: P's rows there by block, Q's by B + block
    row = 5
    want = (ps == ps[row]) & (pb == pb[row])
    assert torch.equal(targets.refused(int(ps[row]), p.parity_index(0, pb[row : row + 1])), want)
    want = (qs == qs[row]) & (qb == qb[row])
    assert torch.equal(targets.refused(int(qs[row]), p.parity_index(1, qb[row : row + 1])), want)
