"""A data server's log of applied updates whose deltas may not have reached their parity servers yet
(commit: deltaLog; docs/protocol.md, "Update path"), without I/O.

With deltaLog a stage applies the part at once and answers with its deltas; the worker delivers them to the
parity servers and, on its next stage here, says so (`ack`). Until then the entry stays: a retried stage is
answered from it (the part is applied once), and if the worker dies before it could deliver, the server
forwards the deltas itself (`due`). Parity servers apply deltas in version order and skip what they already
reflect, so a delta delivered twice — by the worker and by the server — is applied once.

The log also lets the server answer a decode with a row as it was a few versions ago (`roll_back`): a member
ahead of its parity record then still gives a consistent cut, without waiting for the delivery.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ecrec.core.txn import DeltaBatch, never_gone


@dataclass
class LoggedPart:
    """A part applied here: its rows' count and deltas, and when it was applied."""

    rows: int
    batches: list[DeltaBatch]
    applied_at: float


class DeltaLog:
    """Applied parts not yet acknowledged as delivered, in the order they were applied."""

    def __init__(self) -> None:
        self._parts: OrderedDict[str, LoggedPart] = OrderedDict()

    def __len__(self) -> int:
        return len(self._parts)

    def __contains__(self, txn: str) -> bool:
        return txn in self._parts

    def add(self, txn: str, rows: int, batches: list[DeltaBatch], now: float) -> None:
        self._parts[txn] = LoggedPart(rows, list(batches), now)

    def clear(self) -> None:
        """Forget every part (a checkpoint was loaded: the updates they logged were undone)."""
        self._parts.clear()

    def get(self, txn: str) -> LoggedPart | None:
        return self._parts.get(txn)

    def ack(self, txns: Iterable[str]) -> int:
        """The worker delivered these parts' deltas: forget them. Returns how many were here."""
        return sum(self._parts.pop(t, None) is not None for t in txns)

    def due(self, now: float, timeout: float, gone: Callable[[str], bool] = never_gone) -> list[str]:
        """Parts to forward from here: logged for longer than `timeout`, or applied for a worker process known
        to be `gone`. In the order they were applied (a row's deltas then reach a parity server in version
        order)."""
        return [t for t, p in self._parts.items() if now - p.applied_at > timeout or gone(t)]

    def batches(self, txns: Iterable[str]) -> list[DeltaBatch]:
        return [b for t in txns if t in self._parts for b in self._parts[t].batches]

    def roll_back(
        self, local: torch.Tensor, records: torch.Tensor, versions: torch.Tensor, as_of: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `local` (current `records` [n, W] and `versions`) as they were at versions `as_of`: every
        logged update newer than that undone. xor code only: a logged delta is old ^ new, so old = new ^ delta
        bit for bit. A row the log cannot take back that far (its deltas acknowledged meanwhile, or asked
        for a version it has not reached) answers version -1. With r = 1 each row's delta is in one batch."""
        out = records.clone()
        n = local.numel()
        entries = [b for p in self._parts.values() for b in p.batches]
        if n == 0 or not entries:
            return out, torch.where(as_of == versions, versions, -1)
        rows = torch.cat([b.index * k + b.slot for b in entries])
        vers = torch.cat([b.version for b in entries])
        deltas = torch.cat([b.delta for b in entries]).view(torch.int32)
        # entry -> position in the request (requests name a row once; a repeated row is not rolled back)
        order = torch.argsort(local)
        pos = torch.searchsorted(local[order], rows).clamp(max=n - 1)
        hit = local[order][pos] == rows
        at = order[pos]
        undo = hit & (vers > as_of[at]) & (vers <= versions[at])
        at, deltas = at[undo], deltas[undo]
        covered = torch.bincount(at, minlength=n) == versions - as_of
        bits = out.view(torch.int32)
        at, perm = torch.sort(at, stable=True)
        deltas = deltas[perm]
        while at.numel():  # one pass per update of the most updated row (a few): each pass a row at most once
            first = torch.ones_like(at, dtype=torch.bool)
            first[1:] = at[1:] != at[:-1]
            rows_now = at[first]
            bits.index_copy_(0, rows_now, bits.index_select(0, rows_now) ^ deltas[first])
            at, deltas = at[~first], deltas[~first]
        return out, torch.where(covered, as_of, -1)
