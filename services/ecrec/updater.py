"""The worker's side of the update path: one step's two-phase commit over gRPC (docs/protocol.md, "Update
path"), as a driver around the pure bookkeeping of `ecrec.core.update`.

`UpdateDriver.apply` plans the step's parts under the client's cluster map (`StepUpdate`), and runs passes —
stage, deliver the deltas, commit, queue the decisions — until every row's update is applied exactly once. It
owns the commit decisions not yet delivered to their parity servers (`LockedDecisions`: the core's
`DecisionQueue` under a lock of its own, taken only around the queue's own operations, never across a call);
everything about transport and the map (calls, failures, degraded-row counts) is the `PSClient`'s, which it
drives through the part of its interface named by `Transport` (the client imports this module, not the
other way round).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, Protocol

import grpc
import torch

from ecrec.core.update import DecisionQueue, MapView, Part, StepUpdate
from ecrec.faults import fault_point
from ecrec.jobctx import JobContext
from ecrec.metrics import Metrics
from ecrec.proto import ecrec_pb2 as pb
from ecrec.retries import RETRYABLE, UNREACHABLE, Retries, ServerUnavailable
from ecrec.wire import floats_to_bytes, ids_to_bytes

log = logging.getLogger("ecrec.client")


class Transport(Protocol):
    """What the driver uses of its client (ecrec.client.PSClient): calls, the cluster map, failure reports."""

    ctx: JobContext
    epoch: int
    timeout: float
    progress_timeout: float
    interrupt: threading.Event  # set: retried calls give up (the job rolls back)
    metrics: Metrics
    stubs: dict[int, Any]

    def call(self, shard: int, method: str, request) -> Future: ...
    def failed(self, shard: int) -> bool: ...
    def degraded(self) -> bool: ...
    def view(self) -> MapView: ...
    def report_failure(self, shard: int) -> None: ...
    def recover_from(self, shard: int, err: grpc.RpcError) -> None: ...
    def note_degraded(self, kind: str, shard: int, rows: int) -> None: ...


def send_deltas(
    client: Transport, staged: list[tuple[Part, list]], method: str, errors: dict
) -> tuple[dict[int, Any], set[int]]:
    """Send each parity server its batches of the `staged` parts, [(part, deltas)], in one `method` call
    (StageDeltas under rowLocks, DeliverDeltas under deltaLog), all at once. A failed server is skipped: its
    parity is re-encoded from the data rows when it is rebuilt. One that does not answer is reported; if the
    coordinator's probe finds it alive it is sent its batches again (a re-delivery replaces, not adds), up to
    three tries. Returns the answers by server and the live servers that never answered (their errors in
    `errors`): their parts are delivered again on the next pass."""
    by_server: dict[int, list] = {}
    for _part, deltas in staged:
        for d in deltas:
            by_server.setdefault(d.parity_server, []).append(d)
    answers: dict[int, Any] = {}
    undelivered: set[int] = set()
    for _try in range(3):
        calls = []
        for server, batches in by_server.items():
            if client.failed(server):
                continue
            for d in batches:
                client.metrics.of(client.metrics.bytes_sent, kind="delta").inc(len(d.delta))
            req = pb.StageDeltasRequest(epoch=client.epoch, batches=batches)
            calls.append((server, client.call(server, method, req)))
        retry = {}
        for server, fut in calls:
            try:
                answers[server] = fut.result()
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    raise ServerUnavailable(server, e) from e
                if e.code() in UNREACHABLE:
                    client.report_failure(server)
                    if not client.failed(server):
                        retry[server] = by_server[server]
                else:
                    errors[server] = e
                    undelivered.add(server)
        if not retry:
            return answers, undelivered
        by_server = retry
    return answers, undelivered | set(by_server)


class LockedDecisions:
    """The core's DecisionQueue, shared by threads: the update thread queues and takes, any thread may flush
    (a new map of a failure flushes at once). Its lock guards the queue alone and is held only for one
    operation on it."""

    def __init__(self) -> None:
        self._queue = DecisionQueue()
        self._lock = threading.Lock()

    def add(self, decisions: Iterable[tuple[int, object]]) -> None:
        with self._lock:
            self._queue.add(decisions)

    def take(self, server: int) -> list:
        with self._lock:
            return self._queue.take(server)

    def take_all(self) -> dict[int, list]:
        with self._lock:
            return self._queue.take_all()

    def put_back(self, server: int, decisions: list) -> None:
        with self._lock:
            self._queue.put_back(server, decisions)

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._queue)


class UpdateDriver:
    """One worker's ECRec updates through `client` (one step at a time: the worker keeps one in flight)."""

    def __init__(self, client: Transport):
        self.client, self.ctx = client, client.ctx
        # Commit decisions not yet delivered, by parity server: they ride on the next stage at the same
        # server (see apply).
        self.decisions = LockedDecisions()

    def apply(self, step: str, g: torch.Tensor, grads: torch.Tensor, dense_grad: torch.Tensor) -> None:
        """Apply one step's update with the worker-coordinated 2PC of docs/protocol.md; returns when every
        part is committed exactly once.

        Each pass: (1) stage every remaining part at its data server (or acting home) — a pass's only part
        is sent `lone`, free to wait for older parts' rows (wait-die, docs/protocol.md); (2) deliver the
        deltas of the staged parts to their parity servers, one message per parity server for all parts;
        (3) commit every part whose deltas all arrived; (4) queue the decisions for the parity servers. They
        ride on the next pass's stage to the same server, which applies them before anything else, so they
        arrive before any later delta of the same rows and before anything that could wait for them; a
        server the next pass does not stage at gets them on their own (DecideMany), at the same time. A step
        thus costs three messages per server whatever k is. Commits on behalf of a dead server are sent at
        once, and flush_decisions sends what is left when the worker stops. While a shard is failed or
        recovering nothing is held back: degraded reads and rebuilds need consistent stripes, and this
        worker's next pull, which comes before its next update, may need exactly those."""
        ctx = self.ctx
        two_pc = ctx.spec.fault_tolerance.ecrec.two_phase_commit
        grads = grads.to("cpu", torch.float32)
        dense_grad = dense_grad.to("cpu", torch.float32)
        update = StepUpdate(step, ctx.placement, g, [ctx.dense_holders(c) for c in range(ctx.num_servers)])
        retries = Retries(f"update {step}", self.client.progress_timeout, self.client.interrupt)
        while True:
            parts = update.plan(self.client.view())
            if not parts:
                return
            errors: dict[int, grpc.RpcError] = {}
            # (1) stage, carrying the decisions queued for each server; the others get theirs on their own
            carried: dict[int, list] = {}
            futs = []
            for part in parts:
                decisions = [] if part.target in carried else self.decisions.take(part.target)
                carried.setdefault(part.target, decisions)
                futs.append(
                    (
                        part,
                        decisions,
                        self._send_stage(part, g, grads, dense_grad, two_pc, decisions, lone=len(parts) == 1),
                    )
                )
            alone = self._send_decisions_alone()
            staged: list[tuple[Part, list]] = []
            for part, decisions, fut in futs:
                try:
                    resp = fut.result()
                except grpc.RpcError as e:
                    self._requeue(part.target, decisions, e)
                    retries.note(part.target, "Stage", e)
                    self._stage_failed(part, e, errors)
                    continue
                if not two_pc and part.src < 0:
                    update.committed(part)  # applied at once; its deltas went straight to the parity servers
                else:
                    staged.append((part, list(resp.deltas)))
            self._await_decisions_alone(alone)
            fault_point("worker:after_stage")
            # (2) deltas
            _answers, undelivered = send_deltas(self.client, staged, "StageDeltas", errors)
            ready = []
            for part, deltas in staged:
                if undelivered & {d.parity_server for d in deltas}:
                    self._abort_part(part, deltas)  # it tells the parity servers that did get its deltas
                else:
                    ready.append((part, deltas))
            # (3) commit
            fault_point("worker:before_commit")
            cfuts = []
            for part, deltas in ready:
                req = pb.TxnRequest(epoch=self.client.epoch, txn=part.txn)
                cfuts.append((part, deltas, self.client.call(part.target, "Commit", req)))
                fault_point("worker:mid_commit")
            urgent = False
            for part, deltas, fut in cfuts:
                outcome = self._commit_outcome(part, fut, retries)
                if outcome == "committed":
                    update.committed(part)
                    retries.progress()
                    if part.src >= 0:
                        self.client.note_degraded("writes", part.src, part.pos.numel())
                elif outcome == "gone":
                    # It died (or was replaced) after staging: its staged records are gone, but its deltas
                    # are staged at the parity servers. Committing them applies the update exactly once —
                    # the rows are decoded from parity from now on.
                    update.committed_by_dead_target(part)
                    retries.progress()
                    urgent = True
                else:
                    # aborted (its txnTimeout expired): it told the parity servers; retry the part
                    retries.note(part.target, "Commit", f"{part.txn} was aborted")
                    continue
                self._queue_decisions(part, deltas)
            # (4) decisions: queued for the next pass, or sent now for a dead server's parts
            fault_point("worker:before_decide")
            if urgent or self.client.degraded():
                self.flush_decisions()
            for server, e in errors.items():
                self.client.recover_from(server, e)
            if update.finished(self.client.view()):
                return
            retries.check()
            time.sleep(retries.backoff())

    def _stage_failed(self, part: Part, e: grpc.RpcError, errors: dict) -> None:
        if e.code() not in RETRYABLE:
            raise ServerUnavailable(part.target, e) from e
        if e.code() not in UNREACHABLE:
            errors[part.target] = e  # stale map or busy rows: retry the part on the next pass
            return
        # Unreachable: is it dead? The coordinator probes before it says so. Nothing of the part left the
        # server (its deltas come back in the answer), so a dead one needs nothing undone.
        self.client.report_failure(part.target)
        if not self.client.failed(part.target):
            self._abort_part(part)  # alive: it may have staged; undo that before retrying

    def _commit_outcome(self, part: Part, fut: Future, retries: Retries) -> str:
        """committed, aborted, or gone (the target died or was replaced after its stage was answered).

        An unanswered Commit is none of these: the part may well be committed there (the answer was lost,
        or the server hung after committing), and retrying it as a new part would apply the update twice —
        at the server if it comes back, at the acting home if it is declared failed while its parity servers
        still hold the deltas. So ask again (commits are idempotent) until the server answers or the
        coordinator declares it failed; `retries` bounds that by progressTimeoutSeconds (Stalled)."""
        while True:
            try:
                outcome = fut.result().outcome
            except grpc.RpcError as e:
                if e.code() not in UNREACHABLE:
                    raise ServerUnavailable(part.target, e) from e
                retries.note(part.target, "Commit", e)
                self.client.report_failure(part.target)
                if self.client.failed(part.target):
                    return "gone"
                retries.check()
                time.sleep(retries.backoff())
                fut = self.client.call(
                    part.target, "Commit", pb.TxnRequest(epoch=self.client.epoch, txn=part.txn)
                )
                continue
            if outcome == "unknown":  # a replacement answered: the process that staged the part is gone
                return "gone"
            return outcome

    def _queue_decisions(self, part: Part, deltas: list, commit: bool = True) -> None:
        self.decisions.add(
            [
                (d.parity_server, pb.DeltaDecision(txn=part.txn, src=part.target, commit=commit))
                for d in deltas
            ]
        )

    def _requeue(self, server: int, decisions: list, e: grpc.RpcError | None = None) -> None:
        """Decisions whose message failed: send them again later (deciding twice is harmless), unless the
        server is gone or refused them for good."""
        if decisions and not self.client.failed(server) and (e is None or e.code() in RETRYABLE):
            self.decisions.put_back(server, decisions)

    def _send_decisions_alone(self) -> list:
        """DecideMany to every live server with queued decisions that no stage of this pass carries."""
        out = []
        for server, decisions in self.decisions.take_all().items():
            if decisions and not self.client.failed(server):
                req = pb.DecisionsRequest(epoch=self.client.epoch, decisions=decisions)
                out.append((server, decisions, self.client.call(server, "DecideMany", req)))
        return out

    def _await_decisions_alone(self, calls: list) -> None:
        for server, decisions, fut in calls:
            try:
                fut.result()
            except grpc.RpcError as e:
                if e.code() in UNREACHABLE:
                    self.client.report_failure(server)
                self._requeue(server, decisions, e)

    def flush_decisions(self) -> None:
        """Send every queued decision now. A parity server that cannot be told asks the data server for the
        outcome when its staged deltas time out (ShardStore.expire), so this is best effort."""
        for _try in range(3):
            self._await_decisions_alone(self._send_decisions_alone())
            if not self.decisions:
                return
        left = sorted(self.decisions.take_all())
        log.warning("decisions for parity servers %s not delivered; they will ask", left)

    def _send_stage(
        self, part: Part, g, grads, dense_grad, two_pc: bool, decisions: list = (), lone: bool = False
    ) -> Future:
        ctx = self.ctx
        ids, rows = ids_to_bytes(g[part.pos]), floats_to_bytes(grads[part.pos])
        self.client.metrics.of(self.client.metrics.bytes_sent, kind="push").inc(len(rows))
        dense = [floats_to_bytes(dense_grad[slice(*ctx.dense_bounds[c])]) for c in part.dense]
        if not two_pc and part.src < 0:
            # Without 2PC: apply at once. Rows and dense chunks go as separate calls; gather them.
            self._requeue(part.target, list(decisions))  # (none are made without 2PC; keep, do not drop)
            futs = []
            if part.pos.numel():
                futs.append(
                    self.client.call(
                        part.target,
                        "Push",
                        pb.PushRequest(epoch=part.epoch, ids=ids, grads=rows, txn=part.txn),
                    )
                )
            for c, buf in zip(part.dense, dense, strict=True):
                futs.append(
                    self.client.call(
                        part.target,
                        "PushDense",
                        pb.DensePushRequest(epoch=part.epoch, chunk=c, grads=buf, txn=part.txn),
                    )
                )
            return _AllOf(futs)
        req = pb.StageRequest(
            epoch=part.epoch,
            txn=part.txn,
            ids=ids,
            grads=rows,
            src=part.src,
            dense_chunks=part.dense,
            dense_grads=dense,
            decisions=decisions,
            lone=lone,
        )
        return self.client.call(part.target, "Stage", req)

    def _abort_part(self, part: Part, deltas: list = ()) -> None:
        """Abort a part at its server (it aborts and tells its parity servers). If the server cannot be
        reached, the parity servers that got `deltas` are told by this worker: no Commit was sent for the
        part (its deltas did not all arrive), so aborting it on the server's behalf is its only outcome."""
        try:
            self.client.stubs[part.target].Abort(
                pb.TxnRequest(epoch=self.client.epoch, txn=part.txn), timeout=self.client.timeout
            )
        except grpc.RpcError as e:
            log.warning("could not abort %s at server %d: %s", part.txn, part.target, e.code().name)
            if deltas and e.code() in UNREACHABLE:
                self._queue_decisions(part, deltas, commit=False)


class _AllOf:
    """A future over several futures (the no-2PC path's rows and dense pushes)."""

    def __init__(self, futs: list[Future]):
        self.futs = futs

    def result(self):
        return [f.result() for f in self.futs]
