"""Checkpoint snapshots of one shard (strategies checkpoint, checknrun, cpr: docs/protocol.md, "Checkpoint
strategies"): the copy out (ecrec.core.snapshots decides what), cpr's hot rows, and the load back.

Lock discipline: every method takes `lock` itself and must be called without it; none waits. A copy is
taken under the lock (workers are paused for a full checkpoint, so it is a consistent cut); a load merges
the files' tensors without the lock, then replaces the state under it, forgets the remembered outcomes and
notifies `cond`.
"""

from __future__ import annotations

import torch

from ecrec.model import init_dense
from ecrec.store.state import StoreState, _model_args


class Checkpoints(StoreState):
    """Copies of this shard's state for a checkpoint, and its restore."""

    def checkpoint_tensors(self, checkpoint: int = 0, base: int | None = None) -> dict[str, torch.Tensor]:
        """A copy of this shard's state (ecrec.core.snapshots): workers are paused for a checkpoint, so
        nothing is in flight and the copy is a consistent cut."""
        with self.lock:
            return self.snapshots.copy(
                self.rows.records, self.rows.versions, self.dense.records, checkpoint, base
            )

    def hot_tensors(self) -> dict[str, torch.Tensor]:
        """cpr: a copy of the hot rows and every dense chunk, taken while training goes on."""
        with self.lock:
            return self.snapshots.hot_copy(self.rows.records, self.rows.versions, self.dense.records)

    def _initial_tensors(self) -> dict[str, torch.Tensor]:
        """The state the job starts from (a pure function of the seed), for a restore with no checkpoint yet."""
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
        return out

    def load_checkpoint(
        self,
        tensors: dict[str, torch.Tensor] | None,
        *increments: dict[str, torch.Tensor],
        base: int | None = None,
    ) -> int:
        """Replace this shard's whole state with a checkpoint's (None: the initial state), then apply the rows
        (and dense chunks) of `increments` in order: checknrun's increment, cpr's hot-row saves. Returns the
        data rows loaded. A checkpoint of another shape is refused and changes nothing."""
        expect = {"rows": (self.num_rows, self.ctx.record_width), "versions": (self.num_rows,)}
        expect |= {f"dense.{c}": tuple(recs.shape) for c, recs in self.dense.records.items()}
        t = self.snapshots.merge(self._initial_tensors() if tensors is None else tensors, increments, expect)
        with self.lock:
            self.rows.records.copy_(t["rows"])
            self.rows.versions.copy_(t["versions"])
            for c in self.dense.records:
                self.dense.install(c, t[f"dense.{c}"].clone())
            self.row_ready.fill_(True)
            self.snapshots.loaded(base, t["modified"])
            self.replacement = False
            self.outcomes.clear()
            self.cond.notify_all()
        return self.num_rows
