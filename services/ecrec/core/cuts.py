"""Where a failed shard's rows stand in their two parity records (r = 2), without I/O (docs/protocol.md,
"Degraded mode").

Each parity record reflects a prefix of the failed data server's updates of a row: it applies them in
version order, and once it knows the server failed it takes none of them any more. The two prefixes can
differ: a delivery that reached one parity server before it learned of the failure and the other after.
The acting home therefore *aligns* a row before its first degraded write: it decodes the row from both
records and brings the shorter prefix up to the longer one — the union of what either applied (a record
never loses an update it has). The other parity server is told the row is aligned, and at which version of
the dead server's (`cut`). A degraded write that repeats an update whose version is within the cut is
already in both records and is skipped; everything else is applied once, by the acting home, which sends
the other record its delta before it commits (`forwards`). Should the acting home die before answering,
the other parity server — now the acting home — knows which of its rows came from it (`via`), and skips
the worker's retry of them.

A row whose stripe lost a second member decodes only from P and Q together: there the two prefixes must be
equal, and a union cannot be decoded from each record alone. So a parity server *keeps* the dead server's
deltas it refuses (or drops while they wait for a predecessor), for the rows it has not aligned: a decode
that finds the other record ahead by them asks it to catch up (`catch_up`) — it applies exactly the deltas
the other record took before its server learned of the failure. Aligning a row (the acting home's, or a
replacement's as it rebuilds the row) fixes its cut: the deltas kept for it are dropped, and none is kept
from then on.

One `Cuts` per server, as parity server of some stripes and acting home of some rows: the caller
(ShardStore) holds the server's lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ecrec.core.txn import DeltaBatch, ParityParticipant, select_rows

VIA_KEPT = 4096  # (step, src) of acting homes' writes remembered: a worker retries within a few passes
# Refused deltas kept for a catch-up: only those in flight when a server failed are refused, a few parts'
REFUSED_KEPT = 1024


@dataclass
class SrcCuts:
    """The aligned rows of one failure (`key`: the failed shard's incarnation) and their cuts."""

    key: object
    aligned: torch.Tensor  # [rows of src] bool
    cut: torch.Tensor  # [rows of src] int64: the dead server's version both records reflect


@dataclass
class Kept:
    """A dead server's delta batch this parity record refused, and the batch's local rows of its shard."""

    batch: DeltaBatch
    rows: torch.Tensor


class Cuts:
    """Aligned rows and their cuts, per failed shard; degraded writes' forwards in flight; rows applied from
    another acting home's forwards. `rows_on(src)`: how many local rows shard src has."""

    def __init__(self, rows_on) -> None:
        self.rows_on = rows_on
        self.by_src: dict[int, SrcCuts] = {}
        self.forwards: dict[str, list[DeltaBatch]] = {}
        # txns whose forward was sent (it may have been applied): committed, never aborted
        self.sent: set[str] = set()
        self.via: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()
        self.kept: list[Kept] = []

    def reset(self) -> None:
        """A checkpoint was loaded: nothing is failed any more, as far as these records know."""
        self.by_src.clear()
        self.forwards.clear()
        self.sent.clear()
        self.via.clear()
        self.kept.clear()

    def _of(self, src: int, key) -> SrcCuts:
        c = self.by_src.get(src)
        if c is None or c.key != key:  # a new failure of src: nothing aligned yet
            n = self.rows_on(src)
            c = SrcCuts(key, torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.int64))
            self.by_src[src] = c
        return c

    def unaligned(self, src: int, key, rows: torch.Tensor) -> torch.Tensor:
        """Which of failed shard src's `rows` are not aligned yet in this failure (`key`; None: unknown, so
        none is known aligned)."""
        if key is None:
            return torch.ones(rows.numel(), dtype=torch.bool)
        return ~self._of(src, key).aligned[rows]

    def align(self, src: int, key, rows: torch.Tensor, cut: torch.Tensor) -> None:
        """`rows` are aligned at the dead server's versions `cut` (by this acting home, or by the one that
        said so in a realign)."""
        if key is not None:
            c = self._of(src, key)
            c.aligned[rows], c.cut[rows] = True, cut
            self._unkeep(src, rows)

    def unalign(self, src: int, rows: torch.Tensor) -> None:
        """This record's cut of the rows moved without the acting home writing them (a dead server's own
        delta committed on its behalf): align them again before the next write."""
        c = self.by_src.get(src)
        if c is not None:
            c.aligned[rows] = False

    def within(self, src: int, key, rows: torch.Tensor, versions: torch.Tensor) -> torch.Tensor:
        """Rows aligned whose update at the dead server took `versions` (0: it never got there) that both
        records reflect already. (Also a replacement's own rows, aligned as it rebuilt them: `key` its own
        incarnation.)"""
        c = self.by_src.get(src)
        if key is None or c is None or c.key != key:
            return torch.zeros(rows.numel(), dtype=torch.bool)
        return c.aligned[rows] & (versions > 0) & (versions <= c.cut[rows])

    def forgotten(self, src: int) -> None:
        """Shard src is no longer failed: its rows have a writer of their own again."""
        self.by_src.pop(src, None)

    # -- an acting home's writes reaching the other parity record --------------------------------------------
    def applied_via(self, step: str, src: int, rows: torch.Tensor) -> None:
        """Rows of failed shard src written in worker step `step` by another acting home reached this record."""
        key = (step, src)
        prev = self.via.pop(key, None)
        self.via[key] = rows if prev is None else torch.cat([prev, rows])
        while len(self.via) > VIA_KEPT:
            self.via.popitem(last=False)

    def came_via(self, step: str, src: int, rows: torch.Tensor) -> torch.Tensor:
        """Which of `rows` of failed shard src a former acting home wrote in worker step `step` here."""
        got = self.via.get((step, src))
        return torch.zeros(rows.numel(), dtype=torch.bool) if got is None else torch.isin(rows, got)

    # -- a record behind the other on a dead server's rows ------------------------------------------------
    def _open(self, src: int, incarnation: int, rows: torch.Tensor) -> torch.Tensor:
        """Which of `rows` of shard src have no cut fixed in the failure of `incarnation` (a newer failure
        fixed them all: its deltas are not that incarnation's)."""
        c = self.by_src.get(src)
        if c is None or c.key < incarnation:
            return torch.ones(rows.numel(), dtype=torch.bool)
        if c.key > incarnation:
            return torch.zeros(rows.numel(), dtype=torch.bool)
        return ~c.aligned[rows]

    def keep(self, b: DeltaBatch, rows: torch.Tensor) -> None:
        """Keep a delta batch of dead shard b.src this record refused, or dropped while it waited for a
        predecessor (`rows`: its local rows of src), for the rows not aligned yet. A batch whose sender did not
        say its incarnation (0) is not kept: it could not be told from a later incarnation's."""
        if b.incarnation == 0:
            return
        open_ = self._open(b.src, b.incarnation, rows)
        if not bool(open_.any()):
            return
        if not bool(open_.all()):
            b, rows = select_rows(b, open_), rows[open_]
        # an older incarnation's deltas of src are never needed once a newer one's are refused
        self.kept = [k for k in self.kept if k.batch.src != b.src or k.batch.incarnation >= b.incarnation]
        self.kept.append(Kept(b, rows))
        del self.kept[:-REFUSED_KEPT]

    def _unkeep(self, src: int, rows: torch.Tensor) -> None:
        """The cut of shard src's `rows` is fixed: none of their kept deltas may apply any more."""
        out = []
        for k in self.kept:
            if k.batch.src == src:
                stay = ~torch.isin(k.rows, rows)
                if not bool(stay.any()):
                    continue
                if not bool(stay.all()):
                    k = Kept(select_rows(k.batch, stay), k.rows[stay])
            out.append(k)
        self.kept = out

    def catch_up(self, parity: ParityParticipant, index: torch.Tensor, target: torch.Tensor, failed) -> int:
        """Bring parity records `index` up to the member versions `target` [n, k] (the other parity
        record's) where kept deltas take them there: each row's next version at a time, so in version order.
        `failed(src)`: the incarnation of shard src whose failure is being decoded (None: src is not failed,
        its deltas are not refused). Returns how many rows were applied."""
        if index.numel() == 0:
            return 0
        k = parity.placement.k
        # the target of each (record, member) asked, sorted by key: sized to the rows asked, not the table
        keys, at = torch.unique((index.view(-1, 1) * k + torch.arange(k)).view(-1), return_inverse=True)
        wants = torch.zeros(keys.numel(), dtype=torch.int64)
        wants.scatter_reduce_(0, at, target.reshape(-1), reduce="amax")

        def want(key: torch.Tensor) -> torch.Tensor:  # 0 (no target) for a key not asked
            pos = torch.searchsorted(keys, key).clamp_(max=keys.numel() - 1)
            return torch.where(keys[pos] == key, wants[pos], 0)

        flat = parity.pver.view(-1)
        applied, progress = 0, True
        while progress:
            progress = False
            for kk in self.kept:
                b = kk.batch
                if failed(b.src) != b.incarnation:
                    continue
                key = parity.key_of(b)
                go = (b.version == flat.index_select(0, key) + 1) & (b.version <= want(key))
                go &= self._open(b.src, b.incarnation, kk.rows)
                if not bool(go.any()):
                    continue
                step = select_rows(b, go)
                step.base = step.version - 1
                n = int((~parity.realign(step)).sum())
                applied += n
                progress |= n > 0
        return applied
