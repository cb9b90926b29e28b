"""The worker's side of commit: deltaLog (docs/protocol.md, "Update path"): one step's update in two rounds.

(1) Stage every part at its data server (or, for a failed shard's rows, at their acting home): the server
applies it at once and answers with the deltas for its parity servers; a degraded write is complete when it
is answered. (2) Deliver the deltas, one message per parity server for all parts; a parity server answers
once it has applied them, naming any rows it refused because their data server was declared failed or
replaced first — those rows are written again on the next pass, as degraded writes. A parity server that
did not answer is asked again before its rows go anywhere else (it may have applied them). A part whose deltas
all arrived is done; the worker's next stage at its data server says so (`delivered`), and the server
forgets it. Nothing is locked across the two rounds; a retried part keeps its txn, so its server answers it
from its log instead of applying it twice.

With faultTolerance.ecrec.deliveries: ride (the default, outside deterministic training and the sum code),
round (2) is the next step's: the deltas ride on its stages (ecrec.riding), and a step costs two messages per
server instead of three.

`DeltaLogDriver` has the same face as ecrec.updater.UpdateDriver (`apply`, `flush_decisions`) and drives the
same `Transport`.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from concurrent.futures import Future

import grpc
import torch

from ecrec.core.update import ParityTargets, Part, StepUpdate
from ecrec.faults import fault_point
from ecrec.proto import ecrec_pb2 as pb
from ecrec.retries import RETRYABLE, UNREACHABLE, Retries, ServerUnavailable
from ecrec.riding import Carried, Rides, took
from ecrec.updater import Transport, send_deltas
from ecrec.wire import bytes_to_ids, floats_to_bytes, ids_to_bytes

# How long the first wave waits for the stages before delivering what has answered (see DeltaLogDriver.apply):
# far longer than a stage takes in normal operation, so a step still delivers in one message per server.
STAGE_WAVE = 0.25


class Acks:
    """Parts whose deltas were delivered, by data server: they ride on the next stage there. Shared by the
    update thread and whoever flushes; the lock is held for one operation only."""

    def __init__(self) -> None:
        self._by_server: dict[int, list[str]] = {}
        self._lock = threading.Lock()

    def add(self, server: int, txn: str) -> None:
        with self._lock:
            self._by_server.setdefault(server, []).append(txn)

    def take(self, server: int) -> list[str]:
        with self._lock:
            return self._by_server.pop(server, [])

    def take_all(self) -> dict[int, list[str]]:
        with self._lock:
            out, self._by_server = self._by_server, {}
            return out

    def put_back(self, server: int, txns: list[str]) -> None:
        if txns:
            with self._lock:
                self._by_server.setdefault(server, [])[:0] = txns


class DeltaLogDriver:
    """One worker's updates under commit: deltaLog (one step at a time: the worker keeps one in flight)."""

    def __init__(self, client: Transport):
        self.client, self.ctx = client, client.ctx
        self.acks = Acks()
        spec = self.ctx.spec
        ec = spec.fault_tolerance.ecrec
        # Riding leaves a member of a stripe ahead of its parity record for a step: the xor code's decodes read
        # such a member as of the parity's version (ecrec.core.deltalog); the sum code's wait for the delivery.
        # Deterministic runs write refused rows again in step order, which riding would not.
        self.ride = ec.deliveries == "ride" and ec.code == "xor" and not spec.training.deterministic
        self._carried: list[Carried] = []  # updates whose deltas ride on the next stages
        self._carried_lock = threading.Lock()  # the update thread and a flushing thread take them

    def apply(self, step: str, g: torch.Tensor, grads: torch.Tensor, dense_grad: torch.Tensor) -> None:
        """Apply one step's update; returns when every row and dense chunk is applied exactly once — or, riding,
        applied at its data servers, its deltas carried by this driver until they are applied at parity."""
        ctx = self.ctx
        grads = grads.to("cpu", torch.float32)
        dense_grad = dense_grad.to("cpu", torch.float32)
        holders = [ctx.dense_holders(c) for c in range(ctx.num_servers)]
        update = StepUpdate(step, ctx.placement, g, holders, stable_txns=True)
        retries = Retries(f"update {step}", self.client.progress_timeout, self.client.interrupt)
        carried = self._take_carried()
        if not self._riding():
            self._finish(carried)
            self._run(update, g, grads, dense_grad, retries)
            return
        rides = Rides(carried, self.client.failed)
        try:
            staged = self._run(update, g, grads, dense_grad, retries, rides)
        except BaseException:
            for c in carried:  # for a flush (a rollback drops them with this driver)
                if c.unanswered():
                    self._keep(c)
            raise
        if staged:
            kept = Carried(update, g, grads, dense_grad, staged)
            if self._riding():
                self._keep(kept)
            else:  # the map turned degraded meanwhile: deliver now
                self._finish([kept])

    def _riding(self) -> bool:
        """Do deliveries ride now? Not while a shard is failed or recovering: degraded reads, rebuilds and
        degraded writes need every stripe's parity up to date, and deliver at once."""
        return self.ride and not self.client.degraded()

    def _take_carried(self) -> list[Carried]:
        with self._carried_lock:
            out, self._carried = self._carried, []
        return out

    def _keep(self, c: Carried) -> None:
        with self._carried_lock:
            self._carried.append(c)

    def _settle(self, rides: Rides) -> None:
        """Take what the answers to `rides` say (every one answered or lost): parts applied are acknowledged on the
        next stage, held ones ride again; anything unusual is delivered at once, before this step's update
        goes on, so an earlier step's rows written again precede this step's retries."""
        finish = []
        for settled in rides.settle(self.ctx.placement):
            for part in settled.done:
                self.acks.add(part.target, part.txn)
            if settled.refused:
                self.client.refresh()  # a data server is failed or replaced: plan with the new map
            if settled.needs_finish or not self._riding():
                finish.append(settled.carried)
            elif settled.carried.held:
                self._keep(settled.carried)
        self._finish(finish)

    def _finish(self, carried: list[Carried]) -> None:
        """Deliver what is left of carried updates as without riding: asked again, answered once applied, refused
        rows written again. Every one is asked again before any is finished (see `_ask_again`)."""
        runs, errors = [], {}
        for c in carried:
            retries = Retries(f"update {c.update.step}", self.client.progress_timeout, self.client.interrupt)
            unanswered = c.unanswered()
            c.fresh, c.held, c.lost = [], [], []
            if unanswered:
                unanswered = self._ask_again(unanswered, c.g, c.update, retries, errors)
            runs.append((c, retries, unanswered))
        self._recover(errors)
        for c, retries, unanswered in runs:
            self._run(c.update, c.g, c.grads, c.dense_grad, retries, unanswered=unanswered)

    def _ask_again(
        self, unanswered: list, g: torch.Tensor, update: StepUpdate, retries: Retries, errors: dict
    ) -> list[tuple[Part, list]]:
        """Deliver again, after the map is fetched anew where a server said so (`errors`, emptied), deltas a live
        parity server did not answer for, before an earlier step's update is finished. That step's rows written
        again are decoded from their stripes, and a stripe can need these deltas: a data server that applied
        this step's part and failed since (with r = 2 its rows' two parity records stay apart until each has
        taken, or refused and kept, every delta of it the other took: core/cuts.py)."""
        self._recover(errors)
        return self._deliver_wave(unanswered, g, update, retries, errors, again=True)

    def _recover(self, errors: dict) -> None:
        """React to the retryable errors of a pass (a stale map: fetch it anew) and forget them."""
        for server, e in errors.items():
            self.client.recover_from(server, e)
        errors.clear()

    def _run(
        self,
        update: StepUpdate,
        g: torch.Tensor,
        grads: torch.Tensor,
        dense_grad: torch.Tensor,
        retries: Retries,
        rides: Rides | None = None,
        unanswered: list[tuple[Part, list]] = (),
    ) -> list[tuple[Part, list]] | None:
        """Passes until every row of `update` is applied. With `rides` (its first pass carries them): if every
        part staged at once, returns the staged (part, deltas) for the next step's stages to carry instead of
        delivering them; every server in `rides` has answered or failed by then."""
        unanswered = list(unanswered)  # deltas a live parity server has not answered for
        alone: list = []
        try:
            while True:
                errors: dict[int, grpc.RpcError] = {}
                if unanswered:
                    # Asked again before anything else, under the current map: rows it applied are done, rows it
                    # refuses are written again. Written again before it answers, they could be applied twice
                    # (it may have applied them, and their data server may be failed now: a degraded write at
                    # the acting home decodes a record that holds them).
                    unanswered = self._deliver_wave(unanswered, g, update, retries, errors, again=True)
                parts = update.plan(self.client.view())
                if not parts and not unanswered and rides is None:
                    return None
                futs = []
                riding: set[int] = set()
                for part in parts:
                    acks = self.acks.take(part.target)
                    carried, asks = [], []
                    if rides is not None and part.target not in riding:
                        riding.add(part.target)
                        carried, asks = rides.fields(part.target)
                    fut = self._send_stage(part, g, grads, dense_grad, acks, carried, asks)
                    futs.append((part, acks, rides if carried or asks else None, fut))
                if rides is not None:  # what rides to servers this step does not stage at goes on its own
                    alone = self._deliver_alone(rides, set(rides.servers()) - riding)
                unreachable: set[int] = set()
                # Deliver in waves: what has answered within STAGE_WAVE goes out together, the rest as each
                # answers. A stage can wait for stripes to be decodable (a replacement rebuilding its rows on
                # demand, a degraded write), and this worker's own applied parts, until delivered, are exactly
                # what keeps them from being so.
                waiting = futs
                first, carry = True, None
                while waiting:
                    done, _ = futures.wait(
                        [w[-1] for w in waiting],
                        timeout=STAGE_WAVE if first else None,
                        return_when=futures.ALL_COMPLETED if first else futures.FIRST_COMPLETED,
                    )
                    ready = [w for w in waiting if w[-1] in done]
                    waiting = [w for w in waiting if w[-1] not in done]
                    staged = self._staged(ready, update, retries, errors, unreachable)
                    if first and rides is not None and not waiting and not errors and not unreachable:
                        carry = staged  # every part staged at once: its deltas ride on the next step
                    elif staged:
                        unanswered += self._deliver_wave(staged, g, update, retries, errors)
                    first = False
                if rides is not None:
                    self._await_alone(rides, alone)
                    alone, settle, rides = [], rides, None
                    # (a stage a parity server turned away as of a stale map lost what rode on it: the map
                    # is fetched before that is asked for again)
                    self._recover(errors)
                    if unanswered:
                        unanswered = self._ask_again(unanswered, g, update, retries, errors)
                    self._settle(settle)
                # (riding: the earlier steps' deltas are delivered by now, and this step's staged)
                fault_point("worker:after_deliver")
                if carry is not None and not unanswered:
                    return carry
                if carry:
                    unanswered += self._deliver_wave(carry, g, update, retries, errors)
                # Only now: the coordinator's probe of an unreachable server takes a while, and until the
                # deltas above arrive, their stripes cannot be decoded by anyone (degraded reads, rebuilds).
                for server in sorted(unreachable):
                    self.client.report_failure(server)
                self._recover(errors)
                if not unanswered and update.finished(self.client.view()):
                    return None
                retries.check()
                time.sleep(retries.backoff())
        finally:
            if rides is not None:  # (an error before every ride was answered: what is unknown is asked again)
                self._await_alone(rides, alone)

    def _deliver_alone(self, rides: Rides, servers: set[int]) -> list:
        out = []
        for server in sorted(servers):
            batches, asks = rides.fields(server)
            req = pb.StageDeltasRequest(epoch=self.client.epoch, batches=batches, ask=asks, early=True)
            out.append((server, self.client.call(server, "DeliverDeltas", req)))
        return out

    def _await_alone(self, rides: Rides, alone: list) -> None:
        for server, fut in alone:
            try:
                rides.answered(server, fut.result())
            except grpc.RpcError as e:
                rides.lost(server)
                if e.code() in UNREACHABLE:
                    self.client.report_failure(server)

    def _staged(self, answered, update: StepUpdate, retries: Retries, errors: dict, unreachable: set) -> list:
        """Take the stages' answers: degraded writes are done; own parts' deltas are returned to deliver."""
        staged: list[tuple[Part, list]] = []
        for part, acks, rides, fut in answered:
            try:
                resp = fut.result()
            except grpc.RpcError as e:
                if rides is not None:
                    rides.lost(part.target)
                if not self.client.failed(part.target):
                    self.acks.put_back(part.target, acks)  # a dead server's log died with it
                retries.note(part.target, "Stage", e)
                if e.code() not in RETRYABLE:
                    raise ServerUnavailable(part.target, e) from e
                if e.code() in UNREACHABLE:
                    unreachable.add(part.target)  # reported once the others' deltas are delivered
                else:
                    errors[part.target] = e
                continue
            if rides is not None:
                rides.answered(part.target, resp)
            if part.src >= 0:  # a degraded write: applied at its acting home, parity included
                update.committed(part)
                retries.progress()
                self.client.note_degraded("writes", part.src, part.pos.numel())
            else:
                update.dense_applied(part)
                for d in resp.deltas:  # which incarnation applied it, as this worker's map says
                    d.incarnation = part.incarnation
                staged.append((part, list(resp.deltas)))
        fault_point("worker:after_stage")
        return staged

    def _deliver_wave(
        self, staged: list, g, update: StepUpdate, retries: Retries, errors: dict, again: bool = False
    ) -> list[tuple[Part, list]]:
        """Deliver the deltas of `staged` parts and take the answers: rows applied are done, rows refused are
        planned again. Returns (part, deltas) of the parity servers that did not answer: whether they applied
        them is unknown, so their rows wait (StepUpdate.rows_unanswered) until they are asked `again`; then
        only those servers' rows are spoken for."""
        refused, undelivered = self._deliver(staged, errors)
        for server in sorted(undelivered):  # (in the log and in Stalled's reason: a delivery that never ends)
            retries.note(server, "DeliverDeltas", errors.get(server, "no answer"))
        unanswered = []
        # One part's deltas may come in several entries (one per parity server it waits for): its rows are
        # judged on all of them together — a row of r = 2 has two parity servers, and the answer of one is
        # not the row's.
        by_part: dict[int, tuple[Part, list]] = {}
        for part, deltas in staged:
            by_part.setdefault(id(part), (part, []))[1].extend(deltas)
        for part, deltas in by_part.values():
            asked = {d.parity_server for d in deltas}
            late = undelivered & asked
            mine = [(server, idx) for (txn, server), idx in refused.items() if txn == part.txn]
            if not (again or late or mine):  # the usual case: every row applied
                update.rows_applied(part, torch.ones(part.pos.numel(), dtype=torch.bool))
                retries.progress()
            else:
                p = self.ctx.placement
                targets = ParityTargets(p, part.target, p.local_row(g[part.pos]))
                scope = torch.ones(part.pos.numel(), dtype=torch.bool)
                if again:  # (rows refused since by a parity server are decided: written again)
                    scope = targets.at(asked) & update.rows_waiting[part.pos]
                refused_rows = torch.zeros_like(scope)
                for server, idx in mine:
                    refused_rows |= targets.refused(server, idx)
                refused_rows &= scope
                wait = scope & targets.at(late) & ~refused_rows
                answered = scope & ~wait & ~refused_rows
                update.rows_applied(part, answered)  # what is left of the answered rows: applied
                update.rows_unanswered(part, scope & ~wait, waiting=False)  # refused: planned again
                if bool(refused_rows.any()):
                    update.rows_refused(part, refused_rows, took(p, g[part.pos], deltas))
                if late:
                    update.rows_unanswered(part, wait)
                    unanswered.append((part, [d for d in deltas if d.parity_server in late]))
                if bool(answered.any()):
                    retries.progress()
            if bool(update.rows_done[part.pos].all()):
                # Only then: a part retried at the same server (the worker's map lagging behind the parity
                # server's) must still be answered with its deltas.
                self.acks.add(part.target, part.txn)
        if refused:
            self.client.refresh()  # a data server is failed or replaced: plan with the new map
        return unanswered

    def flush_decisions(self) -> None:
        """Deliver the deltas riding on the next step now, and send the acknowledgements no stage will carry (the
        worker stops or pauses, or the map turned degraded: any thread may call this). The acknowledgements are
        best effort: one that never arrives only makes the data server forward the deltas itself after
        txnTimeout, and the parity servers skip what they already hold."""
        self._finish(self._take_carried())
        calls = []
        for server, txns in self.acks.take_all().items():
            if txns and not self.client.failed(server):
                req = pb.StageDeltasRequest(epoch=self.client.epoch, delivered=txns)
                calls.append(self.client.call(server, "DeliverDeltas", req))
        for fut in calls:
            try:
                fut.result()
            except grpc.RpcError:
                pass  # see above

    def _send_stage(
        self, part: Part, g, grads, dense_grad, acks: list[str], carried: list = (), asks: list = ()
    ) -> Future:
        ctx = self.ctx
        rows = floats_to_bytes(grads[part.pos])
        self.client.metrics.of(self.client.metrics.bytes_sent, kind="push").inc(len(rows))
        req = pb.StageRequest(
            epoch=part.epoch,
            txn=part.txn,
            ids=ids_to_bytes(g[part.pos]),
            grads=rows,
            src=part.src,
            dense_chunks=part.dense,
            dense_grads=[floats_to_bytes(dense_grad[slice(*ctx.dense_bounds[c])]) for c in part.dense],
            delivered=acks,
            carried=carried,
            ask=asks,
        )
        if part.versions is not None:  # rows a parity server refused, written again (r = 2)
            req.versions = ids_to_bytes(part.versions)
        return self.client.call(part.target, "Stage", req)

    def _deliver(
        self, staged: list[tuple[Part, list]], errors: dict
    ) -> tuple[dict[tuple[str, int], torch.Tensor], set[int]]:
        """DeliverDeltas to every live parity server at once (updater.send_deltas). Returns the refused rows,
        by (txn, parity server), and the live servers that did not answer (their parts are delivered again)."""
        answers, undelivered = send_deltas(self.client, staged, "DeliverDeltas", errors)
        refused: dict[tuple[str, int], torch.Tensor] = {}
        for server, resp in answers.items():
            for r in resp.refused:  # with r = 2 a part may have P's rows and Q's rows at one server
                key, idx = (r.txn, server), bytes_to_ids(r.index)
                refused[key] = torch.cat([refused[key], idx]) if key in refused else idx
        return refused, undelivered
