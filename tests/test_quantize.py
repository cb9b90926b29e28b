"""Check-N-Run's quantization (ecrec.core.quantize): error bounds, the adaptive search, packing, the policy."""

from __future__ import annotations

import pytest
import torch

from ecrec.core.quantize import adaptive_range, dequantize, intermittent_full, quantize


def rows(n=256, dim=16, seed=0) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_plain_asymmetric_error_is_at_most_half_a_step_and_codes_are_packed(bits):
    x = rows(dim=13)  # not a multiple of the values per byte: padding must not leak
    qz = quantize(x, bits, adaptive=False)
    back = dequantize(qz)
    assert back.shape == x.shape
    assert bool(((back - x).abs() <= qz.scale[:, None] / 2 + 1e-6).all())
    assert qz.codes.shape == (256, -(-13 * bits // 8)) and qz.codes.dtype == torch.uint8
    assert qz.nbytes < x.numel() * 4 * bits / 8 + 256 * 8 + 1


def test_eight_bits_keep_each_rows_extremes_and_constant_rows_exactly():
    x = rows()
    x[3] = 0.25
    back = dequantize(quantize(x, 8))
    assert torch.allclose(back.min(dim=1).values, x.min(dim=1).values, atol=1e-6)
    assert torch.allclose(back.max(dim=1).values, x.max(dim=1).values, atol=1e-6)
    assert bool((back[3] == 0.25).all())


@pytest.mark.parametrize("bits", [2, 4])
def test_the_greedy_search_beats_plain_min_max_on_rows_with_outliers(bits):
    x = rows(512, 32, seed=1)
    x[torch.arange(512), torch.randint(0, 32, (512,), generator=torch.Generator().manual_seed(2))] *= 12.0
    plain = ((dequantize(quantize(x, bits, adaptive=False)) - x) ** 2).sum(dim=1)
    adaptive = ((dequantize(quantize(x, bits, adaptive=True)) - x) ** 2).sum(dim=1)
    assert bool((adaptive <= plain + 1e-5).all())  # never worse: the start is the plain range
    # The paper's Fig. 10: the fewer the bits, the larger the gain (here ~30% at 2 bits, ~13% at 4).
    assert adaptive.mean() < {2: 0.8, 4: 0.95}[bits] * plain.mean()


def test_the_search_range_stays_inside_the_rows_range_and_ratio_zero_is_plain():
    x = rows(64, 8, seed=3)
    lo, hi = adaptive_range(x, 4)
    assert bool((lo >= x.min(dim=1).values - 1e-6).all() and (hi <= x.max(dim=1).values + 1e-6).all())
    lo0, hi0 = adaptive_range(x, 4, ratio=0.0)
    assert torch.equal(lo0, x.min(dim=1).values) and torch.equal(hi0, x.max(dim=1).values)


def test_no_rows_and_bad_widths():
    assert dequantize(quantize(torch.zeros(0, 5), 4)).shape == (0, 5)
    with pytest.raises(ValueError, match="bits"):
        quantize(rows(), 3)


def test_intermittent_policy_takes_a_baseline_once_increments_outgrow_it():
    assert not intermittent_full([])
    assert not intermittent_full([0.25])  # 1.25 > 2 * 0.25
    assert not intermittent_full([0.25, 0.35, 0.45])  # 2.05 > 1.8
    assert intermittent_full([0.25, 0.35, 0.45, 0.55, 0.6])  # 3.2 <= 3.6
    assert not intermittent_full([0.9]) and intermittent_full([0.95, 1.0])  # 2.95 <= 3.0
