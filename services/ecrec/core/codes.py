"""Linear erasure codes over whole row records (float32 [n, W]), design notes §3.

`xor` works on the int32 bit patterns: bit-exact, and deltas commute, so a parity server may apply them in any
order. Its parity may hold NaN/Inf bit patterns; it is only ever moved and XORed as int32, never used in float
arithmetic. `sum` is the paper's float32 sum code: inexact under rounding; kept to reproduce the paper and to
measure its drift (decoders project what it decodes onto the optimizer's domain: RowOptimizer.project, and
docs/protocol.md, "The sum code"). Zero records encode to zero under both, so padding slots cost nothing.
`make_code` builds a code by name and r: with r = 2 parity records per stripe, ecrec.core.raid6's P + Q (xor only).

Pure tensor functions: no I/O, and they run on whatever device their inputs live on.
"""

from __future__ import annotations

import abc

import torch

from ecrec.core.errors import SUM_HAS_NO_R2
from ecrec.core.raid6 import PQCode


class Code(abc.ABC):
    name: str
    # Whether decode gives back the member's exact bits. An inexact code's decode may leave a record outside
    # what the optimizer could have produced (an accumulator at -1e-10), so decoders project it back.
    exact: bool

    @abc.abstractmethod
    def encode(self, members: torch.Tensor) -> torch.Tensor:
        """[m, n, W] -> parity [n, W]; padding slots are zero records (m = 0 gives zeros)."""

    @abc.abstractmethod
    def delta(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """What a data server sends its parity server after changing a record from `old` to `new`."""

    @abc.abstractmethod
    def apply_delta(self, parity: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The new parity; inputs are not mutated."""

    @abc.abstractmethod
    def decode(self, parity: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
        """The lost record from the parity and the other k-1 members [k-1, n, W] (padding as zeros)."""

    @abc.abstractmethod
    def apply_delta_(self, parity_table: torch.Tensor, index: torch.Tensor, delta: torch.Tensor) -> None:
        """parity_table[index] ∘= delta in place. `index` must be unique: with duplicates, all but one
        delta per row would be lost (callers merge deltas per row first)."""


class XorCode(Code):
    name = "xor"
    exact = True

    @staticmethod
    def _bits(x: torch.Tensor) -> torch.Tensor:
        return x.contiguous().view(torch.int32)

    def _xor_all(self, members: torch.Tensor) -> torch.Tensor:
        # A same-size dtype view needs no contiguous copy: members are often a transposed view of [n, m, W]
        # (start-up's initial parity), and copying them cost more than the xor.
        bits = members.view(torch.int32)
        out = torch.zeros(bits.shape[1:], dtype=torch.int32, device=bits.device)
        for m in bits:  # m is small (k): the loop is over stripe slots, each step vectorized over rows
            out ^= m
        return out

    def encode(self, members: torch.Tensor) -> torch.Tensor:
        return self._xor_all(members).view(torch.float32)

    def delta(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return (self._bits(old) ^ self._bits(new)).view(torch.float32)

    def apply_delta(self, parity: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return (self._bits(parity) ^ self._bits(delta)).view(torch.float32)

    def decode(self, parity: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
        return (self._bits(parity) ^ self._xor_all(others)).view(torch.float32)

    def apply_delta_(self, parity_table: torch.Tensor, index: torch.Tensor, delta: torch.Tensor) -> None:
        # Gather and scatter on the int32 view so NaN payloads are moved as bits, never as floats.
        bits = parity_table.view(torch.int32)
        bits.index_copy_(0, index, bits.index_select(0, index) ^ self._bits(delta))


class SumCode(Code):
    name = "sum"
    exact = False

    def encode(self, members: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(members.shape[1:], dtype=torch.float32, device=members.device)
        for m in members:  # fixed slot order (not a tree reduction): the same rounding on every server
            out = out + m
        return out

    def delta(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return new - old

    def apply_delta(self, parity: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return parity + delta

    def decode(self, parity: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
        return parity - self.encode(others)

    def apply_delta_(self, parity_table: torch.Tensor, index: torch.Tensor, delta: torch.Tensor) -> None:
        parity_table.index_add_(0, index, delta)


CODES: dict[str, type[Code]] = {"xor": XorCode, "sum": SumCode}


def make_code(name: str, r: int = 1, k: int = 0) -> Code | PQCode:
    """The code called `name` ("xor" | "sum") for stripes of k data records and r parity records: r = 1 the
    codes above (k unused), r = 2 the P + Q code (ecrec.core.raid6; xor only)."""
    if name not in CODES:
        raise ValueError(f"unknown code {name!r}; valid: {', '.join(CODES)}")
    if r == 1:
        return CODES[name]()
    if r != 2:
        raise ValueError(f"no code with r = {r} parity records per stripe: r is 1 or 2")
    if name != "xor":
        raise ValueError(SUM_HAS_NO_R2)
    return PQCode(k)
