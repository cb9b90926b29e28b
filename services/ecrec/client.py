"""Client side of the parameter servers: the cluster map, calls and their fan-out, and the data path.

Used by workers (training), the launcher (evaluation; the model-level reads, `params_sha256` and the parity
check, are in `ecrec.modelread`, over this client) and benchmarks.
Requests to different servers go out concurrently on a thread pool; tensors are sent as raw bytes. With ECRec
the client follows the cluster map: rows of a failed shard are read from their parity servers (degraded
reads). Updates: without ECRec, `push_rows` / `push_dense`; with it, `apply_update`, whose two-phase commit
lives in `ecrec.updater` (which drives this client's calls and map); retry rules in `ecrec.retries`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import torch

from ecrec import auth
from ecrec.coordinator.client import CoordinatorClient
from ecrec.core.update import MapView
from ecrec.delivery import DeltaLogDriver
from ecrec.evaluation import auc, logloss
from ecrec.grpcopts import GRPC_OPTIONS
from ecrec.jobctx import JobContext
from ecrec.metrics import Metrics, latency_snapshot
from ecrec.proto import ecrec_pb2 as pb
from ecrec.proto import ecrec_pb2_grpc as pb_grpc
from ecrec.retries import RETRYABLE, UNREACHABLE, Retries, ServerUnavailable
from ecrec.streams import StreamPool
from ecrec.updater import UpdateDriver
from ecrec.wire import bytes_to_floats, floats_to_bytes, ids_to_bytes

log = logging.getLogger("ecrec.client")


@dataclass
class Pending:
    """RPCs in flight; `wait()` returns their responses or raises ServerUnavailable for the first failure."""

    calls: list[tuple[int, str, Future]]
    client: PSClient

    def wait(self, timeout: float | None = None) -> list:
        return [self.client.result(shard, method, fut, timeout) for shard, method, fut in self.calls]


class PSClient:
    def __init__(
        self,
        ctx: JobContext,
        cluster: dict,
        metrics: Metrics | None = None,
        timeout: float = 30.0,
        coordinator: str = "",
        streams: int = 0,
    ):
        self.ctx, self.timeout = ctx, timeout
        # Streams per server for this client's calls (ecrec.streams); 0: every call unary. Workers use them
        # (workers.callStreams); one-off readers (verify, the final checks) need not.
        self.streams_per_server = streams
        self.progress_timeout = ctx.spec.coordinator.progress_timeout_seconds
        self.metrics = metrics or Metrics(ctx.name, "client")
        # The coordinator (None: a reader without one, e.g. a test): the map, failure reports, parity results.
        self.coordinator = (
            CoordinatorClient(coordinator, token=ctx.token, timeout=15.0) if coordinator else None
        )
        self._coordinator_log = 0.0
        self._latency: dict[str, object] = {}  # method -> latency histogram child: no label lookup per call
        self.degraded_rows: dict[str, dict[int, int]] = {"reads": {}, "writes": {}}
        self.channels: dict[int, grpc.Channel] = {}
        self.stubs: dict[int, pb_grpc.ParameterServerStub] = {}
        self.streams: dict[int, StreamPool] = {}
        self.addresses: dict[int, str] = {}
        self.states: dict[int, str] = {}
        self.incarnations: dict[int, int] = {}
        self.epoch = 0
        # Set when the job rolls back (the worker's Holds): retried calls give up at once (retries.Interrupted).
        self.interrupt = threading.Event()
        self._map_lock = threading.Lock()  # the training thread and the update thread both adopt maps
        # Enough threads for the training thread's pulls and the update thread's fan-out at once.
        self._pool = ThreadPoolExecutor(max_workers=4 * ctx.num_servers + 4, thread_name_prefix="rpc")
        # before the first map: adopting one may flush its decisions
        self.updates = DeltaLogDriver(self) if _delta_log(ctx) else UpdateDriver(self)
        self.update_cluster(cluster)

    def rolled_back(self) -> None:
        """The job rolled back to a checkpoint: the servers hold its state, with nothing in flight; so does this
        client from now on (no decision or delivery of an update before it is carried over)."""
        self.updates = DeltaLogDriver(self) if _delta_log(self.ctx) else UpdateDriver(self)
        self.interrupt.clear()
        self.refresh()

    @classmethod
    def from_coordinator(cls, ctx: JobContext, url: str, **kw) -> PSClient:
        with CoordinatorClient(url, token=ctx.token, timeout=5.0) as coordinator:
            cluster = coordinator.cluster()
        return cls(ctx, cluster, coordinator=url, **kw)

    # -- the cluster map -------------------------------------------------------------------------------
    def update_cluster(self, cluster: dict) -> None:
        with self._map_lock:
            before = self.epoch
            self._adopt(cluster)
            changed = self.epoch != before and self.degraded()
        if changed:
            # A failure or a recovery: degraded reads and rebuilds need consistent stripes, so the commit
            # decisions this client holds back (see apply_update) must not wait for its next update.
            self.flush_decisions()

    def _adopt(self, cluster: dict) -> None:
        if int(cluster["epoch"]) < self.epoch:
            return
        self.epoch = int(cluster["epoch"])
        for s in cluster["shards"]:
            shard, addr = int(s["shard"]), s["address"]
            self.states[shard] = s["state"]
            self.incarnations[shard] = int(s.get("incarnation", 0))
            if addr and self.addresses.get(shard) != addr:
                if shard in self.channels:
                    self._retire(shard)
                ch = auth.channel(addr, self.ctx.token, options=GRPC_OPTIONS)
                stub = pb_grpc.ParameterServerStub(ch)
                self.channels[shard], self.stubs[shard], self.addresses[shard] = ch, stub, addr
                self.streams[shard] = StreamPool(stub, self.streams_per_server)

    def refresh(self) -> None:
        if self.coordinator is not None:
            with self._no_coordinator("reading the cluster map"):
                self.update_cluster(self.coordinator.cluster())

    def report_failure(self, shard: int) -> None:
        """Tell the coordinator we could not reach `shard`; it probes, and we adopt the resulting map."""
        if self.coordinator is None:
            raise RuntimeError(f"server {shard} is unreachable and this client has no coordinator")
        with self._no_coordinator(f"reporting server {shard} unreachable"):
            self.update_cluster(self.coordinator.report_failure(shard, "client")["cluster"])

    @contextlib.contextmanager
    def _no_coordinator(self, what: str):
        """A coordinator that does not answer is being replaced (docs/protocol.md, Coordinator failover):
        the call is skipped and the caller's retry loop, bounded by progressTimeoutSeconds, asks again."""
        try:
            yield
        except httpx.HTTPError as e:
            now = time.monotonic()
            if now - self._coordinator_log > 1.0:
                log.warning("%s: no answer from the coordinator (%s); retrying", what, e)
                self._coordinator_log = now

    def recover_from(self, shard: int, err: grpc.RpcError) -> None:
        """React to a retryable error from `shard` before trying again."""
        code = err.code()
        self.metrics.of(self.metrics.rpc_errors, method="retry", code=code.name).inc()
        if code in UNREACHABLE:
            self.report_failure(shard)
        elif code == grpc.StatusCode.FAILED_PRECONDITION:
            self.refresh()
        # Busy rows free up within a commit round trip; a new map is already fetched; a failure takes the
        # coordinator's probe: back off accordingly.
        time.sleep(
            {grpc.StatusCode.ABORTED: 0.002, grpc.StatusCode.FAILED_PRECONDITION: 0.01}.get(code, 0.05)
        )

    def failed(self, shard: int) -> bool:
        return self.states.get(shard) == "failed"

    def degraded(self) -> bool:
        """Is any shard failed or recovering in this client's map?"""
        return any(st != "up" for st in self.states.values())

    def view(self) -> MapView:
        """A consistent snapshot of the map for planning an update pass."""
        with self._map_lock:
            failed = frozenset(s for s, st in self.states.items() if st == "failed")
            return MapView(self.epoch, failed, dict(self.incarnations))

    def _retire(self, shard: int) -> None:
        """The shard moved to a new address: end the old channel's idle streams (a lent one ends when its call
        returns). A channel that carried streams is not closed but dropped, for the garbage collector once
        every call and stream on it is over: closing a gRPC Python channel while a call or a stream's request
        thread still uses it can crash the process (a CI chaos run lost a worker that way, at a map change)."""
        streams, channel = self.streams[shard], self.channels[shard]
        streams.close()
        if not streams.opened:
            channel.close()

    def close(self) -> None:
        self.flush_decisions()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for shard in list(self.channels):
            self._retire(shard)
        if self.coordinator is not None:
            self.coordinator.close()

    def call(self, shard: int, method: str, request) -> Future:
        """Start one RPC; the future's result() returns the response or raises the grpc.RpcError.

        Blocking calls on a thread pool, not grpc's `.future()`: each `.future()` on an idle channel starts
        a polling thread, and measured on this project's 2-core machine a fan-out of unary calls costs about
        2.4x the client CPU that way (370 vs 150 µs per call). A call goes as a message on one of the
        server's streams where one is idle (ecrec.streams)."""
        return self._pool.submit(self._timed_call, method, self.streams[shard], request)

    def _timed_call(self, method: str, streams: StreamPool, request):
        """One blocking RPC, its latency observed in ecrec_rpc_latency_seconds{method} (failures too)."""
        start = time.perf_counter()
        try:
            return streams.call(method, request, self.timeout)
        finally:
            hist = self._latency.get(method)
            if hist is None:
                hist = self._latency[method] = self.metrics.of(self.metrics.rpc_latency, method=method)
            hist.observe(time.perf_counter() - start)

    def note_degraded(self, kind: str, shard: int, rows: int) -> None:
        """Count rows of failed shard `shard` read by decoding (kind "reads") or written at their acting home
        ("writes"): here, and in what the worker reports to the coordinator (report_counters)."""
        counts = self.degraded_rows[kind]
        counts[shard] = counts.get(shard, 0) + rows
        metric = self.metrics.degraded_reads if kind == "reads" else self.metrics.degraded_writes
        self.metrics.of(metric, shard=str(shard)).inc(rows)

    def report_counters(self) -> dict:
        """This process's degraded rows by failed shard and RPC latency by method, cumulative: the part of a
        worker's progress report that the coordinator exports (ecrec.metrics.WorkerReports)."""
        return {
            "degradedReads": dict(self.degraded_rows["reads"]),
            "degradedWrites": dict(self.degraded_rows["writes"]),
            "rpcLatency": latency_snapshot(self.metrics),
        }

    def result(self, shard: int, method: str, fut: Future, timeout: float | None = None):
        try:
            return fut.result(timeout=timeout)
        except grpc.RpcError as e:
            self.metrics.of(self.metrics.rpc_errors, method=method, code=e.code().name).inc()
            raise ServerUnavailable(shard, e) from e

    @property
    def ft(self) -> bool:
        return self.ctx.ecrec and self.coordinator is not None

    # -- reads: embedding rows and dense parameters ----------------------------------------------------
    def pull(self, g: torch.Tensor, dense: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedding rows for unique global ids `g` -> float32 [n, dim], and (if `dense`) the flat dense
        parameters, in one round: each server gets one Pull with its shard's rows and the dense chunks it
        serves (each chunk from its first live replica); rows of a failed shard are degraded reads at their
        parity servers. What fails is retried on the next pass, on the map as it then is."""
        ctx = self.ctx
        out = torch.empty(g.numel(), ctx.dim, dtype=torch.float32)
        flat = torch.empty(ctx.dense_numel, dtype=torch.float32) if dense else None
        todo, chunks = torch.arange(g.numel()), list(range(ctx.num_servers)) if dense else []
        retries = Retries(
            f"pull of {g.numel()} rows" + (" and the dense parameters" if dense else ""),
            self.progress_timeout,
            self.interrupt,
        )
        while True:
            calls, wanted, orphaned, retry_chunks = [], {}, False, []
            for c in chunks:
                targets = self.dense_targets(c)
                if not targets:
                    orphaned = True
                    # Every replica lost: more than this job can rebuild. The coordinator fails the job
                    # and names the shards; until it does (or a replacement comes), wait like any refusal.
                    retries.note(-1, "Pull", f"dense chunk {c} has no live replica")
                    retry_chunks.append(c)
                    continue
                wanted.setdefault(targets[0], []).append(c)
            rows_at: dict[int, torch.Tensor] = {}
            for s, pos, _local in ctx.placement.group_by_shard(g[todo]):
                pos = todo[pos]
                if self.ft and self.failed(
                    s
                ):  # degraded read at the acting homes (first live parity servers)
                    pservers, _j = ctx.placement.acting_parity(
                        s, ctx.placement.local_row(g[pos]), self.view().failed_shards
                    )
                    for p in pservers.unique().tolist():
                        sub = pos[pservers == p]
                        req = pb.DegradedPullRequest(epoch=self.epoch, src=s, ids=ids_to_bytes(g[sub]))
                        calls.append((p, sub, [], self.call(p, "DegradedPull", req), s))
                else:
                    rows_at[s] = pos
            none = torch.empty(0, dtype=torch.int64)
            for s in sorted(set(rows_at) | set(wanted)):
                pos, cs = rows_at.get(s, none), wanted.get(s, [])
                req = pb.PullRequest(epoch=self.epoch, ids=ids_to_bytes(g[pos]), dense_chunks=cs)
                calls.append((s, pos, cs, self.call(s, "Pull", req), -1))
            retry, errors = [], []
            for server, pos, cs, fut, src in calls:
                try:
                    resp = fut.result()
                    out[pos] = bytes_to_floats(resp.rows, pos.numel(), ctx.dim, "rows")
                    if cs:
                        bounds = [ctx.dense_bounds[c] for c in cs]
                        values = bytes_to_floats(resp.dense, sum(hi - lo for lo, hi in bounds), 1, "dense")
                        at = 0
                        for lo, hi in bounds:
                            flat[lo:hi] = values[at : at + hi - lo, 0]
                            at += hi - lo
                    if src >= 0:
                        self.note_degraded("reads", src, pos.numel())
                except grpc.RpcError as e:
                    if not self.ft or e.code() not in RETRYABLE:
                        raise ServerUnavailable(server, e) from e
                    retry.append(pos)
                    retry_chunks += cs
                    errors.append((server, e))
                    retries.note(server, "Pull", e)
            if not retry and not retry_chunks:
                return out, flat
            if len(errors) < len(calls):
                retries.progress()
            retries.check()
            for server, e in {s: e for s, e in errors}.items():
                self.recover_from(server, e)
            if orphaned:
                self.refresh()  # a replica may be back: fetch the map
            time.sleep(retries.backoff())
            todo = torch.cat(retry) if retry else none
            chunks = retry_chunks

    def recovering(self) -> bool:
        """Is a shard's replacement being rebuilt, in this client's map?"""
        return any(st == "recovering" for st in self.states.values())

    def warm(self, g: torch.Tensor) -> None:
        """Ask each shard being rebuilt to rebuild its rows among `g` now, ahead of the pulls that will read
        them (ecrec.worker.ReadAhead): one decode round for many steps' rows instead of one per step. Fire and
        forget: nothing waits for the answer, and a refusal costs only the head start."""
        for s, pos, _local in self.ctx.placement.group_by_shard(g):
            if self.states.get(s) == "recovering":
                self.call(s, "Pull", pb.PullRequest(epoch=self.epoch, ids=ids_to_bytes(g[pos]), warm=True))

    def pull_rows(self, g: torch.Tensor) -> torch.Tensor:
        """Embedding rows for unique global ids `g` -> float32 [n, dim] (CPU)."""
        return self.pull(g, dense=False)[0]

    def pull_dense(self) -> torch.Tensor:
        """The flat dense parameters."""
        return self.pull(torch.empty(0, dtype=torch.int64))[1]

    def push_rows(self, g: torch.Tensor, grads: torch.Tensor, txn: str = "") -> Pending:
        """Foundation path (strategy none): apply at once, no retries."""
        grads = grads.to("cpu", torch.float32)
        calls = []
        for s, pos, _local in self.ctx.placement.group_by_shard(g):
            payload = floats_to_bytes(grads[pos])
            self.metrics.of(self.metrics.bytes_sent, kind="push").inc(len(payload))
            req = pb.PushRequest(epoch=self.epoch, ids=ids_to_bytes(g[pos]), grads=payload, txn=txn)
            calls.append((s, "Push", self.call(s, "Push", req)))
        return Pending(calls, self)

    # -- dense parameters ------------------------------------------------------------------------------
    def dense_targets(self, chunk: int) -> list[int]:
        """Live replicas of a dense chunk, serving ones first."""
        # Without ECRec there is no replica to fall back on: the call to a lost server fails (ServerUnavailable)
        # and the strategy decides what then (docs/protocol.md, "Checkpoint strategies").
        holders, states = self.ctx.dense_holders(chunk), self.states
        if all(states.get(h) == "up" for h in holders):  # the usual case: the map as it is, in order
            return list(holders)
        holders = [h for h in holders if not (self.ft and self.failed(h))]
        return sorted(holders, key=lambda h: states.get(h) != "up")

    def push_dense(self, grad: torch.Tensor, txn: str = "") -> Pending:
        ctx, grad = self.ctx, grad.to("cpu", torch.float32)
        calls = []
        for c, (lo, hi) in enumerate(ctx.dense_bounds):
            payload = floats_to_bytes(grad[lo:hi])
            for h in ctx.dense_holders(c):
                self.metrics.of(self.metrics.bytes_sent, kind="dense").inc(len(payload))
                req = pb.DensePushRequest(epoch=self.epoch, chunk=c, grads=payload, txn=txn)
                calls.append((h, "PushDense", self.call(h, "PushDense", req)))
        return Pending(calls, self)

    # -- ECRec updates (ecrec.updater) ---------------------------------------------------------------
    def apply_update(self, step: str, g: torch.Tensor, grads: torch.Tensor, dense_grad: torch.Tensor) -> None:
        """Apply one step's update with the worker-coordinated 2PC of docs/protocol.md (UpdateDriver.apply)."""
        self.updates.apply(step, g, grads, dense_grad)

    def flush_decisions(self) -> None:
        """Send every commit decision still queued for a parity server (UpdateDriver.flush_decisions)."""
        self.updates.flush_decisions()


def _delta_log(ctx: JobContext) -> bool:
    ft = ctx.spec.fault_tolerance
    return ft.strategy == "ecrec" and ft.ecrec.two_phase_commit and ft.ecrec.commit == "deltaLog"


def evaluate(client: PSClient, batches: Iterable, device: str = "cpu") -> dict:
    """AUC and log-loss of the model currently on the servers over `batches` (the held-out split)."""
    from ecrec.model import load_dense_

    ctx = client.ctx
    model = ctx.model.build().to(device).eval()
    load_dense_(model, client.pull_dense())
    labels, probs = [], []
    offsets = ctx.table_offsets
    with torch.no_grad():
        for b in batches:
            g = (b.ids + offsets).reshape(-1)
            uniq, inv = torch.unique(g, return_inverse=True)
            rows = client.pull_rows(uniq)
            sparse = rows[inv].view(b.ids.shape[0], b.ids.shape[1], ctx.dim).to(device)
            logits = model(b.dense.to(device), sparse)
            probs.append(torch.sigmoid(logits).cpu())
            labels.append(b.labels)
    y, p = torch.cat(labels), torch.cat(probs)
    return {"auc": round(auc(y, p), 6), "logloss": round(logloss(y, p), 6), "samples": int(y.numel())}
