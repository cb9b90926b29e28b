"""The cluster map: shard id -> address, state, epoch. Pure state, fed events with explicit times.

The coordinator owns one `ClusterMap`; servers register and heartbeat, workers and servers report RPC
failures, and `tick(now)` turns silent servers into failed ones. Every change that a client must see (a
shard failing, a replacement registering at a new address, a recovery finishing) bumps the epoch, so a
request built on an older map is rejected by servers and retried on the new one.

Every process that registers names itself with an `instance` id, unique per process. A registration or
heartbeat that does not fit the map is refused (`Refused`) and changes nothing: a second process for a shard
whose registered process still answers, a process of a superseded incarnation, a first process that claims to
be a replacement. Whether the registered process still answers is a probe, which is I/O: `register` raises
`ProbeFirst` and the caller probes and calls again with `confirmed_dead=True`.

A coordinator that replaces a dead one (docs/protocol.md, "Coordinator failover") is generation g > 1 and
starts from a seed, the map its predecessor last published (`restore`). Its epochs are (g - 1) * 2**32 + n, so
each is above any epoch an older generation could have published. Processes the seed does not know yet (a
replacement that registered after it was written) rejoin with their heartbeat (`rejoin`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Refused(ValueError):
    """A request that does not fit the map's current state; nothing was changed."""


class ProbeFirst(Exception):
    """The shard's registered process must be probed before a new one may take its place."""

    def __init__(self, shard: int, address: str, instance: str):
        super().__init__(f"shard {shard}: probe {address} ({instance}) first")
        self.shard, self.address, self.instance = shard, address, instance


GENERATION_EPOCHS = 2**32  # epochs one coordinator generation can use


def first_epoch(generation: int) -> int:
    return (generation - 1) * GENERATION_EPOCHS + 1


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
    instance: str = ""  # the registered process's own id (unique per process)
    superseded: dict[str, int] = field(default_factory=dict)  # instances of earlier incarnations
    last_heartbeat: float = 0.0
    failed_at: float | None = None

    def to_dict(self) -> dict:
        return {
            "shard": self.shard,
            "state": self.state.value,
            "address": self.address,
            "metricsUrl": self.metrics_url,
            "incarnation": self.incarnation,
            "instance": self.instance,
        }

    def seed(self) -> dict:
        """What a successor coordinator needs to know of this shard (`ClusterMap.restore`)."""
        return {**self.to_dict(), "superseded": dict(self.superseded)}


@dataclass
class Transition:
    """Something that changed in the map; the coordinator turns these into events and metrics."""

    kind: str  # "registered" | "failure_detected" | "replacement_registered" | "rejoined" | "recovered"
    shard: int
    epoch: int
    at: float


@dataclass
class ClusterMap:
    num_servers: int
    failure_timeout: float
    # Under strategy "none" a failed server cannot be rebuilt, so a replacement simply starts as UP again.
    recoverable: bool = False
    generation: int = 1  # which coordinator incarnation owns this map
    epoch: int = 0  # 0: the generation's first epoch
    shards: list[ShardInfo] = field(default_factory=list)
    restored: bool = False  # started from a predecessor's seed: processes it does not know may rejoin

    def __post_init__(self) -> None:
        if self.generation < 1:
            raise ValueError("generation must be >= 1")
        self.epoch = self.epoch or first_epoch(self.generation)
        if not self.shards:
            self.shards = [ShardInfo(s) for s in range(self.num_servers)]

    def restore(self, seed: dict, now: float) -> None:
        """Take over the map a dead coordinator last published. Shards it had up or recovering count as
        alive from `now` (their heartbeats must follow within the failure timeout); the rest keep their
        state. Refused if the seed is not from an older generation."""
        epoch = int(seed.get("epoch", 0))
        if epoch >= first_epoch(self.generation):
            raise Refused(
                f"seed epoch {epoch} is not from a generation before {self.generation}: "
                "a coordinator must be newer than the one it replaces"
            )
        shards = {int(s["shard"]): s for s in seed.get("shards", [])}
        if set(shards) - set(range(self.num_servers)):
            raise Refused(f"seed lists shards outside [0, {self.num_servers})")
        for sid, s in shards.items():
            info = self.shards[sid]
            info.state = ShardState(s.get("state", "pending"))
            info.address = s.get("address", "")
            info.metrics_url = s.get("metricsUrl", "")
            info.incarnation = int(s.get("incarnation", 0))
            info.instance = s.get("instance", "")
            info.superseded = {str(k): int(v) for k, v in (s.get("superseded") or {}).items()}
            info.last_heartbeat = now
            info.failed_at = now if info.state is ShardState.FAILED else None
        self.restored = True

    def serving(self, now: float) -> None:
        """This coordinator answers from `now` on: the first moment a restored shard's heartbeat can reach it.
        Its failure timeout counts from here, not from `restore` (a successor slow to start, e.g. on a busy
        machine, would otherwise declare every server it restored failed before any could be heard)."""
        for info in self.shards:
            if info.state in (ShardState.UP, ShardState.RECOVERING):
                info.last_heartbeat = max(info.last_heartbeat, now)

    def seed(self) -> dict:
        """This map as a successor's `restore` takes it."""
        return {"epoch": self.epoch, "shards": [s.seed() for s in self.shards]}

    def _check_shard(self, shard: int) -> ShardInfo:
        if not 0 <= shard < self.num_servers:
            raise ValueError(f"shard {shard} out of range [0, {self.num_servers})")
        return self.shards[shard]

    @property
    def ready(self) -> bool:
        return all(s.state is ShardState.UP for s in self.shards)

    def register(
        self,
        shard: int,
        address: str,
        now: float,
        metrics_url: str = "",
        *,
        instance: str,
        replacement: bool = False,
        confirmed_dead: bool = False,
    ) -> list[Transition]:
        """A process registers under `shard`. Refused if it does not fit (see the module docstring); raises
        ProbeFirst while the shard's registered process has not been confirmed dead."""
        info = self._check_shard(shard)
        if not instance:
            raise Refused("instance: a registering process must name itself")
        if instance == info.instance:  # the same process again (its first answer was lost): no change
            if address != info.address:
                raise Refused(f"instance {instance} is registered for shard {shard} at {info.address}")
            return []
        if instance in info.superseded:
            raise Refused(
                f"instance {instance} is incarnation {info.superseded[instance]} of shard {shard}, "
                f"superseded by incarnation {info.incarnation}"
            )
        if info.state is ShardState.PENDING:
            if replacement:
                raise Refused(f"shard {shard} never registered: its first process must not be a replacement")
            self._admit(info, address, instance, metrics_url, now)
            info.state = ShardState.UP
            return [Transition("registered", shard, self.epoch, now)]
        if not replacement:
            raise Refused(
                f"shard {shard} registered before (incarnation {info.incarnation}): "
                "a new process must start empty, as a replacement"
            )
        transitions: list[Transition] = []
        if info.state in (ShardState.UP, ShardState.RECOVERING):
            # The registered process has not been declared dead: a replacement may take its place only if
            # it no longer answers (it died faster than the failure timeout), never while it serves.
            if not confirmed_dead:
                raise ProbeFirst(shard, info.address, info.instance)
            transitions = self._fail(info, now)
        self._admit(info, address, instance, metrics_url, now)
        info.state = ShardState.RECOVERING if self.recoverable else ShardState.UP
        self.epoch += 1
        return [*transitions, Transition("replacement_registered", shard, self.epoch, now)]

    def _admit(self, info: ShardInfo, address: str, instance: str, metrics_url: str, now: float) -> None:
        if info.instance:
            info.superseded[info.instance] = info.incarnation
        info.incarnation += 1
        info.address, info.instance, info.metrics_url, info.last_heartbeat = (
            address,
            instance,
            metrics_url,
            now,
        )

    def heartbeat(self, shard: int, address: str, now: float, instance: str = "") -> bool:
        """Record a heartbeat; False tells the sender it is not (or no longer) the registered process."""
        info = self._check_shard(shard)
        if (
            info.address != address
            or info.instance != instance
            or info.state in (ShardState.FAILED, ShardState.PENDING)
        ):
            return False
        info.last_heartbeat = now
        return True

    def rejoin(
        self,
        shard: int,
        address: str,
        now: float,
        metrics_url: str = "",
        *,
        instance: str,
        incarnation: int,
        recovered: bool,
        confirmed_dead: bool = False,
    ) -> list[Transition]:
        """A process that registered with an earlier generation and that this map's seed does not list (it
        registered after the seed was written) heartbeats: admit it as that registration would have been
        admitted. Only in a restored map, only a newer incarnation than the one listed, never (with a
        recoverable strategy) while the map has the shard failed, and, while the listed process is up or
        recovering, only once a probe shows it gone (ProbeFirst)."""
        info = self._check_shard(shard)
        if not self.restored:
            raise Refused(f"instance {instance} is not registered for shard {shard}")
        if not instance or instance == info.instance or instance in info.superseded:
            raise Refused(f"instance {instance!r} cannot rejoin shard {shard}: it is listed or superseded")
        if incarnation <= info.incarnation:
            raise Refused(
                f"instance {instance} (incarnation {incarnation}) of shard {shard} is not newer than "
                f"incarnation {info.incarnation}"
            )
        if self.recoverable and info.state is ShardState.FAILED:
            # This map has published the shard failed: acting homes may have committed degraded writes of its
            # rows since the process rebuilt them (under the dead coordinator), and parity servers skipped its
            # deltas. Nothing it holds can be trusted; a new replacement rebuilds the shard from scratch.
            raise Refused(
                f"instance {instance} cannot rejoin shard {shard}: the shard is failed in this map, and what "
                "the process rebuilt before may have missed degraded writes; a new replacement rebuilds it"
            )
        transitions: list[Transition] = []
        if info.state in (ShardState.UP, ShardState.RECOVERING):
            if not confirmed_dead:
                raise ProbeFirst(shard, info.address, info.instance)
            transitions = self._fail(info, now)
        if info.instance:
            info.superseded[info.instance] = info.incarnation
        info.incarnation, info.address, info.instance = incarnation, address, instance
        info.metrics_url, info.last_heartbeat = metrics_url, now
        # A first process, or a replacement whose rebuild is done, serves whole rows; any other replacement
        # still has to be rebuilt.
        whole = incarnation == 1 or recovered or not self.recoverable
        info.state = ShardState.UP if whole else ShardState.RECOVERING
        self.epoch += 1
        return [*transitions, Transition("rejoined", shard, self.epoch, now)]

    def lost(self) -> list[int]:
        """Shards whose data is not whole: failed, or replaced and not yet rebuilt."""
        return [s.shard for s in self.shards if s.state in (ShardState.FAILED, ShardState.RECOVERING)]

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
