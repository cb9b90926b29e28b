"""The dense (NN) chunks one server replicates, and their two-phase commit state, without I/O.

The dense parameters are cut into chunks, each held by r + 1 servers (`JobContext.dense_holders`; one without
replication). A worker step's update of a chunk is staged at each replica with the step's row part and applied
when that part commits, so the replicas apply the same steps in commit order. A replacement replica copies
the chunk from a surviving one: the survivor first lets its staged updates drain (`begin_copy`, new stages
wait while `copying`), then hands over its records with the steps they hold (`copy_out`); the replacement
installs them (`install`) and skips those steps if a worker stages them again (`stage` filters by `log`).

Plain state and tensors: the caller (ShardStore) holds the server's lock, waits where this says "not yet",
and turns refusals into its errors.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ecrec.core.optim import RowOptimizer

LOG_STEPS = 4096  # steps remembered per chunk: far more than can be in flight when a copy is taken


class DenseReplicas:
    """This server's replicas of dense chunks: records [length, record width] per chunk, by chunk id."""

    def __init__(self, optimizer: RowOptimizer, records: dict[int, torch.Tensor], ready: dict[int, bool]):
        self.opt = optimizer
        self.records = records
        # False while a replacement has not copied the chunk from its surviving replica (or a checkpoint)
        self.ready = ready
        self.staged: dict[str, dict[int, torch.Tensor]] = {}  # txn -> chunk -> flat gradient
        self.log: dict[int, OrderedDict] = {c: OrderedDict() for c in records}  # chunk -> steps applied
        self.min_epoch: dict[int, int] = {}  # chunk -> stages planned under an older map are refused
        self.copying: set[int] = set()  # chunks being copied out: new stages wait

    def __contains__(self, chunk: int) -> bool:
        return chunk in self.records

    def length(self, chunk: int) -> int:
        return self.records[chunk].shape[0]

    def values(self, chunk: int) -> torch.Tensor:
        """The chunk's parameters (a copy), without optimizer state."""
        return self.records[chunk][:, 0].clone()

    def all_ready(self) -> bool:
        return all(self.ready.values())

    def not_ready(self, chunks) -> list[int]:
        return sorted(c for c in chunks if not self.ready[c])

    def stale(self, chunk: int, epoch: int) -> bool:
        """Was a stage of `chunk` planned under a map older than the chunk's newest replica?"""
        return bool(epoch) and epoch < self.min_epoch.get(chunk, 0)

    def any_copying(self, chunks) -> bool:
        return any(c in self.copying for c in chunks)

    def in_flight(self, chunk: int) -> bool:
        """Is an update of `chunk` staged and undecided?"""
        return any(chunk in d for d in self.staged.values())

    # -- updates ---------------------------------------------------------------------------------------
    def apply_now(self, chunk: int, grads: torch.Tensor) -> None:
        """An update without two-phase commit (grads [length, 1])."""
        self.records[chunk] = self.opt.apply(self.records[chunk], grads)

    def stage(self, txn: str, step: str, grads: dict[int, torch.Tensor]) -> None:
        """Stage `step`'s update of some chunks under `txn`. A step a copy already brought is not staged
        again (the two replicas stay bit-identical)."""
        grads = {c: g for c, g in grads.items() if step not in self.log[c]}
        if grads:
            self.staged[txn] = {c: g.clone() for c, g in grads.items()}

    def commit(self, txn: str, step: str) -> bool:
        """Apply what `txn` staged; False if it staged nothing here."""
        grads = self.staged.pop(txn, None)
        if grads is None:
            return False
        for c, g in grads.items():
            self.records[c] = self.opt.apply(self.records[c], g.reshape(-1, 1))
            log = self.log[c]
            log[step] = None
            while len(log) > LOG_STEPS:
                log.popitem(last=False)
        return True

    def abort(self, txn: str) -> None:
        self.staged.pop(txn, None)

    # -- copies to and from another replica ------------------------------------------------------------
    def begin_copy(self, chunk: int, epoch: int) -> None:
        """The surviving replica's side: refuse stages planned before `epoch` (the replacement's map), and
        hold new ones back until the copy is taken, so the staged ones can drain."""
        self.min_epoch[chunk] = max(self.min_epoch.get(chunk, 0), epoch)
        self.copying.add(chunk)

    def copy_out(self, chunk: int) -> tuple[torch.Tensor, list[str]]:
        """The records and the steps they hold (once nothing is in flight: see in_flight)."""
        return self.records[chunk].clone(), list(self.log[chunk])

    def end_copy(self, chunk: int) -> None:
        self.copying.discard(chunk)

    def install(self, chunk: int, records: torch.Tensor, steps=()) -> None:
        """The replacement's side (or a checkpoint's): the chunk as copied, and the steps it holds."""
        self.records[chunk] = records
        self.log[chunk] = OrderedDict.fromkeys(steps)
        self.ready[chunk] = True

    def load(self, records: dict[int, torch.Tensor]) -> None:
        """Every chunk takes the records given (a checkpoint's, or the initial state), holding no step:
        steps replayed after a rollback must apply. Nothing is staged or being copied out any more.
        `min_epoch` stays: it is about map epochs, which a load leaves alone (a stage planned under a map
        older than a chunk's newest replica is still refused)."""
        for c in self.records:
            self.install(c, records[c])
        self.staged.clear()
        self.copying.clear()
