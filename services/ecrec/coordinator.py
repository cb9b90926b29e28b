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
import logging
import math
import threading
import time
from dataclasses import dataclass, field

import grpc
import uvicorn
from fastapi import FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from ecrec.core.cluster import ClusterMap, ProbeFirst, Refused, ShardState, Transition
from ecrec.core.recovery import RecoveryRecord, plan_recovery
from ecrec.metrics import Metrics
from ecrec.spec import Job, JobSpec

log = logging.getLogger("ecrec.coordinator")


class RegisterServer(BaseModel):
    shard: int
    address: str
    instance: str  # the process's own id, unique per process
    metricsUrl: str = ""
    replacement: bool = False


class Heartbeat(BaseModel):
    shard: int
    address: str
    instance: str
    epoch: int = 0
    recovered: bool = False


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


class WorkerLost(BaseModel):
    rank: int
    instance: str  # the registered process that died
    replacing: bool = False  # a replacement will resume the rank's steps: the job waits for it


class Progress(BaseModel):
    rank: int
    instance: str
    step: int
    samples: int
    loss: float | None = None  # null when the worker has no finite loss to report
    done: bool = False
    error: str | None = None
    lastStepAt: float | None = None  # wall-clock time the worker's latest step completed


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


@dataclass
class JobProgress:
    """Training progress over time. t = 0 is when the last worker registered (training start)."""

    num_workers: int
    workers: dict[int, WorkerProgress] = field(default_factory=dict)
    started_at: float | None = None
    finished_at: float | None = None
    samples_log: list[tuple[float, int]] = field(default_factory=list)  # (wall time, total samples)
    events: list[dict] = field(default_factory=list)

    @property
    def total_samples(self) -> int:
        return sum(w.samples for w in self.workers.values())

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

    def series(self, window: float = 1.0) -> list[list[float]]:
        """[seconds since start, samples/s over the trailing `window`] for every logged sample."""
        out, j = [], 0
        log_ = self.samples_log
        for i, (t, n) in enumerate(log_):
            while j < i and t - log_[j][0] > window:
                j += 1
            if i > j and t > log_[j][0]:
                out.append([round(self.rel(t), 3), round((n - log_[j][1]) / (t - log_[j][0]), 1)])
        return out

    def recent_rate(self, window: float = 2.0) -> float:
        s = self.series(window)
        return s[-1][1] if s else 0.0


class Coordinator:
    def __init__(self, job: Job, clock=time.time, probe=None):
        self.job, self.spec, self.clock = job, job.spec, clock
        spec: JobSpec = job.spec
        self.lock = threading.RLock()
        self.cluster = ClusterMap(
            num_servers=spec.servers.replicas,
            failure_timeout=spec.coordinator.failure_timeout_seconds,
            recoverable=spec.fault_tolerance.strategy == "ecrec",
        )
        self.progress = JobProgress(num_workers=spec.workers.replicas)
        self.metrics = Metrics(job.name, "coordinator")
        self.probe = probe or probe_server
        self.failed_reason: str | None = None
        self.last_step_at: float | None = None  # when some worker last completed a step (stall detection)
        self.recoveries: list[RecoveryRecord] = []
        self._drivers: dict[int, threading.Thread] = {}
        self._stop = threading.Event()

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
        m.of(m.epoch).set(self.cluster.epoch)
        for state in ShardState:
            m.of(m.servers, state=state.value).set(sum(s.state is state for s in self.cluster.shards))

    def register_server(self, req: RegisterServer) -> dict:
        out = self._register_server(req)
        with self.lock:
            self._maybe_start()
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

        with self.lock:
            try:
                return register(False)
            except ProbeFirst as first:
                holder = first
        if self.probe(holder.address, holder.instance):  # outside the lock: a slow probe must not stall
            raise Refused(
                f"shard {req.shard} is up at {holder.address} (instance {holder.instance}) and answering: "
                "a second process is not admitted while it serves"
            )
        with self.lock:
            if self.cluster.shards[req.shard].instance != holder.instance:
                raise Refused(f"shard {req.shard} changed while its registered process was probed: retry")
            return register(True)

    def heartbeat(self, req: Heartbeat) -> dict:
        with self.lock:
            ok = self.cluster.heartbeat(req.shard, req.address, self.clock(), req.instance)
            return {"ok": ok, "epoch": self.cluster.epoch, "cluster": self.cluster.snapshot()}

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
            self.progress.sample(now)
            m = self.metrics
            m.of(m.throughput).set(self.progress.recent_rate())
            if self.failed_reason is None and not self.finished:
                self.failed_reason = self._why_stuck(now)
                if self.failed_reason:
                    self.progress.event("job_failed", now, reason=self.failed_reason)
                    log.error("job failed: %s", self.failed_reason)

    def _why_stuck(self, now: float) -> str | None:
        """Why the job cannot finish, if it cannot: more than r servers lost at once, a shard not rebuilt in
        time, or no worker progressing. None while it can."""
        spec = self.spec
        if self.cluster.recoverable:
            lost = self.cluster.lost()
            r = spec.fault_tolerance.ecrec.r
            if len(lost) > r:
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
        with self.lock:
            if not 0 <= req.rank < self.progress.num_workers:
                raise HTTPException(400, f"worker rank {req.rank} out of range")
            if not req.instance:
                raise Refused("instance: a registering worker must name itself")
            known = self.progress.workers.get(req.rank)
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
            self._maybe_start()
            # A replacement resumes the rank where its predecessor's last progress report ended.
            return {**self.start_state(), "resume": {"step": w.step, "samples": w.samples}}

    def _maybe_start(self) -> None:
        """Training starts once every worker and every server has registered (pods start in any order)."""
        p = self.progress
        if p.started_at is None and len(p.workers) == p.num_workers and self.cluster.ready:
            now = self.clock()
            p.started_at = now
            p.samples_log.append((now, 0))
            p.event("training_started", now)

    def start_state(self) -> dict:
        with self.lock:
            return {"started": self.progress.started_at is not None, "startedAt": self.progress.started_at}

    def report_progress(self, req: Progress) -> dict:
        with self.lock:
            w = self._worker(req.rank, req.instance)
            if req.step < w.step or req.samples < w.samples:
                raise Refused(f"worker {req.rank}: step {req.step} is behind its last report (step {w.step})")
            if req.loss is not None and not math.isfinite(req.loss):
                raise HTTPException(400, "loss: must be a finite number or null")
            if req.step > w.step:
                self.last_step_at = self.clock()
            if req.lastStepAt is not None:
                for rec in self.recoveries:
                    if (
                        rec.detected_at is not None
                        and rec.continued_at is None
                        and req.lastStepAt > rec.detected_at
                    ):
                        rec.continued_at = req.lastStepAt
                        self.progress.event("training_continued", req.lastStepAt, shard=rec.shard)
                        self.metrics.of(self.metrics.time_to_continue).observe(
                            req.lastStepAt - (rec.killed_at or rec.detected_at)
                        )
            if w.lost:
                return {"epoch": self.cluster.epoch}
            delta = max(0, req.samples - w.samples)
            w.step, w.samples, w.loss, w.done, w.error = req.step, req.samples, req.loss, req.done, req.error
            m = self.metrics
            m.of(m.samples).inc(delta)
            if req.error and self.failed_reason is None:  # the first reason is the cause; later ones follow
                self.failed_reason = f"worker {req.rank}: {req.error}"
            if self.finished and self.progress.finished_at is None:
                now = self.clock()
                self.progress.sample(now)
                self.progress.finished_at = now
                self.progress.event("training_finished", now)
            return {"epoch": self.cluster.epoch}

    def worker_lost(self, req: WorkerLost) -> dict:
        """A worker process died before finishing its steps: the job finishes without them, or, if a
        replacement is coming, waits for it to resume them."""
        with self.lock:
            w = self._worker(req.rank, req.instance)
            if w.done or w.lost:
                return {"epoch": self.cluster.epoch}  # finished, or reported lost already
            w.lost, w.done = True, not req.replacing
            self.progress.event("worker_lost", self.clock(), worker=req.rank, step=w.step)
            if self.finished and self.progress.finished_at is None:
                now = self.clock()
                self.progress.finished_at = now
                self.progress.event("training_finished", now)
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
        with self.lock:
            state = self.cluster.shards[shard].state
            if state is not ShardState.RECOVERING:
                why = {
                    ShardState.FAILED: "no replacement has registered yet",
                    ShardState.UP: "it is up",
                    ShardState.PENDING: "it never registered",
                }[state]
                raise Refused(f"shard {shard} has nothing to recover: {why}")
            rec = self.open_recovery(shard)
            driver = self._drivers.get(shard)
            if driver is None or not driver.is_alive():
                rec.state, rec.error = "waiting", None
                driver = threading.Thread(
                    target=self._drive_recovery, args=(rec,), daemon=True, name=f"recovery-{shard}"
                )
                self._drivers[shard] = driver
                driver.start()
            return rec.to_dict(self.progress.started_at)

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
            rec.state, rec.completed_at, rec.error = "completed", now, None
            self.progress.event("recovery_completed", now, shard=rec.shard, rows=rec.rows_recovered)
            m = self.metrics
            m.of(m.recoveries_completed).inc()
            m.of(m.full_recovery).observe(now - (rec.detected_at or rec.started_at or now))

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
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            info = stub.Info(pb.InfoRequest(), timeout=30)
            plan = plan_recovery(
                info.data_rows, info.parity_rows, self.spec.fault_tolerance.ecrec.lock_group_rows
            )
            with self.lock:
                now = self.clock()
                rec.plan, rec.steps_total, rec.steps_done, rec.state = plan, len(plan), 0, "running"
                rec.started_at = rec.started_at or now
                self.progress.event("recovery_started", now, shard=rec.shard)
                self.metrics.of(self.metrics.recoveries_started).inc()
            for step in plan:  # a retried plan repeats steps already done: they are no-ops (0 rows)
                req = pb.RecoverRequest(
                    epoch=epoch, kind=kinds[step.kind], start=step.start, count=step.count
                )
                resp = stub.Recover(req, timeout=300)
                with self.lock:
                    rec.steps_done += 1
                    if step.kind == "data":
                        rec.rows_recovered += resp.rows
                        self.metrics.of(self.metrics.rows_recovered).inc(resp.rows)
                    elif step.kind == "parity":
                        rec.parity_recovered += resp.rows

    def recoveries_view(self) -> list[dict]:
        with self.lock:
            return [r.to_dict(self.progress.started_at) for r in self.recoveries]

    @property
    def finished(self) -> bool:
        p = self.progress
        return len(p.workers) == p.num_workers and all(w.done for w in p.workers.values())

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
                "events": list(p.events),
                "recoveries": [r.to_dict(p.started_at) for r in self.recoveries],
            }

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


def probe_server(address: str, instance: str = "", timeout: float = 1.0) -> bool:
    """True if the parameter server process `instance` answers Info at `address` within `timeout`. Another
    process answering at that address (a replacement that took it over) means `instance` is gone."""
    from ecrec.proto import ecrec_pb2, ecrec_pb2_grpc

    if not address:
        return False
    with grpc.insecure_channel(address) as ch:
        try:
            info = ecrec_pb2_grpc.ParameterServerStub(ch).Info(ecrec_pb2.InfoRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return not instance or info.instance == instance


def create_app(coord: Coordinator) -> FastAPI:
    app = FastAPI(title="ecrec coordinator", version="v1")

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
    def start() -> dict:
        return coord.start_state()

    @app.post("/v1/workers/progress")
    def progress(req: Progress) -> dict:
        return coord.report_progress(req)

    @app.post("/v1/workers/lost")
    def worker_lost(req: WorkerLost) -> dict:
        return coord.worker_lost(req)

    @app.post("/v1/events")
    def events(ev: EventIn) -> dict:
        return coord.add_event(ev)

    @app.post("/recoveries")
    def start_recovery(req: StartRecovery) -> dict:
        return coord.start_recovery(req.shard)

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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    coord = Coordinator(JobContext.load(args.job).job)
    if args.metrics_port:
        coord.metrics.serve(args.metrics_port, args.host)
    coord.run_ticker()
    uvicorn.run(create_app(coord), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
