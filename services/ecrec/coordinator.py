"""The coordinator process: cluster map, failure detection, job progress, REST control plane, /metrics.

A thin FastAPI adapter around `core.cluster.ClusterMap` and `JobProgress`. Servers register and heartbeat
here; workers wait here for the cluster and for each other, then report progress; the local launcher and the
Kubernetes operator read `/v1/status`. All state lives behind one lock: requests are tiny and rare.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import uvicorn
from fastapi import FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from ecrec.core.cluster import ClusterMap, ShardState, Transition
from ecrec.core.recovery import RecoveryRecord, plan_recovery
from ecrec.metrics import Metrics
from ecrec.spec import Job, JobSpec, job_from_dict

log = logging.getLogger("ecrec.coordinator")


class RegisterServer(BaseModel):
    shard: int
    address: str
    metricsUrl: str = ""
    replacement: bool = False


class Heartbeat(BaseModel):
    shard: int
    address: str
    epoch: int = 0
    recovered: bool = False


class StartRecovery(BaseModel):
    shard: int


class FailureReport(BaseModel):
    shard: int
    reporter: str = ""


class RegisterWorker(BaseModel):
    rank: int


class Progress(BaseModel):
    rank: int
    step: int
    samples: int
    loss: float | None = None
    done: bool = False
    error: str | None = None
    lastStepAt: float | None = None  # wall-clock time the worker's latest step completed


class EventIn(BaseModel):
    kind: str
    shard: int | None = None
    at: float | None = None  # wall-clock time.time(); defaults to now
    detail: dict | None = None


@dataclass
class WorkerProgress:
    rank: int
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
        with self.lock:
            self._apply(self.cluster.register(req.shard, req.address, self.clock(), req.metricsUrl))
            return {"epoch": self.cluster.epoch, "cluster": self.cluster.snapshot()}

    def heartbeat(self, req: Heartbeat) -> dict:
        with self.lock:
            ok = self.cluster.heartbeat(req.shard, req.address, self.clock())
            return {"ok": ok, "epoch": self.cluster.epoch, "cluster": self.cluster.snapshot()}

    def report_failure(self, req: FailureReport) -> dict:
        with self.lock:
            info = self.cluster.shards[req.shard] if 0 <= req.shard < self.cluster.num_servers else None
            if info is None:
                raise HTTPException(400, f"shard {req.shard} out of range")
            address, state = info.address, info.state
        # Confirm outside the lock: a slow probe must not stall heartbeats.
        if state in (ShardState.UP, ShardState.RECOVERING) and not self.probe(address):
            with self.lock:
                if self.cluster.shards[req.shard].address == address:
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

    # -- workers ---------------------------------------------------------------------------------------
    def register_worker(self, req: RegisterWorker) -> dict:
        with self.lock:
            if not 0 <= req.rank < self.progress.num_workers:
                raise HTTPException(400, f"worker rank {req.rank} out of range")
            self.progress.workers.setdefault(req.rank, WorkerProgress(req.rank))
            if len(self.progress.workers) == self.progress.num_workers and self.progress.started_at is None:
                now = self.clock()
                self.progress.started_at = now
                self.progress.samples_log.append((now, 0))
                self.progress.event("training_started", now)
            return self.start_state()

    def start_state(self) -> dict:
        with self.lock:
            return {"started": self.progress.started_at is not None, "startedAt": self.progress.started_at}

    def report_progress(self, req: Progress) -> dict:
        with self.lock:
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
            w = self.progress.workers.setdefault(req.rank, WorkerProgress(req.rank))
            if w.lost:
                return {"epoch": self.cluster.epoch}
            delta = max(0, req.samples - w.samples)
            w.step, w.samples, w.loss, w.done, w.error = req.step, req.samples, req.loss, req.done, req.error
            m = self.metrics
            m.of(m.samples).inc(delta)
            if req.error:
                self.failed_reason = f"worker {req.rank}: {req.error}"
            if self.finished and self.progress.finished_at is None:
                now = self.clock()
                self.progress.sample(now)
                self.progress.finished_at = now
                self.progress.event("training_finished", now)
            return {"epoch": self.cluster.epoch}

    def worker_lost(self, req: RegisterWorker) -> dict:
        """A worker process died (killed): the job finishes without it."""
        with self.lock:
            w = self.progress.workers.setdefault(req.rank, WorkerProgress(req.rank))
            w.done, w.lost = True, True
            self.progress.event("worker_lost", self.clock(), worker=req.rank)
            if self.finished and self.progress.finished_at is None:
                now = self.clock()
                self.progress.finished_at = now
                self.progress.event("training_finished", now)
            return {"epoch": self.cluster.epoch}

    def add_event(self, ev: EventIn) -> dict:
        with self.lock:
            at = ev.at or self.clock()
            if ev.kind == "server_killed" and ev.shard is not None:
                self.open_recovery(ev.shard).killed_at = at
            return self.progress.event(ev.kind, at, shard=ev.shard, **(ev.detail or {}))

    # -- recovery --------------------------------------------------------------------------------------
    def start_recovery(self, shard: int) -> dict:
        if not self.cluster.recoverable:
            raise HTTPException(409, "recovery needs faultTolerance.strategy 'ecrec'")
        if not 0 <= shard < self.cluster.num_servers:
            raise HTTPException(400, f"shard {shard} out of range")
        with self.lock:
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
            address, epoch, incarnation = target
            try:
                self._run_plan(rec, address, epoch)
                break
            except grpc.RpcError as e:
                failed_incarnation = incarnation
                with self.lock:
                    rec.state, rec.error = "waiting", f"{e.code().name}: {e.details()}"
                    self.progress.event("recovery_failed", self.clock(), shard=rec.shard)
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

    def _await_replacement(self, rec: RecoveryRecord, not_incarnation: int | None, timeout: float = 600.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stop.is_set():
            with self.lock:
                info = self.cluster.shards[rec.shard]
                if info.state is ShardState.RECOVERING and info.incarnation != not_incarnation:
                    return info.address, self.cluster.epoch, info.incarnation
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
            for step in plan:
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


def probe_server(address: str, timeout: float = 1.0) -> bool:
    """True if a parameter server answers Info at `address` within `timeout`."""
    from ecrec.proto import ecrec_pb2, ecrec_pb2_grpc

    if not address:
        return False
    with grpc.insecure_channel(address) as ch:
        try:
            ecrec_pb2_grpc.ParameterServerStub(ch).Info(ecrec_pb2.InfoRequest(), timeout=timeout)
            return True
        except grpc.RpcError:
            return False


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
    def worker_lost(req: RegisterWorker) -> dict:
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
    ap = argparse.ArgumentParser(prog="ecrec-coordinator")
    ap.add_argument("--job", required=True, help="job JSON file ({name, spec})")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    doc = json.loads(Path(args.job).read_text())
    job = job_from_dict(
        {
            "metadata": {"name": doc["name"]},
            "spec": doc["spec"],
            "apiVersion": "ecrec.dev/v1alpha1",
            "kind": "ECRecJob",
        }
    )
    coord = Coordinator(job)
    coord.run_ticker()
    uvicorn.run(create_app(coord), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
