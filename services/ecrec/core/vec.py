"""Row-work primitives for the hot paths, chosen by measurement (docs/benchmarks.md, "Cheaper row work").

Every request a server handles runs a handful of small tensor ops, and at a few hundred rows each op costs
its dispatch more than its work. Measured on this project's 2-core machine (torch 2.13 CPU, one thread),
some torch idioms cost several times what an equivalent does:

- advanced indexing `t[idx]` (a gather through the general indexing kernel) against `t.index_select(0, idx)`:
  26 against 5 µs at 400 rows, 156 against 27 µs at 4,096; `t[idx, :w]` against `t[:, :w].index_select`,
  460 against 72 µs at 8,192 rows;
- `torch.isfinite(x).all()` against numpy's on the same memory: 44 against 4.5 µs at 400 × 16;
- a uniqueness check by `x.unique()` (a sort and more) against numpy's sort: 23 against 3.5 µs at 400, 590
  against 51 µs at 8,192.

These helpers keep torch semantics (and CUDA tensors on torch) and take the cheaper path on CPU.
"""

from __future__ import annotations

import numpy as np
import torch


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in `x`."""
    if x.device.type != "cpu" or not x.dtype.is_floating_point or x.dtype == torch.bfloat16:
        return bool(torch.isfinite(x).all())
    return bool(np.isfinite(x.detach().numpy()).all())


def all_unique(x: torch.Tensor) -> bool:
    """No value twice in 1-D integer `x`."""
    if x.numel() < 2:
        return True
    if x.device.type != "cpu":
        return x.unique().numel() == x.numel()
    s = np.sort(x.numpy())
    return bool((s[1:] != s[:-1]).all())


def in_range(x: torch.Tensor, n: int) -> bool:
    """Every value of integer `x` in [0, n)."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return int(lo) >= 0 and int(hi) < n


def as_range(x: torch.Tensor) -> tuple[int, int] | None:
    """(lo, hi) where 1-D integer `x` is exactly lo, lo + 1, ..., hi − 1 (a slice then reads it: a copy of
    contiguous memory instead of a gather), else None."""
    n = x.numel()
    if n == 0:
        return None
    lo, hi = int(x[0]), int(x[-1]) + 1
    if hi - lo != n or (n > 1 and not bool((x[1:] > x[:-1]).all())):
        return None
    return lo, hi


def take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A copy of t's rows `index`: of a slice where they are one range (`as_range`: a rebuild's or a
    whole-table read), else a gather (a copy already)."""
    span = as_range(index)
    if span is None:
        return t[index]
    return t[span[0] : span[1]].clone()
