"""The coordinator process: cluster map, failure detection, job progress, REST control plane, /metrics.

A thin FastAPI adapter around `core.cluster.ClusterMap` and `JobProgress`. Servers register and heartbeat
here; workers wait here for the cluster and for each other, then report progress; the local launcher and the
Kubernetes operator read `/v1/status`. All state lives behind one lock: requests are tiny and rare.

Every mutating request is checked against the current state before it changes anything; one that does not fit
(a second process for a live shard, a stale incarnation, a recovery of a healthy shard, progress from a worker
that is not the registered one) is refused with 409 and the reason, and changes nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from ecrec import auth
from ecrec.core.checkpointing import CHECKPOINT_STRATEGIES, Phase
from ecrec.core.cluster import ClusterMap, ProbeFirst, Refused, ShardState, Transition
from ecrec.core.cpu import CpuAccount
from ecrec.core.recovery import MAX_STEP_TIMES, RecoveryRecord, plan_recovery
from ecrec.core.spares import SparePool
from ecrec.core.timeline import SamplesTimeline
from ecrec.faults import configure as configure_faults
from ecrec.faults import fault_point
from ecrec.ft.driver import CheckpointDriver
from ecrec.metrics import coordinator_metrics
from ecrec.spec import Job, JobSpec

T = TypeVar("T")

log = logging.getLogger("ecrec.coordinator")


class RegisterServer(BaseModel):
    shard: int
    address: str
    instance: str  # the process's own id, unique per process
    metricsUrl: str = ""
    replacement: bool = False
    cpuSeconds: float | None = None  # the process's own CPU time so far (ecrec.core.cpu)


class Heartbeat(BaseModel):
    shard: int
    address: str
    instance: str
    epoch: int = 0
    recovered: bool = False
    rowsRecovered: int = Field(default=0, ge=0)  # a replacement's rows rebuilt so far
    # What a successor coordinator needs to admit a process its seed does not list (a rejoin).
    incarnation: int = 0
    metricsUrl: str = ""
    cpuSeconds: float | None = None


class SpareIn(BaseModel):
    """A warm spare's registration and heartbeat (ecrec.core.spares)."""

    instance: str
    address: str = ""
    metricsUrl: str = ""
    cpuSeconds: float | None = None
    # A heartbeat may wait this long for an assignment (a long poll): the spare hears of its shard the moment
    # it is assigned, not at its next heartbeat (capped at half the failure timeout: it is also a heartbeat).
    wait: float = Field(default=0.0, ge=0.0, le=60.0)


class StartRecovery(BaseModel):
    shard: int


class FailureReport(BaseModel):
    shard: int
    reporter: str = ""


class RegisterWorker(BaseModel):
    rank: int
    instance: str
    incarnation: int = 1  # 1 for the rank's first process, +1 for each replacement
    replacement: bool = False  # takes over a rank whose process was reported lost, resuming its steps
    # A worker that registered with an earlier coordinator generation and is not in this one's seed.
    rejoin: bool = False
    step: int = 0
    samples: int = 0
    cpuSeconds: float | None = None


class WorkerLost(BaseModel):
    rank: int
    instance: str  # the registered process that died
    replacing: bool = False  # a replacement will resume the rank's steps: the job waits for it
    reason: str = Field(default="", max_length=200)  # how the launcher saw it go ("exited with code 139")


class WorkerFinished(BaseModel):
    rank: int
    instance: str  # the registered process that exited 0: it trained its steps and a coordinator heard so


class RpcLatency(BaseModel):
    buckets: list[float]  # cumulative counts per bucket of ecrec.metrics.LATENCY_BUCKETS, then +Inf
    sum: float


class Progress(BaseModel):
    rank: int
    instance: str
    step: int
    samples: int
    loss: float | None = None  # null when the worker has no finite loss to report
    done: bool = False
    error: str | None = None
    lastStepAt: float | None = None  # wall-clock time the worker's latest step completed
    # when each step since the previous report completed (the latest MAX_STEP_TIMES): a recovery's time to
    # continue is the first of them after the detection, not the report's latest step
    stepTimes: list[float] = Field(default_factory=list, max_length=MAX_STEP_TIMES)
    # Checkpoint strategies: the checkpoint it is paused for, the rollback generation it has caught up with.
    paused: int | None = None
    stopped: int = 0
    resumed: int = 0  # the rollback generation whose resume point its counters start from
    # Counters of this worker process since it started (exported by the coordinator, ecrec.metrics):
    degradedReads: dict[int, int] = {}  # failed shard -> rows read by decoding
    degradedWrites: dict[int, int] = {}  # failed shard -> rows updated at their acting home
    rpcLatency: dict[str, RpcLatency] = {}  # method -> its ecrec_rpc_latency_seconds buckets
    cpuSeconds: float | None = None  # the process's own CPU time so far (ecrec.core.cpu)


class ParityCheck(BaseModel):
    stripes: int
    mismatches: int
    in_flight: int = 0


MAX_SEEDED_EVENTS = 200  # the job's latest events a successor coordinator keeps
EVENT_KINDS = ("server_killed", "worker_killed", "pod_deleted", "pod_replaced", "note")


class EventIn(BaseModel):
    kind: str  # one of EVENT_KINDS: what an outside actor (launcher, operator) did
    shard: int | None = None
    at: float | None = None  # wall-clock time.time(); defaults to now
    detail: dict | None = None


@dataclass
class WorkerProgress:
    rank: int
    instance: str = ""
    incarnation: int = 1
    step: int = 0
    samples: int = 0
    loss: float | None = None
    done: bool = False
    error: str | None = None
    lost: bool = False
    # When the coordinator last heard this process (registration, progress: its reporter thread posts every
    # 0.5 s whatever training does, so only a hung or paused process goes quiet), and whether it has been
    # quiet for longer than the failure timeout: the launcher then deletes it and a replacement resumes.
    heard_at: float | None = None
    unresponsive: bool = False


@dataclass
class JobProgress:
    """Training progress over time. t = 0 is when the last worker registered (training start)."""

    num_workers: int
    workers: dict[int, WorkerProgress] = field(default_factory=dict)
    started_at: float | None = None
    finished_at: float | None = None
    samples_log: list[tuple[float, int]] = field(default_factory=list)  # (wall time, total samples)
    # the same total by when its steps completed (the reports' step times), for samples_series
    timeline: SamplesTimeline = field(default_factory=SamplesTimeline)
    events: list[dict] = field(default_factory=list)

    @property
    def total_samples(self) -> int:
        return sum(w.samples for w in self.workers.values())

    def workers_gone(self) -> dict[str, int]:
        """rank -> the newest incarnation of it whose process is gone: reported lost, or replaced by a newer
        one (admitted only once its predecessor was reported lost). Servers abort what those left staged at
        once (ShardStore.expire); a worker that is merely silent is not in it (it may come back)."""
        out = {}
        for rank, w in self.workers.items():
            gone = w.incarnation if w.lost else w.incarnation - 1
            if gone > 0:
                out[str(rank)] = gone
        return out

    def rel(self, at: float) -> float:
        return round(at - (self.started_at or at), 3)

    def event(self, kind: str, at: float, **detail) -> dict:
        ev = {
            "t": self.rel(at),
            "wall": at,
            "kind": kind,
            **{k: v for k, v in detail.items() if v is not None},
        }
        self.events.append(ev)
        return ev

    def sample(self, now: float) -> None:
        if self.started_at is not None and self.finished_at is None:
            self.samples_log.append((now, self.total_samples))
            self.timeline.update(self.total_samples, now)  # changes without step times: a rollback, a rejoin

    def series(self, window: float = 1.0) -> list[list[float]]:
        """[seconds since start, samples/s over the trailing `window`] for every logged sample. A rollback
        (checkpoint strategies) takes the samples count back: a window across one shows no progress, 0, not a
        negative rate (the status schema and the dashboard take throughput as >= 0)."""
        out, j = [], 0
        log_ = self.samples_log
        for i, (t, n) in enumerate(log_):
            while j < i and t - log_[j][0] > window:
                j += 1
            if i > j and t > log_[j][0]:
                out.append([round(self.rel(t), 3), max(0.0, round((n - log_[j][1]) / (t - log_[j][0]), 1))])
        return out

    def samples_series(self) -> list[list[float]]:
        """[seconds since start, total samples], linear in between, by when the steps completed (to 0.05 s,
        `SamplesTimeline`): where rates over an arbitrary window are computed from (a benchmark's
        kill-to-recovery window is shorter than `series`' trailing one, and than the reports' interval)."""
        return [[self.rel(t), round(n, 1)] for t, n in self.timeline.series()]

    def recent_rate(self, window: float = 2.0) -> float:
        s = self.series(window)
        return s[-1][1] if s else 0.0


class Coordinator:
    """`generation` counts coordinator incarnations; a generation > 1 replaces a dead coordinator and starts
    from `seed`, the `resume` part of its predecessor's last status (docs/protocol.md, Coordinator failover)."""

    def __init__(
        self,
        job: Job,
        clock=time.time,
        probe=None,
        generation: int = 1,
        seed: dict | None = None,
        token: str | None = None,
    ):
        self.job, self.spec, self.clock = job, job.spec, clock
        self.token = token  # the job token (ecrec.auth): demanded of mutating requests, sent to servers
        spec: JobSpec = job.spec
        self.lock = threading.RLock()
        self.generation = generation
        self.cluster = ClusterMap(
            num_servers=spec.servers.replicas,
            failure_timeout=spec.coordinator.failure_timeout_seconds,
            recoverable=spec.fault_tolerance.strategy != "none",
            generation=generation,
        )
        self.progress = JobProgress(num_workers=spec.workers.replicas)
        # CPU seconds by role since registration (ecrec.core.cpu); this process's own since it got here.
        self.cpu = CpuAccount()
        self.spares = SparePool()
        self.spare_assigned = threading.Condition(self.lock)  # wakes spares waiting in a heartbeat
        self.cpu.report("coordinator", "self", time.process_time())
        self.metrics, self.reports = coordinator_metrics(job.name, self.metrics_state, spec.servers.replicas)
        self.probe = SingleFlight(probe or functools.partial(probe_server, token=token))
        self.failed_reason: str | None = None
        self.last_step_at: float | None = None  # when some worker last completed a step (stall detection)
        self.recoveries: list[RecoveryRecord] = []
        self._drivers: dict[int, threading.Thread] = {}
        self._stop = threading.Event()
        self.ckpt: CheckpointDriver | None = None
        if spec.fault_tolerance.strategy in CHECKPOINT_STRATEGIES:
            self.ckpt = CheckpointDriver(self)
        if seed is not None:
            self._restore(seed)
            if self.ckpt is not None:
                with self.lock:
                    self.ckpt.take_over(seed)

    # -- failover ----------------------------------------------------------------------------------------
    def resume_state(self) -> dict:
        """What a successor needs to carry on after this process dies (`seed`); wall-clock times. The
        launchers keep the latest copy (the operator in the ECRecJob's status.resume)."""
        with self.lock:
            p = self.progress
            return {
                "generation": self.generation,
                **self.cluster.seed(),
                "startedAt": p.started_at,
                "finishedAt": p.finished_at,
                "lastStepAt": self.last_step_at,
                "workers": [
                    {k: getattr(w, k) for k in ("rank", "instance", "incarnation", "step", "samples")}
                    | {"done": w.done, "lost": w.lost}
                    for w in sorted(p.workers.values(), key=lambda w: w.rank)
                ],
                "recoveries": [r.seed() for r in self.recoveries],
                "events": p.events[-MAX_SEEDED_EVENTS:],
                **({"checkpointing": self.ckpt.stats()} if self.ckpt is not None else {}),
            }

    def _restore(self, seed: dict) -> None:
        now = self.clock()
        self.cluster.restore(seed, now)
        p = self.progress
        p.started_at = seed.get("startedAt")
        p.finished_at = seed.get("finishedAt")
        self.last_step_at = seed.get("lastStepAt")
        for w in seed.get("workers", []):
            rank = int(w["rank"])
            if not 0 <= rank < p.num_workers:
                raise Refused(f"seed lists worker rank {rank} outside [0, {p.num_workers})")
            p.workers[rank] = WorkerProgress(
                rank,
                str(w.get("instance", "")),
                int(w.get("incarnation", 1)),
                int(w.get("step", 0)),
                int(w.get("samples", 0)),
                done=bool(w.get("done")),
                lost=bool(w.get("lost")),
                heard_at=now,  # the restored ones get a failure timeout from now to be heard
            )
        self.recoveries = [RecoveryRecord.restore(r) for r in seed.get("recoveries", [])]
        p.events = [dict(e) for e in seed.get("events", [])][-MAX_SEEDED_EVENTS:]
        if p.started_at is not None:
            p.samples_log.append((now, p.total_samples))
            p.timeline.start(now, p.total_samples)
        p.event("coordinator_restored", now, generation=self.generation, epoch=self.cluster.epoch)
        self._apply([])

    def open_recovery(self, shard: int) -> RecoveryRecord:
        """The record of the shard's current (not yet completed) failure, created if none is open."""
        for rec in reversed(self.recoveries):
            if rec.shard == shard and rec.state != "completed":
                return rec
        rec = RecoveryRecord(shard)
        self.recoveries.append(rec)
        return rec

    # -- cluster ---------------------------------------------------------------------------------------
    def _apply(self, transitions: list[Transition]) -> None:
        m = self.metrics
        for tr in transitions:
            self.progress.event(tr.kind, tr.at, shard=tr.shard, epoch=tr.epoch)
            if tr.kind == "failure_detected":
                m.of(m.failures).inc()
                if not self.cluster.recoverable and self.progress.started_at is not None:
                    self.failed_reason = f"server {tr.shard} failed and strategy 'none' cannot recover it"
                if self.cluster.recoverable:
                    rec = self.open_recovery(tr.shard)
                    rec.detected_at = rec.detected_at or tr.at
                if self.ckpt is not None:
                    self.ckpt.feed(self.ckpt.cycle.failure(tr.shard))
                self._assign_spares(tr.at)
            elif tr.kind == "replacement_registered" and self.ckpt is not None:
                self.ckpt.feed(self.ckpt.cycle.registered(tr.shard))
            elif tr.kind == "replacement_registered" and self.cluster.recoverable:
                # Its rebuild starts now: waiting for the launcher to ask (its next look at the status,
                # 0.2 s and more) left the shard degraded for nothing. The launcher still asks: that
                # restarts a driver that is gone (after a coordinator failover) and is a no-op otherwise.
                self._drive(tr.shard)
            elif tr.kind == "rejoined" and self.cluster.shards[tr.shard].state is ShardState.RECOVERING:
                # a replacement the seed did not know: its failure has a record here from now on
                rec = self.open_recovery(tr.shard)
                rec.detected_at = rec.detected_at or tr.at
        m.of(m.epoch).set(self.cluster.epoch)
        for state in ShardState:
            m.of(m.servers, state=state.value).set(sum(s.state is state for s in self.cluster.shards))

    def register_server(self, req: RegisterServer) -> dict:
        out = self._register_server(req)
        with self.lock:
            self.cpu.report("server", req.instance, req.cpuSeconds)
            if self.spares.taken(req.instance) is not None:
                self.progress.event("spare_took_over", self.clock(), shard=req.shard, instance=req.instance)
            elif (spare := self.spares.release(req.shard)) is not None:
                # another process got there first (a replacement its launcher started): the spare stays one
                self.progress.event("spare_released", self.clock(), shard=req.shard, instance=spare.instance)
            self._maybe_start()
        fault_point("coordinator:server_registered")
        return out

    def _register_server(self, req: RegisterServer) -> dict:
        """Admit a server process. A replacement for a shard whose process has not been declared dead is
        admitted only once a probe shows that process no longer answers (the path every real replacement
        takes when it restarts faster than the failure timeout); while it answers, the registration is
        refused and nothing changes."""

        def register(confirmed_dead: bool) -> dict:
            self._apply(
                self.cluster.register(
                    req.shard,
                    req.address,
                    self.clock(),
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
        if self.probe(holder.address, holder.instance):
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
            ok = self.cluster.heartbeat(req.shard, req.address, self.clock(), req.instance)
            rejoin = not ok and self.cluster.restored and req.incarnation > 0
        if rejoin:
            ok = self._rejoin_server(req)
        with self.lock:
            if ok:
                self.cpu.report("server", req.instance, req.cpuSeconds)
            return {
                "ok": ok,
                "epoch": self.cluster.epoch,
                "cluster": self.cluster.snapshot(),
                "workersGone": self.progress.workers_gone(),
            }

    def _rejoin_server(self, req: Heartbeat) -> bool:
        """A server this coordinator's seed does not list (it registered after the seed was written): admit
        it if it is newer than the listed process and that process no longer answers."""

        def rejoin(confirmed_dead: bool) -> None:
            now = self.clock()
            self._apply(
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
                if req.recovered and req.incarnation > 1 and self.ckpt is None and self.cluster.recoverable:
                    # Rebuilt, by a coordinator that died before the launcher saved a seed saying so (the
                    # rebuild starts at registration and can finish within one look at the status): the
                    # record it left open is completed now, when this coordinator learns of it.
                    rec = self.open_recovery(req.shard)
                    self._rows_recovered(rec, req.rowsRecovered)
                    self._completed(rec, now)
                self._maybe_start()

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
                raise HTTPException(400, f"shard {req.shard} out of range")
            address, instance, state = info.address, info.instance, info.state
        # Confirm outside the lock: a slow probe must not stall heartbeats.
        if state in (ShardState.UP, ShardState.RECOVERING) and not self.probe(address, instance):
            with self.lock:
                if self.cluster.shards[req.shard].instance == instance:
                    self._apply(self.cluster.report_failure(req.shard, self.clock()))
        with self.lock:
            return {"epoch": self.cluster.epoch, "cluster": self.cluster.snapshot()}

    def tick(self) -> None:
        with self.lock:
            now = self.clock()
            self._apply(self.cluster.tick(now))
            # a takeover builds the shard's empty store first: seconds on a loaded machine
            takeover = max(10.0, 2 * self.cluster.failure_timeout)
            for spare in self.spares.expire(now, self.cluster.failure_timeout, takeover):
                self.progress.event("spare_lost", now, instance=spare.instance, shard=spare.assigned)
            self._assign_spares(now)
            self._check_workers(now)
            if self.ckpt is not None:
                self.ckpt.feed(self.ckpt.cycle.tick(now))
            self.progress.sample(now)
            m = self.metrics
            m.of(m.throughput).set(self.progress.recent_rate() if self.progress.finished_at is None else 0.0)
            if self.failed_reason is None and not self.finished:
                self.failed_reason = self._why_stuck(now)
                if self.failed_reason:
                    self.progress.event("job_failed", now, reason=self.failed_reason)
                    log.error("job failed: %s", self.failed_reason)

    # -- warm spares (ecrec.core.spares) ------------------------------------------------------------------
    def _assign_spares(self, now: float) -> None:
        """Each failed shard gets an idle spare, if there is one; it hears so in its next heartbeat."""
        if self.finished or self.failed_reason:
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
            self.spares.register(req.instance, req.address, req.metricsUrl, self.clock())
            self.cpu.report("server", req.instance, req.cpuSeconds)
            if not known:
                self.progress.event("spare_registered", self.clock(), instance=req.instance)
            self._assign_spares(self.clock())
            return self._spare_answer(req.instance)

    def spare_heartbeat(self, req: SpareIn) -> dict:
        with self.lock:
            spare = self.spares.heartbeat(req.instance, self.clock())
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
                self.spares.heartbeat(req.instance, self.clock())  # it was alive all along
            return self._spare_answer(req.instance)

    def _spare_answer(self, instance: str) -> dict:
        spare = self.spares.spares.get(instance)
        return {
            "registered": spare is not None,
            "assigned": spare.assigned if spare is not None else None,
            "finished": self.finished or self.failed_reason is not None,
        }

    def _check_workers(self, now: float) -> None:
        """Mark a training worker silent for longer than the failure timeout unresponsive (hung or paused: a
        busy one still reports). Only after training started: before, workers only wait for the start."""
        p = self.progress
        if p.started_at is None or p.finished_at is not None:
            return
        timeout = self.cluster.failure_timeout
        for w in p.workers.values():
            if w.done or w.lost or w.unresponsive:
                continue
            if now - max(w.heard_at or 0.0, p.started_at) > timeout:
                w.unresponsive = True
                p.event("worker_unresponsive", now, worker=w.rank, step=w.step)
                log.warning(
                    "worker %d (%s) silent for over %gs: declared unresponsive", w.rank, w.instance, timeout
                )

    def _why_stuck(self, now: float) -> str | None:
        """Why the job cannot finish, if it cannot: more than r servers lost at once, a shard not rebuilt in
        time, or no worker progressing. None while it can."""
        spec = self.spec
        if self.cluster.recoverable:
            lost = self.cluster.lost()
            r = spec.fault_tolerance.ecrec.r
            if self.ckpt is None and len(lost) > r:  # checkpoints restore any number of lost shards
                placement = self._placement()
                names = ", ".join(f"{s} ({self.cluster.shards[s].state.value})" for s in lost)
                return (
                    f"{len(lost)} servers lost at once, more than r={r} can rebuild: shards {names}; "
                    f"{placement.stripes_lost(lost)} of {placement.num_stripes()} stripes lost"
                )
            limit = spec.coordinator.recovery_timeout_seconds
            for rec in self.recoveries:
                if rec.state != "completed" and rec.detected_at is not None and now - rec.detected_at > limit:
                    doing = rec.error or (
                        f"rebuilt {rec.steps_done} of {rec.steps_total} steps"
                        if rec.state == "running"
                        else "no replacement registered"
                    )
                    return f"shard {rec.shard} not recovered within {limit:g}s of its failure ({rec.state}: {doing})"
        limit = spec.coordinator.progress_timeout_seconds
        if self.ckpt is not None and (self.ckpt.cycle.holding or self.ckpt.cycle.all_done()):
            return None  # paused for a checkpoint or a restore, bounded by the recovery timeout above
        since = self.last_step_at or self.progress.started_at
        # Workers give up after `limit` without progress and say why; this is the backstop for a worker that
        # cannot even say so.
        if since is not None and now - since > limit + 15.0:
            return f"no worker completed a step for {now - since:.0f}s (progressTimeoutSeconds {limit:g})"
        return None

    def _placement(self):
        from ecrec.jobctx import JobContext

        return JobContext(self.job).placement

    # -- workers ---------------------------------------------------------------------------------------
    def _worker(self, rank: int, instance: str) -> WorkerProgress:
        """The registered worker of `rank`, if `instance` is that process; refused otherwise."""
        if not 0 <= rank < self.progress.num_workers:
            raise HTTPException(400, f"worker rank {rank} out of range [0, {self.progress.num_workers})")
        w = self.progress.workers.get(rank)
        if w is None:
            raise Refused(f"worker {rank} has not registered")
        if w.instance != instance:
            raise Refused(f"worker {rank} is registered as instance {w.instance!r}, not {instance!r}")
        return w

    def register_worker(self, req: RegisterWorker) -> dict:
        out = self._register_worker(req)
        with self.lock:
            self.cpu.report("worker", req.instance, req.cpuSeconds)
        return out

    def _register_worker(self, req: RegisterWorker) -> dict:
        with self.lock:
            if not 0 <= req.rank < self.progress.num_workers:
                raise HTTPException(400, f"worker rank {req.rank} out of range")
            if not req.instance:
                raise Refused("instance: a registering worker must name itself")
            known = self.progress.workers.get(req.rank)
            if req.rejoin:
                return self._rejoin_worker(req, known)
            if known is not None and known.instance != req.instance:
                if not (req.replacement and known.lost and not known.done):
                    raise Refused(
                        f"worker {req.rank} is registered as instance {known.instance!r}; a replacement is "
                        "admitted only after that process was reported lost"
                    )
                if req.incarnation <= known.incarnation:
                    raise Refused(
                        f"worker {req.rank}: incarnation {req.incarnation} is not after {known.incarnation}"
                    )
                known.instance, known.incarnation, known.lost = req.instance, req.incarnation, False
                self.progress.event("worker_replaced", self.clock(), worker=req.rank, step=known.step)
            elif known is None and req.replacement:
                raise Refused(f"worker {req.rank} never registered: its first process is not a replacement")
            w = self.progress.workers.setdefault(
                req.rank, WorkerProgress(req.rank, req.instance, req.incarnation)
            )
            w.heard_at, w.unresponsive = self.clock(), False
            self._maybe_start()
            # A replacement resumes the rank where its predecessor's last progress report ended.
            return {**self.start_state(), "resume": {"step": w.step, "samples": w.samples}, **self.control()}

    def _rejoin_worker(self, req: RegisterWorker, known: WorkerProgress | None) -> dict:
        """A worker that registered with an earlier generation: the seed lists it (its progress reports were
        refused for another reason, or the seed is older than its registration) or lists an older process of
        its rank. Its own count of steps is the truth; it never goes back."""
        if not self.cluster.restored:
            raise Refused(f"worker {req.rank}: only a coordinator that replaced another admits rejoins")
        if known is not None and known.instance != req.instance:
            if req.incarnation <= known.incarnation:
                raise Refused(
                    f"worker {req.rank}: incarnation {req.incarnation} is not newer than {known.incarnation}"
                )
            known.instance, known.incarnation, known.lost, known.done = (
                req.instance,
                req.incarnation,
                False,
                False,
            )
        w = self.progress.workers.setdefault(
            req.rank, WorkerProgress(req.rank, req.instance, req.incarnation)
        )
        if req.step > w.step:
            self.last_step_at = self.clock()
        w.step, w.samples = max(w.step, req.step), max(w.samples, req.samples)
        w.heard_at, w.unresponsive = self.clock(), False
        self.progress.event("worker_rejoined", self.clock(), worker=req.rank, step=w.step)
        self._maybe_start()
        return {**self.start_state(), "resume": {"step": w.step, "samples": w.samples}}

    def _maybe_start(self) -> None:
        """Training starts once every worker and every server has registered (pods start in any order)."""
        p = self.progress
        if p.started_at is None and len(p.workers) == p.num_workers and self.cluster.ready:
            now = self.clock()
            p.started_at = now
            p.samples_log.append((now, 0))
            p.timeline.start(now)
            p.event("training_started", now)
            if self.ckpt is not None:
                self.ckpt.feed(self.ckpt.cycle.started(now))

    def start_state(self, rank: int | None = None, instance: str = "") -> dict:
        """Has training started? With `rank` and `instance`, also whether that worker is registered here (a
        worker waiting for the start re-registers when a new coordinator does not know it)."""
        with self.lock:
            out = {"started": self.progress.started_at is not None, "startedAt": self.progress.started_at}
            if rank is not None:
                w = self.progress.workers.get(rank)
                out["registered"] = w is not None and w.instance == instance
            return out

    def report_progress(self, req: Progress) -> dict:
        with self.lock:
            w = self._worker(req.rank, req.instance)
            rollback = self.ckpt.cycle.rollback if self.ckpt is not None else 0
            if req.stopped < rollback or req.resumed < rollback:
                # Sent before the worker took up the latest rollback's resume point: its counts are from before
                # the restore (the rollback's own, set in rolled_back, stand). One exception: the report of
                # the stop itself, while the cycle still waits for every stop, says where the worker stopped:
                # the steps it trained since its last counted report are to be redone too (they were lost
                # from stepsRedone when the kill came soon after a checkpoint).
                w.heard_at = self.clock()
                cycle = self.ckpt.cycle
                step, samples = w.step, w.samples
                if req.stopped == rollback and cycle.phase is Phase.STOPPING:
                    step, samples = max(step, req.step), max(samples, req.samples)
                self.ckpt.feed(cycle.report(req.rank, step, samples, w.done, req.paused, req.stopped))
                return {"epoch": self.cluster.epoch, **self.control()}
            if req.step < w.step or req.samples < w.samples:
                raise Refused(f"worker {req.rank}: step {req.step} is behind its last report (step {w.step})")
            if req.loss is not None and not math.isfinite(req.loss):
                raise HTTPException(400, "loss: must be a finite number or null")
            latency = {k: v.model_dump() for k, v in req.rpcLatency.items()}
            self.reports.check(req.degradedReads, req.degradedWrites, latency)
            if req.step > w.step:
                self.last_step_at = self.clock()
            steps_at = sorted(t for t in req.stepTimes if math.isfinite(t))
            if req.lastStepAt is not None and math.isfinite(req.lastStepAt):
                steps_at.append(req.lastStepAt)
            for rec in self.recoveries:
                if (first := rec.continue_at(steps_at)) is not None:
                    self.progress.event("training_continued", first, shard=rec.shard)
                    self.metrics.of(self.metrics.time_to_continue).observe(
                        first - (rec.killed_at or rec.detected_at)
                    )
            if w.lost:
                return {"epoch": self.cluster.epoch}
            w.heard_at = self.clock()
            if w.unresponsive:  # it came back before it was replaced
                w.unresponsive = False
                self.progress.event("worker_responsive", w.heard_at, worker=w.rank, step=req.step)
            delta = max(0, req.samples - w.samples)
            steps = req.step - w.step
            w.step, w.samples, w.loss, w.done, w.error = req.step, req.samples, req.loss, req.done, req.error
            times = req.stepTimes or ([req.lastStepAt] if req.lastStepAt is not None and steps > 0 else [])
            self.progress.timeline.update(self.progress.total_samples, self.clock(), times, steps)
            self.cpu.report("worker", req.instance, req.cpuSeconds)
            m = self.metrics
            m.of(m.samples).inc(delta)
            self.reports.add(req.rank, req.instance, req.degradedReads, req.degradedWrites, latency)
            if req.error and self.failed_reason is None:  # the first reason is the cause; later ones follow
                self.failed_reason = f"worker {req.rank}: {req.error}"
            if self.ckpt is not None:
                self.ckpt.feed(
                    self.ckpt.cycle.report(req.rank, w.step, w.samples, w.done, req.paused, req.stopped)
                )
            self._maybe_finish()
            return {"epoch": self.cluster.epoch, **self.control()}

    def control(self) -> dict:
        """What the checkpoint strategies tell workers now; nothing for the others."""
        with self.lock:
            return {"control": self.ckpt.cycle.control()} if self.ckpt is not None else {}

    def complete_restore(self, shard: int, rows: int, now: float) -> None:
        """A replacement loaded its checkpoint (checkpoint strategies): its shard is up again."""
        self._apply(self.cluster.recovered(shard, now))
        rec = self.open_recovery(shard)
        rec.state, rec.completed_at, rec.error, rec.rows_recovered = "completed", now, None, rows
        rec.started_at = rec.started_at or now
        self.progress.event("recovery_completed", now, shard=shard, rows=rows)
        m = self.metrics
        m.of(m.recoveries_completed).inc()
        m.of(m.rows_recovered, shard=str(shard)).inc(rows)
        m.of(m.time_to_recover).observe(now - (rec.killed_at or rec.detected_at or now))

    def rolled_back(self, resume: dict[int, tuple[int, int]]) -> None:
        """Every rank goes back to the step the restored checkpoint recorded for it."""
        p = self.progress
        for rank, (step, samples) in resume.items():
            w = p.workers.get(rank)
            if w is not None:
                w.step, w.samples, w.done = step, samples, False
        p.finished_at = None
        self.last_step_at = self.clock()  # the stall clock starts again with the replay
        p.event("rolled_back", self.clock(), steps={str(r): s for r, (s, _n) in resume.items()})

    def worker_lost(self, req: WorkerLost) -> dict:
        """A worker process died before finishing its steps: the job finishes without them, or, if a
        replacement is coming, waits for it to resume them."""
        with self.lock:
            w = self._worker(req.rank, req.instance)
            if w.done or w.lost:
                return {"epoch": self.cluster.epoch}  # finished, or reported lost already
            w.lost, w.done = True, not req.replacing
            detail = {"reason": req.reason} if req.reason else {}
            self.progress.event("worker_lost", self.clock(), worker=req.rank, step=w.step, **detail)
            if self.ckpt is not None:
                self.ckpt.feed(self.ckpt.cycle.worker_lost(req.rank))
            self._maybe_finish(sample=False)  # a lost worker brings no new sample count
            return {"epoch": self.cluster.epoch}

    def _maybe_finish(self, sample: bool = True) -> None:
        """Training is over once every worker is done: the last sample of the series, the event (once)."""
        if self.finished and self.progress.finished_at is None:
            now = self.clock()
            if sample:
                self.progress.sample(now)
            self.progress.finished_at = now
            self.progress.event("training_finished", now)

    def worker_finished(self, req: WorkerFinished) -> dict:
        """A worker process exited 0: it exits only once a coordinator acknowledged its last report (all its
        steps done). That coordinator may have died before its state was saved; the launcher, which sees the
        exit, says so here, and the rank counts as done at its last step."""
        with self.lock:
            w = self._worker(req.rank, req.instance)
            if w.done or w.lost:
                return {"epoch": self.cluster.epoch}
            training = self.spec.training
            steps, samples = max(w.step, training.steps), max(w.samples, training.steps * training.batch_size)
            self.metrics.of(self.metrics.samples).inc(samples - w.samples)
            w.step, w.samples, w.done = steps, samples, True
            self.progress.event("worker_finished", self.clock(), worker=req.rank, step=steps)
            if self.ckpt is not None:
                cycle = self.ckpt.cycle
                self.ckpt.feed(cycle.report(req.rank, steps, samples, True, None, cycle.rollback))
            self._maybe_finish()
            return {"epoch": self.cluster.epoch}

    def add_event(self, ev: EventIn) -> dict:
        if ev.kind not in EVENT_KINDS:
            raise HTTPException(400, f"kind: {ev.kind!r} is not one of {', '.join(EVENT_KINDS)}")
        if ev.shard is not None and not 0 <= ev.shard < self.cluster.num_servers:
            raise HTTPException(400, f"shard {ev.shard} out of range")
        if ev.at is not None and not (math.isfinite(ev.at) and abs(ev.at - self.clock()) < 3600):
            raise HTTPException(400, "at: must be a wall-clock time within an hour of the coordinator's")
        with self.lock:
            at = ev.at or self.clock()
            if ev.kind == "server_killed" and ev.shard is not None:
                self.open_recovery(ev.shard).killed_at = at
            return self.progress.event(ev.kind, at, shard=ev.shard, **(ev.detail or {}))

    # -- recovery --------------------------------------------------------------------------------------
    def start_recovery(self, shard: int) -> dict:
        """Rebuild `shard`'s registered replacement. Only a shard whose replacement is registered and not yet
        rebuilt can be recovered; asking again while its rebuild runs returns the running record."""
        if not self.cluster.recoverable:
            raise HTTPException(409, "recovery needs faultTolerance.strategy 'ecrec'")
        if not 0 <= shard < self.cluster.num_servers:
            raise HTTPException(400, f"shard {shard} out of range")
        if self.ckpt is not None:
            with self.lock:  # the checkpoint cycle restores replacements by itself: this only reports
                # the shard's latest record, never a new one: a request sent before its restore completed must
                # not open a record that nothing will complete (ecrec local would wait for it forever)
                rec = next((r for r in reversed(self.recoveries) if r.shard == shard), None)
                if rec is None:
                    raise Refused(f"shard {shard} has nothing to recover: it has not failed")
                if rec.state == "detected" and self.cluster.shards[shard].state is ShardState.RECOVERING:
                    rec.state = "waiting"
                return rec.to_dict(self.progress.started_at)
        with self.lock:
            state = self.cluster.shards[shard].state
            if state is not ShardState.RECOVERING:
                why = {
                    ShardState.FAILED: "no replacement has registered yet",
                    ShardState.UP: "it is up",
                    ShardState.PENDING: "it never registered",
                }[state]
                raise Refused(f"shard {shard} has nothing to recover: {why}")
            return self._drive(shard).to_dict(self.progress.started_at)

    def _drive(self, shard: int) -> RecoveryRecord:
        """The shard's open record, with its rebuild driver running (started unless it runs already)."""
        rec = self.open_recovery(shard)
        driver = self._drivers.get(shard)
        if driver is None or not driver.is_alive():
            rec.state, rec.error = "waiting", None
            driver = threading.Thread(
                target=self._drive_recovery, args=(rec,), daemon=True, name=f"recovery-{shard}"
            )
            self._drivers[shard] = driver
            driver.start()
        return rec

    def _drive_recovery(self, rec: RecoveryRecord) -> None:
        """Rebuild the shard's replacement, one Recover call per plan step. If the replacement dies meanwhile,
        wait for the next one to register (a newer incarnation) and start over; stop only when done."""
        failed_incarnation = None
        while not self._stop.is_set():
            target = self._await_replacement(rec, failed_incarnation)
            if target is None:
                with self.lock:
                    rec.state, rec.error = "failed", "no replacement registered"
                return
            address, instance, epoch, incarnation = target
            try:
                self._run_plan(rec, address, epoch)
                break
            except grpc.RpcError as e:
                with self.lock:
                    rec.error = f"{e.code().name}: {e.details()}"
                    self.progress.event("recovery_failed", self.clock(), shard=rec.shard, error=rec.error)
                if self.probe(address, instance):
                    time.sleep(0.5)  # the replacement is alive (a peer was busy or failed): try again
                    continue
                failed_incarnation = incarnation
                with self.lock:
                    rec.state = "waiting"
        else:
            return
        with self.lock:
            now = self.clock()
            self._apply(self.cluster.recovered(rec.shard, now))
            self._completed(rec, now, fault="coordinator:recovery_completed")

    def _rows_recovered(self, rec: RecoveryRecord, *counts: int) -> None:
        """The record's rebuilt rows rise to the largest of `counts`; the per-shard counter rises with it (the
        two agree)."""
        before = rec.rows_recovered
        rec.rows_recovered = max(before, *counts)
        self.metrics.of(self.metrics.rows_recovered, shard=str(rec.shard)).inc(rec.rows_recovered - before)

    def _completed(self, rec: RecoveryRecord, now: float, fault: str | None = None) -> None:
        rec.state, rec.completed_at, rec.error = "completed", now, None
        self.progress.event("recovery_completed", now, shard=rec.shard, rows=rec.rows_recovered)
        if fault is not None:
            fault_point(fault)
        m = self.metrics
        m.of(m.recoveries_completed).inc()
        m.of(m.time_to_recover).observe(now - (rec.killed_at or rec.detected_at or rec.started_at or now))

    def _await_replacement(self, rec: RecoveryRecord, not_incarnation: int | None):
        deadline = time.monotonic() + self.spec.coordinator.recovery_timeout_seconds
        while time.monotonic() < deadline and not self._stop.is_set() and self.failed_reason is None:
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
                now = self.clock()
                rec.plan, rec.steps_total, rec.steps_done, rec.state = plan, len(plan), 0, "running"
                rec.done = {}
                rec.started_at = rec.started_at or now
                self.progress.event("recovery_started", now, shard=rec.shard)
                self.metrics.of(self.metrics.recoveries_started).inc()
            fault_point("coordinator:recovery_started")

            def walk(steps: list) -> None:
                for step in steps:  # a retried plan repeats steps already done: they are no-ops (0 rows)
                    req = pb.RecoverRequest(
                        epoch=epoch, kind=kinds[step.kind], start=step.start, count=step.count
                    )
                    began = time.monotonic()
                    with self.metrics.timed("Recover"):
                        resp = stub.Recover(req, timeout=300)
                    took = time.monotonic() - began
                    fault_point(f"coordinator:recovered_{step.kind}")
                    with self.lock:
                        rec.step_done(step.kind, took)
                        if step.kind == "data":
                            # rows_total: a rebuild resumed after a failover finds its earlier steps done
                            self._rows_recovered(rec, rec.rows_recovered + resp.rows, resp.rows_total)
                        elif step.kind == "parity":
                            rec.parity_recovered += resp.rows

            # The three kinds touch disjoint state (the dense chunks, the shard's rows, the parity records it
            # holds, whose members all live on other servers), so they run side by side, each kind's lock
            # groups one after another: the rebuild takes the longest of the three instead of their sum.
            by_kind = [[st for st in plan if st.kind == kind] for kind in kinds]
            with concurrent.futures.ThreadPoolExecutor(len(kinds), thread_name_prefix="recover") as pool:
                for done in [pool.submit(walk, steps) for steps in by_kind if steps]:
                    done.result()  # the first error is the plan's (the others' steps stay done)

    def metrics_state(self) -> dict:
        """The job as the coordinator's scrape-time collector exports it (ecrec.metrics.JobCollector)."""
        with self.lock:
            workers = self.progress.workers.values()
            recoveries = {}
            for rec in self.recoveries:  # the latest record of each shard wins
                recoveries[rec.shard] = {
                    "phase": rec.state,
                    "lock_groups": sum(s.kind != "dense" for s in rec.plan),
                    "lock_groups_done": rec.done.get("data", 0) + rec.done.get("parity", 0),
                    "rows": rec.rows_recovered,
                }
            return {
                "step": min((w.step for w in workers), default=0),
                "target_steps": self.spec.training.steps,
                "losses": {w.rank: w.loss for w in workers if w.loss is not None and not w.lost},
                "phase": self.phase(),
                "shards": [(s.shard, s.state.value, s.incarnation) for s in self.cluster.shards],
                "recoveries": recoveries,
                **({"checkpointing": self.ckpt.stats()} if self.ckpt is not None else {}),
            }

    def record_parity_check(self, req: ParityCheck) -> dict:
        """A parity check's result (`ecrec verify`, `ecrec local` after training), for /metrics."""
        if min(req.stripes, req.mismatches, req.in_flight) < 0 or req.mismatches > req.stripes:
            raise HTTPException(400, "stripes, mismatches, in_flight: counts, mismatches <= stripes")
        with self.lock:
            m = self.metrics
            m.of(m.parity_checks, result="ok").inc(req.stripes - req.mismatches)
            m.of(m.parity_checks, result="mismatch").inc(req.mismatches)
            m.of(m.parity_last_mismatches).set(req.mismatches)
            m.of(m.parity_last_time).set(self.clock())
            return {"ok": req.mismatches == 0}

    def recoveries_view(self) -> list[dict]:
        with self.lock:
            return [r.to_dict(self.progress.started_at) for r in self.recoveries]

    @property
    def finished(self) -> bool:
        p = self.progress
        done = len(p.workers) == p.num_workers and all(w.done for w in p.workers.values())
        return done and (self.ckpt is None or self.ckpt.cycle.finished)

    def phase(self) -> str:
        if self.failed_reason:
            return "Failed"
        if self.finished:
            return "Succeeded"
        states = {s.state for s in self.cluster.shards}
        if self.progress.started_at is None:
            return "Pending"
        if ShardState.FAILED in states:
            return "Degraded"
        if ShardState.RECOVERING in states:
            return "Recovering"
        return "Running"

    def status(self) -> dict:
        with self.lock:
            p = self.progress
            end = p.finished_at or self.clock()
            elapsed = (end - p.started_at) if p.started_at else 0.0
            return {
                "job": self.job.name,
                "generation": self.generation,
                "resume": self.resume_state(),
                "phase": self.phase(),
                "reason": self.failed_reason,
                "cluster": self.cluster.snapshot(),
                "startedAt": p.started_at,
                "finishedAt": p.finished_at,
                "elapsedSeconds": round(elapsed, 3),
                "step": min((w.step for w in p.workers.values()), default=0),
                "samples": p.total_samples,
                "samplesPerSecond": p.recent_rate(),
                "meanSamplesPerSecond": round(p.total_samples / elapsed, 1) if elapsed > 0 else 0.0,
                "workers": [vars(w) for w in sorted(p.workers.values(), key=lambda w: w.rank)],
                "throughputSeries": p.series(),
                "samplesSeries": p.samples_series(),
                "events": list(p.events),
                "recoveries": [r.to_dict(p.started_at) for r in self.recoveries],
                **({"checkpointing": self.ckpt.stats()} if self.ckpt is not None else {}),
                "cpuSeconds": self._cpu_seconds(),
                # by server process; the cluster map's shards name their instances
                "serverCpuSeconds": self.cpu.by_instance("server"),
                "spares": self.spares.snapshot(),
            }

    def _cpu_seconds(self) -> dict[str, float]:
        self.cpu.report("coordinator", "self", time.process_time())
        return self.cpu.by_role()

    # -- lifecycle -------------------------------------------------------------------------------------
    def run_ticker(self) -> threading.Thread:
        interval = min(0.5, self.spec.coordinator.heartbeat_interval_seconds)

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.tick()
                except Exception:  # keep detecting failures whatever one tick hit
                    log.exception("tick failed")

        t = threading.Thread(target=loop, name="coordinator-tick", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()
        if self.ckpt is not None:
            self.ckpt.close()


class SingleFlight:
    """Calls of `fn(address, instance)` made while one with the same arguments runs wait for its answer
    instead of running again: when a server dies, every worker and server that used it reports it at once,
    and each report probing it anew cost the coordinator CPU in the moment the whole job waits on it."""

    def __init__(self, fn: Callable[[str, str], bool]):
        self.fn = fn
        self.lock = threading.Lock()
        self.running: dict[tuple[str, str], concurrent.futures.Future] = {}

    def __call__(self, address: str, instance: str = "") -> bool:
        key = (address, instance)
        with self.lock:
            fut = self.running.get(key)
            first = fut is None
            if first:
                fut = self.running[key] = concurrent.futures.Future()
        if not first:
            return fut.result()
        try:
            answer = self.fn(address, instance)
            fut.set_result(answer)
            return answer
        except BaseException as e:
            fut.set_exception(e)
            raise
        finally:
            with self.lock:
                del self.running[key]


def _tcp_answers(address: str, timeout: float) -> bool | None:
    """Does anything accept a TCP connection at `address` within `timeout`? False when it is refused or
    nothing answers in time (the kernel accepts for a live process however busy it is); None when the network
    cannot tell (no route, a name that does not resolve): gRPC's probe decides then."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (ConnectionRefusedError, TimeoutError):
        return False
    except (OSError, ValueError):
        return None


def probe_server(address: str, instance: str = "", timeout: float = 1.0, token: str | None = None) -> bool:
    """True if the parameter server process `instance` answers Info at `address` within `timeout`. Another
    process answering at that address (a replacement that took it over) means `instance` is gone."""
    from ecrec.proto import ecrec_pb2, ecrec_pb2_grpc

    if not address:
        return False
    # A refused connection answers at once (a killed local process); a gRPC channel takes tens of ms to
    # say the same on a loaded machine, while every worker waits for the verdict.
    if _tcp_answers(address, timeout) is False:
        return False
    with auth.channel(address, token) as ch:
        try:
            info = ecrec_pb2_grpc.ParameterServerStub(ch).Info(ecrec_pb2.InfoRequest(), timeout=timeout)
        except grpc.RpcError as e:
            # A process that refuses our token is still there: never declare a live process dead.
            return e.code() == grpc.StatusCode.UNAUTHENTICATED
    return not instance or info.instance == instance


def load_seed(source: str) -> dict:
    """A --resume argument: `env:VAR` (what the operator sets) or a JSON file (what ecrec local writes)."""
    import json
    import os
    from pathlib import Path

    if source.startswith("env:"):
        text = os.environ.get(source[4:], "")
        if not text:
            raise SystemExit(f"--resume {source}: the variable is unset or empty")
    else:
        text = Path(source).read_text()
    seed = json.loads(text)
    if not isinstance(seed, dict):
        raise SystemExit(f"--resume {source}: not a JSON object")
    return seed


def create_app(coord: Coordinator) -> FastAPI:
    async def require_token(request: Request) -> None:
        # Reads stay open (probes, dashboards, scrapers); what changes the job needs the job token.
        if request.method not in ("GET", "HEAD") and not auth.valid(
            coord.token, request.headers.get(auth.HEADER)
        ):
            raise HTTPException(401, "this job's token is required")

    app = FastAPI(title="ecrec coordinator", version="v1", dependencies=[Depends(require_token)])

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/cluster")
    def cluster() -> dict:
        with coord.lock:
            return coord.cluster.snapshot()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(coord.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/job")
    def job() -> dict:
        return {"name": coord.job.name, "spec": coord.spec.to_dict()}

    @app.get("/v1/status")
    def status() -> dict:
        return coord.status()

    @app.exception_handler(ValueError)
    def bad_request(_request, exc: ValueError) -> JSONResponse:  # e.g. a shard id out of range
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(Refused)
    def refused(_request, exc: Refused) -> JSONResponse:  # does not fit the current state: nothing changed
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.post("/v1/servers/register")
    def register_server(req: RegisterServer) -> dict:
        return coord.register_server(req)

    @app.post("/v1/spares/register")
    def register_spare(req: SpareIn) -> dict:
        return coord.register_spare(req)

    @app.post("/v1/spares/heartbeat")
    def spare_heartbeat(req: SpareIn) -> dict:
        return coord.spare_heartbeat(req)

    @app.post("/v1/servers/heartbeat")
    def heartbeat(req: Heartbeat) -> dict:
        return coord.heartbeat(req)

    @app.post("/v1/failures")
    def failures(req: FailureReport) -> dict:
        return coord.report_failure(req)

    @app.post("/v1/workers/register")
    def register_worker(req: RegisterWorker) -> dict:
        return coord.register_worker(req)

    @app.get("/v1/workers/start")
    def start(rank: int | None = None, instance: str = "") -> dict:
        return coord.start_state(rank, instance)

    @app.post("/v1/workers/progress")
    def progress(req: Progress) -> dict:
        return coord.report_progress(req)

    @app.get("/v1/workers/control")
    def control() -> dict:
        return coord.control().get("control") or {}

    @app.post("/v1/workers/lost")
    def worker_lost(req: WorkerLost) -> dict:
        return coord.worker_lost(req)

    @app.post("/v1/workers/finished")
    def worker_finished(req: WorkerFinished) -> dict:
        return coord.worker_finished(req)

    @app.post("/v1/events")
    def events(ev: EventIn) -> dict:
        return coord.add_event(ev)

    @app.post("/recoveries")
    def start_recovery(req: StartRecovery) -> dict:
        return coord.start_recovery(req.shard)

    @app.post("/v1/parity-checks")
    def parity_checks(req: ParityCheck) -> dict:
        return coord.record_parity_check(req)

    @app.get("/recoveries")
    def recoveries() -> list[dict]:
        return coord.recoveries_view()

    return app


def main(argv: list[str] | None = None) -> None:
    from ecrec.jobctx import JobContext

    ap = argparse.ArgumentParser(prog="ecrec-coordinator")
    ap.add_argument("--job", required=True, help="job JSON file ({name, spec}), or env:VAR")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="also serve /metrics alone on this port (0: only on --port)",
    )
    ap.add_argument(
        "--generation",
        type=int,
        default=1,
        help="this coordinator's incarnation: > 1 replaces a dead one and needs --resume",
    )
    ap.add_argument(
        "--resume",
        default="",
        help="the dead coordinator's last status 'resume' part: a JSON file, or env:VAR",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    configure_faults("coordinator")
    if (args.generation > 1) != bool(args.resume):
        ap.error(
            "--generation > 1 and --resume go together: a replacement starts from its predecessor's state"
        )
    seed = load_seed(args.resume) if args.resume else None
    ctx = JobContext.load(args.job)
    coord = Coordinator(ctx.job, generation=args.generation, seed=seed, token=ctx.token)
    if args.metrics_port:
        coord.metrics.serve(args.metrics_port, args.host)
    coord.run_ticker()
    uvicorn.run(create_app(coord), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
