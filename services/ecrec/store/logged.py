"""Updates under commit: deltaLog (docs/protocol.md, "Update path"): the data server applies a part when it
is staged and logs its deltas; the worker delivers them to the parity servers, which apply each row's deltas
in version order; the worker's next stage here acknowledges the delivery. Nothing is locked across a round
trip, so workers that share hot rows never wait for each other's commits.

Why it is safe (the cut a failure finds is consistent, and every update lands exactly once):
- A data server that dies loses its rows; its stripes then reflect, per row, the updates whose deltas
  reached the parity server before the failure was known there. From then on deltas of that incarnation are
  refused (`deliver`): their rows are written again by their worker, as degraded writes at the acting home.
  Held deltas of that incarnation (waiting for a predecessor that will now be refused) are dropped, and
  their deliverer is told which rows (`refused`), so those are written again too.
- A delivery whose answer did not reach its worker is asked again, never written elsewhere first: a batch
  accepted here is not refused later (`accepted`), so rows applied once are not written again when their
  data server has failed in between.
- A worker that dies before delivering leaves its parts in the data server's log; the server forwards them
  itself once the worker is known gone or the txnTimeout passes (`forward_due`). A parity server skips a
  delta its record already reflects, so a part delivered twice lands once.
- Degraded writes apply at once at the acting home (stage and commit in one call); decodes read a
  consistent cut by versions as they always did (a member ahead of its parity is read again).

Lock discipline as in ecrec.store.state: public methods take `lock`; `deliver` waits under it for held
rows; `forward_due` calls peers without it.
"""

from __future__ import annotations

import logging

import torch

from ecrec.core.txn import DeltaBatch
from ecrec.core.update import step_of
from ecrec.faults import fault_point
from ecrec.store.state import Busy, StoreState

log = logging.getLogger("ecrec.server")

REFUSED_KEPT = 4096  # (txn, src) whose dropped rows are remembered for their deliverer
# (txn, src, incarnation) of accepted batches remembered: a worker asks again within a few passes of the first
# delivery.
ACCEPTED_KEPT = 16384


class LoggedUpdates(StoreState):
    """The data and parity sides of deltaLog on one server."""

    # -- data server ------------------------------------------------------------------------------------
    def apply_part(
        self,
        txn: str,
        g: torch.Tensor,
        grads: torch.Tensor,
        src: int = -1,
        dense: dict[int, torch.Tensor] | None = None,
        epoch: int = 0,
        delivered: list[str] = (),
        versions: torch.Tensor | None = None,
    ) -> tuple[int, list[DeltaBatch]]:
        """Apply a part (this server's rows, or a failed shard's at its acting home) and answer with the
        deltas the worker must deliver. A retried part is answered from the log, applied once."""
        src, local, dense = self._check_part(g, grads, src, dense)
        if delivered:
            with self.lock:
                self.deltalog.ack(delivered)
        if src != self.shard:
            return self._write_acting(txn, src, local, grads, versions), []
        self.ensure_rows(local)
        with self.lock:
            logged = self.deltalog.get(txn)
            if logged is not None:
                return logged.rows, list(logged.batches)
            if txn in self.outcomes:  # applied and acknowledged (or forwarded): nothing left to deliver
                return local.numel(), []
            self._admit(dense, epoch)
            # Only a recovery lock group locks rows under deltaLog: it finishes on its own.
            self._wait(lambda: not self.rows.locks.busy(local, txn), "rows being rebuilt")
            n = local.numel()
            local, grads = self._not_rebuilt_with(local, grads, versions)
            batches = self.rows.apply(txn, local, grads)
            step = step_of(txn)
            self.dense.stage(txn, step, dense)
            self.dense.commit(txn, step)
            # The worker stamps the deltas it delivers with this server's incarnation in its map; those
            # this server forwards itself carry the one in its own (0 while it has none: not said).
            incarnation = self._incarnation(self.shard)
            for b in batches:
                b.incarnation = incarnation
            self.deltalog.add(txn, n, batches, self.clock())
            self._remember(txn, "committed")
            self.cond.notify_all()
        fault_point("stage:after_local")
        return n, list(batches)

    def _write_acting(
        self, txn: str, src: int, local: torch.Tensor, grads: torch.Tensor, versions: torch.Tensor | None
    ) -> int:
        """A degraded write, staged and committed in one call (this server is the rows' only writer)."""
        with self.lock:
            if self.outcomes.get(txn) == "committed":
                return local.numel()  # a retry whose first answer was lost
            self._settle_src(src)
        n = self._stage_acting(txn, src, local, grads, lone=True, versions=versions)
        if self.commit(txn) != "committed":
            raise Busy(f"degraded write {txn} was not committed")
        return n

    def hold_forwards(self, hold: bool) -> None:
        """The coordinator's word (heartbeats): while the job rolls back to a checkpoint, forward nothing: a
        delta from before the rollback must not reach a parity server that has loaded the checkpoint."""
        with self.lock:
            self._forwards_held = hold

    def forwards_held(self) -> bool:
        """Held, and no forward pass that began before is still on its way (said back to the coordinator)."""
        with self.lock:
            return self._forwards_held and self._forwarding == 0

    def forward_due(self) -> int:
        """Forward the deltas of logged parts whose worker is gone (or silent past txnTimeout) to their
        parity servers; returns how many parts were forwarded. A parity server that failed needs nothing:
        its records are re-encoded from the data rows when it is rebuilt."""
        with self.lock:
            if self._forwards_held:
                return 0
            self._forwarding += 1
        try:
            return self._forward_due()
        finally:
            with self.lock:
                self._forwarding -= 1

    def _forward_due(self) -> int:
        with self.lock:
            gone = self.fence.fenced
            txns = self.deltalog.due(self.clock(), self.txn_timeout, gone)
            batches = [b for b in self.deltalog.batches(txns) if not self.peers.is_failed(b.parity_server)]
        if not txns:
            return 0
        if batches:
            errors = self.peers.deltas(batches, True, self.epoch)
            if any(e is not None and not self.peers.confirm_failed(s) for s, e in errors.items()):
                return 0  # a live parity server did not get them: the next expiry pass tries again
        with self.lock:
            self.deltalog.ack(txns)
            for txn in txns:  # the parts-expired counters: what the server settled for a silent worker
                self.stats["expired_worker_gone" if gone(txn) else "expired_timeout"] += 1
        return len(txns)

    # -- parity server ----------------------------------------------------------------------------------
    def deliver(
        self, batches: list[DeltaBatch], wait: bool = True, delivered: list[str] = ()
    ) -> list[tuple[str, int, torch.Tensor]]:
        """Apply delivered deltas in version order. With `wait`, answer once every row is applied, so the
        worker may count them done: a row held for an earlier update waits for it (another worker delivers
        it, or its data server forwards it). Returns (txn, src, parity indices) of rows refused: their data
        server's incarnation is failed or replaced here, and their worker must write them again."""
        refused, accepted, held = self._accept(batches, delivered)
        with self.lock:
            if not wait:
                return refused
            try:
                self._wait(
                    lambda: not self._still_held(held),
                    "deltas held for an earlier update of their rows",
                    cond=self.held_cond,
                )
            except Busy:
                # Normal under load now and then; the same rows every time are the sign of a lost update.
                log.warning("a delivery waited for its predecessors in vain: %s", self.parity.why_held(held))
                raise
            return refused + self._dropped([(b.txn, b.src) for b in accepted])

    def deliver_early(
        self, batches: list[DeltaBatch], asked: list[tuple[str, int]] = (), delivered: list[str] = ()
    ) -> tuple[list[tuple[str, int, torch.Tensor]], list[tuple[str, int]]]:
        """`deliver` without the wait (deliveries riding on the worker's next stage, which must not stall on
        another worker's step): rows held for a predecessor stay held, and their parts are named. `asked`:
        parts named so before — still held, or their held rows applied or dropped since? Returns the refused
        rows (as `deliver`) and the (txn, src) parts still held; every other row of the batches and of
        `asked` is applied."""
        refused, accepted, _held = self._accept(batches, delivered)
        with self.lock:
            parts = list(dict.fromkeys([(b.txn, b.src) for b in accepted] + list(asked)))
            for src in {s for _t, s in asked}:
                self._settle_src(src)
            still = self.parity.held_parts()
            held = [k for k in parts if k in still]
            return refused + self._dropped([k for k in parts if k not in still]), held

    def _accept(self, batches: list[DeltaBatch], delivered: list[str]) -> tuple[list, list, list]:
        """Apply what can be applied of `batches` now: (refused rows, accepted batches, accepted batches with
        rows held for a predecessor)."""
        for b in batches:
            self.check_deltas(b)
        refused: list[tuple[str, int, torch.Tensor]] = []
        with self.lock:
            releases = self.parity.releases
            self.deltalog.ack(delivered)
            accepted, again, held = [], [], []  # held: accepted with rows held for a predecessor
            for b in batches:
                self._settle_src(b.src)
                key = (b.txn, b.src, b.incarnation)  # a replacement may apply the same txn anew
                if key in self.accepted:
                    # Delivered before (its answer was lost, or another server's was): applied then, or
                    # held, and dropped (named in `refused`) if its data server has failed since. Never
                    # refused whole now: a worker that wrote its rows again would apply them twice.
                    self.accepted.move_to_end(key)
                    again.append(b)
                    if not self._refuses(b):
                        self.parity.apply(b)  # rows already reflected are skipped
                elif self._refuses(b):
                    refused.append((b.txn, b.src, b.index))
                    self._keep_refused(b)  # (r = 2: the other parity record may have taken it)
                else:
                    self._written_again(b)
                    if not self.parity.apply(b):
                        held.append(b)
                    accepted.append(b)
                    self.accepted[key] = None
                    if len(self.accepted) > ACCEPTED_KEPT:
                        self.accepted.popitem(last=False)
            self.stats["deltas_delivered"] += len(accepted)
            self.stats["deltas_held"] += len(held)
            accepted += again
            held += again
            self.cond.notify_all()
            if self.parity.releases != releases:  # held rows applied: deliveries waiting for them look again
                self.held_cond.notify_all()
        fault_point("delta:after_stage")
        return refused, accepted, held

    def _written_again(self, b: DeltaBatch) -> None:
        """A part's rows dropped here with an earlier incarnation of `b.src`, delivered anew: its worker, told
        they were refused, wrote them again at the replacement under the same txn (deltaLog's txns are
        stable). They are applied now, no longer refused: named so again, they were written again for ever.
        (Needs `lock`.)"""
        key = (b.txn, b.src)
        rows = self.refused.get(key)
        if rows is None:
            return
        left = rows[~torch.isin(rows, b.index)]
        if left.numel():
            self.refused[key] = left
        else:
            del self.refused[key]

    def _still_held(self, held: list[DeltaBatch]) -> bool:
        """Is a batch of `held` neither applied nor dropped (settled by `_dropped`)? (Needs `lock`.)"""
        still = self.parity.held_parts()
        return any(
            (b.txn, b.src) in still and not self._refuses(b) and (b.txn, b.src) not in self.refused
            for b in held
        )

    def _dropped(self, parts: list[tuple[str, int]]) -> list[tuple[str, int, torch.Tensor]]:
        """The rows of accepted `parts` dropped while held (their data server failed), for their deliverer.
        (Needs `lock`.)"""
        out = []
        for txn, src in parts:
            self._settle_src(src)
            rows = self.refused.get((txn, src))
            if rows is not None and rows.numel():
                out.append((txn, src, rows))
        return out

    def _incarnation(self, shard: int) -> int:
        """The shard's incarnation in this server's map; 0 where it has none (TwoParity._failure_key: None)."""
        return int(self._failure_key(shard) or 0)

    def _refuses(self, b: DeltaBatch) -> bool:
        """Is the incarnation that applied `b` failed or replaced in this server's map? (Needs `lock`.)"""
        if self.peers.is_failed(b.src):
            return True
        known = self._incarnation(b.src)  # 0: this server's map has not been needed yet (nothing changed)
        return b.incarnation != 0 and known != 0 and b.incarnation != known

    def _settle_src(self, src: int) -> None:
        """Drop the held deltas of `src` once the incarnation that sent them is failed or replaced: the
        predecessors they wait for will be refused. Their rows are remembered for their deliverers.
        (Needs `lock`.)"""
        now = -1 if self.peers.is_failed(src) else self._incarnation(src)
        before = self.held_from.get(src, 0)
        if now in (0, before):  # 0: not known yet (this server's map was never needed)
            self.held_from.setdefault(src, now)  # (a key: every expiry pass looks again, `expire`)
            return
        self.held_from[src] = now
        # A first look (before 0) at a shard that is up cannot tell which incarnation its held deltas came
        # from but by their stamps: those of another one wait for predecessors that will be refused.
        for h in self.parity.drop_held(src, incarnation=now if before == 0 and now > 0 else None):
            self._keep_refused(h)
            key = (h.txn, h.src)
            prev = self.refused.get(key)
            self.refused[key] = h.index if prev is None else torch.cat([prev, h.index])
            while len(self.refused) > REFUSED_KEPT:
                self.refused.popitem(last=False)
        self._parity_changed()
