"""Two parity records per stripe through failures (r = 2; docs/protocol.md, "Degraded mode"): the acting home
aligns a failed shard's rows in both records before its first write of them, skips what both hold already,
and sends the other record each write's delta before the write commits; a replacement aligns the rows it
rebuilds the same way and skips a rewrite within its cut; the other parity server's side of both (`realign`,
`apply_forward`). The state is `ecrec.core.cuts.Cuts`.

Lock discipline as in ecrec.store.state: the acting home calls these with the failed shard's rows locked for
its write (ActingHome) and without the store's lock; each takes the lock for what it changes, and calls
peers without it. The receiving side takes the lock itself and waits for nothing.
"""

from __future__ import annotations

import torch

from ecrec.core.stripes import Read, other_member_lost
from ecrec.core.txn import DeltaBatch
from ecrec.core.update import step_of
from ecrec.store.state import Busy, NotOwner, StoreState
from ecrec.wire import InvalidRequest


class TwoParity(StoreState):
    """Both parity records of a failed shard's rows, at their acting home and at the other parity server."""

    # -- the acting home ------------------------------------------------------------------------------------
    def _failure_key(self, src: int):
        key = getattr(self.peers, "failure_key", None)
        return key(src) if key is not None else None

    def _recovering(self, server: int) -> bool:
        """A replacement whose records are being rebuilt, in this server's map (peers without one: never)."""
        recovering = getattr(self.peers, "is_recovering", None)
        return recovering is not None and recovering(server)

    def _down(self) -> set[int]:
        """Servers whose records no decode can read: failed in this server's map, or replacements that have
        not rebuilt them (their state says recovering)."""
        return {
            s
            for s in range(self.ctx.num_servers)
            if self.peers.is_failed(s) or (s != self.shard and self._recovering(s))
        }

    def _send(self, batches: list[DeltaBatch], what: str) -> None:
        """Deliver an acting home's or a replacement's batches to the other parity servers; Busy, naming
        `what`, unless each took them or is confirmed failed (its records are re-encoded when rebuilt)."""
        for server, err in self.peers.deltas(batches, True, self.epoch).items():
            if err is not None and not self.peers.confirm_failed(server):
                raise Busy(f"{what}: parity server {server} did not take it: {err}")

    def _groups(self, src: int, local: torch.Tensor) -> list[tuple[torch.Tensor, int, tuple | None]]:
        """Failed shard src's rows `local` at this acting home by the parity record it holds of them: as P
        (j = 0) of one stripe slot's rows, and as Q (j = 1) of another slot's rows whose P server is failed
        too. Each group: (positions in `local`, j, (server, j, parity indices) of the rows' other parity
        record where its server is live, else None)."""
        p = self.placement
        js = self._acting_parity(src, local)[1]
        out = []
        for j in js.unique().tolist():
            at = (js == j).nonzero().squeeze(1)
            server, block = p.parity_of(src, local[at], 1 - j)  # one slot per group: one server
            other = (
                None
                if self.peers.is_failed(int(server[0]))
                else (int(server[0]), 1 - j, p.parity_index(1 - j, block))
            )
            out.append((at, j, other))
        return out

    def _ready_at(self, server: int, index: torch.Tensor) -> torch.Tensor:
        """Which of parity records `index` of `server` are rebuilt: all, unless it is a replacement still
        being rebuilt (then asked)."""
        if not self._recovering(server):
            return torch.ones(index.numel(), dtype=torch.bool)
        (res,) = self.peers.read_rows([Read(server, "parity", index)], self.epoch)
        return res.ready.to(torch.bool)

    def _as_parity(self, d: torch.Tensor, slot: torch.Tensor, j: int) -> torch.Tensor:
        """P's delta `d` as parity j's (Q's: g^slot times it)."""
        return self.code.for_parity(d, slot, j) if j else d

    def _align(
        self, txn: str, src: int, local: torch.Tensor, records: torch.Tensor, versions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Align failed shard src's rows in both parity records (core/cuts.py): where the other record holds
        a longer prefix of src's updates, this one takes it, and the other is told the rows are aligned, at
        which version of src's (taking this record's prefix where it is the longer). `records`, `versions`:
        the rows as this record holds them (decoded); returns them as both hold them now."""
        key = self._failure_key(src)
        with self.lock:
            todo = self.cuts.unaligned(src, key, local)
        if not bool(todo.any()):
            return records, versions
        # A stripe that lost another member too decoded from P and Q together, which had to agree: aligned.
        lonely = todo & other_member_lost(self.placement, src, local, self._down())
        if bool(lonely.any()):
            self._align_lonely(txn, src, key, local[lonely], versions[lonely])
            todo &= ~lonely
            if not bool(todo.any()):
                return records, versions
        records, versions = records.clone(), versions.clone()
        pos = todo.nonzero().squeeze(1)
        for at, j, other in self._groups(src, local[pos]):
            at = pos[at]
            records[at], versions[at] = self._align_group(
                txn, src, key, local[at], records[at], versions[at], j, other
            )
        return records, versions

    def _align_lonely(self, txn: str, src: int, key, rows: torch.Tensor, versions: torch.Tensor) -> None:
        """`_align` of rows whose stripe lost another member too: they decoded from P and Q together, which
        agreed, so both records are at the cut already. The other record is told (it drops the deltas of src
        it kept for them: core/cuts.py). If it moved since the read, the rows are decoded again (Busy; the
        decode has the record behind catch up)."""
        slot = self.placement.stripe_of(src, rows)[1]
        for at, _j, other in self._groups(src, rows):
            if other is None:
                continue
            server, _jo, index = other
            zero = torch.zeros(at.numel(), self.ctx.record_width)
            b = DeltaBatch(server, txn, src, index, slot[at], zero, versions[at])
            b.via, b.base = self.shard, versions[at]
            try:
                self._send([b], f"aligning shard {src}'s rows")
            except Busy:
                with self.lock:
                    self.acting.invalidate(src, rows)
                raise
        with self.lock:
            self.cuts.align(src, key, rows, versions)

    def _align_group(
        self, txn: str, src: int, key, rows: torch.Tensor, mine: torch.Tensor, mv: torch.Tensor, j: int, other
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_align` of rows whose parity record here is j, the other one `other` (None: failed)."""
        slot = self.placement.stripe_of(src, rows)[1]
        cut, union = mv, mine
        if other is not None:
            server, jo, index = other
            # (a record the other server, a replacement, has not rebuilt is encoded from the members when
            # it is: nothing to align there; the realign below leaves it alone)
            ready = self._ready_at(server, index)
            theirs, tv = mine.clone(), mv.clone()
            if bool(ready.any()):
                theirs[ready], tv[ready] = self.decode_rows(src, rows[ready], unread=self.shard)
            union, cut = _union(mine, mv, theirs, tv)
            newer = tv > mv
            if bool(newer.any()):  # this record takes the other's longer prefix
                own = self._acting_index(src, rows[newer])
                d = self._as_parity(self.code.delta(mine[newer], theirs[newer]), slot[newer], j)
                fix = DeltaBatch(self.shard, txn, src, own, slot[newer], d, tv[newer])
                fix.base = mv[newer]
                with self.lock:
                    off = self.parity.realign(fix)
                    self._parity_changed()
                if bool(off.any()):
                    raise Busy(f"aligning shard {src}'s rows: this parity record moved since it was read")
            d = self._as_parity(self.code.delta(theirs, union), slot, jo)
            b = DeltaBatch(server, txn, src, index, slot, d, cut)  # (the write's txn: its acting home, src)
            b.via, b.base = self.shard, tv
            self._send([b], f"aligning shard {src}'s rows")
            with self.lock:
                self.stats["rows_realigned"] += int((tv != mv).sum())
        with self.lock:
            self.cuts.align(src, key, rows, cut)
        return union, cut

    def _align_rebuilt(
        self, local: torch.Tensor, records: torch.Tensor, versions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A replacement rebuilding its rows `local` (decoded from P where P's server is live: `records` at
        `versions`) aligns their two parity records as an acting home does: the rows are decoded from Q as
        well, and each record takes the longer prefix of the failed incarnation's updates where the other
        has it. Returns the rows at the union."""
        p = self.placement
        slot = p.stripe_of(self.shard, local)[1]
        records, versions = records.clone(), versions.clone()
        down = self._down()
        # (a stripe that lost another member too decoded from P and Q together, which had to agree)
        lonely = other_member_lost(p, self.shard, local, down)
        key = self._failure_key(self.shard)
        failed = key - 1 if key else 0  # the incarnation before this one: the one whose deltas were kept
        for i in slot.unique().tolist():
            at = (slot == i).nonzero().squeeze(1)
            rows = local[at]
            (ps, pb), (qs, qb) = (p.parity_of(self.shard, rows, j) for j in range(2))
            server_p, server_q = int(ps[0]), int(qs[0])
            if {server_p, server_q} & down:
                continue  # one parity record left: its cut is the rows' (the other is re-encoded when rebuilt)
            mine, mv = records[at], versions[at]
            alone = lonely[at]
            theirs, tv = mine.clone(), mv.clone()
            if not bool(alone.all()):
                theirs[~alone], tv[~alone] = self.decode_rows(self.shard, rows[~alone], unread=server_p)
            union, cut = _union(mine, mv, theirs, tv)
            # Every rebuilt row's cut goes to both records: the delta to the union where one is behind, and
            # the end of the deltas of the failed incarnation they kept (core/cuts.py) for all.
            for server, j, index, had, hv in ((server_p, 0, pb, mine, mv), (server_q, 1, qb, theirs, tv)):
                d = self._as_parity(self.code.delta(had, union), slot[at], j)
                b = DeltaBatch(
                    server,
                    f"rebuild/{self.shard}.{self.shard}.0",  # (a txn of src's rows at src)
                    self.shard,
                    p.parity_index(j, index),
                    slot[at],
                    d,
                    cut,
                    incarnation=failed,
                )
                b.via, b.base = self.shard, hv
                self._send([b], f"aligning rebuilt rows of shard {self.shard}")
            with self.lock:
                self.stats["rows_realigned"] += int((tv != mv).sum())
            records[at], versions[at] = union, cut
        return records, versions

    def _not_rebuilt_with(
        self, local: torch.Tensor, grads: torch.Tensor, versions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A replacement's own rows of a part, less those whose update (at `versions`, the ones it took at
        the failed incarnation) the rebuild found in a parity record: the rows hold it already. (Needs
        `lock`.)"""
        if versions is None or self.placement.r == 1:
            return local, grads
        done = self.cuts.within(self.shard, self._failure_key(self.shard), local, versions)
        if not bool(done.any()):
            return local, grads
        return local[~done], grads[~done]

    def _written_already(
        self, txn: str, src: int, local: torch.Tensor, versions: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows of a degraded write both parity records hold already: its update reached one of them from
        src before src failed (`versions`: the ones it took at src), or a former acting home of the rows
        wrote it and died before answering (its delta reached this record)."""
        with self.lock:
            done = self.cuts.came_via(step_of(txn), src, local)
            if versions is not None:
                done |= self.cuts.within(src, self._failure_key(src), local, versions)
        return done

    def _acting_deltas(
        self, txn: str, src: int, local: torch.Tensor, slot: torch.Tensor, d: torch.Tensor, version
    ) -> tuple[list[DeltaBatch], list[DeltaBatch]]:
        """A degraded write's delta batches for this acting home's parity records (one per parity j it holds
        of the rows) and (r = 2) for the other records whose servers are live, from P's delta `d`."""
        if self.placement.r == 1:
            return [DeltaBatch(self.shard, txn, src, self._acting_index(src, local), slot, d, version)], []
        own, forwards = [], []
        for at, j, other in self._groups(src, local):
            rows, sl, dd, v = local[at], slot[at], d[at], version[at]
            own.append(
                DeltaBatch(
                    self.shard, txn, src, self._acting_index(src, rows), sl, self._as_parity(dd, sl, j), v
                )
            )
            if other is not None:
                server, jo, index = other
                forward = DeltaBatch(server, txn, src, index, sl, self._as_parity(dd, sl, jo), v)
                forward.via = self.shard
                forwards.append(forward)
        return own, forwards

    def _send_forward(self, txn: str, forwards: list[DeltaBatch]) -> None:
        """Deliver a degraded write's delta to the other parity server before the write commits here, the
        rows still locked (so each reaches it in version order). From the moment it is sent the write is
        committed, never aborted (`cuts.sent`): the other record may hold it. Busy while a live server has
        not taken it; the worker commits again, or expiry does."""
        with self.lock:
            self.cuts.sent.add(txn)
        self._send(forwards, f"degraded write {txn}")

    # -- either parity server: deltas refused, and a catch-up ------------------------------------------------
    def _keep_refused(self, b: DeltaBatch) -> None:
        """A failed shard's delta batch refused or dropped here: kept for a catch-up (core/cuts.py). (Needs
        `lock`.)"""
        if self.placement.r == 2:
            self.cuts.keep(b, self._rows_of(b))

    def _rows_of(self, b: DeltaBatch) -> torch.Tensor:
        """Shard b.src's local rows of a batch's parity records here."""
        return self.placement.parity_slot(b.index)[1] * self.placement.k + b.slot

    def _failed_incarnations(self) -> dict[int, int]:
        """Per failed shard, the incarnation whose failure a decode is about: the one in this server's map
        while it is failed, the one before it while its replacement is rebuilt. Asked before taking `lock`."""
        out = {}
        for s in range(self.ctx.num_servers):
            key = self._failure_key(s)
            if key is not None and s != self.shard:
                if self.peers.is_failed(s):
                    out[s] = key
                elif self._recovering(s):
                    out[s] = key - 1
        return out

    def _catch_up(self, index: torch.Tensor, target: torch.Tensor, failed: dict[int, int]) -> None:
        """A decode found the other parity record ahead of these (`target`: its member versions): apply the
        kept deltas that take them there. (Needs `lock`.)"""
        n = self.cuts.catch_up(self.parity, index, target, failed.get)
        if n:
            self._parity_changed()
            self.stats["rows_caught_up"] += n

    # -- the other parity server ----------------------------------------------------------------------------
    def _from_acting_home(self, b: DeltaBatch) -> torch.Tensor:
        """Check a batch an acting home sent (`via`) for failed shard b.src's rows; their local rows."""
        self.check_deltas(b)
        if b.via < 0 or b.via == self.shard or not 0 <= b.via < self.ctx.num_servers:
            raise InvalidRequest(f"via: {b.via} is not another server")
        if b.via == b.src:  # a replacement aligning the rows it rebuilds (only realigns)
            if b.base is None or self.peers.is_failed(b.src):
                raise NotOwner(f"shard {b.src} is failed in this server's map: it rebuilds nothing")
        elif not (self.peers.is_failed(b.src) if b.base is not None else b.src in self._down()):
            # (a write's delta is taken while the shard's replacement is being rebuilt too: the write began
            # while it was failed, and the rebuild waits for it at its acting home: read_rows)
            raise NotOwner(f"shard {b.src} is not failed in this server's map (epoch {self.epoch}) yet")
        if self.peers.is_failed(b.via):
            raise NotOwner(f"shard {b.via} is failed in this server's map: it acts for nobody")
        return self._rows_of(b)

    def realign(self, b: DeltaBatch) -> None:
        """The acting home aligned failed shard b.src's rows: this record's prefix of src's updates becomes
        the union (the delta is zero where it is already), src's held deltas of the rows are dropped (every
        delta of src is refused from now on), and the rows' cut is remembered. Busy if some record is no
        longer at the base the acting home read. (A record this replacement has not rebuilt needs nothing:
        it is encoded from the members when it is.)"""
        if b.base is None:
            raise InvalidRequest("realign: a base version for every row")
        rows = self._from_acting_home(b)
        with self.lock:
            if self.logged:
                self._settle_src(b.src)
            off = self.parity.realign(b) & self.parity.ready.index_select(0, b.index)
            self._parity_changed()
            if not bool(off.any()):
                # (a replacement rebuilding the rows: their cut in the failure of the incarnation before it)
                key = b.incarnation if b.via == b.src else self._failure_key(b.src)
                self.cuts.align(b.src, key, rows, b.version)
        if bool(off.any()):
            raise Busy(
                f"realign: {int(off.sum())} records of shard {b.src}'s rows changed since they were read"
            )

    def apply_forward(self, b: DeltaBatch) -> None:
        """A degraded write's delta from the acting home of failed shard b.src's rows: each row at its next
        version (the acting home sends them in order, the rows locked). A repeat (its answer was lost) is
        applied once. Remembered by worker step, for this server's turn as acting home (`cuts.via`). Rows
        whose record this replacement has not rebuilt keep the delta for the rebuild (ParityParticipant.apply),
        which applies it if the members it encodes do not reflect it yet."""
        rows = self._from_acting_home(b)
        with self.lock:
            ready = self.parity.ready.index_select(0, b.index)
            now = self.parity.pver.view(-1).index_select(0, self.parity.key_of(b))[ready]
            if bool((now == b.version[ready]).all()):
                if bool(ready.all()):
                    return  # applied before
            elif not bool((now == b.version[ready] - 1).all()):
                raise Busy(f"forward {b.txn}: rows of shard {b.src} are not at the version before")
            self.parity.apply(b)
            self.cuts.applied_via(step_of(b.txn), b.src, rows)
            self._parity_changed()


def _union(
    mine: torch.Tensor, mv: torch.Tensor, theirs: torch.Tensor, tv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows decoded from two parity records (each a prefix of the failed shard's updates, at versions mv and
    tv): each row as the longer prefix has it, selected as bits, and that version."""
    union = torch.where((tv > mv).view(-1, 1), theirs.view(torch.int32), mine.view(torch.int32))
    return union.view(torch.float32), torch.maximum(mv, tv)
