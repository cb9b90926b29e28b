"""A parameter server process: a `ShardStore` served over gRPC, registered with the coordinator.

`ParameterServicer` is the thin adapter: it decodes raw-byte tensors, checks every field against the server's
geometry and state before anything happens, checks epochs, maps errors to status codes (bad input ->
INVALID_ARGUMENT, stale map or a request that does not fit the server's state -> FAILED_PRECONDITION, busy rows
-> ABORTED, anything unexpected -> INTERNAL, logged once), and records metrics. An epoch is adopted only once
the coordinator's published map confirms it. `GrpcPeers` is the store's window on the other servers. The
process's side of the coordinator (its copy of the cluster map, registration and heartbeats, a spare's wait)
is `ecrec.serverlink`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import signal
import threading
import time
import uuid
from concurrent import futures

import grpc
import httpx
import torch

from ecrec import auth, faults, rest
from ecrec.core.txn import DeltaBatch, RowsBusy
from ecrec.core.update import parse_txn
from ecrec.ft.servicer import CheckpointHandlers, CheckpointRefused
from ecrec.grpcopts import GRPC_OPTIONS
from ecrec.jobctx import JobContext
from ecrec.metrics import Metrics, StoreCollector
from ecrec.proto import ecrec_pb2 as pb
from ecrec.proto import ecrec_pb2_grpc as pb_grpc
from ecrec.serverlink import ClusterView, CoordinatorLink, wait_as_spare
from ecrec.store import (
    CALLER,
    Busy,
    Caller,
    Cancelled,
    NotOwner,
    PeerFailed,
    ReadResult,
    ShardStore,
    Staged,
)
from ecrec.streams import StreamEndpoint
from ecrec.wire import (
    InvalidRequest,
    bytes_to_floats,
    bytes_to_ids,
    check_finite,
    floats_to_bytes,
    ids_to_bytes,
)

log = logging.getLogger("ecrec.server")

KIND_NAMES = {pb.DATA: "data", pb.PARITY: "parity", pb.DENSE: "dense"}
# How long a rebuild read waits for this server's map to reach the reader's epoch before it is refused: two of
# the view's fetch windows (ClusterView.confirm fetches at most once per 50 ms), so that an epoch published
# just now is found; one the coordinator does not publish (made up, or no coordinator answering) is refused
# after that, and the rebuild asks again.
ADOPT_EPOCH_WAIT = 0.12
ADOPTING_AT_ONCE = 8


class StaleEpoch(Exception):
    pass


class WrongState(Exception):
    """The request does not fit this server's state (e.g. Recover on a server that is not being rebuilt)."""


def new_instance() -> str:
    """An id for this process, unique across restarts: the coordinator tells processes of a shard apart by it."""
    return uuid.uuid4().hex[:16]


class GrpcPeers:
    """`Peers` over gRPC, fanning requests to several servers out as futures."""

    def __init__(
        self, view: ClusterView, me: int, metrics: Metrics, timeout: float = 10.0, token: str | None = None
    ):
        self.view, self.me, self.metrics, self.timeout = view, me, metrics, timeout
        self.token = token
        self._stubs: dict[str, pb_grpc.ParameterServerStub] = {}
        self._lock = threading.Lock()
        # Blocking calls on a pool rather than grpc's .future(): cheaper in CPU (see PSClient._call).
        self._pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="peer")

    def _call(self, server: int, method: str, request, timeout: float | None = None):
        stub = getattr(self.stub(server), method)
        return self._pool.submit(stub, request, timeout=timeout or self.timeout)

    def stub(self, server: int) -> pb_grpc.ParameterServerStub:
        addr = self.view.address(server)
        with self._lock:
            if addr not in self._stubs:
                self._stubs[addr] = pb_grpc.ParameterServerStub(
                    auth.channel(addr, self.token, options=GRPC_OPTIONS)
                )
            return self._stubs[addr]

    def _gather(self, calls: list[tuple[int, grpc.Future]]) -> dict[int, Exception | None]:
        out: dict[int, Exception | None] = {}
        for server, fut in calls:
            try:
                fut.result()
                out.setdefault(server, None)
            except grpc.RpcError as e:
                out[server] = PeerFailed(server, f"{e.code().name}: {e.details()}")
        return out

    def deltas(self, batches: list[DeltaBatch], immediate: bool, epoch: int) -> dict[int, Exception | None]:
        calls = []
        for b in batches:
            req = delta_message(b, epoch=epoch, immediate=immediate)
            self.metrics.of(self.metrics.bytes_sent, kind="delta").inc(len(req.delta))
            calls.append((b.parity_server, self._call(b.parity_server, "Delta", req)))
        return self._gather(calls)

    def decide(self, servers: list[int], txn: str, src: int, commit: bool, epoch: int) -> dict:
        req = pb.DeltaDecision(epoch=epoch, txn=txn, src=src, commit=commit)
        return self._gather([(s, self._call(s, "DecideDeltas", req)) for s in servers])

    def read_rows(self, requests, epoch: int) -> list[ReadResult]:
        """The reads, one message per server (ReadMany where a server has several), answered in order."""
        by_server: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_server.setdefault(r.server, []).append(i)
        calls = []
        for server, at in by_server.items():
            reads = [self._read_request(requests[i], epoch) for i in at]
            if len(reads) == 1:
                calls.append((server, at, self._call(server, "ReadRows", reads[0], timeout=60.0)))
            else:
                req = pb.ReadManyRequest(epoch=epoch, reads=reads)
                calls.append((server, at, self._call(server, "ReadMany", req, timeout=60.0)))
        out: list[ReadResult | None] = [None] * len(requests)
        for server, at, fut in calls:
            try:
                resp = fut.result()
            except grpc.RpcError as e:
                raise PeerFailed(server, f"{e.code().name}: {e.details()}") from e
            answers = resp.reads if len(at) > 1 else [resp]
            for i, answer in zip(at, answers, strict=True):
                r = requests[i]
                out[i] = self._read_result(r.kind, r.index.numel(), answer)
        return out  # type: ignore[return-value]

    @staticmethod
    def _read_request(r, epoch: int):
        req = pb.ReadRowsRequest(
            epoch=epoch,
            kind=pb.PARITY if r.kind == "parity" else pb.DATA,
            index=ids_to_bytes(r.index),
            src=r.src,
        )
        if r.as_of is not None:  # optional: present only when asked
            req.as_of = ids_to_bytes(r.as_of)
        return req

    def _read_result(self, kind: str, n: int, resp) -> ReadResult:
        # Each access to a bytes field copies it out of the message: take each once, and keep the views (they
        # hold the bytes alive; decodes and encodes only read them, into tensors of their own).
        records, versions = resp.records, resp.versions
        self.metrics.of(self.metrics.bytes_sent, kind="recovery").inc(len(records))
        recs = bytes_to_floats(records, n, len(records) // (4 * n) if n else 0)
        vers = bytes_to_ids(versions, "versions")
        ready = None
        if kind == "parity":
            vers = vers.view(n, -1)
            ready = torch.frombuffer(resp.ready, dtype=torch.bool) if n else torch.empty(0, dtype=torch.bool)
        return ReadResult(recs, vers, ready)

    def dense_copy(self, server: int, chunk: int, epoch: int):
        try:
            resp = self.stub(server).CopyDense(pb.CopyDenseRequest(epoch=epoch, chunk=chunk), timeout=60.0)
        except grpc.RpcError as e:
            raise PeerFailed(server, f"{e.code().name}: {e.details()}") from e
        recs = bytes_to_floats(resp.records, resp.count, resp.width).clone()
        return recs, list(resp.txns)

    def outcome(self, server: int, txn: str) -> str:
        try:
            return self.stub(server).Outcome(pb.TxnRequest(txn=txn), timeout=self.timeout).outcome
        except grpc.RpcError as e:
            raise PeerFailed(server, f"{e.code().name}: {e.details()}") from e

    def confirm_failed(self, server: int) -> bool:
        return self.view.confirm_failed(server, reporter=f"server-{self.me}")

    def is_failed(self, server: int) -> bool:
        return self.view.is_failed(server)

    def failure_key(self, server: int) -> int:
        """Which failure of `server` this is: its incarnation, bumped by every replacement."""
        return int(self.view.shard(server).get("incarnation", 0))

    def is_recovering(self, server: int) -> bool:
        """A replacement whose records are being rebuilt (r = 2: not read by a decode that can do without)."""
        return self.view.shard(server).get("state") == "recovering"


def delta_message(b: DeltaBatch, epoch: int = 0, immediate: bool = False) -> pb.DeltaRequest:
    """One part's deltas for one parity server, as raw bytes."""
    msg = pb.DeltaRequest(
        epoch=epoch,
        txn=b.txn,
        src=b.src,
        index=ids_to_bytes(b.index),
        slot=ids_to_bytes(b.slot),
        delta=floats_to_bytes(b.delta),
        version=ids_to_bytes(b.version),
        immediate=immediate,
        parity_server=b.parity_server,
        incarnation=b.incarnation,
    )
    if b.via >= 0:  # (optional fields: absent from the ordinary batch, which pays nothing for them)
        msg.via = b.via
    if b.base is not None:
        msg.base = ids_to_bytes(b.base)
    return msg


def check_acting_txn(txn: str, via: int, src: int) -> None:
    """The txn of a batch from failed shard src's acting home `via`: its degraded write (or, via == src, the
    rebuild of src's replacement); InvalidRequest otherwise."""
    try:
        _step, target, tsrc, _attempt = parse_txn(txn)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if target != via or tsrc != src:
        raise InvalidRequest(f"txn: {txn} is not a write of shard {src}'s rows at server {via}")


def stage_versions(request: pb.StageRequest, n: int) -> torch.Tensor | None:
    """A rewrite's `versions` (r = 2: what each row's update took at its failed data server)."""
    if not request.HasField("versions"):
        return None
    versions = bytes_to_ids(request.versions, "versions")
    if versions.numel() != n:
        raise InvalidRequest("versions: one per row")
    return versions


def delta_batch(request: pb.DeltaRequest, parity_server: int, width: int) -> DeltaBatch:
    """The `DeltaBatch` a `delta_message` carries to `parity_server` (records `width` floats wide), its tensors
    owned; `InvalidRequest` for lengths that disagree."""
    index, slot, version = (
        bytes_to_ids(request.index),
        bytes_to_ids(request.slot),
        bytes_to_ids(request.version),
    )
    n = index.numel()
    if slot.numel() != n or version.numel() != n:
        raise InvalidRequest("index, slot and version differ in length")
    delta = bytes_to_floats(request.delta, n, width, "delta").clone()
    base = None
    if request.HasField("base"):
        base = bytes_to_ids(request.base, "base").clone()
        if base.numel() != n or not request.HasField("via"):
            raise InvalidRequest("base: one version per row, from an acting home (via)")
    return DeltaBatch(
        parity_server,
        request.txn,
        request.src,
        index.clone(),
        slot.clone(),
        delta,
        version.clone(),
        request.incarnation,
        request.via if request.HasField("via") else -1,
        base,
    )


def read_into(store, request: pb.ReadRowsRequest, resp: pb.ReadRowsResponse) -> pb.ReadRowsResponse:
    """Serve one read (ReadRows, or one of a ReadMany) into `resp`: its bytes are copied into the message once."""
    if request.kind not in (pb.DATA, pb.PARITY):
        raise InvalidRequest("kind: ReadRows reads DATA or PARITY records")
    other = request.kind == pb.PARITY  # a parity read waits for another shard's updates, never its own
    if request.src != -1 and (
        not 0 <= request.src < store.ctx.num_servers or (other and request.src == store.shard)
    ):
        raise InvalidRequest(f"src: {request.src} is not {'another ' if other else 'a '}shard of this job")
    index = bytes_to_ids(request.index, "index")
    as_of = None
    if request.HasField("as_of"):  # (DATA: [n] versions; PARITY: [n, k], checked by the store)
        as_of = bytes_to_ids(request.as_of, "as_of")
    res = store.read_rows(KIND_NAMES[request.kind], index, request.src, as_of)
    resp.records, resp.versions = floats_to_bytes(res.records), ids_to_bytes(res.versions)
    if res.ready is not None:
        resp.ready = res.ready.to(torch.uint8).numpy().tobytes()
    return resp


def refused_rows(refused: list[tuple[str, int, torch.Tensor]]) -> list:
    """(txn, src, parity indices) of rows a parity server did not apply, as RefusedRows messages."""
    return [pb.RefusedRows(txn=t, src=s, index=ids_to_bytes(i)) for t, s, i in refused]


_logged_once: set[tuple[str, str]] = set()


def rpc(method: str, check_epoch: bool = True, adopt_epoch: bool = False):
    """Servicer method wrapper: epoch check, error mapping and latency metric in one place. No exception
    escapes as UNKNOWN: what no rule expects is INTERNAL, logged with its traceback once per (method, type).
    `adopt_epoch`: the caller's newer epoch must be this server's before the call runs (see observe_epoch)."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self: ParameterServicer, request, context: grpc.ServicerContext):
            m = self.metrics
            left = context.time_remaining()
            caller = Caller(time.monotonic() + left if left is not None else None, context.is_active)
            token = CALLER.set(caller)
            with m.timed(method):
                try:
                    self.observe_epoch(getattr(request, "epoch", 0), check_epoch, adopt_epoch)
                    return fn(self, request, context)
                except InvalidRequest as e:
                    code, msg = grpc.StatusCode.INVALID_ARGUMENT, str(e)
                except (StaleEpoch, NotOwner, WrongState, CheckpointRefused) as e:
                    code, msg = grpc.StatusCode.FAILED_PRECONDITION, str(e)
                except (Busy, RowsBusy) as e:
                    code, msg = grpc.StatusCode.ABORTED, f"busy: {e}"
                except PeerFailed as e:
                    code, msg = grpc.StatusCode.UNAVAILABLE, str(e)
                except Cancelled as e:
                    code, msg = grpc.StatusCode.CANCELLED, str(e)
                except Exception as e:  # noqa: BLE001 - the edge: report, never crash or leak UNKNOWN
                    code, msg = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
                    if (method, type(e).__name__) not in _logged_once:
                        _logged_once.add((method, type(e).__name__))
                        log.exception("%s: unexpected error (logged once per method and type)", method)
                finally:
                    CALLER.reset(token)
                m.of(m.rpc_errors, method=method, code=code.name).inc()
                context.abort(code, msg)

        return wrapper

    return deco


class ParameterServicer(pb_grpc.ParameterServerServicer):
    def __init__(
        self,
        store: ShardStore,
        metrics: Metrics,
        view: ClusterView | None = None,
        epoch: int = 1,
        instance: str = "",
    ):
        self.store, self.metrics = store, metrics
        self.view = view or ClusterView()
        self.store.epoch = epoch
        self.instance = instance or new_instance()
        self.checkpoints = CheckpointHandlers(store)  # Checkpoint and Restore (ecrec.ft.servicer)
        self.streams = StreamEndpoint(self)  # the Calls stream runs the methods below, one message each
        self._adopting = threading.BoundedSemaphore(ADOPTING_AT_ONCE)  # see _await_epoch

    def Calls(self, request_iterator, context):
        """Unary calls as messages on a long-lived stream (ecrec.streams)."""
        yield from self.streams.serve(request_iterator, context)

    @property
    def epoch(self) -> int:
        return self.store.epoch

    def observe_epoch(self, epoch: int, check: bool, adopt: bool = False) -> None:
        """Reject a stale epoch; adopt a newer one only once the coordinator's map confirms it. A request
        that claims an epoch the coordinator has not published is refused and its epoch never stored.

        `adopt`: a replacement's rebuild reads (ReadRows). This server must hold the reader's epoch before
        it reads, so that no stage planned on an older map (one that skips the replacement as a failed
        parity server) applies after the read (ShardStore._admit); it asks the map again for a moment
        (ADOPT_EPOCH_WAIT), then refuses (the rebuild tries again)."""
        # 0 means "no epoch" (proto3 default): tools and tests that do not track the map.
        if not epoch:
            return
        if epoch > self.store.epoch:
            if not self.view.confirm(epoch) and not (adopt and self._await_epoch(epoch)):
                if not check and not adopt:
                    # Commits, decisions and reads do not depend on the map: served, the epoch not stored.
                    # (A worker can be ahead legitimately: two failures publish two epochs within the 50 ms
                    # this view waits between fetches, and a refused Commit failed the whole job.)
                    return
                raise StaleEpoch(
                    f"epoch {epoch} is ahead of the coordinator's map (epoch {self.view.epoch}): refused"
                )
            self.store.epoch = max(self.store.epoch, self.view.epoch)
        if check and epoch < self.store.epoch:
            raise StaleEpoch(f"stale epoch {epoch}: the cluster map is at epoch {self.store.epoch}")

    def _await_epoch(self, epoch: int, patience: float = ADOPT_EPOCH_WAIT) -> bool:
        """Ask the map again (ClusterView.confirm) until it has `epoch`, for `patience` seconds. A few such
        waits at a time (a rebuild reads in one round): requests that claim made-up epochs are refused at once
        beyond that, instead of each holding a handler thread."""
        if not self._adopting.acquire(blocking=False):
            return False
        try:
            end = time.monotonic() + patience
            while time.monotonic() < end:
                time.sleep(0.055)  # past the fetch window of the confirm that just failed
                if self.view.confirm(epoch):
                    return True
            return False
        finally:
            self._adopting.release()

    # -- field checks (before anything happens) ---------------------------------------------------------
    def _shard_id(self, s: int, what: str, *, other: bool = True) -> int:
        if not 0 <= s < self.store.ctx.num_servers or (other and s == self.store.shard):
            raise InvalidRequest(f"{what}: {s} is not {'another ' if other else 'a '}shard of this job")
        return s

    def _own_txn(self, txn: str, src: int | None = None) -> str:
        """A part's txn id addressed to this server (and, given `src`, for rows of shard src)."""
        try:
            _step, target, tsrc, _attempt = parse_txn(txn)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if target != self.store.shard:
            raise InvalidRequest(f"txn: {txn} is a part of server {target}, not of server {self.store.shard}")
        if src is not None and tsrc != src:
            raise InvalidRequest(f"txn: {txn} is for rows of shard {tsrc}, the request says {src}")
        return txn

    def _decision(self, txn: str, src: int) -> tuple[str, int]:
        """A decision about (txn, src)'s deltas: src is the data server that staged the part."""
        self._shard_id(src, "src")
        try:
            _step, target, tsrc, _attempt = parse_txn(txn)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if target != src or tsrc != -1:
            raise InvalidRequest(f"txn: {txn} is not a part of data server {src}'s own rows")
        return txn, src

    def _two_pc(self) -> bool:
        ec = self.store.ctx.spec.fault_tolerance
        return ec.strategy == "ecrec" and ec.ecrec.two_phase_commit

    # -- foundation path -------------------------------------------------------------------------------
    @rpc("Pull")
    def Pull(self, request, context):
        g = bytes_to_ids(request.ids)
        if request.warm:  # a worker's read-ahead (PSClient.warm): rebuild what is not yet, answer nothing
            if request.dense_chunks:
                raise InvalidRequest("dense_chunks: a warm pull reads no dense chunks")
            self.store.warm(g)
            return pb.PullResponse()
        chunks = list(request.dense_chunks)
        if len(set(chunks)) != len(chunks):
            raise InvalidRequest("dense_chunks: a chunk is named twice")
        for c in chunks:  # all checked before any is read
            self.store.chunk_len(c)
        payload = floats_to_bytes(self.store.pull(g))
        dense = floats_to_bytes(torch.cat([self.store.pull_dense(c) for c in chunks])) if chunks else b""
        m = self.metrics
        m.of(m.rows, kind="pull").inc(g.numel())
        m.of(m.bytes_sent, kind="pull").inc(len(payload))
        if dense:
            m.of(m.bytes_sent, kind="dense").inc(len(dense))
        return pb.PullResponse(rows=payload, dense=dense)

    @rpc("Push")
    def Push(self, request, context):
        if self._two_pc():
            raise WrongState("Push applies at once: with twoPhaseCommit updates are staged (Stage)")
        g = bytes_to_ids(request.ids)
        grads = bytes_to_floats(request.grads, g.numel(), self.store.dim, "grads")
        n = self.store.push(g, grads, request.txn)
        self.metrics.of(self.metrics.rows, kind="push").inc(n)
        return pb.PushResponse(applied=n)

    @rpc("PushDense")
    def PushDense(self, request, context):
        if self._two_pc():
            raise WrongState("PushDense applies at once: with twoPhaseCommit updates are staged (Stage)")
        n = self.store.chunk_len(request.chunk)
        self.store.push_dense(request.chunk, bytes_to_floats(request.grads, n, 1, "grads"))
        return pb.DensePushResponse()

    @rpc("ReadRecords", check_epoch=False)
    def ReadRecords(self, request, context):
        if request.kind not in KIND_NAMES:
            raise InvalidRequest(f"kind: unknown record kind {request.kind}")
        recs = self.store.read(KIND_NAMES[request.kind], request.start, request.count, request.chunk)
        payload = floats_to_bytes(recs)
        return pb.ReadRecordsResponse(records=payload, width=recs.shape[1], count=recs.shape[0])

    @rpc("Info", check_epoch=False)
    def Info(self, request, context):
        s = self.store
        return pb.InfoResponse(
            instance=self.instance,
            shard=s.shard,
            epoch=s.epoch,
            data_rows=s.num_rows,
            parity_rows=s.parity.parity.shape[0],
            record_width=s.ctx.record_width,
            dense_chunks=sorted(s.dense.records),
            state="recovering" if s.replacement and not s.recovery_done() else "up",
            strategy=s.ctx.spec.fault_tolerance.strategy,
            staged=s.staged_count(),
        )

    # -- ECRec -----------------------------------------------------------------------------------------
    @rpc("Stage")
    def Stage(self, request, context):
        if request.src != -1:
            self._shard_id(request.src, "src")
        self._own_txn(request.txn, request.src)
        g = bytes_to_ids(request.ids)
        grads = bytes_to_floats(request.grads, g.numel(), self.store.dim, "grads")
        if len(request.dense_chunks) != len(request.dense_grads):
            raise InvalidRequest("dense_chunks and dense_grads differ in length")
        if len(set(request.dense_chunks)) != len(request.dense_chunks):
            raise InvalidRequest("dense_chunks: a chunk appears twice")
        if request.dense_chunks and request.src != -1:
            raise InvalidRequest(
                "dense_chunks: dense chunks are staged at their replicas, not with acting rows"
            )
        dense = {}
        for c, buf in zip(request.dense_chunks, request.dense_grads, strict=True):
            dense[int(c)] = bytes_to_floats(buf, self.store.chunk_len(int(c)), 1, "dense_grads").view(-1)
        txn, src, versions = request.txn, request.src, stage_versions(request, g.numel())
        early: tuple[list, list] = ([], [])
        if self.store.logged:  # commit: deltaLog — applied now; the deltas are the worker's to deliver
            if request.decisions:
                raise InvalidRequest("decisions: commit decisions belong to commit: rowLocks")
            delivered = [self._own_txn(t, -1) for t in request.delivered]
            carried, asked = self._carried(request.carried), self._asked(request.ask)  # all checked first
            if carried or asked:  # the worker's earlier deliveries to this server as a parity server
                early = self.store.deliver_early(carried, asked)
            staged = Staged(
                *self.store.apply_part(txn, g, grads, src, dense, request.epoch, delivered, versions)
            )
        else:
            if request.delivered or request.carried or request.ask:
                raise InvalidRequest("delivered, carried, ask: deliveries belong to commit: deltaLog only")
            decisions = self._decisions(request.decisions)
            staged = self.store.stage(
                txn, g, grads, src, dense, request.epoch, decisions, request.lone, versions
            )
        self.metrics.of(self.metrics.rows, kind="stage").inc(staged.rows)
        if request.src != -1:  # rows of failed shard src, written at this acting home
            self.metrics.of(self.metrics.degraded_writes, shard=str(request.src)).inc(staged.rows)
        return pb.StageResponse(
            staged=staged.rows,
            deltas=[delta_message(b) for b in staged.batches],
            refused=refused_rows(early[0]),
            held=[pb.PartRef(txn=t, src=s) for t, s in early[1]],
        )

    @rpc("Commit", check_epoch=False)
    def Commit(self, request, context):
        return pb.TxnResponse(outcome=self.store.commit(self._own_txn(request.txn)))

    @rpc("Abort", check_epoch=False)
    def Abort(self, request, context):
        return pb.TxnResponse(outcome=self.store.abort(self._own_txn(request.txn)))

    def _batch(self, request) -> DeltaBatch:
        if request.parity_server != self.store.shard:
            raise InvalidRequest(
                f"parity_server: batch for {request.parity_server} sent to {self.store.shard}"
            )
        batch = delta_batch(request, self.store.shard, self.store.ctx.record_width)
        if self.store.code.name != "xor":  # xor deltas are bit patterns; float deltas must be numbers
            check_finite(batch.delta, "delta")
        # Placement is checked by the store (stage_deltas), once for every batch of the message.
        return batch

    @rpc("Delta", check_epoch=False)
    def Delta(self, request, context):
        if request.HasField("via"):  # r = 2: an acting home (or a replacement) aligning or forwarding a write
            check_acting_txn(request.txn, request.via, self._shard_id(request.src, "src"))
            self.store.receive_deltas(self._batch(request), immediate=True)
            return pb.TxnResponse(outcome="applied")
        if self.store.logged and request.immediate:
            # a data server forwarding a part its worker did not deliver (LoggedUpdates.forward_due)
            self._decision(request.txn, request.src)
            self.store.receive_deltas(self._batch(request), immediate=True)
            return pb.TxnResponse(outcome="applied")
        if self._two_pc() or not request.immediate:
            raise WrongState(
                "Delta is the data server's message without 2PC; staged deltas come in StageDeltas"
            )
        self.store.receive_deltas(self._batch(request), request.immediate)
        return pb.TxnResponse(outcome="staged" if not request.immediate else "applied")

    @rpc("DeliverDeltas")
    def DeliverDeltas(self, request, context):
        if not self.store.logged:
            raise WrongState("DeliverDeltas is part of commit: deltaLog, which this job does not run")
        batches = self._carried(request.batches)  # all validated before any is applied
        delivered = [self._own_txn(t, -1) for t in request.delivered]
        asked = self._asked(request.ask)
        if request.early:
            refused, held = self.store.deliver_early(batches, asked, delivered)
        elif asked:
            raise InvalidRequest("ask: parts are asked about with early deliveries only")
        else:
            refused, held = self.store.deliver(batches, delivered=delivered), []
        return pb.DeliverResponse(
            refused=refused_rows(refused), held=[pb.PartRef(txn=t, src=s) for t, s in held]
        )

    def _carried(self, messages) -> list[DeltaBatch]:
        """Deltas a worker delivers to this server (DeliverDeltas, or riding on a stage), validated."""
        for b in messages:
            self._decision(b.txn, b.src)  # a part of data server src's own rows
        batches = [self._batch(b) for b in messages]
        m = self.metrics
        m.of(m.rows, kind="delta").inc(sum(b.index.numel() for b in batches))
        return batches

    def _asked(self, refs) -> list[tuple[str, int]]:
        return [self._decision(r.txn, r.src) for r in refs]

    @rpc("StageDeltas")
    def StageDeltas(self, request, context):
        if self.store.logged:
            raise WrongState("StageDeltas is part of commit: rowLocks; this job delivers with DeliverDeltas")
        if not self._two_pc():
            raise WrongState("StageDeltas is part of the two-phase commit, which this job does not run")
        if request.delivered:
            raise InvalidRequest("delivered: acknowledgements ride on DeliverDeltas (commit: deltaLog)")
        for b in request.batches:
            self._decision(b.txn, b.src)  # a part of data server src's own rows
            if b.immediate:
                raise InvalidRequest("immediate: staged deltas are applied on their decision")
        batches = [self._batch(b) for b in request.batches]  # all validated before any is staged
        self.store.stage_deltas(batches)
        m = self.metrics
        m.of(m.rows, kind="delta").inc(sum(b.index.numel() for b in batches))
        return pb.TxnResponse(outcome="staged")

    @rpc("DecideDeltas", check_epoch=False)
    def DecideDeltas(self, request, context):
        txn, src = self._decision(request.txn, request.src)
        return pb.TxnResponse(outcome=self.store.decide_deltas(txn, src, request.commit))

    def _decisions(self, decisions) -> list[tuple[str, int, bool]]:
        return [(*self._decision(d.txn, d.src), d.commit) for d in decisions]  # all checked first

    @rpc("DecideMany", check_epoch=False)
    def DecideMany(self, request, context):
        return pb.DecisionsResponse(outcomes=self.store.decide_many(self._decisions(request.decisions)))

    @rpc("Outcome", check_epoch=False)
    def Outcome(self, request, context):
        return pb.TxnResponse(outcome=self.store.outcome(self._own_txn(request.txn, -1)))

    @rpc("ReadRows", check_epoch=False, adopt_epoch=True)
    def ReadRows(self, request, context):
        return read_into(self.store, request, pb.ReadRowsResponse())

    @rpc("ReadMany", check_epoch=False, adopt_epoch=True)
    def ReadMany(self, request, context):
        resp = pb.ReadManyResponse()
        for read in request.reads:  # each answer filled in place: its bytes copied into the message once
            read_into(self.store, read, resp.reads.add())
        return resp

    @rpc("DegradedPull")
    def DegradedPull(self, request, context):
        self._shard_id(request.src, "src")
        g = bytes_to_ids(request.ids)
        rows = self.store.degraded_pull(request.src, g)
        m = self.metrics
        m.of(m.degraded_reads, shard=str(request.src)).inc(g.numel())
        return pb.PullResponse(rows=floats_to_bytes(rows))

    def _recovering(self, shard: int, instance: str | None = None) -> bool:
        """Does the coordinator's map say `shard` is being rebuilt (as process `instance`, if given)? The view
        is fetched again once if it says otherwise: it may be a heartbeat behind."""
        for attempt in range(2):
            info = self.view.shard(shard)
            if info.get("state") == "recovering" and instance in (None, info.get("instance")):
                return True
            if attempt == 0 and self.view.coordinator is not None:
                with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                    self.view.refresh()
        return False

    @rpc("Recover", check_epoch=False)
    def Recover(self, request, context):
        """One step of the rebuild plan. Only on a replacement the coordinator's map shows under recovery,
        for a range inside its table; a step already done is a no-op (0 rows)."""
        start = time.perf_counter()
        s = self.store
        if request.kind not in KIND_NAMES:
            raise InvalidRequest(f"kind: unknown record kind {request.kind}")
        if not request.epoch:
            raise InvalidRequest("epoch: Recover is sent under a cluster-map epoch")
        if not s.replacement or not self._recovering(s.shard, self.instance):
            raise WrongState(f"server {s.shard} ({self.instance}) is not a replacement under recovery")
        if request.kind != pb.DENSE:
            size = s.num_rows if request.kind == pb.DATA else s.parity.parity.shape[0]
            if request.count < 1 or request.start >= size or request.start + request.count > size:
                raise InvalidRequest(
                    f"start/count: [{request.start}, {request.start + request.count}) is not a non-empty "
                    f"range inside the {KIND_NAMES[request.kind]} table ({size} records)"
                )
            index = torch.arange(request.start, request.start + request.count, dtype=torch.int64)
        if request.kind == pb.DATA:
            n = s.rebuild_rows(index)
            self.metrics.of(self.metrics.rows_recovered).inc(n)
        elif request.kind == pb.PARITY:
            n = s.rebuild_parity(index)
        else:
            n = s.copy_dense()
        return pb.RecoverResponse(
            rows=n, seconds=time.perf_counter() - start, rows_total=s.stats["rows_recovered"]
        )

    @rpc("CopyDense", check_epoch=False)
    def CopyDense(self, request, context):
        """A surviving replica's side of a dense copy: only for a chunk another replica of which is a
        replacement under recovery."""
        self.store.chunk_len(request.chunk)  # held here, or INVALID_ARGUMENT
        others = [h for h in self.store.ctx.dense_holders(request.chunk) if h != self.store.shard]
        if not any(self._recovering(h) for h in others):
            raise WrongState(f"dense chunk {request.chunk} has no replica under recovery to copy to")
        recs, txns = self.store.serve_dense_copy(request.chunk, request.epoch)
        return pb.CopyDenseResponse(
            records=floats_to_bytes(recs), width=recs.shape[1], count=recs.shape[0], txns=txns
        )

    # -- checkpoint strategies (ecrec.ft.servicer) -------------------------------------------------------
    @rpc("Checkpoint", check_epoch=False)
    def Checkpoint(self, request, context):
        """Write this shard's part of a checkpoint (CheckpointHandlers.checkpoint)."""
        return self.checkpoints.checkpoint(request)

    @rpc("Restore", check_epoch=False)
    def Restore(self, request, context):
        """Load this shard's part of a committed checkpoint (CheckpointHandlers.restore)."""
        return self.checkpoints.restore(request)


def start_grpc(
    servicer: ParameterServicer, bind: str, threads: int = 64, token: str | None = None
) -> tuple[grpc.Server, int]:
    """Serve `servicer` on `bind`; with a job `token`, every call must carry it (ecrec.auth). `threads` for
    unary calls, and one more for each `Calls` stream it keeps open."""
    interceptors = [auth.RequireToken(token)] if token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads + servicer.streams.max_streams),
        options=GRPC_OPTIONS,
        interceptors=interceptors,
    )
    pb_grpc.add_ParameterServerServicer_to_server(servicer, server)
    port = server.add_insecure_port(bind)
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {bind}")
    server.start()
    return server, port


def warm_up(ctx: JobContext) -> None:
    """What a spare does before it waits: run once everything a takeover runs for the first time (lazy
    imports, torch's first calls, the job's cached shapes) on a throwaway empty store, so that the takeover
    itself only allocates its shard's tables and HTTP clients (ecrec.rest: their TLS context is made now)."""
    ShardStore(ctx, 0, replacement=True)
    rest.tls_context()


def expire_forever(store, interval: float, stop: threading.Event, now: threading.Event | None = None) -> None:
    """Settle transactions whose worker went silent or is gone (ShardStore.expire), every `interval` and at
    once when `now` is set, on a thread of its own: settling calls peers and the coordinator with long
    timeouts, and must never hold up the heartbeats."""
    now = now or threading.Event()
    while not stop.is_set():
        now.wait(interval)
        now.clear()
        if stop.is_set():
            return
        try:
            store.expire()
        except Exception:  # noqa: BLE001 - an abort that cannot reach a peer is retried next time
            log.exception("expiring stale transactions failed")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ecrec-server")
    ap.add_argument("--job", required=True, help="job JSON file ({name, spec}), or env:VAR")
    ap.add_argument("--shard", type=int, help="shard id (required unless --spare)")
    ap.add_argument(
        "--spare",
        type=int,
        metavar="INDEX",
        help="start as warm spare INDEX: no shard until the coordinator assigns a failed one (servers.spares)",
    )
    ap.add_argument("--coordinator", default="", help="coordinator base URL")
    ap.add_argument("--standalone", action="store_true", help="serve without a coordinator (benchmarks)")
    ap.add_argument(
        "--replacement",
        action="store_true",
        help="start empty and be rebuilt by recovery (set by the supervisor / operator)",
    )
    ap.add_argument("--bind", default="127.0.0.1:0", help="gRPC bind address (port 0 picks one)")
    ap.add_argument("--advertise", default="", help="address clients should dial (default: the bind address)")
    ap.add_argument("--metrics-port", type=int, default=0)
    ap.add_argument("--metrics-addr", default="127.0.0.1")
    ap.add_argument("--instance", default="", help="this process's id (default: a new random one)")
    args = ap.parse_args(argv)
    if (args.shard is None) == (args.spare is None):
        ap.error("exactly one of --shard and --spare is required")
    if args.spare is not None and not args.coordinator:
        ap.error("--spare needs --coordinator")
    name = f"server-{args.shard}" if args.spare is None else f"spare-{args.spare}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    ctx = JobContext.load(args.job)
    torch.set_num_threads(ctx.spec.servers.threads)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    args.instance = args.instance or new_instance()
    serving = threading.Event()  # registered as its shard (a spare's keep-alive stops then)
    if args.spare is not None:
        warm_up(ctx)
        log.info("spare %d (%s): ready, waiting for a failed shard", args.spare, args.instance)
        interval = ctx.spec.coordinator.heartbeat_interval_seconds
        shard = wait_as_spare(args.coordinator, args.instance, interval, ctx.token, stop, serving)
        if shard is None:
            log.info("spare %d: the job finished without needing it", args.spare)
            return
        log.info("spare %d: taking over shard %d", args.spare, shard)
        args.shard, args.replacement = shard, True
    faults.configure(f"server-{args.shard}")
    t0 = time.perf_counter()
    metrics = Metrics(ctx.name, "server", str(args.shard))
    view = ClusterView(args.coordinator if not args.standalone else "", token=ctx.token)
    peers = GrpcPeers(view, args.shard, metrics, token=ctx.token)
    ec = ctx.spec.fault_tolerance.ecrec
    store = ShardStore(
        ctx, args.shard, peers, replacement=args.replacement, txn_timeout=ec.txn_timeout_seconds
    )
    metrics.registry.register(StoreCollector(store, metrics.labels))
    metrics_port = metrics.serve(args.metrics_port, args.metrics_addr)
    servicer = ParameterServicer(store, metrics, view, instance=args.instance)
    server, port = start_grpc(servicer, args.bind, token=ctx.token)
    host = args.bind.rsplit(":", 1)[0]
    address = args.advertise or f"{host}:{port}"
    log.info(
        "shard %d%s: %d rows + %d parity records x %d floats ready in %.2fs, serving on %s",
        args.shard,
        " (replacement, empty)" if args.replacement else "",
        store.num_rows,
        store.parity.parity.shape[0],
        ctx.record_width,
        time.perf_counter() - t0,
        address,
    )
    if not args.standalone:
        if not args.coordinator:
            ap.error("--coordinator is required unless --standalone")
        metrics_url = f"http://{args.metrics_addr}:{metrics_port}/metrics"
        link = CoordinatorLink(
            args.coordinator,
            args.shard,
            address,
            metrics_url,
            ctx.spec.coordinator.heartbeat_interval_seconds,
            servicer.instance,
            token=ctx.token,
        )
        try:
            body = link.register(args.replacement)
        except RuntimeError as e:
            log.error("%s", e)
            server.stop(grace=0)
            raise SystemExit(2) from e
        serving.set()
        view.update(body["cluster"])
        store.epoch = int(body["epoch"])
        expire_now = threading.Event()
        threading.Thread(
            target=link.heartbeat_forever, args=(servicer, stop, expire_now), daemon=True
        ).start()
        threading.Thread(
            target=expire_forever, args=(store, link.interval, stop, expire_now), daemon=True, name="expire"
        ).start()
    while not stop.wait(0.5):  # a bounded wait keeps the main thread responsive to signals
        pass
    server.stop(grace=1.0).wait()
    log.info("shard %d stopped", args.shard)


if __name__ == "__main__":
    main()
