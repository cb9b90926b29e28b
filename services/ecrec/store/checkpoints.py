"""Checkpoint snapshots of one shard (strategies checkpoint, checknrun, cpr, and ecrec's checkpoint fallback:
docs/protocol.md, "Checkpoint strategies"): the copy out (ecrec.core.snapshots decides what), cpr's hot rows,
and the load back.

Lock discipline: every method takes `lock` itself and must be called without it; none waits. A copy is
taken under the lock (workers are paused for a full checkpoint, so it is a consistent cut); a load merges
the files' tensors without the lock, then replaces the state under it, resets every piece of protocol state
in flight to a freshly started, fully rebuilt server's (`_start_afresh`) and notifies `cond`.
"""

from __future__ import annotations

import torch

from ecrec.model import init_dense
from ecrec.store.state import StoreState, _model_args


class Checkpoints(StoreState):
    """Copies of this shard's state for a checkpoint, and its restore."""

    def checkpoint_tensors(self, checkpoint: int = 0, base: int | None = None) -> dict[str, torch.Tensor]:
        """A copy of this shard's state (ecrec.core.snapshots): rows, versions, dense chunks, and under
        strategy ecrec its parity records and their versions (`parity`, `pver`), all under one lock. Workers
        are paused for a checkpoint with their last update applied and delivered, so nothing is in flight
        and the copies of every shard together are a consistent cut."""
        with self.lock:
            return self.snapshots.copy(
                self.rows.records,
                self.rows.versions,
                self.dense.records,
                checkpoint,
                base,
                parity=self._parity_tensors() if self.ctx.ecrec and base is None else None,
            )

    def _parity_tensors(self) -> dict[str, torch.Tensor]:
        """ecrec: the parity records and the member versions they reflect, by their names in a checkpoint."""
        return {"parity": self.parity.parity, "pver": self.parity.pver}

    def hot_tensors(self) -> dict[str, torch.Tensor]:
        """cpr: a copy of the hot rows and every dense chunk, taken while training goes on."""
        with self.lock:
            return self.snapshots.hot_copy(self.rows.records, self.rows.versions, self.dense.records)

    def _initial_tensors(self) -> dict[str, torch.Tensor]:
        """The state the job starts from (a pure function of the seed), for a restore with no checkpoint yet:
        under ecrec with the parity of the initial rows, reflecting version 0 of every member."""
        seed = self.ctx.spec.training.seed
        out = {
            "rows": self._init_records(
                self.placement.global_id(self.shard, torch.arange(self.num_rows)), seed
            ),
            "versions": torch.zeros(self.num_rows, dtype=torch.int64),
        }
        flat = init_dense(*_model_args(self.ctx), seed=seed)
        for c in self.dense.records:
            lo, hi = self.ctx.dense_bounds[c]
            out[f"dense.{c}"] = self.opt.init_records(flat[lo:hi].reshape(-1, 1).clone())
        if self.ctx.ecrec:
            n_par = self.parity.parity.shape[0]
            out["parity"] = self._encode_initial_parity(n_par, seed) if n_par else self.parity.parity.clone()
            out["pver"] = torch.zeros_like(self.parity.pver)
        return out

    def load_checkpoint(
        self,
        tensors: dict[str, torch.Tensor] | None,
        *increments: dict[str, torch.Tensor],
        base: int | None = None,
    ) -> int:
        """Replace this shard's whole state with a checkpoint's (None: the initial state), then apply the rows
        (and dense chunks) of `increments` in order: checknrun's increment, cpr's hot-row saves. Under ecrec
        the checkpoint's parity records and pver are loaded too. Every piece of protocol state in flight is
        reset to what a freshly started, fully rebuilt server has (`_start_afresh`); the epoch stays (the
        coordinator bumps it after a rollback). Returns the data rows loaded. A checkpoint of another shape is
        refused (InvalidRequest) and changes nothing.

        Callers quiesce the updates first (the workers have stopped, as for a rollback): an update that
        reaches this server while it loads is lost or applied to the state it loaded."""
        expect = {"rows": (self.num_rows, self.ctx.record_width), "versions": (self.num_rows,)}
        expect |= {f"dense.{c}": tuple(recs.shape) for c, recs in self.dense.records.items()}
        if self.ctx.ecrec:
            expect |= {key: tuple(t.shape) for key, t in self._parity_tensors().items()}
        t = self.snapshots.merge(self._initial_tensors() if tensors is None else tensors, increments, expect)
        with self.lock:
            self.rows.load(t["rows"], t["versions"])
            self.dense.load({c: t[f"dense.{c}"].clone() for c in self.dense.records})
            if self.ctx.ecrec:
                self.parity.load(t["parity"], t["pver"])
            else:
                self.parity.reset()  # no parity records without ecrec (r = 0): only their bookkeeping
            self.snapshots.loaded(base, t["modified"])
            self._start_afresh()
            self._parity_changed()
        return self.num_rows

    def _start_afresh(self) -> None:
        """After a load (with `lock` held): the server's protocol state as a freshly started server's that has
        rebuilt everything. What the participants keep (staged parts, deltas, locks) they reset themselves
        when they load; this is the store's own. Kept: `epoch` (not part of a checkpoint), `fence` (the
        coordinator's word on dead worker processes; it only grows), `stats` (counters never go back),
        `waiting` (requests still in `_wait` count themselves out) and `dense.min_epoch` (about map epochs)."""
        self.replacement = False  # a replacement that loaded a checkpoint is whole, not rebuilding
        self.row_ready.fill_(True)
        # A rebuild or dense copy still under way on another thread finds `loads` changed and installs
        # nothing over the loaded state (ecrec.store.recovery).
        self.loads += 1
        self.parity_rebuilding.zero_()
        self.dense_copying_in.clear()
        self.acting.reset()
        self.cuts.reset()
        # Updates after the checkpoint were undone: a replay under an id used before must apply anew, not be
        # answered from what this server remembers of it.
        self.outcomes.clear()
        self.deltalog.clear()
        self.accepted.clear()
        self.refused.clear()
        # Nothing is held any more; which incarnation of each data server held deltas belong to is learned
        # again from the map (`_settle_src`).
        self.held_from.clear()
