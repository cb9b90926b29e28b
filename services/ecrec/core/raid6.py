"""The P + Q code: r = 2 parity records per stripe, any two of its k + 2 records lost come back (issue #30).

A stripe's records are its k data records D_0 .. D_{k-1} (padding slots: all-zero records), then P at position
k and Q at k + 1, the order of placement's data slots and parity slots j = 0, 1. Per byte, over GF(2^8)
(ecrec.core.gf256, the field of Linux raid6 and ISA-L):

    P = D_0 ⊕ D_1 ⊕ ... ⊕ D_{k-1}          Q = g^0·D_0 ⊕ g^1·D_1 ⊕ ... ⊕ g^{k-1}·D_{k-1}

Bit-exact whatever the float bits are (NaN payloads, -0.0, subnormals): records are only ever handled as their
bytes (int32 words for xor and mul_g, uint8 for table gathers), never in float arithmetic. Both parities are
linear, so a change of D_i reaches parity j as a delta that the parity server xors in: ΔP = old ⊕ new,
ΔQ = g^i·(old ⊕ new). Xor commutes, so deltas may arrive in any order. Zero records encode to zero, so padding
costs nothing. Needs k <= 255, so that the coefficients g^i are distinct.

Pure tensor functions: no I/O, and they run on the device their inputs live on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ecrec.core import gf256

# P is XorCode's parity, computed here on the words rather than through XorCode: codes.make_code builds this
# code, and importing codes here would close a cycle.


def _words(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _ones(keep: torch.Tensor) -> torch.Tensor:
    """Bool [..., n] as int32 and-masks [..., n, 1]: all bits set where True, zero where False."""
    return keep.to(torch.int32).neg().unsqueeze(-1)


def _xor_words(data: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(data.shape[1:], dtype=torch.int32, device=data.device)
    for d in data:  # m is small (k): the loop is over stripe slots, each step vectorized over rows
        out ^= d
    return out


def _horner(data: torch.Tensor) -> torch.Tensor:
    """Σ g^i·data[i] over int32 words [m, ...] (m >= 1): (((D_{m-1})·g ⊕ D_{m-2})·g ⊕ ...)·g ⊕ D_0."""
    q = data[-1].clone()
    for i in range(data.shape[0] - 2, -1, -1):  # m is small (k): each step is vectorized over rows
        q = gf256.mul_g(q) ^ data[i]
    return q


class PQCode:
    """RAID-6 P + Q over stripes of k data records; positions 0 .. k-1 are data, k is P, k + 1 is Q."""

    name = "pq"
    exact = True
    r = 2

    def __init__(self, k: int) -> None:
        if not 1 <= k <= gf256.ORDER:
            raise ValueError(f"the P + Q code needs 1 <= k <= {gf256.ORDER}, got k={k}")
        self.k = k

    # -- parity and deltas ------------------------------------------------------------------------------
    def encode(self, members: torch.Tensor, j: int) -> torch.Tensor:
        """Parity j (0: P, 1: Q) [n, W] of members [m, n, W] at slots 0 .. m-1; slots m .. k-1 are padding."""
        m = members.shape[0]
        if m > self.k or j not in (0, 1):
            raise ValueError(f"encode: {m} members for k={self.k}, parity j={j} (0: P, 1: Q)")
        if m == 0:
            return torch.zeros(members.shape[1:], dtype=torch.float32, device=members.device)
        if j == 0:
            return _xor_words(_words(members)).view(torch.float32)
        return _horner(_words(members)).view(torch.float32)

    def delta(
        self, old: torch.Tensor, new: torch.Tensor, slot: int | torch.Tensor = 0, j: int = 0
    ) -> torch.Tensor:
        """What the data server holding rows `old` -> `new` [n, W] sends parity server j. `slot` is the rows'
        data slot: one int for all, or an integer tensor [n] of slots < k (a server's rows sit at different
        slots; not range-checked, which would cost a device sync). With j = 0 (the default) the delta is
        P's, the same as the xor code's, and `for_parity` turns it into Q's."""
        return self.for_parity((_words(old) ^ _words(new)).view(torch.float32), slot, j)

    def for_parity(self, d: torch.Tensor, slot: int | torch.Tensor, j: int) -> torch.Tensor:
        """P's delta `d` [n, W] (new xor old) as parity j's: itself for P, g^slot · d for Q."""
        if j == 0:
            return d
        if j != 1:
            raise ValueError(f"delta: parity j={j} (0: P, 1: Q)")
        if not isinstance(slot, torch.Tensor):
            slot = int(slot)
            if not 0 <= slot < self.k:
                raise ValueError(f"delta: slot {slot} outside 0 .. {self.k - 1}")
            return gf256.mul(_bytes(d), gf256.gpow(slot)).view(torch.float32)
        coeff = gf256.tables(d.device)["exp"][slot.to(d.device, torch.int64)]
        return gf256.mul_rows(_bytes(d), coeff).view(torch.float32)

    def apply_delta(self, parity: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The new parity (P or Q: both take deltas by xor); inputs are not mutated."""
        return (_words(parity) ^ _words(delta)).view(torch.float32)

    def apply_delta_(self, parity_table: torch.Tensor, index: torch.Tensor, delta: torch.Tensor) -> None:
        """parity_table[index] ^= delta in place, as bits; `index` must be unique (XorCode.apply_delta_)."""
        # Gather and scatter on the int32 view so NaN payloads are moved as bits, never as floats.
        words = parity_table.view(torch.int32)
        words.index_copy_(0, index, words.index_select(0, index) ^ _words(delta))

    # -- decode -----------------------------------------------------------------------------------------
    def decode(self, records: torch.Tensor, lost: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The lost records [L, n, W] of stripes records [k + 2, n, W] (data, then P, then Q).

        `lost` names L = 1 or 2 distinct positions in 0 .. k+1, either for all rows (a sequence of ints) or per
        row (an integer tensor [n, L]); what `records` holds at a row's lost positions is masked off unused.
        """
        k, n = self.k, records.shape[1]
        if records.dim() != 3 or records.shape[0] != k + 2:
            raise ValueError(f"decode: records {tuple(records.shape)}, expected [k + 2 = {k + 2}, n, W]")
        lost_t = self._lost(lost, n, records.device)
        gone = torch.zeros(n, k + 2, dtype=torch.bool, device=records.device)
        gone.scatter_(1, lost_t, True)
        known = _words(records) & _ones(~gone.T)  # and-masks: several times faster than masked_fill on CPU

        # Syndromes: with the lost records zeroed, data ⊕ P leaves the xor of the lost data (P known), and
        # Horner over the data ⊕ Q leaves Σ g^i·D_i over the lost data (Q known).
        data_xor, horner = _xor_words(known[:k]), _horner(known[:k])
        sp, sq = data_xor ^ known[k], horner ^ known[k + 1]
        x, y, has_y, a, b = self._solve(lost_t)

        # D_x = a·Sp ⊕ b·Sq (a, b per row; both 0 where no data is lost), D_y = Sp ⊕ D_x where it exists.
        dx = (gf256.mul_rows(_bytes(sp), a) ^ gf256.mul_rows(_bytes(sq), b)).view(torch.int32)
        dy = (sp ^ dx) & _ones(has_y)
        # A row that lost a parity lost at most one data record (D_x): re-encode the parity with it.
        parity = {}
        if bool((lost_t == k).any()):
            parity[k] = data_xor ^ dx
        if bool((lost_t == k + 1).any()):
            parity[k + 1] = horner ^ self._scaled(dx, x)
        out = []
        for col in lost_t.T:  # L <= 2 columns [n]
            rec = (dx & _ones(col == x)) | (dy & _ones(col == y))
            for pos, words in parity.items():
                rec |= words & _ones(col == pos)
            out.append(rec)
        return torch.stack(out).view(torch.float32)

    def _lost(self, lost: Sequence[int] | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
        """`lost` as an int64 tensor [n, L], checked: L in 1..2, positions in range and distinct per row."""
        if isinstance(lost, torch.Tensor):
            t = lost.to(device, torch.int64)
        else:
            t = torch.tensor(list(lost), dtype=torch.int64, device=device).view(1, -1).expand(n, -1)
        if t.dim() != 2 or t.shape[0] != n or not 1 <= t.shape[1] <= 2:
            raise ValueError(f"decode: lost must name 1 or 2 positions per row, got shape {tuple(t.shape)}")
        bad = (t < 0) | (t > self.k + 1)
        if t.shape[1] == 2:
            bad |= (t[:, 0] == t[:, 1]).view(-1, 1)
        if bool(bad.any()):
            raise ValueError(f"decode: lost positions must be distinct, in 0 .. {self.k + 1}")
        return t

    def _solve(self, lost: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per row: the lost data positions x < y (k + 2 where there is none), whether y exists, and the
        coefficients a, b with D_x = a·Sp ⊕ b·Sq. Two data lost (Anvin §4): with d = y - x,
        D_x = (g^d·Sp ⊕ g^-x·Sq) / (g^d ⊕ 1), and g^d ≠ 1 as 0 < d < 255. Data and P lost: D_x = g^-x·Sq.
        Data alone, or data and Q: D_x = Sp. No data lost: a = b = 0."""
        k, t = self.k, gf256.tables(lost.device)
        exp, mul, inv = t["exp"].long(), t["mul"], t["inv"]
        lo, hi = lost.min(dim=1).values, lost.max(dim=1).values
        has_x, has_y = lo < k, (hi < k) & (hi != lo)
        x, y = torch.where(has_x, lo, k + 2), torch.where(has_y, hi, k + 2)
        p_lost = (lost == k).any(dim=1)
        gx_inv = exp[torch.remainder(-lo, gf256.ORDER)]  # g^-x
        gd = exp[torch.remainder(hi - lo, gf256.ORDER)]
        denom = inv[gd ^ 1].long()  # inv(0) = 0 in rows that are not two-data rows: unused there
        zero, one = torch.zeros_like(gd), torch.ones_like(gd)
        a = torch.where(has_y, mul[gd, denom].long(), torch.where(p_lost, zero, one))
        b = torch.where(has_y, mul[gx_inv, denom].long(), torch.where(p_lost, gx_inv, zero))
        return x, y, has_y, torch.where(has_x, a, 0), torch.where(has_x, b, 0)

    @staticmethod
    def _scaled(words: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """g^slot[r]·words[r] per row (any coefficient where slot is past the data: those rows are zero)."""
        coeff = gf256.tables(words.device)["exp"][torch.remainder(slot, gf256.ORDER)]
        return gf256.mul_rows(_bytes(words), coeff).view(torch.int32)
