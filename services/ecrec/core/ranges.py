"""Decoding a contiguous range of a lost shard's rows at once, without I/O: the rebuild's lock groups
(docs/protocol.md, "Recovery").

A replacement rebuilds its rows lock group by lock group, each a range [lo, hi) of local rows. With one
parity record per stripe (r = 1) the placement makes that range's stripes regular: in block b the lost row
at slot i decodes from parity index b on server (src − i + k) mod N and from local row b·k + m of server
(src − i + m) mod N for each other slot m. So every read is a contiguous range — each surviving server's
data rows over the range's blocks, and each parity server's records over the same blocks — and the decode
is k strided passes over whole blocks, with no per-row index arithmetic, gathers or scatters (which is
what the general `StripeDecode` spends its time on for a lock group). Ranges whose reads a server cannot
answer (another failure) and r = 2 take `StripeDecode`.

Rows whose members' versions differ from what their parity record reflects (a commit between the reads;
under deltaLog a member ahead by an undelivered delta) come out not `consistent`: the caller decodes those
few with `StripeDecode`, which reads them again or as of the parity's versions.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from ecrec.core.codes import Code
from ecrec.core.placement import Placement
from ecrec.core.stripes import Read, ReadResult, SecondFailure


class RangeDecode:
    """Decode rows [lo, hi) of shard `src` (r = 1). `reads`: one parity read per data slot (k of them, in
    slot order), then one data read per surviving server holding members; `wait_src` is passed to the parity
    reads as `StripeDecode` does. Use `RangeDecode.plan`, which says None where the range does not fit."""

    def __init__(self, p: Placement, src: int, lo: int, hi: int, wait_src: int = -1):
        self.p, self.src, self.lo, self.hi = p, src, lo, hi
        k, n = p.k, p.num_servers
        self.b0, self.b1 = lo // k, -(-hi // k)
        blocks = torch.arange(self.b0, self.b1, dtype=torch.int64)
        self.parity_servers = [(src - i + k) % n for i in range(k)]
        self.reads: list[Read] = [Read(s, "parity", blocks, wait_src) for s in self.parity_servers]
        # Every server but src holds members of some slot's stripes (src − i + m covers all of them once N is
        # at most 2k − 1; with more servers some hold none and are not read).
        holders = sorted({(src - i + m) % n for i in range(k) for m in range(k) if m != i})
        self._data_at: dict[int, int] = {}
        for s in holders:
            end = min(self.b1 * k, p.rows_on(s))
            if end > self.b0 * k:
                self._data_at[s] = len(self.reads)
                self.reads.append(Read(s, "data", torch.arange(self.b0 * k, end, dtype=torch.int64)))

    @classmethod
    def plan(
        cls, p: Placement, src: int, lo: int, hi: int, wait_src: int = -1, down: Collection[int] = ()
    ) -> RangeDecode | None:
        """The range decode, or None where it does not apply: r ≠ 1, an empty range, or a read that would go
        to a server in `down`."""
        if p.r != 1 or hi <= lo:
            return None
        plan = cls(p, src, lo, hi, wait_src)
        if any(r.server in down for r in plan.reads):
            return None
        return plan

    def decode(
        self, code: Code, width: int, results: list[ReadResult]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(records [hi − lo, W], versions, consistent) from the answers to `reads`, in order."""
        p, k, src = self.p, self.p.k, self.src
        nb = self.b1 - self.b0
        out = torch.empty(nb, k, width)
        vers = torch.empty(nb, k, dtype=torch.int64)
        consistent = torch.empty(nb, k, dtype=torch.bool)
        members = torch.empty(k, nb, width)
        for read, parity in zip(self.reads[:k], results[:k], strict=True):
            if parity.ready is not None and not bool(parity.ready.all()):
                raise SecondFailure(f"parity records on shard {read.server} not rebuilt", read.server)
        for i in range(k):
            parity = results[i]
            pver = parity.versions.view(nb, k)
            mvers = pver.clone()  # padding members agree by construction, and so does the lost row
            members[i].zero_()
            for m in range(k):
                if m == i:
                    continue
                s = (src - i + m) % p.num_servers
                at = self._data_at.get(s)
                if at is None:  # the server's rows end before this range's blocks: all padding
                    members[m].zero_()
                    continue
                res = results[at]
                recs, mv = res.records[m::k], res.versions[m::k]  # rows b·k + m, while they exist
                n = recs.shape[0]
                members[m, :n] = recs
                members[m, n:].zero_()
                mvers[:n, m] = mv
            out[:, i] = code.decode(parity.records, members)
            vers[:, i] = pver[:, i]
            consistent[:, i] = (mvers == pver).all(dim=1)
        a, b = self.lo - self.b0 * k, self.hi - self.b0 * k
        return (
            out.view(nb * k, width)[a:b],
            vers.view(-1)[a:b],
            consistent.view(-1)[a:b],
        )


def members_by_slot(p: Placement, parity_server: int, j: int, tables: list[torch.Tensor]) -> torch.Tensor:
    """The members of every stripe whose parity j `parity_server` holds, from whole tables of every server
    (`tables[s]`: [rows_on(s), ...] records or versions): [k, blocks, ...], padding zero. Slot i of block b is
    row b·k + i of server (first + i) mod N — a strided view of that server's table, so this is k copies
    with no index arithmetic (the parity check of a whole model)."""
    blocks = p.parity_rows_on(parity_server)
    first = (parity_server - p.k - j) % p.num_servers
    like = tables[0]
    out = torch.zeros(p.k, blocks, *like.shape[1:], dtype=like.dtype)
    for i in range(p.k):
        column = tables[(first + i) % p.num_servers][i :: p.k]
        out[i, : column.shape[0]] = column
    return out
