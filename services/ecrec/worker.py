"""A training worker: pull rows and dense parameters, forward/backward, push gradients.

Workers are asynchronous: each trains on its own interleaved batch indices (rank, rank + W, ...) and never
waits for other workers. Outside deterministic mode a worker keeps one update in flight, overlapping the push
of step t with the pull and compute of step t + 1. Deterministic mode (one worker) waits for every push to be
acknowledged before the next pull, so a run is a pure function of the spec.
"""

from __future__ import annotations

import argparse
import collections
import logging
import math
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import torch
import torch.nn.functional as F

from ecrec import faults
from ecrec.client import Pending, PSClient
from ecrec.coordinator.client import CoordinatorClient, Refused
from ecrec.coordinator.contract import Progress, RegisterWorker
from ecrec.core.checkpointing import ROLLBACK_STRATEGIES
from ecrec.core.recovery import MAX_STEP_TIMES
from ecrec.data import Batch, make_data_source
from ecrec.jobctx import JobContext
from ecrec.metrics import Metrics
from ecrec.model import flatten_dense_grad, load_dense_
from ecrec.retries import ServerUnavailable, Stalled
from ecrec.roles import CPUS_ENV, cores
from ecrec.termination import EXIT_CODE, Terminated, Termination

log = logging.getLogger("ecrec.worker")


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("workers.device is 'cuda' but CUDA is not available on this worker")
        return torch.device("cuda")
    return torch.device("cpu")


def data_source(ctx: JobContext):
    d, m = ctx.spec.data, ctx.model
    return make_data_source(
        d.source,
        m.table_sizes,
        m.num_dense,
        ctx.spec.training.seed,
        zipf_exponent=d.zipf_exponent,
        eval_samples=d.eval_samples,
        paths=d.paths,
    )


class Trainer:
    """One worker's model replica and its step function; the transport is a `PSClient`."""

    def __init__(self, ctx: JobContext, client: PSClient, device: torch.device):
        self.ctx, self.client, self.device = ctx, client, device
        self.model = ctx.model.build().to(device)
        self.offsets = ctx.table_offsets
        self.updater = ThreadPoolExecutor(max_workers=1, thread_name_prefix="update")

    def step(self, batch: Batch, index: int) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pull, forward, backward. Returns (loss, unique row ids, their gradients, flat dense gradient);
        raises NonFiniteStep if the loss or a gradient is NaN or Inf (`index` names the step)."""
        ctx, dev = self.ctx, self.device
        B, T = batch.ids.shape
        g = (batch.ids + self.offsets).reshape(-1)
        uniq, inv = torch.unique(g, return_inverse=True)
        rows, dense = self.client.pull(uniq)
        load_dense_(self.model, dense)
        # The gathered [B, T, dim] tensor is the autograd leaf; its gradient is summed per unique row with
        # index_add_, which is deterministic on CPU (autograd's own scatter for indexing need not be).
        sparse = rows.to(dev)[inv.to(dev)].view(B, T, ctx.dim).requires_grad_(True)
        self.model.zero_grad(set_to_none=True)
        logits = self.model(batch.dense.to(dev), sparse)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(dev))
        loss.backward()
        row_grads = torch.zeros(uniq.numel(), ctx.dim, device=dev).index_add_(
            0, inv.to(dev), sparse.grad.view(B * T, ctx.dim)
        )
        value, dense_grad = float(loss.detach()), flatten_dense_grad(self.model)
        check_finite_step(index, value, uniq, rows, row_grads, dense_grad)
        return value, uniq, row_grads, dense_grad

    def push(self, uniq: torch.Tensor, row_grads: torch.Tensor, dense_grad: torch.Tensor, txn: str):
        """Send the update. Returns something with .wait(): the foundation's Pending RPCs, or, with ECRec, a
        future of the whole two-phase commit (run on a background thread: it retries through failures)."""
        row_grads, dense_grad = row_grads.cpu(), dense_grad.cpu()
        if self.ctx.ecrec:
            return _FutureWait(
                self.updater.submit(self.client.apply_update, txn, uniq, row_grads, dense_grad)
            )
        return _Both(self.client.push_rows(uniq, row_grads, txn), self.client.push_dense(dense_grad, txn))


class NonFiniteStep(RuntimeError):
    """A step's loss or gradients are NaN or Inf: nothing is pushed, and the job fails with this one line."""


def check_finite_step(
    index: int,
    loss: float,
    uniq: torch.Tensor,
    rows: torch.Tensor,
    row_grads: torch.Tensor,
    dense_grad: torch.Tensor,
) -> None:
    """Raise NonFiniteStep naming the step, the loss and the rows whose gradients (or pulled values, the
    usual cause: the servers hold a non-finite row) are not finite. A cheap check: one pass over each."""
    bad_grads = ~torch.isfinite(row_grads).all(dim=1).cpu()
    bad_dense = not bool(torch.isfinite(dense_grad).all())
    if math.isfinite(loss) and not bool(bad_grads.any()) and not bad_dense:
        return
    what = [] if math.isfinite(loss) else [f"loss ({loss})"]
    if bool(bad_grads.any()):
        what.append(f"gradients of {_ids(uniq[bad_grads])}")
    if bad_dense:
        what.append("dense gradients")
    pulled = ~torch.isfinite(rows).all(dim=1).cpu()
    cause = f"; pulled non-finite: {_ids(uniq[pulled])}" if bool(pulled.any()) else ""
    raise NonFiniteStep(f"step {index}: non-finite {', '.join(what)}{cause}; nothing was pushed")


def _ids(g: torch.Tensor, show: int = 8) -> str:
    """'3 rows (global ids 5, 17, 95)', the first `show` ids and how many more."""
    ids = ", ".join(str(i) for i in g[:show].tolist())
    more = f", ... {g.numel() - show} more" if g.numel() > show else ""
    s = "" if g.numel() == 1 else "s"
    return f"{g.numel()} row{s} (global id{s} {ids}{more})"


class _Both:
    def __init__(self, *pending: Pending):
        self.pending = pending

    def wait(self) -> None:
        for p in self.pending:
            p.wait()


class _FutureWait:
    def __init__(self, fut: Future):
        self.fut = fut

    def wait(self) -> None:
        self.fut.result()


class CoordinatorLink:
    """A worker's calls to the coordinator. The coordinator is not on the training path, so while none
    answers (a dead one being replaced) the worker keeps training and these calls are retried; a new
    coordinator that does not know this process yet is told who it is (a rejoin: rank, incarnation, steps)."""

    def __init__(
        self, url: str, rank: int, instance: str, incarnation: int, patience: float, token: str | None = None
    ):
        self.rank, self.instance, self.incarnation = rank, instance, incarnation
        self.patience = patience  # how long to keep trying before the worker gives up
        self.coordinator = CoordinatorClient(url, token=token, timeout=10.0)
        self._last_log = 0.0

    def _retry(self, what: str, call):
        """`call()` until it returns; httpx errors (no coordinator) are retried for `patience` seconds."""
        end = time.monotonic() + self.patience
        while True:
            try:
                return call()
            except httpx.HTTPError as e:
                if time.monotonic() > end:
                    msg = f"the coordinator did not answer {what} for {self.patience:g}s: {e}"
                    raise RuntimeError(msg) from e
                if time.monotonic() - self._last_log > 1.0:
                    log.warning("%s: no answer from the coordinator, retrying: %s", what, e)
                    self._last_log = time.monotonic()
                time.sleep(0.2)

    def register(self, replacement: bool, rejoin: bool = False, step: int = 0, samples: int = 0) -> dict:
        req = RegisterWorker(
            rank=self.rank,
            instance=self.instance,
            incarnation=self.incarnation,
            replacement=replacement,
            rejoin=rejoin,
            step=step,
            samples=samples,
            cpuSeconds=time.process_time(),
        )

        def call() -> dict:
            try:
                return self.coordinator.register_worker(req)
            except Refused as e:
                log.error("registration refused: %s", e.detail)
                raise SystemExit(2) from e

        return self._retry("registration", call)

    def wait_start(self) -> None:
        def started() -> bool:
            body = self.coordinator.workers_start(self.rank, self.instance)
            if body.get("registered") is False:  # a coordinator that replaced the one we registered with
                self.register(replacement=False, rejoin=True)
            return body["started"]

        while not self._retry("waiting for the start", started):
            time.sleep(0.05)

    def cluster(self) -> dict:
        return self._retry("reading the cluster map", self.coordinator.cluster)

    def progress(self, report: Progress) -> dict:
        """One progress report; a coordinator that does not list this process is told who it is first."""
        try:
            return self.coordinator.report_progress(report)
        except Refused:
            self.register(replacement=False, rejoin=True, step=report.step, samples=report.samples)
            return self.coordinator.report_progress(report)

    def control(self) -> dict:
        """What the checkpoint strategies tell workers now (ecrec.core.checkpointing.CheckpointCycle.control)."""
        return self._retry("reading the control state", self.coordinator.workers_control)


class ProgressReporter:
    """Posts this worker's counters to the coordinator every `interval` seconds, off the training thread."""

    def __init__(self, link: CoordinatorLink, interval: float = 0.5):
        self.link, self.interval = link, interval
        self.step = self.samples = 0
        self.loss: float | None = None
        self.last_step_at: float | None = None
        # when each step since the last report completed (the latest MAX_STEP_TIMES)
        self.step_times: collections.deque[float] = collections.deque(maxlen=MAX_STEP_TIMES)
        self.counters = None  # PSClient.report_counters: degraded rows and RPC latency, for /metrics
        # The checkpoint strategies: what this worker holds for, and the coordinator's latest control.
        self.paused: int | None = None
        self.stopped = 0
        # The rollback whose resume point the counters above are from: reports of a worker that stopped for a
        # rollback carry pre-rollback counters until it resumes, and must not count once the restore is done.
        self.resumed = 0
        self.lock = threading.Lock()  # one report's counters are of one moment (see Holds._stop)
        # One report on the wire at a time, sent in the order they were read: the loop's and post_now's reports
        # race otherwise, and a report that reaches the coordinator after a later one is behind its last step:
        # refused, as from a process it does not know (seen under load: the worker's reporter thread died).
        self._sending = threading.Lock()
        self._refused: SystemExit | None = None  # the coordinator refused this process (from the loop)
        self.done = False  # all steps trained (a rollback can undo it)
        self.control: dict | None = None
        # called with each control the coordinator sends (Holds: a rollback interrupts the step's calls)
        self.on_control: Callable[[dict], None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stepped(self, step: int, samples: int, loss: float, at: float) -> None:
        """A step completed at wall-clock time `at`."""
        if self._refused is not None:  # the worker ends as it would had the training thread been refused
            raise self._refused
        with self.lock:
            self.step, self.samples, self.loss, self.last_step_at = step, samples, loss, at
            self.step_times.append(at)

    def _post(self, done: bool | None = None, error: str | None = None) -> None:
        """One report; `done` None: as the counters say (read with them)."""
        with self._sending:
            self._send(done, error)

    def _send(self, done: bool | None, error: str | None) -> None:
        with self.lock:
            body = {
                "rank": self.link.rank,
                "instance": self.link.instance,
                "step": self.step,
                "samples": self.samples,
                "loss": self.loss
                if self.loss is None or math.isfinite(self.loss)
                else None,  # no NaN in JSON
                "done": self.done if done is None else done,
                "error": error,
                "lastStepAt": self.last_step_at,
                "stepTimes": list(self.step_times),
                "paused": self.paused,
                "stopped": self.stopped,
                "resumed": self.resumed,
                "cpuSeconds": time.process_time(),
            }
            self.step_times.clear()  # a report that fails loses them: only a recovery's precision suffers
        counters = self.counters() if self.counters is not None else {}
        answer = self.link.progress(Progress(**body, **counters))
        if answer.get("control") is not None:
            self.control = answer["control"]
            if self.on_control is not None:
                self.on_control(self.control)

    def post_now(self) -> None:
        """A report at once (the coordinator waits for it), retried while no coordinator answers."""
        self.link._retry("a progress report", self._post)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._post()
            except httpx.HTTPError as e:
                log.warning("progress report failed: %s", e)
            except SystemExit as e:
                # Not a process the coordinator admits (its rejoin was refused): no more reports, nor steps.
                self._refused = e
                return

    def finish(self, error: str | None = None) -> None:
        """The last report, retried until acknowledged: a worker never exits with its end unrecorded (its
        process gone, nobody would know its steps are done)."""
        self._stop.set()
        self._thread.join(timeout=2)
        self.link._retry("the final progress report", lambda: self._post(done=error is None, error=error))


class Holds:
    """A worker's side of the checkpoint strategies (docs/protocol.md, "Checkpoint strategies") and of strategy
    ecrec's checkpoint fallback: pause at a step boundary while a checkpoint is written, stop and resume at the
    checkpoint's step after a rollback, and wait out a lost server. The coordinator's `control` says which;
    every wait polls it. Under the fallback a rollback comes while ECRec calls are being retried (more than r
    servers lost: their rows cannot be decoded): the reporter's thread hears of it first and interrupts them."""

    POLL = 0.02

    def __init__(
        self, ctx: JobContext, rank: int, link: CoordinatorLink, reporter: ProgressReporter, control
    ):
        self.ctx, self.rank, self.link, self.reporter = ctx, rank, link, reporter
        ft = ctx.spec.fault_tolerance
        self.rolls_back = ft.strategy in ROLLBACK_STRATEGIES or ft.strategy == "ecrec"  # ecrec: the fallback
        control = control or {}
        # The rollback generation this process has caught up with (a replacement starts at the current one).
        self.acked = reporter.stopped = reporter.resumed = int(control.get("rollback", 0))
        self.paused_for: int | None = None  # the checkpoint it last paused for
        self.client: PSClient | None = None
        reporter.on_control = self._heard

    def _heard(self, ctl: dict) -> None:
        """The reporter's thread: a new rollback interrupts the calls of the step under way (they may wait for
        rows no server can give before the restore)."""
        if self.rolls_back and int(ctl.get("rollback", 0)) > self.acked and self.client is not None:
            self.client.interrupt.set()

    def check(self, in_flight, step: int) -> int | None:
        """Called at each step boundary, `step` steps done: None to go on, or the step to go on from after a
        rollback. A checkpoint with `pauseAtStep` (intervalSteps) holds this rank once it has done that many
        steps, so every rank's cut is at the same step; one without holds it now."""
        ctl = self.reporter.control or {}
        if int(ctl.get("rollback", 0)) > self.acked:
            _settle(in_flight)
            return self._stop()
        pause, at = ctl.get("pause"), ctl.get("pauseAtStep")
        if pause is not None and pause != self.paused_for and (at is None or step >= at):
            _settle(in_flight)
            if self.client is not None:  # ecrec (rowLocks): parity applies a commit once told: tell it now
                self.client.flush_decisions()
            return self._pause(pause)
        return None

    def _pause(self, checkpoint: int) -> int | None:
        self.reporter.paused = checkpoint
        self.reporter.post_now()
        try:
            while True:
                ctl = self.link.control()
                self.reporter.control = ctl  # the next checkpoint may be armed already
                if int(ctl["rollback"]) > self.acked:
                    return self._stop()
                if ctl["pause"] != checkpoint:
                    return None
                time.sleep(self.POLL)
        finally:
            self.reporter.paused, self.paused_for = None, checkpoint

    def _stop(self) -> int:
        """Stop for the newest rollback and wait for the restore: the step (and samples) to resume from."""
        while True:
            ctl = self.link.control()
            gen = int(ctl["rollback"])
            if self.reporter.stopped != gen:
                self.reporter.stopped = gen
                self.reporter.post_now()
            resume = ctl.get("resume")
            self.reporter.control = ctl
            if gen == self.reporter.stopped and resume is not None and str(self.rank) in resume:
                step, samples = (int(x) for x in resume[str(self.rank)])
                log.info("rolled back (rollback %d): resuming at step %d", gen, step)
                self.acked = gen
                with self.reporter.lock:
                    r = self.reporter
                    r.step, r.samples, r.done, r.resumed = step, samples, False, gen
                if self.client is not None:
                    self.client.rolled_back()  # nothing of before the rollback in flight; the replacements' addresses
                self.reporter.post_now()
                return step
            time.sleep(self.POLL)

    def server_lost(self, err: ServerUnavailable) -> None:
        """A server did not answer. It is reported; rollback strategies then stop (the next `check` sees the
        rollback), cpr waits until the shard's replacement has loaded its checkpoint."""
        log.warning("%s: waiting for the coordinator", err)
        assert self.client is not None
        if err.shard >= 0:  # (an Interrupted call blames no server)
            self.client.report_failure(err.shard)
        end = time.monotonic() + self.ctx.spec.coordinator.progress_timeout_seconds
        while time.monotonic() < end:
            ctl = self.link.control()
            self.reporter.control = ctl
            if self.rolls_back and int(ctl["rollback"]) > self.acked:
                return
            if not self.rolls_back:
                self.client.refresh()
                if self.client.states.get(err.shard) == "up":
                    return
            time.sleep(self.POLL * 5)
        raise err

    def wait_finished(self) -> int | None:
        """After the last step: report done, then wait until the job is finished (None) or rolled back (the
        step to train again from)."""
        self.reporter.done = True
        self.reporter.post_now()
        while True:
            ctl = self.link.control()
            self.reporter.control = ctl
            if int(ctl["rollback"]) > self.acked:
                return self._stop()
            if ctl.get("finished"):
                return None
            time.sleep(self.POLL * 5)


class Pace:
    """training.maxStepsPerSecond: step starts at least 1/rate apart. A step that ran late is not made up for
    by a burst after it (a recovery's slow steps leave the rate as it was). `clock`/`sleep` for tests."""

    def __init__(self, rate: float | None, clock: Callable[[], float] = time.monotonic, sleep=time.sleep):
        self.interval = 1.0 / rate if rate else 0.0
        self.clock, self.sleep = clock, sleep
        self.due = -math.inf

    def wait(self) -> float:
        """Before a step: sleep until it may start; the seconds slept."""
        if not self.interval:
            return 0.0
        now = self.clock()
        slept = max(0.0, self.due - now)
        if slept:
            self.sleep(slept)
        self.due = max(self.due, now) + self.interval
        return slept


READ_AHEAD_STEPS = 64  # steps whose rows a worker announces to a replacement being rebuilt (ReadAhead)


class ReadAhead:
    """A worker's batches, made ahead while a shard's replacement is being rebuilt, so that it can rebuild the
    rows they will pull in one decode round (`warm`, PSClient.warm) instead of one round per step: a pull of a
    row not rebuilt yet waits for its decode, and with Zipf ids almost every step pulls some. Every
    `steps // 2` steps it announces the rows of the next `steps` steps. A batch is a pure function of its
    step (`make`), made once: early, and kept for its step."""

    def __init__(
        self,
        make: Callable[[int], Batch],
        last: int,
        offsets: torch.Tensor,
        warm: Callable[[torch.Tensor], None],
        recovering: Callable[[], bool],
        steps: int = READ_AHEAD_STEPS,
    ):
        self.make, self.last, self.offsets = make, last, offsets
        self.warm, self.recovering, self.steps = warm, recovering, steps
        self._made: dict[int, Batch] = {}
        self._until = 0  # the steps before this one have been announced

    def batch(self, step: int) -> Batch:
        for old in [s for s in self._made if s < step]:  # (a jump forward: those steps will not come)
            del self._made[old]
        if step + self.steps // 2 >= self._until and self.recovering():
            first, end = max(step, self._until), min(self.last, step + self.steps)
            for s in range(first, end):
                if s not in self._made:
                    self._made[s] = self.make(s)
            if end > first:
                ids = torch.cat([(self._made[s].ids + self.offsets).reshape(-1) for s in range(first, end)])
                self.warm(torch.unique(ids))
            self._until = end
        made = self._made.pop(step, None)
        return made if made is not None else self.make(step)


def _settle(in_flight) -> None:
    """Wait for the update in flight; a lost server's part of it is the rollback's or the restore's concern."""
    if in_flight is not None:
        try:
            in_flight.wait()
        except ServerUnavailable as e:
            log.info("update in flight lost with its server: %s", e)


def _wind_down(in_flight, client: PSClient, reporter: ProgressReporter, rank: int) -> None:
    """SIGTERM: leave nothing staged and tell the coordinator how far this process got — not an error (that
    would fail the job) and not done. Its launcher sees it exit with EXIT_CODE, reports it lost and replaces it
    (ecrec.core.reconcile); the replacement resumes after this report's step."""
    try:
        _settle(in_flight)  # the update of the last step
        client.flush_decisions()  # its decisions: the parity servers need not ask for them
    except Exception as e:  # a server that does not answer: the protocol's rules for a lost worker apply
        log.warning("SIGTERM: the last update was not settled: %s", e)
    try:
        reporter._post()  # once, not retried: the watchdog would end a long wait anyway
    except (Exception, SystemExit) as e:
        log.warning("SIGTERM: the last progress report failed: %s", e)
    log.info("SIGTERM: worker %d stopped after step %d; exiting with %d", rank, reporter.step, EXIT_CODE)


def run_worker(
    ctx: JobContext,
    rank: int,
    coordinator: str,
    metrics: Metrics,
    instance: str,
    incarnation: int = 1,
    replacement: bool = False,
    term: Termination | None = None,
) -> None:
    """Train rank `rank`'s steps. A replacement (a later incarnation of a rank whose process was lost) resumes
    at the step where the coordinator's record of its predecessor's progress ends: steps the predecessor
    completed after its last report are trained again (at least once, not exactly once). `term`: SIGTERM
    (ecrec.termination) stops it after the step under way, with Terminated."""
    term = term or Termination()  # not installed: never requested
    spec = ctx.spec
    workers = spec.workers.replicas
    # threads 0: the process's cores shared between the processes on them (all of the job's, unless the
    # launcher pinned the roles to cores of their own: then only the workers)
    sharing = workers if os.environ.get(CPUS_ENV) else workers + spec.servers.replicas
    threads = spec.workers.threads or max(1, cores() // sharing)
    torch.set_num_threads(threads)
    device = pick_device(spec.workers.device)
    if spec.training.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    url = coordinator.rstrip("/")
    link = CoordinatorLink(
        url, rank, instance, incarnation, spec.coordinator.progress_timeout_seconds, token=ctx.token
    )
    registered = link.register(replacement)
    resume = registered.get("resume") or {"step": 0, "samples": 0}
    # Reports start at once: the coordinator takes a worker silent for its failure timeout for hung, and
    # setting up (the model, the data) may take longer than that.
    reporter = ProgressReporter(link, spec.coordinator.heartbeat_interval_seconds)
    reporter.step, reporter.samples = int(resume["step"]), int(resume["samples"])
    reporter.start()
    link.wait_start()
    client = PSClient(ctx, link.cluster(), metrics, coordinator=url, streams=ctx.spec.workers.call_streams)
    reporter.counters = client.report_counters
    trainer = Trainer(ctx, client, device)
    data = data_source(ctx)
    holds = None
    if spec.fault_tolerance.checkpoints() is not None:  # a checkpoint strategy, or ecrec's fallback
        control = link.control()  # now: an intervalSteps checkpoint may be due within the first report's wait
        reporter.control = control
        holds = Holds(ctx, rank, link, reporter, control)
        holds.client = client
    in_flight = None
    B = spec.training.batch_size
    step = int(resume["step"])
    pace = Pace(spec.training.max_steps_per_second)
    ahead = ReadAhead(
        lambda s: data.batch(s * workers + rank, B),
        spec.training.steps,
        ctx.table_offsets,
        client.warm,
        lambda: ctx.ecrec and client.recovering(),
    )
    try:
        while True:
            while step < spec.training.steps:
                if holds is not None and (jump := holds.check(in_flight, step)) is not None:
                    in_flight, step = None, jump
                    continue
                pace.wait()
                batch = ahead.batch(step)
                # Step ids are unique per process and rollback: a replacement's predecessor, or this process
                # before a rollback, may have applied the same step.
                txn = f"w{rank}-{step}" if incarnation == 1 else f"w{rank}i{incarnation}-{step}"
                if holds is not None and holds.acked:
                    txn += f"r{holds.acked}"
                try:
                    with term.step():  # a SIGTERM now ends the worker once this step is done
                        loss, uniq, row_grads, dense_grad = trainer.step(batch, step)
                        if in_flight is not None:  # at most one update in flight: the previous step's
                            in_flight.wait()
                        in_flight = trainer.push(uniq, row_grads, dense_grad, txn)
                        if spec.training.deterministic:
                            in_flight.wait()
                            in_flight = None
                        reporter.stepped(step + 1, (step + 1) * B, loss, time.time())
                        metrics.of(metrics.steps).inc()
                        metrics.of(metrics.samples).inc(B)
                        step += 1
                except ServerUnavailable as e:
                    if holds is None:
                        raise
                    in_flight = None
                    holds.server_lost(e)  # then a rollback (next check), or the step again once it is back
                    continue
            if holds is None:
                if in_flight is not None:
                    in_flight.wait()
                break
            _settle(in_flight)
            in_flight = None
            client.flush_decisions()  # the last step's deltas (riding) and acks: nothing of it waits for a next step
            if (jump := holds.wait_finished()) is None:
                break
            step = jump
        term.finishing()  # trained: a SIGTERM from now on lets it finish (exit 0)
        client.flush_decisions()  # the last step's decisions had no next step to ride on
    except Terminated:
        _wind_down(in_flight, client, reporter, rank)
        raise
    except (ServerUnavailable, Stalled, NonFiniteStep) as e:  # the reason names the server / step and rows
        log.error("%s", e)
        reporter.finish(error=str(e))
        raise SystemExit(1) from e
    except Exception as e:
        log.exception("worker %d failed", rank)
        reporter.finish(error=f"{type(e).__name__}: {e}")
        raise SystemExit(1) from e
    reporter.finish()
    log.info("worker %d finished %d steps on %s", rank, spec.training.steps, device)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ecrec-worker")
    ap.add_argument("--job", required=True, help="job JSON file ({name, spec}), or env:VAR")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--metrics-port", type=int, default=0)
    ap.add_argument("--metrics-addr", default="127.0.0.1")
    ap.add_argument("--instance", default="", help="this process's id (default: a new random one)")
    ap.add_argument(
        "--incarnation", type=int, default=1, help="1 for the rank's first process, +1 per replacement"
    )
    ap.add_argument(
        "--replacement", action="store_true", help="resume a lost process's rank (set by the launcher)"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s worker-{args.rank} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # PID 1 of a pod ignores a SIGTERM it has no handler for: the pod would wait out its grace period.
    term = Termination().install()
    try:
        _main(args, term)
    except Terminated:
        # Wound down (or nothing to wind down): exit now. The interpreter's own finalization (a collection of
        # torch's heap) was seen taking seconds of a pod's grace period on a busy machine.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(EXIT_CODE)


def _main(args: argparse.Namespace, term: Termination) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    faults.configure(f"worker-{args.rank}")
    ctx = JobContext.load(args.job)
    metrics = Metrics(ctx.name, "worker", "")
    port = metrics.serve(args.metrics_port, args.metrics_addr)
    log.info("metrics on http://%s:%d/metrics", args.metrics_addr, port)
    run_worker(
        ctx,
        args.rank,
        args.coordinator,
        metrics,
        args.instance or uuid.uuid4().hex[:16],
        args.incarnation,
        args.replacement,
        term,
    )


if __name__ == "__main__":
    main()
