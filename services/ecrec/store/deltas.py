"""The parity server's side of the 2PC (docs/protocol.md, "Update path", phases 2 and 4): check and stage
the deltas of other servers' rows (or apply them at once without 2PC), apply or drop them on the worker's
decisions, and settle the ones nobody decided by asking their data server (expiry, I4).

Lock discipline: every method takes `lock` itself and must be called without it; none waits. Deltas are
checked (`check_deltas`, geometry only) before the lock is taken. Decisions notify `cond` (a parity read
for a rebuild, or a degraded write, may wait for them). `_settle` asks the data server (a peer) without the
lock, then decides under it. `stage_deltas` is called by `push` without 2PC (ecrec.store.records: through
the peers) and `decide_many` by a stage that carries decisions (ecrec.store.participant).
"""

from __future__ import annotations

import torch

from ecrec.core.lineage import proves_commit
from ecrec.core.txn import DeltaBatch
from ecrec.faults import fault_point
from ecrec.store.peers import PeerFailed
from ecrec.store.state import NotOwner, StoreState
from ecrec.wire import InvalidRequest


class ParityDeltas(StoreState):
    """Deltas of other servers' rows, staged here until their worker (or their data server) decides."""

    def decide_deltas(self, txn: str, src: int, commit: bool) -> str:
        """A parity server's side of a decision about (txn, src)'s staged deltas."""
        with self.lock:
            if src in self.acting.cache and commit and (txn, src) in self.parity.staged:
                # A dead server's own update committed on its behalf changes its lost rows: forget them.
                rows = torch.cat([self._rows_of(b) for b in self.parity.staged[(txn, src)]])
                self.acting.invalidate(src, rows)
                self.cuts.unalign(src, rows)
            out = self.parity.commit(txn, src) if commit else self.parity.abort(txn, src)
            self._parity_changed()
        fault_point("decide:after_apply")
        return out

    def receive_deltas(self, batch: DeltaBatch, immediate: bool) -> None:
        """Deltas of another server's rows (from the worker, or from the data server without 2PC, or from a
        data server forwarding what its worker did not deliver under deltaLog)."""
        if batch.via >= 0:  # r = 2: from the acting home of a failed shard's rows (ecrec.store.twoparity)
            if batch.base is not None:
                self.realign(batch)
            else:
                self.apply_forward(batch)
        elif self.logged and immediate:
            self.deliver([batch], wait=False)
        else:
            self.stage_deltas([batch], immediate)

    def check_deltas(self, b: DeltaBatch) -> None:
        """A delta batch must come from a data shard whose parity this server holds, for the parity indices
        and stripe slots that placement gives that shard's rows here."""
        p, n = self.placement, self.ctx.num_servers
        if b.parity_server != self.shard or b.src == self.shard or not 0 <= b.src < n:
            raise InvalidRequest(
                f"deltas: batch for server {b.parity_server} from {b.src} sent to {self.shard}"
            )
        if b.index.numel() == 0:
            return
        # numpy on CPU: the same checks at ~1 µs each instead of torch's 5-10 (every batch of every delivery)
        cpu = b.index.device.type == "cpu"
        index, version, slots = (t.numpy() if cpu else t for t in (b.index, b.version, b.slot))
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= self.parity.parity.shape[0]:
            raise InvalidRequest("index: parity indices out of range")
        if int(version.min()) < (0 if b.base is not None else 1):  # (an aligned row may be at version 0)
            raise InvalidRequest("version: a delta takes its row to version 1 or later")
        # The closed form of placement.stripe_members for one source (a hot path: every delta message):
        # every stripe whose parity j this server holds has its member of shard src at the same slot, and
        # that member is a real row (not padding) up to some block. A batch holds one parity j (its rows'
        # parity indices all in j's part of the table, Placement.parity_index).
        j = 0
        if p.r > 1:
            blocks = p.parity_rows_on(self.shard)  # P's, then Q's (Placement.parity_index)
            j = lo // blocks
            if hi // blocks != j:
                raise InvalidRequest("index: a batch's rows are of one parity record j (P or Q), not both")
            hi -= j * blocks
        slot = (b.src - (self.shard - p.k - j) % n) % n
        if bool((slots != slot).any()):
            lo, hi = b.slot.aminmax()
            if int(lo) < 0 or int(hi) >= p.k:
                raise InvalidRequest(f"slot: stripe slots are in [0, {p.k})")
            raise InvalidRequest(f"index: not parity records of shard {b.src}'s rows on server {self.shard}")
        if slot >= p.k or int(hi) * p.k + slot >= p.rows_on(b.src):
            raise InvalidRequest(f"index: not parity records of shard {b.src}'s rows on server {self.shard}")

    def stage_deltas(self, batches: list[DeltaBatch], immediate: bool = False) -> None:
        """Stage (or, without 2PC, apply) deltas of other servers' rows."""
        for b in batches:  # all checked before any is staged
            self.check_deltas(b)
        with self.lock:
            if not immediate:
                # Deltas of a part its data server staged before it died, delivered only after this server
                # learned of the failure: a degraded write of the same rows may be staged here already,
                # built on the version these deltas also build on, and only one of two such updates can
                # reach the record (the other would be skipped as a duplicate, while the acting home's
                # materialized rows hold it). Refused; the worker aborts the part and retries it as a
                # degraded write. Deltas that arrived before the failure are staged, and degraded writes
                # of their rows wait for their decision (_staged_from_rows).
                gone = sorted({b.src for b in batches if self.peers.is_failed(b.src)})
                if gone:
                    raise NotOwner(
                        f"deltas: shard {gone[0]} is failed in this server's cluster map (epoch {self.epoch}):"
                        " retry the part as a degraded write"
                    )
            now = self.clock()
            for b in batches:
                if immediate:
                    self.parity.apply_now(b)
                else:
                    self.parity.stage(b, now)
            self._parity_changed()
        fault_point("delta:after_stage")

    def decide_many(self, decisions: list[tuple[str, int, bool]]) -> list[str]:
        """Decisions about staged deltas, (txn, src, commit) each, in one message from the worker. Commits
        are applied together (ParityParticipant.commit_many) unless an abort is among them or this server
        stands in for one of their data servers (its materialized rows must see each one)."""
        with self.lock:
            if all(commit and src not in self.acting.cache for _t, src, commit in decisions):
                out = self.parity.commit_many([(txn, src) for txn, src, _c in decisions])
                self._parity_changed()
            else:
                out = None
        if out is None:
            return [self.decide_deltas(txn, src, commit) for txn, src, commit in decisions]
        fault_point("decide:after_apply")
        return out

    def _settle(self, txn: str, src: int, age: float) -> None:
        """A delta no worker decided: its data server's outcome decides. If that server is gone, the worker
        that staged the part decides on its behalf; if nobody has after three timeouts, nobody will (the
        worker died too) and dropping the delta is consistent, as the data server's records are gone."""
        answer = "unknown"
        if not self.peers.is_failed(src):
            try:
                answer = self.peers.outcome(src, txn)
            except PeerFailed:
                answer = "unknown"
        if answer == "unknown":
            with self.lock:  # a later delta of one of its rows from src proves src committed it
                if proves_commit(self.parity, txn, src, exclude=self.acting.staged):
                    answer = "committed"
        if answer == "committed":
            self.decide_deltas(txn, src, True)
        elif answer == "aborted" or (answer == "unknown" and age > 3 * self.txn_timeout):
            self.decide_deltas(txn, src, False)
