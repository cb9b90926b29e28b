"""Admission of server processes and warm spares: registrations, heartbeats, rejoins after a coordinator
failover, failure reports, and spares waiting for a failed shard (ecrec.core.spares).

The decisions are the cluster map's (ecrec.core.cluster) and the spare pool's; this room runs them under the
coordinator's lock, probes a listed process outside it when the map asks (`ProbeFirst`), and hands the
resulting transitions to the coordinator (`AdmissionHost.apply`). Lock discipline: `lock` is the
coordinator's; it guards the cluster map, the spare pool, the CPU account and the job's progress record. The
public methods take it themselves and never hold it across a probe; `assign_spares` and `expire_spares` are
called with it held. `spare_assigned` (a condition on that lock) wakes spares waiting in a heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from ecrec.coordinator.contract import FailureReport, Heartbeat, RegisterServer, SpareIn
from ecrec.core.cluster import ClusterMap, ProbeFirst, Refused, ShardState, Transition
from ecrec.core.cpu import CpuAccount
from ecrec.core.spares import SparePool
from ecrec.core.workers import JobProgress
from ecrec.faults import fault_point

T = TypeVar("T")

log = logging.getLogger("ecrec.coordinator")


class AdmissionHost(Protocol):
    clock: Callable[[], float]
    probe: Callable[[str, str], bool]  # does that process (address, instance) still answer

    def apply(self, transitions: list[Transition]) -> None:
        """Carry out what the cluster map's transitions mean for the job. Called with the lock held."""
        ...

    def maybe_start(self) -> None:
        """Start training if every process it waits for is there. Called with the lock held."""
        ...

    def rebuilt_unseen(self, shard: int, rows: int, now: float) -> None:
        """A rejoining replacement says it was rebuilt, by a coordinator before this one. Lock held."""
        ...

    def over(self) -> bool:
        """Has the job finished or failed? Called with the lock held."""
        ...

    def rolling_back(self) -> bool:
        """Is the job rolling back to a checkpoint (strategy ecrec's fallback)? Called with the lock held."""
        ...


class Admission:
    def __init__(
        self,
        host: AdmissionHost,
        lock: threading.RLock,
        cluster: ClusterMap,
        spares: SparePool,
        cpu: CpuAccount,
        progress: JobProgress,
    ):
        self.host, self.lock, self.cluster, self.spares, self.cpu, self.progress = (
            host,
            lock,
            cluster,
            spares,
            cpu,
            progress,
        )
        self.spare_assigned = threading.Condition(lock)  # wakes spares waiting in a heartbeat
        # shard -> the instance that last said it holds its forwards (the fallback's rollback)
        self.holding: dict[int, str] = {}

    # -- servers -------------------------------------------------------------------------------------------
    def register_server(self, req: RegisterServer) -> dict:
        out = self._register_server(req)
        with self.lock:
            self.cpu.report("server", req.instance, req.cpuSeconds)
            if self.spares.taken(req.instance) is not None:
                self.progress.event(
                    "spare_took_over", self.host.clock(), shard=req.shard, instance=req.instance
                )
            elif (spare := self.spares.release(req.shard)) is not None:
                # another process got there first (a replacement its launcher started): the spare stays one
                self.progress.event(
                    "spare_released", self.host.clock(), shard=req.shard, instance=spare.instance
                )
            self.host.maybe_start()
        fault_point("coordinator:server_registered")
        return out

    def _register_server(self, req: RegisterServer) -> dict:
        """Admit a server process. A replacement for a shard whose process has not been declared dead is
        admitted only once a probe shows that process no longer answers (the path every real replacement
        takes when it restarts faster than the failure timeout); while it answers, the registration is
        refused and nothing changes."""

        def register(confirmed_dead: bool) -> dict:
            self.host.apply(
                self.cluster.register(
                    req.shard,
                    req.address,
                    self.host.clock(),
                    req.metricsUrl,
                    instance=req.instance,
                    replacement=req.replacement,
                    confirmed_dead=confirmed_dead,
                )
            )
            return {"epoch": self.cluster.epoch, "cluster": self.cluster.snapshot(), "instance": req.instance}

        return self._admit(req.shard, register)

    def _admit(self, shard: int, attempt: Callable[[bool], T]) -> T:
        """Run `attempt(confirmed_dead)` under the lock; when the cluster map wants the listed process of `shard`
        probed first (ProbeFirst), probe it outside the lock — a slow probe must not stall the job — and try
        again only if it no longer answers and is still the one listed. Refused otherwise."""
        with self.lock:
            try:
                return attempt(False)
            except ProbeFirst as first:
                holder = first
        if self.host.probe(holder.address, holder.instance):
            raise Refused(
                f"shard {shard} is up at {holder.address} (instance {holder.instance}) and answering: "
                "a second process is not admitted while it serves"
            )
        with self.lock:
            if self.cluster.shards[shard].instance != holder.instance:
                raise Refused(f"shard {shard} changed while its registered process was probed: retry")
            return attempt(True)

    def heartbeat(self, req: Heartbeat) -> dict:
        with self.lock:
            ok = self.cluster.heartbeat(req.shard, req.address, self.host.clock(), req.instance)
            rejoin = not ok and self.cluster.restored and req.incarnation > 0
        if rejoin:
            ok = self._rejoin_server(req)
        with self.lock:
            if ok:
                self.cpu.report("server", req.instance, req.cpuSeconds)
                if req.forwardsHeld:
                    self.holding[req.shard] = req.instance
                else:
                    self.holding.pop(req.shard, None)
            return {
                "ok": ok,
                "epoch": self.cluster.epoch,
                "cluster": self.cluster.snapshot(),
                "workersGone": self.progress.workers_gone(),
                "rollingBack": self.host.rolling_back(),
            }

    def wait_forwards_held(self, timeout: float) -> None:
        """Until every shard's registered process says it holds its forwards (the fallback's restore; called
        without the lock), or `timeout` seconds."""
        end = time.monotonic() + timeout
        while True:
            with self.lock:
                waiting = [s.shard for s in self.cluster.shards if self.holding.get(s.shard) != s.instance]
            if not waiting:
                return
            if time.monotonic() > end:
                log.warning("servers %s did not say they hold their forwards; restoring anyway", waiting)
                return
            time.sleep(0.05)

    def _rejoin_server(self, req: Heartbeat) -> bool:
        """A server this coordinator's seed does not list (it registered after the seed was written): admit
        it if it is newer than the listed process and that process no longer answers."""

        def rejoin(confirmed_dead: bool) -> None:
            now = self.host.clock()
            self.host.apply(
                self.cluster.rejoin(
                    req.shard,
                    req.address,
                    now,
                    req.metricsUrl,
                    instance=req.instance,
                    incarnation=req.incarnation,
                    recovered=req.recovered,
                    confirmed_dead=confirmed_dead,
                )
            )
            with self.lock:
                if req.recovered and req.incarnation > 1:
                    self.host.rebuilt_unseen(req.shard, req.rowsRecovered, now)
                self.host.maybe_start()

        try:
            self._admit(req.shard, rejoin)
            return True
        except Refused as e:
            # e.g. the listed process still serves: the newcomer is refused, as a registration would be
            log.info("rejoin of shard %d refused: %s", req.shard, e)
            return False

    def report_failure(self, req: FailureReport) -> dict:
        with self.lock:
            info = self.cluster.shards[req.shard] if 0 <= req.shard < self.cluster.num_servers else None
            if info is None:
                raise ValueError(f"shard {req.shard} out of range")
            address, instance, state = info.address, info.instance, info.state
        # Confirm outside the lock: a slow probe must not stall heartbeats.
        if state in (ShardState.UP, ShardState.RECOVERING) and not self.host.probe(address, instance):
            with self.lock:
                if self.cluster.shards[req.shard].instance == instance:
                    self.host.apply(self.cluster.report_failure(req.shard, self.host.clock()))
        with self.lock:
            return {"epoch": self.cluster.epoch, "cluster": self.cluster.snapshot()}

    # -- warm spares (ecrec.core.spares) -------------------------------------------------------------------
    def expire_spares(self, now: float) -> None:
        # a takeover builds the shard's empty store first: seconds on a loaded machine
        takeover = max(10.0, 2 * self.cluster.failure_timeout)
        for spare in self.spares.expire(now, self.cluster.failure_timeout, takeover):
            self.progress.event("spare_lost", now, instance=spare.instance, shard=spare.assigned)

    def assign_spares(self, now: float) -> None:
        """Each failed shard gets an idle spare, if there is one; it hears so in its next heartbeat."""
        if self.host.over():
            return
        failed = [s.shard for s in self.cluster.shards if s.state is ShardState.FAILED]
        for shard, spare in self.spares.assign(failed, now):
            self.progress.event("spare_assigned", now, shard=shard, instance=spare.instance)
            log.info("shard %d: assigned to spare %s", shard, spare.instance)
            self.spare_assigned.notify_all()

    def register_spare(self, req: SpareIn) -> dict:
        with self.lock:
            if not req.instance:
                raise Refused("instance: a spare must name itself")
            if any(s.instance == req.instance for s in self.cluster.shards):
                raise Refused(f"instance {req.instance} already serves a shard")
            known = req.instance in self.spares.spares
            self.spares.register(req.instance, req.address, req.metricsUrl, self.host.clock())
            self.cpu.report("server", req.instance, req.cpuSeconds)
            if not known:
                self.progress.event("spare_registered", self.host.clock(), instance=req.instance)
            self.assign_spares(self.host.clock())
            return self._spare_answer(req.instance)

    def spare_heartbeat(self, req: SpareIn) -> dict:
        with self.lock:
            spare = self.spares.heartbeat(req.instance, self.host.clock())
            if spare is None:
                return self._spare_answer(req.instance)
            self.cpu.report("server", req.instance, req.cpuSeconds)
            wait = min(req.wait, self.cluster.failure_timeout / 2)
            if wait > 0 and spare.assigned is None:
                # (the wait releases the lock; a spare dropped meanwhile answers "not registered")
                self.spare_assigned.wait_for(
                    lambda: self.spares.spares.get(req.instance) is not spare or spare.assigned is not None,
                    timeout=wait,
                )
                self.spares.heartbeat(req.instance, self.host.clock())  # it was alive all along
            return self._spare_answer(req.instance)

    def _spare_answer(self, instance: str) -> dict:
        spare = self.spares.spares.get(instance)
        return {
            "registered": spare is not None,
            "assigned": spare.assigned if spare is not None else None,
            "finished": self.host.over(),
        }
