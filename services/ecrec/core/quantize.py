"""Check-N-Run's checkpoint quantization of embedding vectors (check-n-run.txt §5.2), vectorized over rows.

Each row x is stored as N-bit integers q = round((clip(x, lo, hi) - lo) / scale), scale = (hi - lo) / (2^N - 1),
with its own (lo, scale) in float32; x' = lo + q * scale. The paper's two methods:
- **asymmetric** (its choice for 8 bits): lo, hi = the row's min and max;
- **adaptive asymmetric** (its choice for <= 4 bits): a greedy search narrows [lo, hi] to cut the l2 error when
  a few large elements would stretch the scale. step = (max - min) / num_bins; each iteration quantizes with
  lo + step and with hi - step, keeps the move with the lower l2 error, and continues while the covered range
  hi - lo is above (1 - ratio) of the original; the (lo, hi) of the iteration with the lowest error wins.
  The paper's defaults: 25 bins for 2-3 bits, 45 for 4 bits, ratio 1.0 (the whole range).
All rows are searched together: one iteration is a few tensor ops over [rows, dim], never a per-row loop.
Values are packed 8 / bits per byte for 1, 2 and 4 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BINS = {1: 25, 2: 25, 3: 25, 4: 45}


@dataclass
class Quantized:
    """Rows of `dim` values as `bits`-bit codes (packed), with a float32 (lo, scale) per row."""

    codes: torch.Tensor  # uint8: [rows, dim] for 8 bits, packed [rows, ceil(dim * bits / 8)] below
    lo: torch.Tensor  # float32 [rows]
    scale: torch.Tensor  # float32 [rows]
    bits: int
    dim: int

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * (self.lo.numel() + self.scale.numel())


def _codes(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((x.clamp(lo[:, None], hi[:, None]) - lo[:, None]) / scale[:, None]).clamp_(0, levels)
    return q, scale


def _error(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Squared l2 error per row of quantizing x to [lo, hi]."""
    q, scale = _codes(x, lo, hi, bits)
    return ((lo[:, None] + q * scale[:, None] - x) ** 2).sum(dim=1)


def adaptive_range(
    x: torch.Tensor, bits: int, num_bins: int | None = None, ratio: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy search's (lo, hi) per row of x [rows, dim]."""
    x = x.float()
    lo, hi = x.min(dim=1).values, x.max(dim=1).values
    bins = num_bins or DEFAULT_BINS.get(bits, 25)
    step = (hi - lo) / bins
    best_lo, best_hi, best = lo.clone(), hi.clone(), _error(x, lo, hi, bits)
    # Each iteration shrinks the range by one step; stop once it covers less than (1 - ratio) of the original
    # (ratio 1: until a step is left), for every row together.
    for _ in range(max(0, int(bins * ratio) - 1)):
        e_lo, e_hi = _error(x, lo + step, hi, bits), _error(x, lo, hi - step, bits)
        raise_lo = e_lo <= e_hi
        lo = torch.where(raise_lo, lo + step, lo)
        hi = torch.where(raise_lo, hi, hi - step)
        err = torch.minimum(e_lo, e_hi)
        better = err < best
        best = torch.where(better, err, best)
        best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
    return best_lo, best_hi


def quantize(x: torch.Tensor, bits: int, adaptive: bool | None = None, **search) -> Quantized:
    """Quantize rows x [rows, dim]. `adaptive` defaults to the paper's choice: the greedy search at <= 4 bits."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, not {bits}")
    x = x.float()
    rows, dim = x.shape
    if adaptive is None:
        adaptive = bits <= 4
    if rows == 0:
        lo = hi = torch.zeros(0)
    elif adaptive:
        lo, hi = adaptive_range(x, bits, **search)
    else:
        lo, hi = x.min(dim=1).values, x.max(dim=1).values
    q, scale = _codes(x, lo, hi, bits)
    return Quantized(_pack(q.to(torch.uint8), bits), lo.float(), scale.float(), bits, dim)


def dequantize(qz: Quantized) -> torch.Tensor:
    q = _unpack(qz.codes, qz.bits, qz.dim).float()
    return qz.lo[:, None] + q * qz.scale[:, None]


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return q
    per = 8 // bits
    rows, dim = q.shape
    pad = (-dim) % per
    q = torch.nn.functional.pad(q, (0, pad)).view(rows, (dim + pad) // per, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (q << shifts).sum(dim=2).to(torch.uint8)


def _unpack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    if bits == 8:
        return codes
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    q = (codes.to(torch.int32)[:, :, None] >> shifts) & ((1 << bits) - 1)
    return q.reshape(codes.shape[0], codes.shape[1] * per)[:, :dim].to(torch.uint8)


def intermittent_full(sizes: list[float]) -> bool:
    """Check-N-Run's intermittent incremental policy (§5.1): after a full baseline (size 1) and increments of
    sizes S1..Si (fractions of the baseline), write a full baseline next iff Fc = 1 + S1 + ... + Si is at most
    Ic = (i + 1) * Si: the next i + 1 increments cost at least Si each. No increment yet: an increment."""
    if not sizes:
        return False
    i = len(sizes)
    return 1 + sum(sizes) <= (i + 1) * sizes[-1]
