"""Warm spares (`servers.spares`): server processes started, registered and idle, each ready to take over a
failed shard at once. Pure bookkeeping of the coordinator's side, no I/O and no clock of its own.

A spare process registers without a shard id and heartbeats like a server. When a shard is declared failed,
the coordinator assigns it a live spare (`assign`); the spare hears its assignment in its next heartbeat's
answer, builds the empty store of that shard and registers under the shard id as a replacement — the same
path a freshly started replacement takes, minus the process start-up (imports, the gRPC server), which is
what a full recovery waited for most. Once it registered as the shard (`taken`) it is a server like any
other and leaves the pool; the launcher (ecrec.core.reconcile) starts a new spare to keep `servers.spares`.

An assignment is released when the spare goes silent for the failure timeout before it registered, or has
not registered as the shard within that time although it heartbeats (`expire`): the shard then gets another
spare, or a new process from the launcher. A coordinator that
replaces a dead one starts with an empty pool; spares whose heartbeats it does not know register again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Spare:
    instance: str
    address: str
    metrics_url: str
    heard_at: float
    registered_at: float
    assigned: int | None = None  # the shard it is to take over
    assigned_at: float | None = None

    def to_dict(self) -> dict:
        return {
            "instance": self.instance,
            "address": self.address,
            "assigned": self.assigned,
        }


class SparePool:
    def __init__(self) -> None:
        self.spares: dict[str, Spare] = {}  # by instance, in registration order

    def register(self, instance: str, address: str, metrics_url: str, now: float) -> Spare:
        """A spare says it is there (again: a repeated registration keeps its assignment)."""
        if not instance:
            raise ValueError("instance: a spare must name itself")
        spare = self.spares.get(instance)
        if spare is None:
            spare = self.spares[instance] = Spare(instance, address, metrics_url, now, now)
        spare.address, spare.metrics_url, spare.heard_at = address, metrics_url, now
        return spare

    def heartbeat(self, instance: str, now: float) -> Spare | None:
        """The spare, if this pool knows it (None: it must register again)."""
        spare = self.spares.get(instance)
        if spare is not None:
            spare.heard_at = now
        return spare

    def assigned_to(self, shard: int) -> Spare | None:
        return next((s for s in self.spares.values() if s.assigned == shard), None)

    def assign(self, failed: Iterable[int], now: float) -> list[tuple[int, Spare]]:
        """Give each failed shard without a spare one of the idle spares (the longest registered first);
        returns the new assignments."""
        out = []
        idle = [s for s in self.spares.values() if s.assigned is None]
        for shard in sorted(set(failed)):
            if not idle:
                break
            if self.assigned_to(shard) is not None:
                continue
            spare = idle.pop(0)
            spare.assigned, spare.assigned_at = shard, now
            out.append((shard, spare))
        return out

    def release(self, shard: int) -> Spare | None:
        """The shard no longer needs its spare (a process of its own registered for it first)."""
        spare = self.assigned_to(shard)
        if spare is not None:
            spare.assigned = spare.assigned_at = None
        return spare

    def taken(self, instance: str) -> Spare | None:
        """The spare registered as its shard: it is a server now, no longer a spare."""
        return self.spares.pop(instance, None)

    def expire(self, now: float, timeout: float, takeover_timeout: float | None = None) -> list[Spare]:
        """Spares silent for `timeout` seconds are dropped (their assignments with them), and so are spares
        that heartbeat but have not taken the shard assigned to them within `takeover_timeout` (default
        `timeout`; a takeover takes about a second): a stuck spare, or a stray client posing as one, must not
        hold a failed shard."""
        takeover = timeout if takeover_timeout is None else takeover_timeout
        gone = [
            s
            for s in self.spares.values()
            if now - s.heard_at > timeout or (s.assigned_at is not None and now - s.assigned_at > takeover)
        ]
        for s in gone:
            del self.spares[s.instance]
        return gone

    def snapshot(self) -> list[dict]:
        return [s.to_dict() for s in self.spares.values()]
