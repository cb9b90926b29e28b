"""Reading stripes, without I/O: which records a decode or a parity re-encode needs from which server, and
what those records give once read (docs/protocol.md, "Degraded mode" and "Recovery").

A lost row is decoded from its stripe: a parity record, the versions it reflects for each member (`pver`),
and the k−1 other members' records with their versions. The reads go to several servers at once, while
commits go on, so the cut they give need not be consistent: a stripe decodes only where every member's
version equals the one its parity record reflects; the others are read again (`StripeDecode.rest`). Under
commit: deltaLog a member is ahead of its parity record for a delivery round after every update, so hot
stripes are seldom consistent at first read; `catch_up` then asks those members for their records as of the
version the parity reflects (their delta log can undo the newer updates), one round instead of many.
Re-encoding a parity record reads its members, each with its version (`StripeEncode`).

With r = 2 parity records per stripe (P, Q: ecrec.core.raid6) a stripe survives any two of its records lost.
A decode is told which other servers cannot be read (`failed`) and reads, per stripe, as many parity records
as it lost data records, the first readable ones in slot order: P alone while only the decoded row is lost
(as with r = 1), Q where P's server is down, P and Q where a second member is down. Two parity records read
must reflect the same versions, the lost members' slots included (both lost rows come out at them).

The caller (ShardStore) sends the `reads` — all at once: the parity and the members do not depend on each
other — and hands the answers back in the same order.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from ecrec.core.codes import Code, XorCode
from ecrec.core.placement import Placement
from ecrec.core.raid6 import PQCode


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
    only): the records as they were at these versions; a row the server cannot roll back answers version -1.
    `j` (parity only): each record's parity slot (0: P, 1: Q), None where all are P, as with r = 1."""

    server: int
    kind: str
    index: torch.Tensor
    src: int = -1
    as_of: torch.Tensor | None = None
    j: torch.Tensor | None = None


class SecondFailure(Exception):
    """A parity record this decode needs is not rebuilt: its server (`server`) is a replacement too."""

    def __init__(self, message: str, server: int = -1) -> None:
        super().__init__(message)
        self.server = server


class StripesLost(Exception):
    """More than r of a stripe's records sit on servers that cannot be read: no decode brings its rows back.
    `shards`: the servers holding them, the decoded shard among them; `stripes`: how many stripes."""

    def __init__(self, src: int, shards: tuple[int, ...], stripes: int, r: int) -> None:
        self.shards, self.stripes = shards, stripes
        names = ", ".join(map(str, shards))
        super().__init__(
            f"{stripes} stripes of shard {src}'s rows lost more than r = {r} of their records: shards {names}"
        )


AnyCode = Code | PQCode
_XOR = XorCode()


def _check_code(code: AnyCode, p: Placement) -> None:
    if isinstance(code, PQCode) != (p.r == 2) or (isinstance(code, PQCode) and code.k != p.k):
        raise ValueError(f"code {code.name!r} does not fit stripes of k = {p.k}, r = {p.r} (codes.make_code)")


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


def other_member_lost(p: Placement, src: int, local: torch.Tensor, down: Collection[int]) -> torch.Tensor:
    """Rows of shard src whose stripe has another real member on a `down` server: with r = 2 such a row
    decodes only from P and Q together, and its two parity records cannot be told apart (ecrec.core.cuts)."""
    pserver, pindex = p.parity_of(src, local)
    shards, _locs, present = members_of(p, pserver, pindex)
    others = present.clone()
    others[torch.arange(local.numel()), p.stripe_of(src, local)[1]] = False
    lost = torch.zeros(p.num_servers, dtype=torch.bool)
    lost[sorted(set(down) - {src})] = True
    return (others & lost[shards]).any(dim=1)


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
    home reads committed state). `failed`: the other servers no read may go to (failed, or replacements whose
    records are not rebuilt); `lost_members`: servers whose data rows are decoded around though their parity
    records may be read (r = 2: replacements being rebuilt); StripesLost if that leaves a stripe more than r
    records short.

    Only src's rows come back, also where a second lost member is decoded on the way: that member's rows are
    its own server's to decode (its replacement or acting home), under that server's row locks."""

    def __init__(
        self,
        p: Placement,
        src: int,
        local: torch.Tensor,
        wait_src: int = -1,
        failed: Collection[int] = (),
        lost_members: Collection[int] = (),
    ):
        self.p, self.src, self.local, self.wait_src = p, src, local, wait_src
        self.failed = frozenset(int(s) for s in failed) - {src}
        self.lost_members = frozenset(int(s) for s in lost_members) - {src}
        n, k = local.numel(), p.k
        rows = torch.arange(n)
        pservers = torch.stack([p.parity_of(src, local, j)[0] for j in range(p.r)], dim=1)  # [n, r]
        self.pserver, self.pindex = pservers[:, 0], p.parity_of(src, local)[1]
        self.slot = p.stripe_of(src, local)[1]
        self._shards, self._locs, self._present = members_of(p, self.pserver, self.pindex)
        down = torch.zeros(p.num_servers, dtype=torch.bool)
        down[sorted(self.failed)] = True
        members_down = down.clone()
        members_down[sorted(self.lost_members)] = True
        others = self._present.clone()
        others[rows, self.slot] = False  # the row being decoded
        lost = others & members_down[self._shards]  # other members that cannot be read [n, k]
        parity_down = down[pservers]
        self._refuse_overrun(lost, parity_down, pservers)
        # As many parity records as data records lost, the first readable ones in slot order: P alone unless
        # P's server is down or a second member is lost.
        readable = ~parity_down
        self._want = readable & (readable.cumsum(dim=1) <= 1 + lost.sum(dim=1, keepdim=True))
        self._p_alone = bool(self._want[:, 0].all()) and int(self._want.sum()) == n  # as with r = 1
        # PQCode.decode's `lost` (r = 2): src's slot, then the other member lost, else the parity not read.
        if p.r == 2:
            unread = k + (~self._want).to(torch.int64).argmax(dim=1)
            other = torch.where(lost.any(dim=1), lost.to(torch.int64).argmax(dim=1), unread)
            self._lost = torch.stack([self.slot, other], dim=1)
        self.reads: list[Read] = []
        self._parity: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, parity slots) of each parity read
        for server in pservers[self._want].unique().tolist():
            ri, jj = (self._want & (pservers == server)).nonzero(as_tuple=True)
            self.reads.append(
                Read(server, "parity", self.pindex[ri], wait_src, j=jj if bool(jj.any()) else None)
            )
            self._parity.append((ri, jj))
        member_reads, self._members = _member_reads(self._shards, self._locs, others & ~lost, -1)
        self.reads += member_reads

    def _refuse_overrun(self, lost: torch.Tensor, parity_down: torch.Tensor, pservers: torch.Tensor) -> None:
        over = 1 + lost.sum(dim=1) + parity_down.sum(dim=1) > self.p.r
        if not bool(over.any()):
            return
        shards = {
            self.src,
            *self._shards[over][lost[over]].tolist(),
            *pservers[over][parity_down[over]].tolist(),
        }
        stripes = self.p.stripe_of(self.src, self.local[over])[0].unique().numel()
        raise StripesLost(self.src, tuple(sorted(shards)), stripes, self.p.r)

    def decode(
        self, code: AnyCode, width: int, results: list[ReadResult]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(records, versions, consistent) of the rows from the answers to `reads`, in order; records and
        versions are meaningful where `consistent`. SecondFailure if a parity record is not rebuilt."""
        _check_code(code, self.p)
        p, n = self.p, self.local.numel()
        self._records = torch.zeros(p.k + p.r, n, width)  # data slots, then parity j at k + j
        pvers = torch.zeros(p.r, n, p.k, dtype=torch.int64)
        parity = len(self._parity)
        for read, (ri, jj), res in zip(self.reads[:parity], self._parity, results[:parity], strict=True):
            if res.ready is not None and not bool(res.ready.all()):
                raise SecondFailure(
                    f"parity record on shard {read.server} not rebuilt: a second failure", read.server
                )
            j = jj if read.j is not None else 0  # all P: plain row indexing, the cheaper copy
            self._records[p.k + j, ri] = res.records
            pvers[j, ri] = res.versions
        self._pvers = pvers
        self._pver, self._agree = pvers[0], torch.ones(n, dtype=torch.bool)
        if not self._p_alone:
            self._pver = pvers[self._want.to(torch.int64).argmax(dim=1), torch.arange(n)]  # the first read
            # Two parity records read must reflect the same versions on every slot, the lost members'
            # included: each gives the lost rows at its own versions.
            differ = self._want.T.unsqueeze(2) & self._present & (pvers != self._pver)
            self._agree = ~differ.any(dim=2).any(dim=0)
        self._mvers = self._pver.clone()  # absent members (padding) and the lost rows agree by construction
        for (ri, sj), res in zip(self._members, results[parity:], strict=True):
            self._records[sj, ri] = res.records
            self._mvers[ri, sj] = res.versions
        return self._decoded(code)

    def _decoded(self, code: AnyCode) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        consistent = (self._mvers == self._pver).all(dim=1) & self._agree
        rows = torch.arange(self.local.numel())
        if not self._p_alone:
            records = code.decode(self._records, self._lost)[0]
        else:  # P is the xor code's parity: with one record lost per stripe, the r = 1 decode (no Q arithmetic)
            k = self.p.k
            self._records[self.slot, rows] = 0.0
            records = (_XOR if isinstance(code, PQCode) else code).decode(self._records[k], self._records[:k])
        return records, self._pver[rows, self.slot], consistent

    def parity_behind(self) -> list[Read]:
        """After `decode` (r = 2): where the two parity records read are apart on a member that cannot be
        read, reads of the one behind as of the other's versions — it refused the member's delta the other
        took before its server learned of the failure, and catches up from the deltas it kept
        (ecrec.core.cuts). [] where none is apart."""
        if self._p_alone or bool(self._agree.all()):
            return []
        down = torch.zeros(self.p.num_servers, dtype=torch.bool)
        down[sorted(self.failed | self.lost_members | {self.src})] = True
        lost = self._present & down[self._shards]  # [n, k]
        target = torch.where(lost, self._pvers.amax(dim=0), 0)
        out = []
        for read, (ri, jj) in zip(self.reads, self._parity, strict=False):
            j = jj if read.j is not None else torch.zeros_like(ri)
            behind = (self._pvers[j, ri] < target[ri]).any(dim=1)
            if bool(behind.any()):
                out.append(
                    Read(
                        read.server,
                        "parity",
                        read.index[behind],
                        as_of=target[ri][behind],
                        j=None if read.j is None else read.j[behind],
                    )
                )
        return out

    def catch_up(self) -> list[Read]:
        """After `decode`: for the stripes whose members were only ahead of their parity records (none
        behind, and the parity records read agreeing), reads of those members as of the versions the parity
        reflects, one per server."""
        ahead = self._mvers > self._pver
        fixable = ahead.any(dim=1) & (self._mvers >= self._pver).all(dim=1) & self._agree
        want = ahead & fixable.view(-1, 1)
        reads, self._caught = _member_reads(self._shards, self._locs, want, -1)
        return [
            Read(r.server, r.kind, r.index, as_of=self._pver[ri, sj])
            for r, (ri, sj) in zip(reads, self._caught, strict=True)
        ]

    def decode_caught_up(
        self, code: AnyCode, results: list[ReadResult]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`decode` again with the answers to `catch_up`'s reads in place of the members read first."""
        for (ri, sj), res in zip(self._caught, results, strict=True):
            self._records[sj, ri] = res.records
            self._mvers[ri, sj] = res.versions
        return self._decoded(code)

    def rest(self, consistent: torch.Tensor) -> StripeDecode:
        """The decode of the rows whose stripes were not consistent, to be read again."""
        return StripeDecode(
            self.p, self.src, self.local[~consistent], self.wait_src, self.failed, self.lost_members
        )


class StripeEncode:
    """Re-encode parity records `index` of parity slot `j` (0: P, 1: Q) of server `shard` from their members'
    records. The member reads ask their servers to wait until no transaction has the rows staged (a delta
    staged at the dead parity server died with it). Two parity servers rebuilt at once read members only, so
    neither needs the other."""

    def __init__(self, p: Placement, shard: int, index: torch.Tensor, j: int = 0):
        if not 0 <= j < p.r:
            raise ValueError(f"parity slot j={j} with r = {p.r}")
        self.p, self.index, self.j = p, index, j
        shards, locs, present = p.stripe_members(shard, index, j)
        self.reads, self._members = _member_reads(shards, locs, present, shard)

    def encode(
        self, code: AnyCode, width: int, results: list[ReadResult]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(parity records, pver) from the answers to `reads`, in order."""
        _check_code(code, self.p)
        n = self.index.numel()
        members = torch.zeros(self.p.k, n, width)
        vers = torch.zeros(n, self.p.k, dtype=torch.int64)
        for (ri, sj), res in zip(self._members, results, strict=True):
            members[sj, ri] = res.records
            vers[ri, sj] = res.versions
        return (code.encode(members, self.j) if isinstance(code, PQCode) else code.encode(members)), vers
