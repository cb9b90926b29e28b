"""The cluster map: shard id -> address, state, epoch. Pure state, fed events with explicit times.

The coordinator owns one `ClusterMap`; servers register and heartbeat, workers and servers report RPC
failures, and `tick(now)` turns silent servers into failed ones. Every change that a client must see (a
shard failing, a replacement registering at a new address, a recovery finishing) bumps the epoch, so a
request built on an older map is rejected by servers and retried on the new one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ShardState(str, enum.Enum):
    PENDING = "pending"  # never registered yet
    UP = "up"  # serving
    FAILED = "failed"  # declared dead; reads are degraded until a replacement recovers
    RECOVERING = "recovering"  # a replacement registered and is being rebuilt


@dataclass
class ShardInfo:
    shard: int
    state: ShardState = ShardState.PENDING
    address: str = ""
    metrics_url: str = ""
    incarnation: int = 0  # how many processes have registered under this shard id
    last_heartbeat: float = 0.0
    failed_at: float | None = None

    def to_dict(self) -> dict:
        return {
            "shard": self.shard,
            "state": self.state.value,
            "address": self.address,
            "metricsUrl": self.metrics_url,
            "incarnation": self.incarnation,
        }


@dataclass
class Transition:
    """Something that changed in the map; the coordinator turns these into events and metrics."""

    kind: str  # "registered" | "failure_detected" | "replacement_registered" | "recovered"
    shard: int
    epoch: int
    at: float


@dataclass
class ClusterMap:
    num_servers: int
    failure_timeout: float
    # Under strategy "none" a failed server cannot be rebuilt, so a replacement simply starts as UP again.
    recoverable: bool = False
    epoch: int = 1
    shards: list[ShardInfo] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.shards:
            self.shards = [ShardInfo(s) for s in range(self.num_servers)]

    def _check_shard(self, shard: int) -> ShardInfo:
        if not 0 <= shard < self.num_servers:
            raise ValueError(f"shard {shard} out of range [0, {self.num_servers})")
        return self.shards[shard]

    @property
    def ready(self) -> bool:
        return all(s.state is ShardState.UP for s in self.shards)

    def register(self, shard: int, address: str, now: float, metrics_url: str = "") -> list[Transition]:
        info = self._check_shard(shard)
        info.incarnation += 1
        info.address, info.metrics_url, info.last_heartbeat = address, metrics_url, now
        if info.state is ShardState.PENDING:
            info.state = ShardState.UP
            return [Transition("registered", shard, self.epoch, now)]
        # A new process under a known shard id: whatever it replaced is gone, and it starts empty.
        if info.state is ShardState.UP:
            # The old process died without being noticed (it restarted faster than the failure timeout).
            transitions = self._fail(info, now)
        else:
            transitions = []
        info.state = ShardState.RECOVERING if self.recoverable else ShardState.UP
        self.epoch += 1
        return [*transitions, Transition("replacement_registered", shard, self.epoch, now)]

    def heartbeat(self, shard: int, address: str, now: float) -> bool:
        """Record a heartbeat; False tells the sender it is not (or no longer) the registered process."""
        info = self._check_shard(shard)
        if info.address != address or info.state in (ShardState.FAILED, ShardState.PENDING):
            return False
        info.last_heartbeat = now
        return True

    def report_failure(self, shard: int, now: float) -> list[Transition]:
        """A client saw the shard fail (RPC unavailable). The caller should confirm it first (a probe)."""
        info = self._check_shard(shard)
        if info.state in (ShardState.UP, ShardState.RECOVERING):
            return self._fail(info, now)
        return []

    def recovered(self, shard: int, now: float) -> list[Transition]:
        info = self._check_shard(shard)
        if info.state is not ShardState.RECOVERING:
            return []
        info.state = ShardState.UP
        self.epoch += 1
        return [Transition("recovered", shard, self.epoch, now)]

    def tick(self, now: float) -> list[Transition]:
        out: list[Transition] = []
        for info in self.shards:
            if info.state in (ShardState.UP, ShardState.RECOVERING) and (
                now - info.last_heartbeat > self.failure_timeout
            ):
                out.extend(self._fail(info, now))
        return out

    def _fail(self, info: ShardInfo, now: float) -> list[Transition]:
        info.state = ShardState.FAILED
        info.failed_at = now
        self.epoch += 1
        return [Transition("failure_detected", info.shard, self.epoch, now)]

    def snapshot(self) -> dict:
        return {
            "epoch": self.epoch,
            "numServers": self.num_servers,
            "ready": self.ready,
            "shards": [s.to_dict() for s in self.shards],
        }
