"""Decoding a failed shard's rows from their stripes (degraded reads, the acting home's writes, rebuilds)
and the recovery of a replacement (docs/protocol.md, "Degraded mode" and "Recovery"): data rows lock group
by lock group, parity records re-encoded, dense chunks copied from the surviving replica; and the reads
other servers make here for theirs (`read_rows`, `serve_dense_copy`).

Lock discipline: public methods take `lock` themselves and must be called without it. Decoding
(`decode_rows`, `_read_many`) calls peers, so it runs without the lock; the state it needs is claimed first
under the lock and installed after: a lock group's rows are locked in `rows.locks` under the REBUILD_TXN
holder, parity indices marked in `parity_rebuilding`, dense chunks in `dense_copying_in` (a second Recover
step waits for the first, then finds the work done); each is released and `cond` notified in a `finally`.
`read_rows` waits under the lock for staged rows (a re-encode) or a shard's undecided deltas (a rebuild);
`serve_dense_copy` waits for the chunk's dense stages in flight. `_undecided_from` needs `lock` held. A
checkpoint loaded while a rebuild or copy decodes (`loads` changed) wins: the rebuild installs nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ecrec.core.ranges import RangeDecode
from ecrec.core.stripes import Read, ReadResult, SecondFailure, StripeDecode, StripeEncode, StripesLost
from ecrec.core.vec import in_range, take
from ecrec.faults import fault_point
from ecrec.store.peers import PeerFailed
from ecrec.store.state import REBUILD_TXN, Busy, NotOwner, StoreState
from ecrec.wire import InvalidRequest

CONSISTENT_READ_TRIES = 200
RANGE_MIN_ROWS = 256  # a lock group this large and dense decodes as a range (RangeDecode)
log = logging.getLogger("ecrec.server")


class Recovery(StoreState):
    """Degraded reads, the acting home's decodes, and the rebuild of a replacement."""

    def read_rows(
        self, kind: str, index: torch.Tensor, src: int = -1, as_of: torch.Tensor | None = None
    ) -> ReadResult:
        """Records with versions. PARITY reads for rebuilding shard `src` wait for its undecided deltas; DATA
        reads with `src >= 0` (re-encoding parity) wait until none of the rows is staged. DATA reads `as_of`
        versions answer the rows as they were then where the delta log can undo what came after (deltaLog,
        xor code), and version -1 for the others. PARITY reads `as_of` member versions ([n, k], another
        parity record's: r = 2) first catch up where deltas this server refused take the records there
        (ecrec.core.cuts)."""
        if kind == "data":
            if not in_range(index, self.num_rows):
                raise InvalidRequest("index: local rows out of range")
            if as_of is not None and as_of.shape != index.shape:
                raise InvalidRequest(f"as_of: {as_of.numel()} versions for {index.numel()} rows")
            with self.lock:
                # (first: rows a lock group of this replacement is rebuilding are locked, and not to wait for)
                if not bool(self.row_ready[index].all()):
                    raise NotOwner(f"rows of shard {self.shard} not rebuilt yet")
                if src >= 0:  # re-encoding parity: no staged update may slip between this read and its commit
                    self._wait(lambda: not self.rows.locks.busy(index), "rows staged by a txn")
                # (copies: nothing here aliases the table)
                records, versions = take(self.rows.records, index), take(self.rows.versions, index)
                if as_of is None:
                    return ReadResult(records, versions)
                if not (self.logged and self.code.exact):
                    return ReadResult(records, torch.where(versions == as_of, versions, -1))
                return ReadResult(*self.deltalog.roll_back(index, records, versions, as_of, self.placement.k))
        n_par = self.parity.parity.shape[0]
        if not in_range(index, n_par):
            raise InvalidRequest("index: parity indices out of range")
        failed = {}
        if as_of is not None:
            if as_of.numel() != index.numel() * self.placement.k:
                raise InvalidRequest(
                    f"as_of: {as_of.numel()} versions for {index.numel()} parity records of k = {self.placement.k}"
                )
            failed = self._failed_incarnations()
        with self.lock:
            if failed:
                self._catch_up(index, as_of.view(index.numel(), self.placement.k), failed)
            if src >= 0:
                if self.logged:
                    self._settle_src(src)  # held deltas of a replaced incarnation never apply
                try:
                    self._wait(lambda: not self._undecided_from(src, index), f"deltas of shard {src}")
                except Busy:
                    # The rebuild retries; the same wait every time is the sign of an update lost for good.
                    log.warning("a rebuild's read waited in vain: %s", self._undecided_why(src, index))
                    raise
            pr = self.parity
            return ReadResult(take(pr.parity, index), take(pr.pver, index), take(pr.ready, index))

    def _undecided_why(self, src: int, index: torch.Tensor) -> str:
        """What `_undecided_from` waits for, in words (for the log). (Needs `lock`.)"""
        staged = {
            t for t, idx, _slot in self.parity.staged_members(src) if bool(torch.isin(idx, index).any())
        }
        held = [b for b in self.parity.held if b.src == src and bool(torch.isin(b.index, index).any())]
        return (
            f"shard {src} (incarnation {self._failure_key(src)} in this server's map, failed: "
            f"{self.peers.is_failed(src)}, held from {self.held_from.get(src)}): staged txns "
            f"{sorted(staged)[:4]}, held {[(b.txn, b.incarnation) for b in held[:4]]} "
            f"({self.parity.why_held(held)}), degraded write running: {self.acting.writing(src)}"
        )

    def _undecided_from(self, src: int, index: torch.Tensor) -> bool:
        """Any update of shard `src`'s rows in flight on these parity indices? (A staged delta of src, or a
        degraded write this server is running for src, possibly still decoding.)"""
        for _txn, idx, _slot in self.parity.staged_members(src) + self.parity.held_members(src):
            if bool(torch.isin(idx, index).any()):
                return True
        if self.acting.writing(src):
            p = self.placement
            js, blocks = p.parity_slot(index)
            for j in js.unique().tolist():  # P's and Q's records (r = 2) have different members
                shards, locs, present = p.stripe_members(self.shard, blocks[js == j], j)
                rows = locs[(shards == src) & present]
                if rows.numel() and self.acting.busy(src, rows):
                    return True
        return False

    # ---------------------------------------------------------------------------------------------------
    # decoding (degraded reads, acting-home writes, recovery)
    def decode_rows(
        self, src: int, local: torch.Tensor, unread: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Records and versions of shard src's rows, decoded from their stripes (consistent cut). The
        parity records and the other members are read in one round (ecrec.core.stripes); stripes a commit
        was crossing are read again; no read goes to a server this one's map has failed. `unread`: one more
        server not to read (r = 2: an acting home or a replacement decodes the rows from the other parity record
        too, waiting for src's updates in flight there, to align the two: ecrec.store.twoparity)."""
        out = torch.empty(local.numel(), self.ctx.record_width)
        vers = torch.empty(local.numel(), dtype=torch.int64)
        todo = torch.arange(local.numel())
        # Only the replacement rebuilding its own rows must wait for src's in-flight updates to settle; a
        # degraded read or write at the acting home reads committed state (and holds the row lock itself).
        wait = src if src == self.shard or unread >= 0 else -1
        down = {s for s in range(self.ctx.num_servers) if s != src and self.peers.is_failed(s)}
        down |= {unread} if unread >= 0 else set()
        # r = 2: a replacement's data rows are decoded around even where they are rebuilt already, so that a
        # stripe with a member on one decodes from P and Q together, as its alignment expects
        # (other_member_lost over `_down`); its parity records are read where they are rebuilt.
        lost = self._down() - {src} if self.placement.r == 2 else set()

        def plan_for(rows: torch.Tensor) -> StripeDecode:
            try:
                return StripeDecode(self.placement, src, rows, wait, down, lost)
            except StripesLost as e:
                raise PeerFailed(-1, str(e)) from e

        plan = plan_for(local)
        for _attempt in range(CONSISTENT_READ_TRIES):
            try:
                decoded, versions, consistent = plan.decode(
                    self.code, self.ctx.record_width, self._read_many(plan.reads)
                )
            except (SecondFailure, PeerFailed) as e:
                # r = 2: a server that cannot answer (a replacement whose records are not rebuilt, or one
                # that died since the map said otherwise) is one more record lost: decode without it. (A
                # server that is only busy is asked again by the caller, not decoded around.)
                unreadable = isinstance(e, SecondFailure) or e.server in self._down()
                if self.placement.r == 1 or e.server < 0 or e.server in down or not unreadable:
                    if isinstance(e, SecondFailure):
                        raise PeerFailed(-1, str(e)) from e
                    raise
                down.add(e.server)
                plan = plan_for(local[todo])
                continue
            if self.placement.r == 2 and not bool(consistent.all()):
                # two parity records of a stripe apart on a failed member: the one behind catches up from
                # the deltas it refused, if it has them (ecrec.core.cuts); the next round reads it again
                behind = plan.parity_behind()
                if behind:
                    self._read_many(behind)
            if self.logged and self.code.exact and not bool(consistent.all()):
                # members ahead of their parity by undelivered deltas: read them as of what it reflects
                again = plan.catch_up()
                if again:
                    decoded, versions, consistent = plan.decode_caught_up(self.code, self._read_many(again))
            if not self.code.exact:  # rounding may leave state outside its domain (docs/protocol.md)
                decoded = self.opt.project(decoded, self.dim)
            out[todo[consistent]] = decoded[consistent]
            vers[todo[consistent]] = versions[consistent]
            todo = todo[~consistent]
            if todo.numel() == 0:
                if self.tap is not None:
                    self.tap.decoded(src, local, vers, out)
                return out, vers
            plan = plan.rest(consistent)
            with self.lock:
                self.stats["stripes_read_again"] += todo.numel()
            time.sleep(0.002)  # a commit is between a member and its parity server: read again
        raise Busy(f"could not read a consistent cut of {todo.numel()} stripes")

    def _read_many(self, reads: list[Read]) -> list[ReadResult]:
        """Reads from peers, all at once; reads addressed to this server are served locally."""
        out: list[ReadResult | None] = [None] * len(reads)
        p = self.placement
        # parity j's records of blocks `index` (r = 2) are rows j·B + block of the server's parity table
        reads = [
            dataclasses.replace(r, index=p.parity_index(r.j, r.index), j=None) if r.j is not None else r
            for r in reads
        ]
        remote = [(i, r) for i, r in enumerate(reads) if r.server != self.shard]
        for i, r in enumerate(reads):
            if r.server == self.shard:
                out[i] = self.read_rows(r.kind, r.index, r.src, r.as_of)
        if remote:
            answers = self.peers.read_rows([r for _i, r in remote], self.epoch)
            for (i, _r), res in zip(remote, answers, strict=True):
                out[i] = res
        return out  # type: ignore[return-value]

    def degraded_pull(self, src: int, g: torch.Tensor) -> torch.Tensor:
        local = self.local_rows(g, src)
        self._check_acting(src, local)
        recs, _v = self.lost_rows(src, local)
        self.stats["degraded_rows"] += local.numel()
        return recs[:, : self.dim]

    def lost_rows(self, src: int, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed records and versions of failed shard src's rows: materialized ones from the acting
        home's cache, the rest decoded (and materialized)."""

        def reflected() -> torch.Tensor:  # the versions this server's parity records reflect for these rows
            return self.parity.pver[self._acting_index(src, local), self.placement.stripe_of(src, local)[1]]

        if local.numel() == 0:
            return torch.empty(0, self.ctx.record_width), torch.empty(0, dtype=torch.int64)
        with self.lock:
            seen = self.acting.lookup(src, local, reflected)
            if seen.cache is not None and bool(seen.hit.all()):
                return seen.cache.records[local].clone(), seen.cache.versions[local].clone()
        miss = (~seen.hit).nonzero().squeeze(1)
        recs = torch.empty(local.numel(), self.ctx.record_width)
        vers = torch.empty(local.numel(), dtype=torch.int64)
        recs[miss], vers[miss] = self.decode_rows(src, local[miss])
        with self.lock:
            self.acting.materialize(src, local, seen, recs, vers)
        return recs, vers

    def _check_acting(self, src: int, local: torch.Tensor) -> None:
        if src == self.shard or not self.peers.is_failed(src):
            with self.lock:
                self.acting.forget(src)
                self.cuts.forgotten(src)
            raise NotOwner(f"shard {src} is not failed in this server's cluster map (epoch {self.epoch})")
        if bool((self._acting_parity(src, local)[0] != self.shard).any()):
            raise InvalidRequest(
                f"ids: this server is not the acting home (first live parity server) of all these rows of"
                f" shard {src}"
            )
        key = self._failure_key(src)
        with self.lock:
            self.acting.begin(src, key)

    def _acting_parity(self, src: int, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(server, j) of the acting home of failed shard src's rows: their first live parity server."""
        n = self.ctx.num_servers
        return self.placement.acting_parity(src, local, {s for s in range(n) if self.peers.is_failed(s)})

    def _acting_index(self, src: int, local: torch.Tensor) -> torch.Tensor:
        """Where this server, their acting home, keeps the parity record of failed shard src's rows."""
        p = self.placement
        if p.r == 1:
            return p.parity_of(src, local)[1]
        _server, j = self._acting_parity(src, local)
        return p.parity_index(j, p.parity_of(src, local)[1])

    # ---------------------------------------------------------------------------------------------------
    # recovery of a replacement
    def ensure_rows(self, local: torch.Tensor) -> None:
        """Rebuild on demand any of these rows that recovery has not reached yet."""
        if not self.replacement or bool(self.row_ready[local].all()):
            return
        self.rebuild_rows(local)

    def rebuild_rows(self, local: torch.Tensor) -> int:
        """Rebuild one lock group: lock, gather + decode, install, unlock (queued requests then run)."""
        group = f"{REBUILD_TXN}{id(local)}:{time.monotonic_ns()}"
        with self.lock:
            # Only rows not rebuilt yet: they can be locked by another group, never staged (a stage rebuilds
            # its rows first). Rows already rebuilt may be staged by a worker's part, and a pull that also
            # needs some rows rebuilt must not wait for that part's commit.
            self._wait(lambda: not self.rows.locks.busy(local[~self.row_ready[local]]), "rows being rebuilt")
            todo = local[~self.row_ready[local]]
            if todo.numel() == 0:
                return 0
            self.rows.locks.lock(group, todo)
            loads = self.loads
        try:
            recs, vers = self._decode_own(todo)
            if self.placement.r == 2:  # both parity records to the union of the lost rows' prefixes
                recs, vers = self._align_rebuilt(todo, recs, vers)
            fault_point("recover:mid_group")
            with self.lock:
                if self.loads != loads:  # a checkpoint was loaded meanwhile: its rows stand
                    return 0
                self.rows.records[todo] = recs
                self.rows.versions[todo] = vers
                self.row_ready[todo] = True
                if self.placement.r == 2:  # a worker's rewrite of an update within the cut is skipped
                    self.cuts.align(self.shard, self._failure_key(self.shard), todo, vers)
                self.stats["rows_recovered"] += todo.numel()
        finally:
            with self.lock:
                self.rows.locks.unlock(group)
                self.cond.notify_all()
        fault_point("recover:after_group")
        return todo.numel()

    def _decode_own(self, todo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This replacement's rows `todo`, decoded: a lock group's range in bulk (RangeDecode) where it
        applies; otherwise, and for rows its reads caught mid-commit, by `decode_rows`."""
        lo, hi = int(todo.min()), int(todo.max()) + 1
        plan = None
        if todo.numel() >= RANGE_MIN_ROWS and hi - lo <= 2 * todo.numel():
            down = {s for s in range(self.ctx.num_servers) if s != self.shard and self.peers.is_failed(s)}
            plan = RangeDecode.plan(self.placement, self.shard, lo, hi, self.shard, down)
        if plan is None:
            return self.decode_rows(self.shard, todo)
        try:
            recs, vers, ok = plan.decode(self.code, self.ctx.record_width, self._read_many(plan.reads))
        except (SecondFailure, PeerFailed):  # decode_rows reads around what it can and says what it cannot
            return self.decode_rows(self.shard, todo)
        at = todo - lo
        recs, vers, ok = recs[at], vers[at], ok[at]
        if not self.code.exact:  # rounding may leave state outside its domain (as in decode_rows)
            recs = self.opt.project(recs, self.dim)
        if self.tap is not None:
            self.tap.decoded(self.shard, todo[ok], vers[ok], recs[ok])
        if not bool(ok.all()):
            again = (~ok).nonzero().squeeze(1)
            recs[again], vers[again] = self.decode_rows(self.shard, todo[again])
        return recs, vers

    def rebuild_parity(self, index: torch.Tensor) -> int:
        """Re-encode parity records from their members' current records (versions make the cut exact)."""
        with self.lock:
            self._wait(lambda: not bool(self.parity_rebuilding[index].any()), "parity records being rebuilt")
            index = index[~self.parity.ready[index]]
            if index.numel() == 0:
                return 0
            self.parity_rebuilding[index] = True
            loads = self.loads
        try:
            p = self.placement
            js, blocks = p.parity_slot(index)
            done = []
            for j in js.unique().tolist():  # (r = 2: P's records and Q's, of different stripes)
                at = js == j
                plan = StripeEncode(p, self.shard, blocks[at], j)  # its reads wait for staged rows: read_rows
                done.append(
                    (index[at], *plan.encode(self.code, self.ctx.record_width, self._read_many(plan.reads)))
                )
            with self.lock:
                if self.loads != loads:  # a checkpoint was loaded meanwhile: its parity stands
                    return 0
                for at, records, vers in done:
                    self.parity.install(at, records, vers)
        finally:
            with self.lock:
                self.parity_rebuilding[index] = False
                self._parity_changed()
        return index.numel()

    def copy_dense(self) -> int:
        """Copy the replicated chunks from the surviving replica; skip txns the copy already contains."""
        n = 0
        for c in list(self.dense.records):
            with self.lock:
                self._wait(lambda c=c: c not in self.dense_copying_in, f"dense chunk {c} being copied")
                if self.dense.ready[c]:
                    continue
                self.dense_copying_in.add(c)
                loads = self.loads
            try:
                recs, txns = self._copy_from_a_replica(c)
                with self.lock:
                    if self.loads != loads:  # a checkpoint was loaded meanwhile: its chunks stand
                        return n
                    self.dense.install(c, recs, txns)
            finally:
                with self.lock:
                    self.dense_copying_in.discard(c)
                    self.cond.notify_all()
            n += recs.shape[0]
        return n

    def _copy_from_a_replica(self, c: int) -> tuple[torch.Tensor, list[str]]:
        """Dense chunk c from the first of its other replicas that has it (r = 2: three replicas, one of which
        may be failed or a replacement that has not copied it yet)."""
        others = [h for h in self.ctx.dense_holders(c) if h != self.shard]
        live = [h for h in others if not self.peers.is_failed(h)] or others
        for h in live[:-1]:
            try:
                return self.peers.dense_copy(h, c, self.epoch)
            except PeerFailed:
                continue
        return self.peers.dense_copy(live[-1], c, self.epoch)

    def serve_dense_copy(self, chunk: int, epoch: int) -> tuple[torch.Tensor, list[str]]:
        """The surviving replica's side of copy_dense: from now on reject dense stages older than `epoch`."""
        self._chunk(chunk)
        with self.lock:
            if not self.dense.ready[chunk]:  # a replacement replica itself (r = 2): ask another
                raise NotOwner(f"dense chunk {chunk} is not copied to shard {self.shard} yet")
            # New stages of the chunk wait from here, so the ones in flight can drain.
            self.dense.begin_copy(chunk, epoch)
            try:
                self._wait(lambda: not self.dense.in_flight(chunk), "dense txns in flight")
                return self.dense.copy_out(chunk)
            finally:
                self.dense.end_copy(chunk)
                self.cond.notify_all()

    def recovery_done(self) -> bool:
        return bool(self.row_ready.all()) and bool(self.parity.ready.all()) and self.dense.all_ready()
