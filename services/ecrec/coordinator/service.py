"""The coordinator service: the job's state behind one lock, and what each request does to it.

`Coordinator` holds the cluster map (ecrec.core.cluster), the worker registry (ecrec.core.workers), the
recovery records (`records`), the spare pool and the metrics, and delegates to its rooms: server and spare
admission (`admission`), the recovery driver (`recovery`), the checkpoint driver (`checkpoints`), the views
(`views`). The FastAPI app (`app`) is a thin adapter around it. Servers register and heartbeat here; workers
wait here for the cluster and for each other, then report progress; the local launcher and the Kubernetes
operator read `/v1/status`.

Every mutating request is checked against the current state before it changes anything; one that does not fit
(a second process for a live shard, a stale incarnation, a recovery of a healthy shard, progress from a worker
that is not the registered one) is refused (`Refused`, 409 with the reason) and changes nothing; a malformed
one is rejected (`ValueError`, 400). Domain code raises nothing else.

Lock discipline: `lock` (re-entrant) guards all of the job's state: the cluster map, the registry and its
progress record, the recovery records, the spares, the checkpoint cycle, `failed_reason`. Requests are tiny
and rare: every public method takes it itself, and none holds it across a probe, an RPC or a sleep (the
drivers' threads take it only for bookkeeping). Methods named in the drivers' host protocols say whether
they expect it held.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time

from ecrec.coordinator import failover, views
from ecrec.coordinator.admission import Admission
from ecrec.coordinator.checkpoints import CheckpointDriver
from ecrec.coordinator.contract import (
    EVENT_KINDS,
    EventIn,
    FailureReport,
    Heartbeat,
    ParityCheck,
    Progress,
    RegisterServer,
    RegisterWorker,
    SpareIn,
    WorkerFinished,
    WorkerLost,
)
from ecrec.coordinator.probe import SingleFlight, probe_server
from ecrec.coordinator.records import RecoveryLog
from ecrec.coordinator.recovery import RecoveryDriver
from ecrec.core.cluster import ClusterMap, ShardState, Transition
from ecrec.core.cpu import CpuAccount
from ecrec.core.recovery import RecoveryRecord
from ecrec.core.spares import SparePool
from ecrec.core.workers import WorkerRegistry, step_times
from ecrec.metrics import coordinator_metrics
from ecrec.spec import Job, JobSpec

log = logging.getLogger("ecrec.coordinator")

MAX_SEEDED_EVENTS = 200  # the job's latest events a successor coordinator keeps


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
        self.workers = WorkerRegistry(spec.workers.replicas)
        self.progress = self.workers.progress
        # CPU seconds by role since registration (ecrec.core.cpu); this process's own since it got here.
        self.cpu = CpuAccount()
        self.spares = SparePool()
        self.cpu.report("coordinator", "self", time.process_time())
        self.metrics, self.reports = coordinator_metrics(job.name, self.metrics_state, spec.servers.replicas)
        self.probe = SingleFlight(probe or functools.partial(probe_server, token=token))
        self.failed_reason: str | None = None
        self.recoveries = RecoveryLog(self.progress, self.metrics)
        self._stop = threading.Event()
        self.admission = Admission(self, self.lock, self.cluster, self.spares, self.cpu, self.progress)
        self.recovery = RecoveryDriver(
            self, self.cluster, self.recoveries, self.lock, self._stop, spec, token, self.metrics
        )
        self.ckpt: CheckpointDriver | None = None
        if spec.fault_tolerance.checkpoints() is not None:  # a checkpoint strategy, or ecrec's fallback
            self.ckpt = CheckpointDriver(self, job, generation, token, self.lock)
        # strategy ecrec with a checkpoint fallback: ECRec rebuilds up to r lost shards, the checkpoint more
        self.fallback = self.ckpt is not None and self.ckpt.cycle.fallback
        if seed is not None:
            failover.restore(self, seed, MAX_SEEDED_EVENTS)
            if self.ckpt is not None:
                with self.lock:
                    self.ckpt.take_over(seed)

    # -- failover ----------------------------------------------------------------------------------------
    def resume_state(self) -> dict:
        """What a successor needs to carry on after this process dies (`seed`); wall-clock times. The
        launchers keep the latest copy (the operator in the ECRecJob's status.resume)."""
        with self.lock:
            return views.resume_state(self, MAX_SEEDED_EVENTS)

    # -- cluster ---------------------------------------------------------------------------------------
    def apply(self, transitions: list[Transition]) -> None:
        """What the cluster map's transitions mean for the job: events, metrics, recovery records, spares,
        the checkpoint cycle, a rebuild started. Called with the lock held."""
        m = self.metrics
        for tr in transitions:
            self.progress.event(tr.kind, tr.at, shard=tr.shard, epoch=tr.epoch)
            if tr.kind == "failure_detected":
                m.of(m.failures).inc()
                if not self.cluster.recoverable and self.progress.started_at is not None:
                    self.failed_reason = f"server {tr.shard} failed and strategy 'none' cannot recover it"
                if self.cluster.recoverable:
                    self.recoveries.detected(tr.shard, tr.at)
                if self.ckpt is not None:
                    self.ckpt.feed(self.ckpt.cycle.failure(tr.shard))
                self.admission.assign_spares(tr.at)
            elif tr.kind == "replacement_registered" and self.ckpt is not None and self.ckpt.restores:
                self.ckpt.feed(self.ckpt.cycle.registered(tr.shard))
            elif tr.kind == "replacement_registered" and self.cluster.recoverable:
                # Its rebuild starts now: waiting for the launcher to ask (its next look at the status,
                # 0.2 s and more) left the shard degraded for nothing. The launcher still asks: that
                # restarts a driver that is gone (after a coordinator failover) and is a no-op otherwise.
                self.recovery.drive(tr.shard)
            elif tr.kind == "rejoined" and self.cluster.shards[tr.shard].state is ShardState.RECOVERING:
                # a replacement the seed did not know: its failure has a record here from now on
                self.recoveries.detected(tr.shard, tr.at)
        if self.fallback and self.failed_reason is None and self.progress.started_at is not None:
            self.ckpt.beyond_parity(self.cluster, self.spec.fault_tolerance.ecrec.r)
        m.of(m.epoch).set(self.cluster.epoch)
        for state in ShardState:
            m.of(m.servers, state=state.value).set(sum(s.state is state for s in self.cluster.shards))

    def register_server(self, req: RegisterServer) -> dict:
        return self.admission.register_server(req)

    def heartbeat(self, req: Heartbeat) -> dict:
        return self.admission.heartbeat(req)

    def report_failure(self, req: FailureReport) -> dict:
        return self.admission.report_failure(req)

    def register_spare(self, req: SpareIn) -> dict:
        return self.admission.register_spare(req)

    def spare_heartbeat(self, req: SpareIn) -> dict:
        return self.admission.spare_heartbeat(req)

    def rebuilt_unseen(self, shard: int, rows: int, now: float) -> None:
        """AdmissionHost: a rejoining replacement was rebuilt by a coordinator before this one."""
        if (self.ckpt is None or self.fallback) and self.cluster.recoverable:
            # Rebuilt, by a coordinator that died before the launcher saved a seed saying so (the rebuild
            # starts at registration and can finish within one look at the status): the record it left open
            # is completed now, when this coordinator learns of it.
            rec = self.recoveries.open(shard)
            self.recoveries.rows_recovered(rec, rows)
            self.recoveries.completed(rec, now)

    def over(self) -> bool:
        return self.finished or self.failed_reason is not None

    def tick(self) -> None:
        with self.lock:
            now = self.clock()
            self.apply(self.cluster.tick(now))
            self.admission.expire_spares(now)
            self.admission.assign_spares(now)
            for w in self.workers.check_silent(now, self.cluster.failure_timeout):
                log.warning(
                    "worker %d (%s) silent for over %gs: declared unresponsive",
                    w.rank,
                    w.instance,
                    self.cluster.failure_timeout,
                )
            if self.ckpt is not None:
                self.ckpt.feed(self.ckpt.cycle.tick(now))
            self.progress.sample(now)
            m = self.metrics
            m.of(m.throughput).set(self.progress.recent_rate() if self.progress.finished_at is None else 0.0)
            if self.failed_reason is None and not self.finished:
                self.failed_reason = views.why_stuck(self, now)
                if self.failed_reason:
                    self.progress.event("job_failed", now, reason=self.failed_reason)
                    log.error("job failed: %s", self.failed_reason)

    # -- workers ---------------------------------------------------------------------------------------
    def register_worker(self, req: RegisterWorker) -> dict:
        with self.lock:
            now = self.clock()
            if req.rejoin:
                restored = self.cluster.restored
                w = self.workers.rejoin(
                    req.rank, req.instance, req.incarnation, req.step, req.samples, restored, now
                )
            else:
                w = self.workers.register(req.rank, req.instance, req.incarnation, req.replacement, now)
            self.maybe_start()
            # A replacement resumes the rank where its predecessor's last progress report ended.
            out = {**self.start_state(), "resume": {"step": w.step, "samples": w.samples}}
            out |= {} if req.rejoin else self.control()
        with self.lock:
            self.cpu.report("worker", req.instance, req.cpuSeconds)
        return out

    def maybe_start(self) -> None:
        """Training starts once every worker and every server has registered (pods start in any order)."""
        if self.progress.started_at is None and self.workers.all_registered and self.cluster.ready:
            now = self.clock()
            self.progress.started(now)
            if self.ckpt is not None:
                self.ckpt.feed(self.ckpt.cycle.started(now))

    def start_state(self, rank: int | None = None, instance: str = "") -> dict:
        """Has training started? With `rank` and `instance`, also whether that worker is registered here (a
        worker waiting for the start re-registers when a new coordinator does not know it)."""
        with self.lock:
            out = {"started": self.progress.started_at is not None, "startedAt": self.progress.started_at}
            if rank is not None:
                out["registered"] = self.workers.registered(rank, instance)
            return out

    def report_progress(self, req: Progress) -> dict:
        with self.lock:
            w = self.workers.worker(req.rank, req.instance)
            rollback = self.ckpt.cycle.rollback if self.ckpt is not None else 0
            if req.stopped < rollback or req.resumed < rollback:
                # Sent before the worker took up the latest rollback's resume point: its counts are from before
                # the restore (the rollback's own, set in rolled_back, stand). One exception: a report of the
                # stop, until the restore is done, says where the worker stopped: the steps it trained since
                # its last counted report are to be redone too (they were lost from stepsRedone when the kill
                # came soon after a checkpoint).
                self.workers.heard(w, self.clock())
                cycle = self.ckpt.cycle
                step, samples = w.step, w.samples
                if req.stopped == rollback and cycle.rolling_back:
                    step, samples = max(step, req.step), max(samples, req.samples)
                self.ckpt.feed(cycle.report(req.rank, step, samples, w.done, req.paused, req.stopped))
                return {"epoch": self.cluster.epoch, **self.control()}
            self.workers.check_report(w, req.step, req.samples, req.loss)
            latency = {k: v.model_dump() for k, v in req.rpcLatency.items()}
            self.reports.check(req.degradedReads, req.degradedWrites, latency)
            now = self.clock()
            self.recoveries.continued(step_times(req.stepTimes, req.lastStepAt))
            args = (req.step, req.samples, req.loss, req.done, req.error, req.stepTimes, req.lastStepAt, now)
            delta = self.workers.report(w, *args)
            if delta is None:  # from a process reported lost
                return {"epoch": self.cluster.epoch}
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

    def worker_lost(self, req: WorkerLost) -> dict:
        """A worker process died before finishing its steps: the job finishes without them, or, if a
        replacement is coming, waits for it to resume them."""
        with self.lock:
            if self.workers.lost(req.rank, req.instance, req.replacing, req.reason, self.clock()):
                if self.ckpt is not None:
                    self.ckpt.feed(self.ckpt.cycle.worker_lost(req.rank))
                self._maybe_finish(sample=False)  # a lost worker brings no new sample count
            return {"epoch": self.cluster.epoch}

    def worker_finished(self, req: WorkerFinished) -> dict:
        """A worker process exited 0: it exits only once a coordinator acknowledged its last report (all its
        steps done). That coordinator may have died before its state was saved; the launcher, which sees the
        exit, says so here, and the rank counts as done at its last step."""
        with self.lock:
            t = self.spec.training
            delta = self.workers.finished(
                req.rank, req.instance, t.steps, t.steps * t.batch_size, self.clock()
            )
            if delta is None:
                return {"epoch": self.cluster.epoch}
            self.metrics.of(self.metrics.samples).inc(delta)
            if self.ckpt is not None:
                w, cycle = self.progress.workers[req.rank], self.ckpt.cycle
                self.ckpt.feed(cycle.report(req.rank, w.step, w.samples, True, None, cycle.rollback))
            self._maybe_finish()
            return {"epoch": self.cluster.epoch}

    def _maybe_finish(self, sample: bool = True) -> None:
        """Training is over once every worker is done: the last sample of the series, the event (once)."""
        if self.finished:
            self.progress.finish(self.clock(), sample)

    @property
    def finished(self) -> bool:
        return self.workers.all_done and (self.ckpt is None or self.ckpt.cycle.finished)

    # -- CheckpointHost (the checkpoint driver's): `addresses` takes the lock, the others expect it held -----
    def addresses(self, shards: tuple[int, ...]) -> dict[int, str]:
        with self.lock:
            return {s: self.cluster.shards[s].address for s in shards}

    def shards_down(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        down = [s for s in self.cluster.shards if s.state in (ShardState.FAILED, ShardState.RECOVERING)]
        return tuple(s.shard for s in down), tuple(s.shard for s in down if s.state is ShardState.RECOVERING)

    def event(self, kind: str, at: float, **detail) -> None:
        self.progress.event(kind, at, **detail)

    def restore_done(self, shards: tuple[int, ...], rows: dict[int, int], now: float) -> None:
        for s in shards:
            if self.cluster.shards[s].state is ShardState.RECOVERING:
                self.complete_restore(s, rows[s], now)

    def complete_restore(self, shard: int, rows: int, now: float) -> None:
        """A replacement loaded its checkpoint (checkpoint strategies): its shard is up again."""
        self.apply(self.cluster.recovered(shard, now))
        self.recoveries.restore_completed(shard, rows, now)

    def rolled_back(self, resume: dict[int, tuple[int, int]]) -> None:
        """Every rank goes back to the step the restored checkpoint recorded for it."""
        self.workers.rolled_back(resume, self.clock())

    def fail(self, reason: str) -> None:
        self.failed_reason = self.failed_reason or reason

    # -- recovery (RecoveryHost, the recovery driver's: `rebuilt` expects the lock held) ----------------------
    def start_recovery(self, shard: int) -> dict:
        return self.recovery.start(shard)

    def failed(self) -> bool:
        return self.failed_reason is not None

    def rolling_back(self) -> bool:
        return self.fallback and self.ckpt.cycle.rolling_back

    def before_restore(self) -> None:
        """CheckpointHost: the fallback's restore waits for the rebuilds it stopped and for every server to hold
        its forwards (heartbeats: a delta from before the rollback must not land on a server that loaded)."""
        if self.fallback:
            if not self.recovery.join(timeout=60.0):
                log.warning("a rebuild still runs; restoring the checkpoint anyway")
            self.admission.wait_forwards_held(timeout=60.0)

    def rebuilt(self, rec: RecoveryRecord, now: float) -> None:
        self.apply(self.cluster.recovered(rec.shard, now))
        if self.fallback:
            self.ckpt.feed(self.ckpt.cycle.rebuilt(rec.shard))
        self.recoveries.completed(rec, now, fault="coordinator:recovery_completed")

    # -- outside reports -------------------------------------------------------------------------------
    def add_event(self, ev: EventIn) -> dict:
        if ev.kind not in EVENT_KINDS:
            raise ValueError(f"kind: {ev.kind!r} is not one of {', '.join(EVENT_KINDS)}")
        if ev.shard is not None and not 0 <= ev.shard < self.cluster.num_servers:
            raise ValueError(f"shard {ev.shard} out of range")
        if ev.at is not None and not (math.isfinite(ev.at) and abs(ev.at - self.clock()) < 3600):
            raise ValueError("at: must be a wall-clock time within an hour of the coordinator's")
        with self.lock:
            at = ev.at or self.clock()
            if ev.kind == "server_killed" and ev.shard is not None:
                self.recoveries.killed(ev.shard, at)
            return self.progress.event(ev.kind, at, shard=ev.shard, **(ev.detail or {}))

    def record_parity_check(self, req: ParityCheck) -> dict:
        """A parity check's result (`ecrec verify`, `ecrec local` after training), for /metrics."""
        if min(req.stripes, req.mismatches, req.in_flight) < 0 or req.mismatches > req.stripes:
            raise ValueError("stripes, mismatches, in_flight: counts, mismatches <= stripes")
        with self.lock:
            m = self.metrics
            m.of(m.parity_checks, result="ok").inc(req.stripes - req.mismatches)
            m.of(m.parity_checks, result="mismatch").inc(req.mismatches)
            m.of(m.parity_last_mismatches).set(req.mismatches)
            m.of(m.parity_last_time).set(self.clock())
            return {"ok": req.mismatches == 0}

    # -- views (ecrec.coordinator.views) ---------------------------------------------------------------
    def status(self) -> dict:
        with self.lock:
            return views.status(self)

    def metrics_state(self) -> dict:
        """The job as the coordinator's scrape-time collector exports it (ecrec.metrics.JobCollector)."""
        with self.lock:
            return views.metrics_state(self)

    def cluster_snapshot(self) -> dict:
        with self.lock:
            return self.cluster.snapshot()

    def recoveries_view(self) -> list[dict]:
        with self.lock:
            return self.recoveries.view(self.progress.started_at)

    def phase(self) -> str:
        return views.phase(self)

    # -- lifecycle -------------------------------------------------------------------------------------
    def serving(self) -> None:
        """This process answers from now on (failover.serving)."""
        with self.lock:
            failover.serving(self)

    def run_ticker(self) -> threading.Thread:
        """Start watching for failures; called as the app starts serving (see `serving`)."""
        interval = min(0.5, self.spec.coordinator.heartbeat_interval_seconds)
        self.serving()

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
