"""The recovery driver: rebuilds a registered replacement (strategy ecrec) with `Recover` calls, one per step of
its plan (ecrec.core.recovery), on a thread of its own per shard; and decides what a request to recover a
shard (`POST /v1/recoveries`) does.

It talks to the coordinator only through `RecoveryHost` (whether the job failed, the probe, the rebuild's
end), reads the cluster map for the replacement to rebuild and keeps the shard's record in the `RecoveryLog`.
Lock discipline: `lock` is the coordinator's; it guards the cluster map, the records and the driver's own
thread table. `drive` is called with it held, `start` takes it; the driver's threads take it only for
bookkeeping, never across an RPC, a probe or a sleep.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from ecrec import auth
from ecrec.coordinator.records import RecoveryLog
from ecrec.core.checkpointing import CHECKPOINT_STRATEGIES
from ecrec.core.cluster import ClusterMap, Refused, ShardState
from ecrec.core.recovery import RecoveryRecord, plan_recovery
from ecrec.faults import fault_point
from ecrec.spec import JobSpec


class RecoveryHost(Protocol):
    clock: Callable[[], float]
    probe: Callable[[str, str], bool]  # does that process (address, instance) still answer

    def failed(self) -> bool:
        """Has the job failed (nothing more to rebuild for)?"""
        ...

    def rolling_back(self) -> bool:
        """Is the checkpoint fallback rolling back (the lost shards come back by a restore, not a rebuild)?"""
        ...

    def rebuilt(self, rec: RecoveryRecord, now: float) -> None:
        """The shard's replacement holds everything again. Called with the lock held."""
        ...


class Cancelled(Exception):
    """A rebuild stopped between two steps: the checkpoint fallback rolls back instead."""


class RecoveryDriver:
    def __init__(
        self,
        host: RecoveryHost,
        cluster: ClusterMap,
        records: RecoveryLog,
        lock: threading.RLock,
        stop: threading.Event,
        spec: JobSpec,
        token: str | None,
        metrics,
    ):
        self.host, self.cluster, self.records, self.lock, self._stop = host, cluster, records, lock, stop
        self.spec, self.token, self.metrics = spec, token, metrics
        # the checkpoint strategies restore replacements by themselves (ecrec.coordinator.checkpoints)
        self.checkpointed = spec.fault_tolerance.strategy in CHECKPOINT_STRATEGIES
        self._drivers: dict[int, threading.Thread] = {}

    def join(self, timeout: float) -> bool:
        """Wait until no rebuild runs (the fallback, before its restore: no Recover step may land after it).
        False if one still ran after `timeout` seconds."""
        end = time.monotonic() + timeout
        for t in list(self._drivers.values()):
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self._drivers.values())

    def start(self, shard: int) -> dict:
        """Rebuild `shard`'s registered replacement. Only a shard whose replacement is registered and not yet
        rebuilt can be recovered; asking again while its rebuild runs returns the running record."""
        if not self.cluster.recoverable:
            raise Refused("recovery needs faultTolerance.strategy 'ecrec'")
        if not 0 <= shard < self.cluster.num_servers:
            raise ValueError(f"shard {shard} out of range")
        if self.checkpointed:
            with self.lock:  # the checkpoint cycle restores replacements by itself: this only reports
                # the shard's latest record, never a new one: a request sent before its restore completed must
                # not open a record that nothing will complete (ecrec local would wait for it forever)
                rec = self.records.latest(shard)
                if rec is None:
                    raise Refused(f"shard {shard} has nothing to recover: it has not failed")
                if rec.state == "detected" and self.cluster.shards[shard].state is ShardState.RECOVERING:
                    rec.state = "waiting"
                return self.records.to_dict(rec)
        with self.lock:
            state = self.cluster.shards[shard].state
            if state is not ShardState.RECOVERING:
                why = {
                    ShardState.FAILED: "no replacement has registered yet",
                    ShardState.UP: "it is up",
                    ShardState.PENDING: "it never registered",
                }[state]
                raise Refused(f"shard {shard} has nothing to recover: {why}")
            return self.records.to_dict(self.drive(shard))

    def drive(self, shard: int) -> RecoveryRecord:
        """The shard's open record, with its rebuild driver running (started unless it runs already)."""
        rec = self.records.open(shard)
        driver = self._drivers.get(rec.shard)
        if self.host.rolling_back():
            return rec  # the restore brings it back (and completes the record)
        if driver is None or not driver.is_alive():
            rec.state, rec.error = "waiting", None
            driver = threading.Thread(
                target=self._drive_recovery, args=(rec,), daemon=True, name=f"recovery-{rec.shard}"
            )
            self._drivers[rec.shard] = driver
            driver.start()
        return rec

    def _drive_recovery(self, rec: RecoveryRecord) -> None:
        """Rebuild the shard's replacement, one Recover call per plan step. If the replacement dies meanwhile,
        wait for the next one to register (a newer incarnation) and start over; stop only when done."""
        failed_incarnation = None
        while not self._stop.is_set():
            if self.host.rolling_back():
                return  # the fallback restores the shard instead
            target = self._await_replacement(rec, failed_incarnation)
            if target is None:
                if self.host.rolling_back():
                    return
                with self.lock:
                    rec.state, rec.error = "failed", "no replacement registered"
                return
            address, instance, epoch, incarnation = target
            try:
                self._run_plan(rec, address, epoch)
                break
            except Cancelled:
                return
            except grpc.RpcError as e:
                with self.lock:
                    self.records.attempt_failed(rec, f"{e.code().name}: {e.details()}", self.host.clock())
                if self.host.probe(address, instance):
                    time.sleep(0.5)  # the replacement is alive (a peer was busy or failed): try again
                    continue
                failed_incarnation = incarnation
                with self.lock:
                    rec.state = "waiting"
        else:
            return
        with self.lock:
            self.host.rebuilt(rec, self.host.clock())

    def _await_replacement(self, rec: RecoveryRecord, not_incarnation: int | None):
        deadline = time.monotonic() + self.spec.coordinator.recovery_timeout_seconds
        while (
            time.monotonic() < deadline
            and not self._stop.is_set()
            and not self.host.failed()
            and not self.host.rolling_back()
        ):
            with self.lock:
                info = self.cluster.shards[rec.shard]
                if info.state is ShardState.RECOVERING and info.incarnation != not_incarnation:
                    return info.address, info.instance, self.cluster.epoch, info.incarnation
            time.sleep(0.05)
        return None

    def _run_plan(self, rec: RecoveryRecord, address: str, epoch: int) -> None:
        from ecrec.proto import ecrec_pb2 as pb
        from ecrec.proto import ecrec_pb2_grpc as pb_grpc

        kinds = {"dense": pb.DENSE, "data": pb.DATA, "parity": pb.PARITY}
        with auth.channel(address, self.token) as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            info = stub.Info(pb.InfoRequest(), timeout=30)
            plan = plan_recovery(
                info.data_rows, info.parity_rows, self.spec.fault_tolerance.ecrec.lock_group_rows
            )
            with self.lock:
                self.records.started(rec, plan, self.host.clock())
            fault_point("coordinator:recovery_started")

            def walk(steps: list) -> None:
                for step in steps:  # a retried plan repeats steps already done: they are no-ops (0 rows)
                    if self.host.rolling_back():
                        raise Cancelled(rec.shard)
                    req = pb.RecoverRequest(
                        epoch=epoch, kind=kinds[step.kind], start=step.start, count=step.count
                    )
                    began = time.monotonic()
                    with self.metrics.timed("Recover"):
                        resp = stub.Recover(req, timeout=300)
                    took = time.monotonic() - began
                    fault_point(f"coordinator:recovered_{step.kind}")
                    with self.lock:
                        self.records.step_done(rec, step.kind, took, resp.rows, resp.rows_total)

            # The three kinds touch disjoint state (the dense chunks, the shard's rows, the parity records it
            # holds, whose members all live on other servers), so they run side by side, each kind's lock
            # groups one after another: the rebuild takes the longest of the three instead of their sum.
            by_kind = [[st for st in plan if st.kind == kind] for kind in kinds]
            with concurrent.futures.ThreadPoolExecutor(len(kinds), thread_name_prefix="recover") as pool:
                for done in [pool.submit(walk, steps) for steps in by_kind if steps]:
                    done.result()  # the first error is the plan's (the others' steps stay done)
