"""The P + Q code (issue #30): GF(2^8) is the RAID-6 field, P and Q are what their definitions say, deltas update
them exactly in any order, and any one or two of a stripe's k + 2 records come back bit for bit, NaN payloads,
infinities and -0.0 included."""

from __future__ import annotations

import itertools

import pytest
import torch

from ecrec.core import gf256
from ecrec.core.raid6 import PQCode


def _peasant(a: int, b: int) -> int:
    """Carry-less a·b reduced mod 0x11d, bit by bit: an independent reference for the tables."""
    out = 0
    while b:
        if b & 1:
            out ^= a
        b >>= 1
        a <<= 1
        if a & 0x100:
            a ^= 0x11D
    return out


REF = torch.tensor([[_peasant(a, b) for b in range(256)] for a in range(256)], dtype=torch.uint8)
BYTES = torch.arange(256)


def _i32(pattern: int) -> int:
    return pattern - (1 << 32) if pattern >= 1 << 31 else pattern


# ±0, subnormals, extremes, ±inf, quiet and signalling NaNs with payloads, 1.0.
SPECIAL = torch.tensor(
    [
        _i32(b)
        for b in (0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000)
        + (0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FC0BEEF, 0x3F800000)
    ],
    dtype=torch.int32,
)


def records(seed: int, *shape: int) -> torch.Tensor:
    """float32 records of random bits, a third of them special patterns, built as int32 so no float operation
    touches a NaN payload on the way in."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int32)
    special = SPECIAL[torch.randint(len(SPECIAL), shape, generator=gen)]
    return torch.where(torch.rand(shape, generator=gen) < 0.33, special, raw).view(torch.float32)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def ref_q(members: torch.Tensor) -> torch.Tensor:
    """Q = Σ g^i·D_i per byte, from the reference table and repeated doubling for g^i."""
    out = torch.zeros(members.shape[1:].numel() * 4, dtype=torch.uint8)
    coeff = 1
    for m in members:
        out ^= REF[coeff][m.contiguous().view(torch.uint8).reshape(-1).long()]
        coeff = _peasant(coeff, 2)
    return out.view(torch.float32).view(members.shape[1:])


def stripe(code: PQCode, seed: int, n: int = 6, w: int = 5) -> torch.Tensor:
    data = records(seed, code.k, n, w)
    return torch.cat([data, code.encode(data, 0)[None], code.encode(data, 1)[None]])


# -- the field ----------------------------------------------------------------------------------------------
def test_product_table_is_carryless_multiplication_mod_0x11d():
    assert torch.equal(gf256.MUL, REF)
    assert all(gf256.gmul(a, b) == _peasant(a, b) for a in range(0, 256, 7) for b in range(256))


def test_field_axioms_hold_on_every_pair_and_triple():
    m = gf256.MUL.long()
    a, b, c = BYTES.view(-1, 1, 1), BYTES.view(1, -1, 1), BYTES.view(1, 1, -1)
    assert torch.equal(m, m.T)  # commutative
    assert torch.equal(m[a, b ^ c], m[a, b] ^ m[a, c])  # distributes over xor (addition)
    assert torch.equal(m[m[a, b], c], m[a, m[b, c]])  # associative
    assert torch.equal(m[1], BYTES) and not m[0].any()  # 1 is the identity, 0 absorbs


def test_every_nonzero_byte_has_an_inverse_and_zero_has_none():
    c = BYTES[1:]
    assert torch.equal(gf256.MUL[c, gf256.INV[c].long()], torch.ones(255, dtype=torch.uint8))
    assert [gf256.inv(int(x)) for x in c] == gf256.INV[1:].tolist()
    with pytest.raises(ValueError):
        gf256.inv(0)
    with pytest.raises(ValueError):
        gf256.glog(0)


def test_g_generates_the_multiplicative_group_of_order_255():
    powers = [1]
    for _ in range(255):
        powers.append(_peasant(powers[-1], 2))
    assert sorted(powers[:255]) == list(range(1, 256)) and powers[255] == 1
    assert [gf256.gpow(i) for i in range(255)] == powers[:255] == gf256.EXP.tolist()
    assert all(gf256.glog(gf256.gpow(i)) == i for i in range(255))
    assert all(_peasant(gf256.gpow(-i), gf256.gpow(i)) == 1 for i in range(300))


def test_tensor_multiplications_match_the_table_on_every_byte():
    x = BYTES.to(torch.uint8)
    for c in range(256):
        assert torch.equal(gf256.mul(x, c), REF[c]), c
    grid = x.view(1, -1).expand(256, -1).contiguous()  # row c times c: the whole table at once
    assert torch.equal(gf256.mul_rows(grid, BYTES), REF)


def test_mul_g_doubles_each_byte_of_a_word_independently():
    # every byte value in every byte position of an int32 word, beside random neighbours
    gen = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (4, 256, 4), generator=gen, dtype=torch.uint8)
    for pos in range(4):
        raw[pos, :, pos] = BYTES
    words = raw.view(torch.int32)
    assert torch.equal(gf256.mul_g(words).view(torch.uint8), REF[2][raw.long()])


# -- encode and deltas ----------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_p_is_the_xor_and_q_the_weighted_sum_of_the_data(k):
    code = PQCode(k)
    data = records(k, k, 9, 7)
    p = torch.zeros(9, 7, dtype=torch.int32)
    for d in data:
        p ^= bits(d)
    assert torch.equal(bits(code.encode(data, 0)), p)
    assert torch.equal(bits(code.encode(data, 1)), bits(ref_q(data)))


def test_missing_trailing_slots_encode_as_zero_records():
    code = PQCode(5)
    data = records(3, 3, 4, 6)
    padded = torch.cat([data, torch.zeros(2, 4, 6)])
    for j in (0, 1):
        assert torch.equal(bits(code.encode(data, j)), bits(code.encode(padded, j)))
        assert not bits(code.encode(data[:0], j)).any()
    with pytest.raises(ValueError):
        code.encode(records(0, 6, 4, 6), 0)  # more members than slots
    with pytest.raises(ValueError):
        code.encode(data, 2)


@pytest.mark.parametrize("j", [0, 1])
def test_updating_any_slot_by_delta_equals_re_encoding(j):
    k = 6
    code = PQCode(k)
    before = records(10 + j, k, 8, 5)
    for i in range(k):
        after = before.clone()
        after[i] = records(100 + i, 8, 5)
        delta = code.delta(before[i], after[i], i, j)
        assert torch.equal(bits(code.apply_delta(code.encode(before, j), delta)), bits(code.encode(after, j)))


def test_a_servers_rows_at_different_slots_get_their_own_coefficients():
    code = PQCode(8)
    old, new = records(20, 16, 5), records(21, 16, 5)
    slot = torch.tensor([i % 8 for i in range(16)]).flip(0)
    per_row = code.delta(old, new, slot, 1)
    for r in range(16):
        assert torch.equal(
            bits(per_row[r]), bits(code.delta(old[r : r + 1], new[r : r + 1], int(slot[r]), 1)[0])
        )
    assert torch.equal(bits(code.delta(old, new, slot, 0)), bits(old) ^ bits(new))  # P ignores the slot


def test_deltas_applied_in_any_order_give_the_re_encoded_parity():
    # Three rounds of updates to random slots of 10 stripes; every parity server applies all deltas, in
    # shuffled order, in place, one row per call group: both parity tables end at the re-encoded bits.
    k, stripes, w = 4, 10, 3
    code = PQCode(k)
    data = records(30, k, stripes, w)
    tables = [code.encode(data, j) for j in (0, 1)]
    deltas = []  # (stripe rows, delta, j)
    gen = torch.Generator().manual_seed(31)
    for rnd in range(3):
        for i in range(k):
            rows = torch.randperm(stripes, generator=gen)[:6]
            new = records(1000 + 10 * rnd + i, 6, w)
            for j in (0, 1):
                deltas.append((rows, code.delta(data[i, rows], new, i, j), j))
            data[i, rows] = new
    orders = [torch.randperm(len(deltas), generator=gen).tolist() for _ in range(3)]
    ends = []
    for order in orders:
        tabs = [t.clone() for t in tables]
        for o in order:
            rows, delta, j = deltas[o]
            code.apply_delta_(tabs[j], rows, delta)
        ends.append(tabs)
    for tabs in ends:
        for j in (0, 1):
            assert torch.equal(bits(tabs[j]), bits(code.encode(data, j)))


# -- decode ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_every_one_or_two_lost_records_of_a_stripe_decode_bit_exactly(k):
    code = PQCode(k)
    full = stripe(code, seed=k, n=40, w=6)
    for lost in itertools.chain(
        itertools.combinations(range(k + 2), 1), itertools.combinations(range(k + 2), 2)
    ):
        for order in {lost, lost[::-1]}:
            garbage = full.clone()
            garbage[list(order)] = records(99, len(order), 40, 6)  # what sits at a lost position is ignored
            assert torch.equal(bits(code.decode(garbage, list(order))), bits(full[list(order)])), order


@pytest.mark.parametrize("k", [1, 3, 5])
def test_lost_positions_may_differ_per_row(k):
    # every single and every pair at once, one per row, each in both orders
    code = PQCode(k)
    pairs = [list(p) for p in itertools.permutations(range(k + 2), 2)]
    singles = [[p] for p in range(k + 2)]
    for cases in (pairs, singles):
        lost = torch.tensor(cases)
        full = stripe(code, seed=50 + k, n=len(cases), w=4)
        want = bits(full)[lost.T, torch.arange(len(cases))]
        assert torch.equal(bits(code.decode(full, lost)), want)


@pytest.mark.parametrize("k", [8, 16, 255])
def test_large_stripes_decode_any_two_data_or_data_and_parity(k):
    code = PQCode(k)
    full = stripe(code, seed=k, n=12, w=3)
    gen = torch.Generator().manual_seed(k)
    picks = [(0, k - 1), (k - 1, k), (0, k + 1), (k, k + 1)]
    picks += [tuple(torch.randperm(k + 2, generator=gen)[:2].tolist()) for _ in range(20)]
    for lost in picks:
        assert torch.equal(bits(code.decode(full, list(lost))), bits(full[list(lost)])), lost
    per_row = torch.stack([torch.randperm(k + 2, generator=gen)[:2] for _ in range(12)])
    assert torch.equal(bits(code.decode(full, per_row)), bits(full)[per_row.T, torch.arange(12)])


def test_padding_slots_are_zero_records_for_decode_too():
    # A last stripe with 2 real rows of k = 5: slots 2..4 are padding, known as zeros, or lost and rebuilt as
    # zeros (a padding slot on a lost server).
    code = PQCode(5)
    data = torch.cat([records(60, 2, 7, 4), torch.zeros(3, 7, 4)])
    full = torch.cat([data, code.encode(data[:2], 0)[None], code.encode(data[:2], 1)[None]])
    for lost in ([0, 1], [1, 6], [0, 5], [3, 1], [4, 6]):
        assert torch.equal(bits(code.decode(full, lost)), bits(full[lost]))
    assert not bits(code.decode(full, [2, 4])).any()


def test_decode_refuses_what_no_stripe_could_mean():
    code = PQCode(3)
    full = stripe(code, seed=70, n=4, w=2)
    for lost in ([], [0, 1, 2], [1, 1], [5], [-1, 0]):
        with pytest.raises(ValueError):
            code.decode(full, lost)
    with pytest.raises(ValueError):
        code.decode(full[:4], [0])  # k + 1 records
    with pytest.raises(ValueError):
        code.decode(full, torch.tensor([[0, 1], [2, 2], [0, 1], [0, 1]]))
    with pytest.raises(ValueError):
        PQCode(256)  # g^255 = g^0: slots 0 and 255 would share a coefficient


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_parity_tables_on_cuda_give_the_same_bits():
    code, dev = PQCode(4), torch.device("cuda")
    full = stripe(code, seed=80, n=33, w=64)
    old, new = records(81, 33, 64), records(82, 33, 64)
    slot = torch.arange(33) % 4
    for j in (0, 1):
        assert torch.equal(bits(code.encode(full[:4].to(dev), j)).cpu(), bits(full[4 + j]))
        d = code.delta(old.to(dev), new.to(dev), slot.to(dev), j)
        assert torch.equal(bits(d).cpu(), bits(code.delta(old, new, slot, j)))
        table, index = full[4 + j].to(dev), torch.arange(33, device=dev).flip(0)
        code.apply_delta_(table, index, d)
        cpu = full[4 + j].clone()
        code.apply_delta_(cpu, index.cpu(), code.delta(old, new, slot, j))
        assert torch.equal(bits(table).cpu(), bits(cpu))
    lost = torch.tensor([[0, 3], [1, 4], [2, 5], [4, 5]]).repeat(9, 1)[:33]
    assert torch.equal(bits(code.decode(full.to(dev), lost.to(dev))).cpu(), bits(code.decode(full, lost)))
    assert torch.equal(bits(code.decode(full.to(dev), [1, 2])).cpu(), bits(full[[1, 2]]))
