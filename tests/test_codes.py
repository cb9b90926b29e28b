"""Erasure codes over row records (design notes §3). xor: every member comes back bit-exactly, deltas commute
(any order gives the re-encoded parity, bit for bit), NaN/Inf patterns survive. sum: the same properties
within float32 rounding bounds derived below, and its drift under many updates is measured against them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ecrec.core.codes import Code, SumCode, XorCode, make_code

SETTINGS = settings(max_examples=40, deadline=None)
U = 2.0**-24  # float32 unit roundoff: fl(a ± b) = (a ± b)(1 + δ), |δ| <= U; exact in the subnormal range
SEEDS = st.integers(0, 2**32 - 1)
K = st.integers(1, 6)
ROWS = st.integers(1, 8)
WIDTH = st.integers(1, 9)


def _i32(pattern: int) -> int:
    return pattern - (1 << 32) if pattern >= 1 << 31 else pattern


# Bit patterns xor must carry untouched: ±0, subnormals, extremes, ±inf, quiet and signalling NaNs.
SPECIAL = torch.tensor(
    [
        _i32(b)
        for b in (0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000)
        + (0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x3F800000)
    ],
    dtype=torch.int32,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The int32 bit patterns: ±0 and NaN payloads count as differences, and NaN equals itself."""
    return t.contiguous().view(torch.int32)


def xor_records(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 records mixing any bit pattern, ordinary floats and the special patterns, built on int32 so
    no float operation can touch a NaN payload on the way in."""
    raw = torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int32)
    normal = bits(torch.randn(shape, generator=gen) * 100)
    special = SPECIAL[torch.randint(len(SPECIAL), shape, generator=gen)]
    pick = torch.rand(shape, generator=gen)
    out = torch.where(pick < 0.4, normal, torch.where(pick < 0.6, special, raw))
    return out.view(torch.float32)


def sum_records(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Finite float32 records spanning subnormals (~1e-45) to 1e30 plus ±0; 6 of them cannot overflow."""
    exp = torch.randint(-45, 31, shape, generator=gen).to(torch.float64)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 10.0**exp).clamp(-1e30, 1e30)
    zero = torch.rand(shape, generator=gen) < 0.1
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, 1.0, -1.0).to(torch.float32)
    return torch.where(zero, sign * 0.0, x.to(torch.float32))


def gamma(m: int) -> float:
    """Error factor of m successive float32 roundings: |fl(Σ) - Σ| <= γ_m Σ|x| (Higham, eq. 3.4)."""
    return m * U / (1 - m * U)


def others_than(members: torch.Tensor, lost: int) -> torch.Tensor:
    return torch.cat([members[:lost], members[lost + 1 :]])


# -- xor ----------------------------------------------------------------------------------------------------


@SETTINGS
@given(SEEDS, K, ROWS, WIDTH)
@example(0, 1, 1, 1)
def test_xor_decode_recovers_every_member_bit_exactly(seed: int, k: int, n: int, w: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    members = xor_records(gen, (k, n, w))
    code = XorCode()
    parity = code.encode(members)
    assert parity.shape == (n, w) and parity.dtype == torch.float32
    for lost in range(k):
        assert torch.equal(bits(code.decode(parity, others_than(members, lost))), bits(members[lost]))


def run_updates(
    code: Code, members: torch.Tensor, steps: int, gen: torch.Generator, fresh
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Apply `steps` updates to copies of `members` (each: one slot, a random subset of rows, new values) and
    return the final members and each update's (row index, delta) in update order, computed against the
    record as it was just before that update, as a data server would."""
    current = members.clone()
    k, n, w = members.shape
    deltas = []
    for _ in range(steps):
        slot = int(torch.randint(k, (1,), generator=gen))
        rows = torch.nonzero(torch.rand(n, generator=gen) < 0.6).view(-1)
        new = fresh(gen, (rows.numel(), w))
        deltas.append((rows, code.delta(current[slot, rows], new)))
        current[slot, rows] = new
    return current, deltas


@SETTINGS
@given(SEEDS, K, ROWS, WIDTH, st.integers(1, 12), st.randoms(use_true_random=False))
def test_xor_deltas_in_any_order_give_the_reencoded_parity(seed, k, n, w, steps, rnd) -> None:
    gen = torch.Generator().manual_seed(seed)
    code = XorCode()
    members = xor_records(gen, (k, n, w))
    final, deltas = run_updates(code, members, steps, gen, xor_records)
    rnd.shuffle(deltas)
    want = bits(code.encode(final))
    # Functional form, on whole-parity deltas (zero on untouched rows) ...
    parity = code.encode(members)
    for rows, d in deltas:
        # d may hold NaN patterns: place it via the int32 view, never as floats
        full = torch.zeros(n, w, dtype=torch.int32).index_put((rows,), bits(d)).view(torch.float32)
        parity = code.apply_delta(parity, full)
    assert torch.equal(bits(parity), want)
    # ... and the in-place form a parity server uses (each update's rows are unique).
    table = code.encode(members)
    for rows, d in deltas:
        code.apply_delta_(table, rows, d)
    assert torch.equal(bits(table), want)


@SETTINGS
@given(SEEDS, st.integers(1, 40), WIDTH, st.sampled_from(["xor", "sum"]))
def test_apply_delta_in_place_with_unique_indices_equals_the_functional_form(seed, rows, w, name) -> None:
    gen = torch.Generator().manual_seed(seed)
    code = make_code(name)
    fresh = xor_records if name == "xor" else sum_records
    table = fresh(gen, (rows, w))
    index = torch.randperm(rows, generator=gen)[: int(torch.randint(rows + 1, (1,), generator=gen))]
    delta = fresh(gen, (index.numel(), w))
    old_table, old_delta = bits(table).clone(), bits(delta).clone()
    gathered = table[index]
    functional = code.apply_delta(gathered, delta)
    assert torch.equal(bits(gathered), old_table[index]) and torch.equal(
        bits(delta), old_delta
    )  # no mutation
    want = old_table.clone()
    want[index] = bits(functional)
    assert code.apply_delta_(table, index, delta) is None
    assert torch.equal(bits(table), want)  # touched rows updated, the rest untouched, bit for bit


@pytest.mark.parametrize("name", ["xor", "sum"])
def test_zero_records_encode_to_zero_and_padding_slots_change_nothing(name: str) -> None:
    code = make_code(name)
    gen = torch.Generator().manual_seed(3)
    assert torch.equal(bits(code.encode(torch.zeros(4, 5, 6))), torch.zeros(5, 6, dtype=torch.int32))
    assert torch.equal(bits(code.encode(torch.zeros(0, 5, 6))), torch.zeros(5, 6, dtype=torch.int32))
    members = (xor_records if name == "xor" else sum_records)(gen, (3, 5, 6))
    padded = torch.cat([members[:1], torch.zeros(2, 5, 6), members[1:]])
    assert torch.equal(bits(code.encode(padded)), bits(code.encode(members)))
    # A one-member stripe (k = 1): the parity is the record, and decoding needs no others.
    one = members[:1]
    assert torch.equal(bits(code.decode(code.encode(one), torch.zeros(0, 5, 6))), bits(one[0]))


def test_xor_is_exact_where_the_sum_code_loses_the_small_member() -> None:
    members = torch.tensor([[[1e8]], [[1.0]]], dtype=torch.float32)
    xor, total = XorCode(), SumCode()
    assert torch.equal(xor.decode(xor.encode(members), members[:1]), members[1])
    # 1e8 + 1 is not a float32: the sum parity rounds to 1e8 and the 1.0 is lost.
    assert total.decode(total.encode(members), members[:1]).item() == 0.0


# -- sum ----------------------------------------------------------------------------------------------------


@SETTINGS
@given(SEEDS, K, ROWS, WIDTH)
def test_sum_decode_recovers_every_member_within_the_rounding_bound(
    seed: int, k: int, n: int, w: int
) -> None:
    """encode rounds k-1 times (|err| <= γ_{k-1} S, S = Σ|x_i|), the others' sum k-2 times, the final
    subtraction once more: |decode - x_lost| <= (γ_{k-1} + γ_{k-2})(1 + u) S + u|x_lost| <= 2k·u·S."""
    gen = torch.Generator().manual_seed(seed)
    members = sum_records(gen, (k, n, w))
    code = SumCode()
    parity = code.encode(members)
    scale = members.double().abs().sum(dim=0)
    for lost in range(k):
        err = (code.decode(parity, others_than(members, lost)).double() - members[lost].double()).abs()
        assert (err <= 2 * k * U * scale).all(), float((err - 2 * k * U * scale).max())


def drift_bound(
    members: torch.Tensor, final: torch.Tensor, moved: torch.Tensor, parities: torch.Tensor
) -> torch.Tensor:
    """Elementwise bound on |incremental parity - encode(final)| (float64). Exactly, Σ final = Σ initial + Σ_t
    (new_t - old_t). The computed parity differs from that by: the initial encode (γ_{k-1} Σ|initial|), each
    delta's rounding (u |new_t - old_t|, `moved` sums those) and each addition's (u/(1-u) |p_t|, `parities`
    sums the computed parities); encode(final) by γ_{k-1} Σ|final|. Nothing else can contribute."""
    k = members.shape[0]
    g = gamma(max(k - 1, 0))
    return (
        g * (members.double().abs().sum(0) + final.double().abs().sum(0)) + U * moved + U / (1 - U) * parities
    )


@SETTINGS
@given(SEEDS, K, ROWS, WIDTH, st.integers(1, 12), st.randoms(use_true_random=False))
def test_sum_deltas_in_any_order_stay_within_the_drift_bound(seed, k, n, w, steps, rnd) -> None:
    gen = torch.Generator().manual_seed(seed)
    code = SumCode()
    members = sum_records(gen, (k, n, w))
    final, deltas = run_updates(code, members, steps, gen, sum_records)
    rnd.shuffle(deltas)
    table = code.encode(members)
    moved = torch.zeros(n, w, dtype=torch.float64)
    parities = torch.zeros(n, w, dtype=torch.float64)
    for rows, d in deltas:
        code.apply_delta_(table, rows, d)
        moved[rows] += d.double().abs()
        parities[rows] += table[rows].double().abs()
    drift = (table.double() - code.encode(final).double()).abs()
    # moved sums the computed |fl(new - old)| = |new - old|(1 + δ); (1 + 2u) recovers an upper bound on |new - old|.
    assert (drift <= drift_bound(members, final, moved * (1 + 2 * U), parities)).all()


def test_sum_drift_over_many_training_updates_is_measured_and_bounded() -> None:
    """A stripe of k=4 Adagrad-like records (magnitude ~1) updated 400 times in small steps. Drift is at most
    the per-update bound summed: (2(k-1) + 2T)·u·M, M the largest |partial parity| seen; measured it is
    a random walk, far below, and the drift it leaves in decoded records stays under the same bound."""
    gen = torch.Generator().manual_seed(11)
    code = SumCode()
    k, n, w, steps = 4, 64, 8, 400
    members = torch.randn(k, n, w, generator=gen)
    current = members.clone()
    parity = code.encode(members)
    biggest = float(parity.abs().max())
    for _ in range(steps):
        slot = int(torch.randint(k, (1,), generator=gen))
        new = current[slot] - 0.01 * torch.randn(n, w, generator=gen)
        parity = code.apply_delta(parity, code.delta(current[slot], new))
        current[slot] = new
        biggest = max(biggest, float(parity.abs().max()), float(current.abs().sum(0).max()))
    drift = float((parity.double() - current.double().sum(0)).abs().max())
    tolerance = (2 * (k - 1) + 2 * steps) * U * biggest
    assert drift <= tolerance, (drift, tolerance)
    for lost in range(k):
        err = (code.decode(parity, others_than(current, lost)).double() - current[lost].double()).abs().max()
        assert float(err) <= drift + 2 * k * U * biggest  # the drift plus one decode's rounding (see above)


# -- construction and devices ---------------------------------------------------------------------------------


def test_make_code_builds_each_code_and_names_the_valid_ones_otherwise() -> None:
    assert isinstance(make_code("xor"), XorCode) and make_code("xor").name == "xor"
    assert isinstance(make_code("sum"), SumCode) and make_code("sum").name == "sum"
    with pytest.raises(ValueError, match="'rs'.*xor.*sum"):
        make_code("rs")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["xor", "sum"])
def test_codes_run_on_cuda_tensors_and_agree_with_cpu(name: str) -> None:
    gen = torch.Generator().manual_seed(5)
    code = make_code(name)
    members = (xor_records if name == "xor" else sum_records)(gen, (3, 16, 8))
    dev = members.cuda()
    parity = code.encode(dev)
    assert parity.device.type == "cuda"
    assert torch.equal(bits(parity.cpu()), bits(code.encode(members)))
    assert torch.equal(
        bits(code.decode(parity, dev[1:]).cpu()), bits(code.decode(code.encode(members), members[1:]))
    )
    table, index = parity.clone(), torch.tensor([3, 0, 7], device="cuda")
    code.apply_delta_(table, index, dev[0, :3])
    want = code.encode(members)
    code.apply_delta_(want, index.cpu(), members[0, :3])
    assert torch.equal(bits(table.cpu()), bits(want))
