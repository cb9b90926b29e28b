"""Reading stripes, without I/O: which records a decode or a parity re-encode needs from which server, and
what those records give once read (docs/protocol.md, "Degraded mode" and "Recovery").

A lost row is decoded from its stripe: the parity record, the versions it reflects for each member (`pver`),
and the k−1 other members' records with their versions. The reads go to several servers at once, while
commits go on, so the cut they give need not be consistent: a stripe decodes only where every member's
version equals the one its parity record reflects; the others are read again (`StripeDecode.rest`). Under
commit: deltaLog a member is ahead of its parity record for a delivery round after every update, so hot
stripes are seldom consistent at first read; `catch_up` then asks those members for their records as of the
version the parity reflects (their delta log can undo the newer updates), one round instead of many.
Re-encoding a parity record reads its members, each with its version (`StripeEncode`).

The caller (ShardStore) sends the `reads` — all at once: the parity and the members do not depend on each
other — and hands the answers back in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ecrec.core.codes import Code
from ecrec.core.placement import Placement


@dataclass
class ReadResult:
    """Records read from one server, with their versions (`pver` rows for parity records) and, for parity
    records, whether each is rebuilt (`ready`)."""

    records: torch.Tensor
    versions: torch.Tensor
    ready: torch.Tensor | None = None


@dataclass(frozen=True)
class Read:
    """One batched read: `kind` ("data" or "parity") records `index` of `server`. `src` >= 0 asks the server
    to wait for shard src's updates in flight on them first (ShardStore.read_rows says when). `as_of` (data
    only): the records as they were at these versions; a row the server cannot roll back answers version -1."""

    server: int
    kind: str
    index: torch.Tensor
    src: int = -1
    as_of: torch.Tensor | None = None


class SecondFailure(Exception):
    """A parity record this decode needs is not rebuilt: its server is a replacement too."""


def members_of(p: Placement, pserver: torch.Tensor, pindex: torch.Tensor):
    """placement.stripe_members for stripes whose parity records sit on different servers: (shards, local
    rows, present), each [n, k]."""
    n = pindex.numel()
    shards = torch.empty(n, p.k, dtype=torch.int64)
    locs = torch.empty(n, p.k, dtype=torch.int64)
    present = torch.empty(n, p.k, dtype=torch.bool)
    for server in pserver.unique().tolist():
        pos = (pserver == server).nonzero().squeeze(1)
        s, loc, pr = p.stripe_members(server, pindex[pos])
        shards[pos], locs[pos], present[pos] = s, loc, pr
    return shards, locs, present


def _member_reads(shards, locs, want, src: int) -> tuple[list[Read], list[tuple[torch.Tensor, torch.Tensor]]]:
    """One data read per server for the members marked in `want` [n, k]; with (row, slot) of each."""
    reads, where = [], []
    for server in shards[want].unique().tolist():
        ri, sj = (want & (shards == server)).nonzero(as_tuple=True)
        reads.append(Read(server, "data", locs[ri, sj], src))
        where.append((ri, sj))
    return reads, where


class StripeDecode:
    """Decode failed (or rebuilt) shard `src`'s local rows `local` from their stripes. `wait_src`: passed
    to the parity reads (the replacement rebuilding its own rows waits for src's updates in flight; an acting
    home reads committed state)."""

    def __init__(self, p: Placement, src: int, local: torch.Tensor, wait_src: int = -1):
        self.p, self.src, self.local, self.wait_src = p, src, local, wait_src
        self.pserver, self.pindex = p.parity_of(src, local)
        self.slot = p.stripe_of(src, local)[1]
        n = local.numel()
        self.reads: list[Read] = []
        self._parity: list[torch.Tensor] = []  # positions of each parity read
        for server in self.pserver.unique().tolist():
            pos = (self.pserver == server).nonzero().squeeze(1)
            self.reads.append(Read(server, "parity", self.pindex[pos], wait_src))
            self._parity.append(pos)
        self._shards, self._locs, present = members_of(p, self.pserver, self.pindex)
        want = present.clone()
        want[torch.arange(n), self.slot] = False  # the row being decoded
        member_reads, self._members = _member_reads(self._shards, self._locs, want, -1)
        self.reads += member_reads

    def decode(
        self, code: Code, width: int, results: list[ReadResult]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(records, versions, consistent) of the rows from the answers to `reads`, in order; records and
        versions are meaningful where `consistent`. SecondFailure if a parity record is not rebuilt."""
        p, n = self.p, self.local.numel()
        self._par = torch.empty(n, width)
        self._pver = torch.empty(n, max(p.k, 1), dtype=torch.int64)
        for pos, res in zip(self._parity, results[: len(self._parity)], strict=True):
            if res.ready is not None and not bool(res.ready.all()):
                raise SecondFailure("parity record not rebuilt: a second failure in the stripe")
            self._par[pos], self._pver[pos] = res.records, res.versions
        self._records = torch.zeros(p.k, n, width)
        self._mvers = self._pver.clone()  # absent members (padding) and the decoded row agree by construction
        for (ri, sj), res in zip(self._members, results[len(self._parity) :], strict=True):
            self._records[sj, ri] = res.records
            self._mvers[ri, sj] = res.versions
        return self._decoded(code)

    def _decoded(self, code: Code) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        consistent = (self._mvers == self._pver).all(dim=1)
        rows = torch.arange(self.local.numel())
        self._records[self.slot, rows] = 0.0
        return code.decode(self._par, self._records), self._pver[rows, self.slot], consistent

    def catch_up(self) -> list[Read]:
        """After `decode`: for the stripes whose members were only ahead of their parity record (none
        behind), reads of those members as of the versions the parity reflects, one per server."""
        ahead = self._mvers > self._pver
        fixable = ahead.any(dim=1) & (self._mvers >= self._pver).all(dim=1)
        want = ahead & fixable.view(-1, 1)
        reads, self._caught = _member_reads(self._shards, self._locs, want, -1)
        return [
            Read(r.server, r.kind, r.index, as_of=self._pver[ri, sj])
            for r, (ri, sj) in zip(reads, self._caught, strict=True)
        ]

    def decode_caught_up(
        self, code: Code, results: list[ReadResult]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`decode` again with the answers to `catch_up`'s reads in place of the members read first."""
        for (ri, sj), res in zip(self._caught, results, strict=True):
            self._records[sj, ri] = res.records
            self._mvers[ri, sj] = res.versions
        return self._decoded(code)

    def rest(self, consistent: torch.Tensor) -> StripeDecode:
        """The decode of the rows whose stripes were not consistent, to be read again."""
        return StripeDecode(self.p, self.src, self.local[~consistent], self.wait_src)


class StripeEncode:
    """Re-encode parity records `index` of server `shard` from their members' records. The member reads ask
    their servers to wait until no transaction has the rows staged (a delta staged at the dead parity server
    died with it)."""

    def __init__(self, p: Placement, shard: int, index: torch.Tensor):
        self.p, self.index = p, index
        shards, locs, present = p.stripe_members(shard, index)
        self.reads, self._members = _member_reads(shards, locs, present, shard)

    def encode(self, code: Code, width: int, results: list[ReadResult]) -> tuple[torch.Tensor, torch.Tensor]:
        """(parity records, pver) from the answers to `reads`, in order."""
        n = self.index.numel()
        members = torch.zeros(self.p.k, n, width)
        vers = torch.zeros(n, self.p.k, dtype=torch.int64)
        for (ri, sj), res in zip(self._members, results, strict=True):
            members[sj, ri] = res.records
            vers[ri, sj] = res.versions
        return code.encode(members), vers
