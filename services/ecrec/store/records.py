"""The shard's own rows and dense chunks: reads (pull, whole-table pages) and the updates without 2PC
(strategy none, or twoPhaseCommit: false), which apply at once and send their deltas from here.

Lock discipline: every method takes `lock` itself (StoreState) and must be called without it. `pull` and
`push` first rebuild rows a replacement has not reached yet (Recovery.ensure_rows, without the lock); reads
wait (`_wait`) only for a dense chunk not copied yet. `push` applies and locks its rows under the lock,
releases it to send the deltas (`_send_deltas` calls peers), then unlocks the rows and notifies `cond`.
"""

from __future__ import annotations

import time

import torch

from ecrec.core.txn import DeltaBatch
from ecrec.store.peers import PeerFailed
from ecrec.store.state import StoreState
from ecrec.wire import InvalidRequest, check_finite


class Records(StoreState):
    """Reads of this shard's rows and chunks, and updates that apply at once."""

    # ---------------------------------------------------------------------------------------------------
    # reads
    def pull(self, g: torch.Tensor) -> torch.Tensor:
        local = self.local_rows(g)
        self.ensure_rows(local)
        with self.lock:
            self.snapshots.read(local)
            return self.rows.records[:, : self.dim].index_select(0, local)

    def warm(self, g: torch.Tensor) -> None:
        """Rebuild those of rows `g` a replacement has not reached yet, ahead of their pulls."""
        self.ensure_rows(self.local_rows(g))

    def pull_dense(self, chunk: int) -> torch.Tensor:
        self._chunk(chunk)
        with self.lock:
            self._wait(lambda: self.dense.ready[chunk], f"dense chunk {chunk} not copied yet")
            return self.dense.values(chunk)

    def chunk_len(self, chunk: int) -> int:
        return self._chunk(chunk).shape[0]

    def read(self, kind: str, start: int, count: int, chunk: int = 0) -> torch.Tensor:
        table = {
            "data": lambda: self.rows.records,
            "parity": lambda: self.parity.parity,
            "dense": lambda: self._chunk(chunk),
        }[kind]()
        n = table.shape[0]
        if start > n:
            raise InvalidRequest(f"start: {start} is past the end ({n} records)")
        end = n if count == 0 else min(n, start + count)
        with self.lock:
            return table[start:end].clone()

    # ---------------------------------------------------------------------------------------------------
    # updates without 2PC (strategy none, or twoPhaseCommit: false)
    def push(self, g: torch.Tensor, grads: torch.Tensor, txn: str = "") -> int:
        local = self.local_rows(g)
        self._check_grads(grads, local.numel())
        self.ensure_rows(local)
        txn = txn or f"push:{time.monotonic_ns()}"
        with self.lock:
            self._wait(lambda: not self.rows.locks.busy(local), "rows staged by another txn")
            part = self.rows.stage(txn, local, grads, self.clock())
            self.rows.commit(txn)  # applied at once; rows stay locked until the parity has the delta
            self.rows.locks.lock(txn, local)
            self.snapshots.written(local)
        try:
            self._send_deltas(part.batches, immediate=True)
        finally:
            with self.lock:
                self.rows.locks.unlock(txn)
                self.cond.notify_all()
        return local.numel()

    def push_dense(self, chunk: int, grads: torch.Tensor) -> None:
        recs = self._chunk(chunk)
        if grads.shape != (recs.shape[0], 1):
            grads = grads.reshape(-1, 1)
        check_finite(grads, "grads")
        with self.lock:
            self._wait(lambda: self.dense.ready[chunk], "dense chunk not copied yet")
            self.dense.apply_now(chunk, grads)

    def _send_deltas(self, batches: list[DeltaBatch], immediate: bool) -> None:
        """Deliver deltas; a parity server that fails is confirmed with the coordinator, then skipped."""
        pending = [b for b in batches if not self.peers.is_failed(b.parity_server)]
        for _attempt in range(10):
            if not pending:
                return
            errors = self.peers.deltas(pending, immediate, self.epoch)
            retry = []
            for b in pending:
                if errors.get(b.parity_server) is None:
                    continue
                if not self.peers.confirm_failed(b.parity_server):
                    retry.append(b)  # alive after all (a transient error): send again
            pending = retry
        raise PeerFailed(pending[0].parity_server, "deltas not delivered")
