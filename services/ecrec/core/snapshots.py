"""What a shard copies out for the checkpoint strategies and what it loads back (docs/protocol.md, "Checkpoint
strategies"). Pure: tensors in, tensors out; the shard store calls it under its lock.

- **checkpoint**: a full copy (rows, versions, dense chunks) while the workers are paused: a consistent cut.
- **ecrec** (its checkpoint fallback): full copies that also hold the shard's parity records and the member
  versions they reflect (`parity`, `pver`): with the workers paused, data and parity of every shard form one
  consistent cut, which every server loads back when more than r servers are lost at once.
- **checknrun**: a full copy is a *baseline*; from it on the rows updated are marked, and an *increment* over
  baseline b holds only the rows marked since b. A baseline copied here may never be committed (the writer
  died), so the masks of the last few baselines are kept until an increment names a newer base.
- **cpr**: besides full checkpoints, *hot-row saves*: the rows a tracker (ecrec.core.hotrows) found used most,
  copied while training goes on (CPR does not need a consistent cut).

Loading replaces a shard's whole state: a checkpoint (or the initial state), then increments in order.
"""

from __future__ import annotations

import torch

from ecrec.core.errors import InvalidRequest
from ecrec.core.hotrows import make_tracker
from ecrec.core.vec import in_range

MAX_BASELINE_MASKS = 4  # checknrun: baselines whose updated rows a server tracks (uncommitted ones included)

Tensors = dict[str, torch.Tensor]


class ShardSnapshots:
    """One shard's checkpoint bookkeeping: the rows updated since each checknrun baseline, and cpr's hot-row
    tracker (None unless `hot_rows` names one)."""

    def __init__(
        self,
        shard: int,
        num_rows: int,
        *,
        hot_rows: str = "none",
        hot_fraction: float = 0.0,
        ssu_period: int = 2,
    ):
        self.shard, self.num_rows = shard, num_rows
        self.hot_fraction = hot_fraction
        self.modified_since: dict[int, torch.Tensor] = {}
        self.hot = make_tracker(hot_rows, num_rows, hot_fraction, ssu_period, shard)

    # -- what the update path tells it ----------------------------------------------------------------
    def read(self, local: torch.Tensor) -> None:
        """Rows read for a step (cpr's trackers count them)."""
        if self.hot is not None:
            self.hot.access(local)

    def written(self, local: torch.Tensor) -> None:
        """Rows updated: every tracked baseline's next increment holds them."""
        for mask in self.modified_since.values():
            mask[local] = True

    # -- copies out -------------------------------------------------------------------------------------
    def copy(
        self,
        rows: torch.Tensor,
        versions: torch.Tensor,
        dense: Tensors,
        checkpoint: int = 0,
        base: int | None = None,
        parity: Tensors | None = None,
    ) -> Tensors:
        """A copy of the shard's state: row records and versions, dense chunks (`dense.<chunk>`), and for
        ecrec `parity` (its tensors by name: `parity` [P, W] and `pver` [P, k]). With `base` (checknrun's
        increments): only the rows updated since baseline `base` was copied, and their local `index`; a
        baseline `checkpoint` starts tracking the rows updated after it. An increment holds no parity."""
        if base is None:
            out = {"rows": rows.clone(), "versions": versions.clone()}
            out |= {key: t.clone() for key, t in (parity or {}).items()}
            if checkpoint:
                self.modified_since[checkpoint] = torch.zeros(self.num_rows, dtype=torch.bool)
                for old in sorted(self.modified_since)[:-MAX_BASELINE_MASKS]:
                    del self.modified_since[old]  # bounded: a base that old would be a lost cause
        else:
            if parity:
                raise InvalidRequest(
                    "base: a copy with parity records is a full one (ecrec takes no increments)"
                )
            if base not in self.modified_since:
                raise InvalidRequest(f"base: baseline checkpoint {base} was not copied on this server")
            for old in [c for c in self.modified_since if c < base]:
                del self.modified_since[old]
            index = self.modified_since[base].nonzero().squeeze(1)
            out = {"index": index, "rows": rows[index], "versions": versions[index]}
        return out | _dense_copy(dense)

    def hot_copy(self, rows: torch.Tensor, versions: torch.Tensor, dense: Tensors) -> Tensors:
        """cpr: the hot rows (at most hot_fraction of them, the tracker's pick), their `index`, and every dense
        chunk."""
        k = max(1, int(self.num_rows * self.hot_fraction))
        index = self.hot.take(k) if self.hot is not None else torch.zeros(0, dtype=torch.int64)
        return {"index": index, "rows": rows[index], "versions": versions[index]} | _dense_copy(dense)

    # -- loading ------------------------------------------------------------------------------------------
    def merge(self, tensors: Tensors, increments: tuple[Tensors, ...], expect: dict[str, tuple]) -> Tensors:
        """A checkpoint with `increments` applied in order (their rows, and dense chunks), checked against the
        shapes in `expect` (every tensor the shard loads: ecrec's parity and pver too); raises InvalidRequest
        (and changes nothing) for another shape. The rows the increments hold are `modified` in the answer:
        what differs from the checkpoint they apply to."""
        t = dict(tensors)
        modified = torch.zeros(self.num_rows, dtype=torch.bool)
        if increments:
            t["rows"], t["versions"] = t["rows"].clone(), t["versions"].clone()
        for increment in increments:
            index = increment["index"]
            if not in_range(index, self.num_rows):
                raise InvalidRequest(f"checkpoint of shard {self.shard}: increment rows outside the table")
            t["rows"][index], t["versions"][index] = increment["rows"], increment["versions"]
            t |= {k: v for k, v in increment.items() if k.startswith("dense.")}
            modified[index] = True
        for key, shape in expect.items():
            if key not in t or tuple(t[key].shape) != shape:
                got = tuple(t[key].shape) if key in t else "missing"
                raise InvalidRequest(f"checkpoint of shard {self.shard}: {key} is {got}, expected {shape}")
        return t | {"modified": modified}

    def loaded(self, base: int | None, modified: torch.Tensor) -> None:
        """A checkpoint was loaded: the next increment over `base` holds what differs from that baseline."""
        self.modified_since = {base: modified} if base is not None else {}


def _dense_copy(dense: Tensors) -> Tensors:
    return {f"dense.{c}": recs.clone() for c, recs in dense.items()}
