"""GF(2^8) arithmetic for the P + Q code (ecrec.core.raid6): the RAID-6 field of Linux raid6 and Intel ISA-L.

Bytes are polynomials over GF(2) modulo x^8 + x^4 + x^3 + x^2 + 1 (0x11d); addition is xor, and g = 2 generates
the multiplicative group (order 255), so g^0 .. g^254 are distinct and non-zero: each stripe slot i < 255 gets
its own coefficient g^i (H. P. Anvin, "The mathematics of RAID-6").

The tables are constants built once at import; the tensor functions multiply every byte by a constant with one
gather from a 256-entry row of the product table (or, per row, from the flat 256 x 256 table), never a Python
loop over bytes. They run on the device their input lives on; the tables are copied there once and cached.
"""

from __future__ import annotations

import functools

import torch

POLY = 0x11D
GENERATOR = 2
ORDER = 255  # of the multiplicative group: g^ORDER = 1


def _build_exp_log() -> tuple[list[int], list[int]]:
    # 255 steps of "multiply by g" at import: the field's whole multiplicative group, once.
    exp, log = [0] * (2 * ORDER), [0] * 256
    x = 1
    for i in range(ORDER):
        exp[i] = exp[i + ORDER] = x  # doubled, so exp[log a + log b] needs no reduction mod 255
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= POLY
    return exp, log


_EXP, _LOG = _build_exp_log()
EXP = torch.tensor(_EXP[:ORDER], dtype=torch.uint8)  # EXP[i] = g^i, i < 255
LOG = torch.tensor(_LOG, dtype=torch.int64)  # LOG[c] = i with g^i = c; LOG[0] is 0 but meaningless


def _build_mul() -> torch.Tensor:
    a = torch.arange(256)
    exp2 = torch.tensor(_EXP, dtype=torch.uint8)
    prod = exp2[LOG.view(-1, 1) + LOG.view(1, -1)]
    return torch.where((a.view(-1, 1) == 0) | (a.view(1, -1) == 0), 0, prod).to(torch.uint8)


MUL = _build_mul()  # MUL[a, b] = a·b
# INV[c] = c^-1; INV[0] = 0 by convention, so callers may compute masked-off lanes without an error.
INV = torch.tensor([0] + [_EXP[(ORDER - _LOG[c]) % ORDER] for c in range(1, 256)], dtype=torch.uint8)


# -- scalars (Python ints) --------------------------------------------------------------------------------
def gmul(a: int, b: int) -> int:
    """a·b for bytes a, b."""
    return 0 if a == 0 or b == 0 else _EXP[_LOG[a] + _LOG[b]]


def gpow(i: int) -> int:
    """g^i for any integer i (negative too: g^-i = (g^i)^-1)."""
    return _EXP[i % ORDER]


def inv(c: int) -> int:
    """c^-1; zero has no inverse."""
    if not 0 < c < 256:
        raise ValueError(f"{c} has no inverse in GF(2^8)")
    return _EXP[(ORDER - _LOG[c]) % ORDER]


def glog(c: int) -> int:
    """i in [0, 255) with g^i = c; zero has no logarithm."""
    if not 0 < c < 256:
        raise ValueError(f"{c} has no logarithm in GF(2^8)")
    return _LOG[c]


# -- tensors ---------------------------------------------------------------------------------------------
@functools.cache
def tables(device: torch.device) -> dict[str, torch.Tensor]:
    """The constant tables on `device` (copied once per device): exp, inv, the flat product table."""
    return {
        "exp": EXP.to(device),
        "inv": INV.to(device),
        "mul": MUL.to(device),
        "flat": MUL.reshape(-1).to(device),
    }


def mul(x: torch.Tensor, c: int) -> torch.Tensor:
    """Every byte of uint8 tensor `x` times the constant c."""
    if c == 0:
        return torch.zeros_like(x)
    if c == 1:
        return x.clone()
    row = tables(x.device)["mul"][c]
    # index_select with int32 indices: the fastest gather on CPU, several times faster than row[x.long()].
    return row.index_select(0, x.reshape(-1).to(torch.int32)).view(x.shape)


def mul_rows(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Row r of uint8 tensor `x` [n, ...] times c[r] (uint8 or integer tensor [n] on x's device)."""
    flat = tables(x.device)["flat"]
    base = c.to(torch.int32).view(-1, *([1] * (x.dim() - 1))) * 256
    return flat.index_select(0, x.to(torch.int32).add_(base).reshape(-1)).view(x.shape)


def mul_g(words: torch.Tensor) -> torch.Tensor:
    """Every byte packed in int32 tensor `words` times g, without tables: shift each byte left and fold the
    carried-out bit back as 0x1d (the low byte of 0x11d). The masks keep bytes from spilling into each other, so
    byte order does not matter. Linux raid6 computes Q the same way (Horner's rule, one mul_g per slot)."""
    return ((words & 0x7F7F7F7F) << 1) ^ (((words >> 7) & 0x01010101) * 0x1D)
