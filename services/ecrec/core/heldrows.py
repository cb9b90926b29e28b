"""A parity server's version-ordered apply of xor deltas with the held rows in flat arrays, the loop in C
(ecrec/core/_heldrows.c): `ParityParticipant`'s path wherever the extension is built and the records are
float32 on the CPU. Without the extension the numpy path (ecrec.core.ordered_xor) runs instead, and the torch
path (ecrec.core.txn) stays the reference: tests/test_txn.py checks all three agree, tests/test_heldrows.py what
only this path has.

Why: with several workers on hot rows half the delivered batches have rows ahead of a predecessor, and in
numpy the cost of holding, cutting and retrying them — a dozen calls of a few µs per batch, whatever its
rows — grew a stage by 40% from one worker to four (docs/benchmarks.md, "The held path in C"). Here a batch is one call: rows
next in their version order are xored in, rows further ahead are copied into the held arrays, and each
applied row releases the held rows of its own (record, member) key that are next now, until none is.

Held rows are grouped back into `DeltaBatch`es only where the protocol asks about them by part (a failed data
server's held rows dropped, a commit proved, a held part named in a log line): rare paths. `parts()` — which
parts still have held rows, asked on every delivery that waits or asks — reads the arrays directly.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    from ecrec.core import _heldrows
except ImportError:  # not built (no C compiler where the package was installed): ecrec.core.ordered_xor runs
    _heldrows = None

AVAILABLE = _heldrows is not None


class HeldRows:
    """The rows of committed xor deltas held for a predecessor, and the apply that fills and empties them."""

    def __init__(
        self, parity: torch.Tensor, pver: torch.Tensor, k: int, batch_type: type, capacity: int = 256
    ):
        if _heldrows is None:
            raise RuntimeError("ecrec.core._heldrows is not built")
        self.k, self._batch = k, batch_type
        self.width = parity.shape[1]
        # The records' memory as the C side takes it (the tensors are only ever changed in place).
        self._bits = parity.numpy().reshape(-1).view(np.int32)
        self._pver = pver.numpy().reshape(-1)
        self.marks = np.zeros(pver.numel(), dtype=np.int32)  # held rows per (record, member) key
        self.count = 0
        self._allocate(capacity)
        # Part ids: (txn, src, incarnation, parity server) of the batches rows were held from, by first hold.
        self._parts: list[tuple] = []
        self._ids: dict[tuple, int] = {}

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return self.key, self.index, self.version, self.part, self.delta

    def _allocate(self, capacity: int) -> None:
        self.key, self.index, self.version, self.part = (np.zeros(capacity, dtype=np.int64) for _ in range(4))
        self.delta = np.zeros((capacity, self.width), dtype=np.int32)
        self._flat_delta = self.delta.reshape(-1)

    def _reserve(self, n: int) -> None:
        """Room for `n` more rows (the C side writes only within the arrays it is given)."""
        if self.count + n <= self.key.size:
            return
        old = self._arrays()
        self._allocate(max(2 * self.key.size, self.count + n))
        for new, was in zip(self._arrays(), old, strict=True):
            new[: self.count] = was[: self.count]

    def __len__(self) -> int:
        return self.count

    def _part_id(self, b, hold: bool) -> int:
        """The id of the batch's part (txn, src, incarnation, parity server); `hold`: register it if new."""
        ident = (b.txn, b.src, b.incarnation, b.parity_server)
        pid = self._ids.get(ident, len(self._parts))
        if hold and pid == len(self._parts):
            self._ids[ident] = pid
            self._parts.append(ident)
        return pid

    def apply(self, b) -> tuple[bool, bool]:
        """Apply one batch of committed xor deltas. Returns (every row reflected — none held —, some held row
        left: applied, or dropped as already reflected)."""
        self._reserve(b.index.numel())
        pid = self._part_id(b, hold=False)
        count, _applied, ahead, released, dropped = _heldrows.apply(
            self._bits,
            self._pver,
            self.marks,
            self.width,
            self.k,
            np.ascontiguousarray(b.index.numpy()),
            np.ascontiguousarray(b.slot.numpy()),
            np.ascontiguousarray(b.version.numpy()),
            np.ascontiguousarray(b.delta.numpy()).reshape(-1).view(np.int32),
            self.key,
            self.index,
            self.version,
            self.part,
            self._flat_delta,
            self.count,
            pid,
        )
        self.count = count
        if ahead:  # rows were held under the id: keep it
            self._part_id(b, hold=True)
        if released or dropped:
            self._tidy()
        return ahead == 0, bool(released or dropped)

    def _tidy(self) -> None:
        """Forget the part ids no held row names any more (all of them once nothing is held)."""
        if self.count == 0:
            self._parts, self._ids = [], {}
        elif len(self._parts) > 4 * max(self.count, 64):
            live, inverse = np.unique(self.part[: self.count], return_inverse=True)
            self._parts = [self._parts[i] for i in live.tolist()]
            self._ids = {p: i for i, p in enumerate(self._parts)}
            self.part[: self.count] = inverse

    def parts(self) -> set[tuple[str, int]]:
        """(txn, src) of the parts with rows held."""
        if not self.count:
            return set()
        return {self._parts[i][:2] for i in np.unique(self.part[: self.count]).tolist()}

    def batches(self) -> list:
        """The held rows as `DeltaBatch`es, one per part (in the order parts were first held), rows by key."""
        if not self.count:
            return []
        n = self.count
        order = np.lexsort((self.key[:n], self.part[:n]))
        part = self.part[:n][order]
        cuts = np.flatnonzero(np.diff(part)) + 1
        out = []
        for rows in np.split(order, cuts):
            txn, src, incarnation, server = self._parts[int(self.part[rows[0]])]
            key = self.key[rows]
            out.append(
                self._batch(
                    parity_server=server,
                    txn=txn,
                    src=src,
                    index=torch.from_numpy(self.index[rows]),
                    slot=torch.from_numpy(key % self.k),
                    delta=torch.from_numpy(self.delta[rows].view(np.float32)),
                    version=torch.from_numpy(self.version[rows]),
                    incarnation=incarnation,
                    keys=key,
                )
            )
        return out

    def load(self, batches: list) -> None:
        """Hold exactly the rows of `batches` (what stays held after a drop), nothing else."""
        self.count = 0
        self.marks[:] = 0
        self._parts, self._ids = [], {}
        n = sum(b.index.numel() for b in batches)
        self._reserve(n)
        at = 0
        for b in batches:
            m = b.index.numel()
            key = b.member_keys(self.k)
            self.key[at : at + m] = key
            self.index[at : at + m] = b.index.numpy()
            self.version[at : at + m] = b.version.numpy()
            self.part[at : at + m] = self._part_id(b, hold=True)
            self.delta[at : at + m] = b.delta.numpy().view(np.int32)
            np.add.at(self.marks, key, 1)
            at += m
        self.count = at
