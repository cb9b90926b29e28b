"""A data server's log of applied updates whose deltas may not have reached their parity servers yet
(commit: deltaLog; docs/protocol.md, "Update path"), without I/O.

With deltaLog a stage applies the part at once and answers with its deltas; the worker delivers them to the
parity servers and, on its next stage here, says so (`ack`). Until then the entry stays: a retried stage is
answered from it (the part is applied once), and if the worker dies before it could deliver, the server
forwards the deltas itself (`due`). Parity servers apply deltas in version order and skip what they already
reflect, so a delta delivered twice — by the worker and by the server — is applied once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

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
