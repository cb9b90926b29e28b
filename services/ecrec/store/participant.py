"""The data server's side of the worker-coordinated 2PC (docs/protocol.md, "Update path"): stage a part
(its rows locked, new records and deltas computed, nothing applied), commit it (the part's decision point),
abort it, answer for its outcome; degraded writes of a failed shard's rows at their acting home; hot rows
under wait-die; expiry of what a dead worker left undecided (I4).

Lock discipline: public methods take `lock` themselves and must be called without it. `stage` and
`_stage_acting` wait under it (`_wait_rows`, wait-die: YOUNGER_WAIT, then ROW_LOCK_WAIT for rows another
worker's part holds; wait_timeout for a recovery lock group) and release it to decode a failed shard's rows
(`lost_rows`, which calls peers). `_wait_rows` and `_staged_from_rows` need `lock` held. `commit`, `abort`
and their acting-home variants notify `cond` (rows released); `abort` and `expire` send decisions to parity
servers (`_decide`, `_settle`) after releasing it. The parity servers' side is ecrec.store.deltas.

Uses the other parts (one ShardStore): `ensure_rows`, `lost_rows`, `_check_acting` (recovery), `decide_many`,
`_settle` (deltas), `chunk_len` (records).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ecrec.core.lineage import drop_orphans
from ecrec.core.txn import DeltaBatch, RowLocks
from ecrec.core.update import step_of, txn_age
from ecrec.faults import fault_point
from ecrec.store.state import REBUILD_TXN, Busy, NotOwner, StoreState

log = logging.getLogger("ecrec.server")

# How long a stage waits for rows another worker's part holds before answering Busy. Waits follow wait-die
# (Participant._wait_rows), so they form no cycle; the bound is for a holder whose worker died (its part
# expires after txnTimeout). Rows locked by a recovery lock group are waited for up to wait_timeout (the
# group finishes on its own).
ROW_LOCK_WAIT = 0.05
# How long a part waits for an older part's rows before it answers Busy (wait-die, Participant._wait_rows).
# The older part usually commits within a few round trips. Measured on examples/local-small.yaml, k=4, 2
# workers, alternating runs: 0 (die at once) 23.8 RPCs per worker step; 10 ms 22.8; 20 ms 21.0-21.2 and the
# best throughput; 40 ms the same RPCs but slower (a real wait cycle stalls its two workers that long).
YOUNGER_WAIT = 0.02


@dataclass
class Staged:
    """A stage's answer: rows staged and, for the server's own rows, the deltas the worker must deliver to
    their parity servers before it commits."""

    rows: int
    batches: list[DeltaBatch]


class Participant(StoreState):
    """Stage, commit, abort and expire parts at this data server (and at the acting home of a failed one)."""

    def _wait_rows(
        self, locks: RowLocks, rows: torch.Tensor, txn: str, what: str, lone: bool = False
    ) -> None:
        """Wait for rows held by others: longer for a recovery lock group; for another worker's part, under
        wait-die (docs/protocol.md, "Hot rows"): past a short grace (YOUNGER_WAIT), a part waits only for
        younger holders (txn_age), or when it is `lone` — its worker holds no other part anywhere, so nothing
        can be waiting for it. Otherwise it answers Busy and its worker retries it once its other parts are
        decided. Past the grace, waits only go from older to younger parts or from parts nobody waits for:
        no cycle, so two workers staging the same hot rows on two servers in opposite orders stall each
        other for the grace at most, not until ROW_LOCK_WAIT runs out."""
        if not locks.busy(rows, txn):
            return  # the usual case: nothing to wait for, and no need to learn who holds what
        self._wait(lambda: not any(h.startswith(REBUILD_TXN) for h in locks.holders_of(rows)), what)
        if lone:
            self._wait(lambda: not locks.busy(rows, txn), what, timeout=ROW_LOCK_WAIT)
            return
        try:  # most holders commit soon; one that is waiting for this worker's rows elsewhere does not
            self._wait(lambda: not locks.busy(rows, txn), what, timeout=YOUNGER_WAIT)
            return
        except Busy:
            pass
        age = txn_age(txn)

        def free() -> bool:
            holders = locks.holders_of(rows) - {txn}
            if any(txn_age(h) <= age for h in holders):
                raise Busy(
                    f"{what}: held by an older part (wait-die: retried once this worker's others are decided)"
                )
            return not holders

        self._wait(free, what, timeout=ROW_LOCK_WAIT)

    # ---------------------------------------------------------------------------------------------------
    # two-phase commit
    def stage(
        self,
        txn: str,
        g: torch.Tensor,
        grads: torch.Tensor,
        src: int = -1,
        dense: dict[int, torch.Tensor] | None = None,
        epoch: int = 0,
        decisions: list[tuple[str, int, bool]] = (),
        lone: bool = False,
        versions: torch.Tensor | None = None,
    ) -> Staged:
        """Phase 1 of a part (docs/protocol.md): stage the new records; the answer carries the deltas for the
        worker to deliver to the parity servers (nothing is sent from here). The worker's decisions about
        earlier parts, for which this server is a parity server, ride along: they are applied first, before
        this stage can wait for anything that might be waiting for them. `lone`: the worker stages nothing
        else while this waits (see _wait_rows)."""
        src, local, dense = self._check_part(g, grads, src, dense)
        if decisions:  # checked above; applied before this stage can wait for anything
            self.decide_many(list(decisions))
        if src != self.shard:
            return Staged(self._stage_acting(txn, src, local, grads, lone, versions), [])
        self.ensure_rows(local)
        with self.lock:
            if txn in self.outcomes:
                raise Busy(f"txn {txn} was already {self.outcomes[txn]}")
            self._admit(dense, epoch)
            if txn not in self.rows.staged:
                self._wait_rows(self.rows.locks, local, txn, "rows staged by another txn", lone)
            n = local.numel()
            local, grads = self._not_rebuilt_with(local, grads, versions)
            part = self.rows.stage(txn, local, grads, self.clock())  # a retried stage gets the same part
            self.dense.stage(txn, step_of(txn), dense)
        fault_point("stage:after_local")
        return Staged(n, list(part.batches))

    def _stage_acting(
        self,
        txn: str,
        src: int,
        local: torch.Tensor,
        grads: torch.Tensor,
        lone: bool = False,
        versions: torch.Tensor | None = None,
    ) -> int:
        """Phase 1 of a degraded write: this parity server stands in for failed shard src's rows. Rows
        another worker's degraded write holds are waited for under wait-die, like a data server's
        (_wait_rows): two workers' degraded writes of hot rows at two acting homes would otherwise each wait
        for the other until ROW_LOCK_WAIT ran out. With r = 2 the rows are aligned in both parity records
        first, and rows whose update (at `versions`, the ones it took at src) both records hold already are
        not written again (ecrec.store.twoparity)."""
        with self.lock:
            if txn in self.acting:  # a retried stage gets the same answer, staged once
                return local.numel()
            if txn in self.outcomes:
                raise Busy(f"txn {txn} was already {self.outcomes[txn]}")
        self._check_acting(src, local)
        with self.lock:
            while True:
                # the dead server's own undecided deltas: decided by their workers (or on expiry), soon
                self._wait(
                    lambda: not self._staged_from_rows(src, local),
                    "rows of a failed shard with an undecided update of its own",
                    timeout=ROW_LOCK_WAIT,
                )
                if (locks := self.acting.locks.get(src)) is not None:
                    self._wait_rows(locks, local, txn, "rows of a failed shard staged by another txn", lone)
                if not self._staged_from_rows(src, local):  # none came back while this waited
                    break
            # Checked again under the lock (the wait released it): a replacement's rebuild may have read
            # these rows' parity since, and must not miss a write that starts after its read.
            if not self.peers.is_failed(src):
                raise NotOwner(f"shard {src} has a replacement now (epoch {self.epoch}): refresh the map")
            self.acting.lock(txn, src, local)
        n = local.numel()
        try:
            old, vers = self.lost_rows(src, local)
            write = torch.ones(local.numel(), dtype=torch.bool)
            if self.placement.r == 2:
                old, vers = self._align(txn, src, local, old, vers)
                write = ~self._written_already(txn, src, local, versions)
        except Exception:
            with self.lock:
                self.acting.unlock(txn, src)
                self.cond.notify_all()
            raise
        if not bool(write.all()):
            if not bool(write.any()):  # every row is in both parity records already: done
                with self.lock:
                    self.acting.unlock(txn, src)
                    self._remember(txn, "committed")
                    self.cond.notify_all()
                return n
            local, old, vers, grads = local[write], old[write], vers[write], grads[write]
        new = self.opt.apply(old, grads)
        slot = self.placement.stripe_of(src, local)[1]
        d = self.code.delta(old, new)  # P's; Q's is g^slot times it (PQCode.for_parity)
        own, forwards = self._acting_deltas(txn, src, local, slot, d, vers + 1)
        with self.lock:
            for b in own:
                self.parity.stage(b)
            self.acting.stage(txn, src, local, new, vers + 1, self.clock())
            if forwards:  # the other parity records' deltas: delivered before the write commits
                self.cuts.forwards[txn] = forwards
            self.stats["degraded_rows"] += local.numel()
        fault_point("acting:after_stage")
        return n

    def _staged_from_rows(self, src: int, local: torch.Tensor) -> bool:
        """Does failed shard src still have an undecided delta (staged before it died) on these rows, or a
        committed one held until its predecessor is applied?"""
        p = self.placement
        for txn, idx, slot in self.parity.staged_members(src) + self.parity.held_members(src):
            if txn in self.acting:
                continue
            if bool(torch.isin(p.parity_slot(idx)[1] * p.k + slot, local).any()):
                return True
        return False

    def commit(self, txn: str) -> str:
        """Phase 2 at the data server, the part's decision point: apply the staged records (and dense
        chunks) and release the rows. The worker then tells the parity servers; a parity server that never
        hears asks here (outcome)."""
        with self.lock:
            forwards = None if txn in self.outcomes else self.cuts.forwards.get(txn)
        if forwards:  # r = 2, a degraded write: the other parity records take its deltas first
            self._send_forward(txn, forwards)
        with self.lock:
            if txn in self.outcomes:
                return self.outcomes[txn]
            write = self.acting.commit(txn)
            if write is not None:
                self.parity.commit(txn, write.src)
                self.cuts.forwards.pop(txn, None)
                self.cuts.sent.discard(txn)
                self._said_committing.discard(txn)  # (whoever commits it: its worker, or expiry)
                self._remember(txn, "committed")
                self._parity_changed()
                return "committed"
            part = self.rows.staged.get(txn)
            if part is None and txn not in self.dense.staged:
                return "unknown"
            if part is not None:
                self.rows.commit(txn)
            self.dense.commit(txn, step_of(txn))
            self._remember(txn, "committed")
            self.cond.notify_all()
        fault_point("commit:after_apply")
        return "committed"

    def outcome(self, txn: str) -> str:
        """What this data server decided about a part: committed, aborted, staged (undecided) or unknown."""
        with self.lock:
            if txn in self.outcomes:
                return self.outcomes[txn]
            if txn in self.rows.staged or txn in self.dense.staged or txn in self.acting:
                return "staged"
            return "unknown"

    def abort(self, txn: str) -> str:
        """Undo a staged part. A txn this server never staged answers "unknown" and leaves no trace: a
        stray abort must not decide the fate of a part that has not arrived yet."""
        with self.lock:
            if txn in self.outcomes:
                return self.outcomes[txn]
            if txn not in self.acting and txn not in self.rows.staged and txn not in self.dense.staged:
                return "unknown"
            if txn in self.cuts.sent:  # (r = 2) the other parity record may hold the write: it commits
                raise Busy(f"degraded write {txn} is being committed")
            self.cuts.forwards.pop(txn, None)
            write = self.acting.abort(txn)
            if write is not None:
                self.parity.abort(txn, write.src)
            part = self.rows.abort(txn)
            self.dense.abort(txn)
            self._remember(txn, "aborted")
            self.cond.notify_all()
        if part is not None:
            self._decide(list(part.parity_servers), txn, commit=False)
        return "aborted"

    def _decide(self, servers: list[int], txn: str, commit: bool) -> None:
        live = [s for s in servers if not self.peers.is_failed(s)]
        for _attempt in range(10):
            if not live:
                return
            errors = self.peers.decide(live, txn, self.shard, commit, self.epoch)
            live = [s for s in live if errors.get(s) is not None and not self.peers.confirm_failed(s)]

    def staged_count(self) -> int:
        """Undecided 2PC state on this server (parts, acting parts, parity deltas, dense stages)."""
        with self.lock:
            return len(self.rows.staged) + len(self.acting) + len(self.parity.staged) + len(self.dense.staged)

    def fence_workers(self, gone: dict) -> bool:
        """The coordinator's word on which worker processes are gone (rank -> newest incarnation gone); True
        if it names one not known before: then `expire` has work to do now."""
        with self.lock:
            return self.fence.update(gone)

    def expire(self) -> list[str]:
        """Resolve what a dead worker left undecided (I4): abort its parts staged here, and settle deltas
        staged here by asking their data server what it decided. A worker is known dead when its part has
        waited `txn_timeout` for a decision, or at once when the coordinator says its process is gone (the
        fence): its staged rows would otherwise hold up every worker that needs them until the timeout."""
        with self.lock:
            now = self.clock()
            gone = self.fence.fenced
            stale = list(self.rows.expired(now, self.txn_timeout, gone))
            # degraded writes whose worker died expire too, or the failed shard's rows would stay locked
            stale += self.acting.expired(now, self.txn_timeout, gone)
            committing = [t for t in stale if t in self.cuts.sent]
            stale = [t for t in stale if t not in self.cuts.sent]
            undecided = [
                (key, now - self.parity.staged_at[key])
                for key in self.parity.expired(now, self.txn_timeout, gone)
                if key[0] not in self.acting  # this server's own degraded writes: aborted above
            ]
            reasons = {txn: "expired_worker_gone" if gone(txn) else "expired_timeout" for txn in stale}
        for txn in stale:
            if self.abort(txn) == "aborted":
                with self.lock:
                    self.stats[reasons[txn]] += 1
        for (txn, src), age in undecided:
            self._settle(txn, src, age)
        for txn in committing:  # (r = 2) their other parity record may hold them already: commit, not abort
            try:
                self.commit(txn)
            except Busy as e:  # the next expiry pass tries again; said once (a write that never commits
                if txn not in self._said_committing:  # keeps its rows from a rebuild)
                    self._said_committing.add(txn)
                    log.warning("expired degraded write %s could not commit yet: %s", txn, e)
        if self.logged:
            self.forward_due()
            with self.lock:
                for src in list(self.held_from):
                    self._settle_src(src)
            return stale
        if self.ctx.spec.fault_tolerance.ecrec.two_phase_commit:  # without 2PC deltas are never staged here
            with self.lock:
                if drop_orphans(self.parity):
                    self._parity_changed()
        return stale
