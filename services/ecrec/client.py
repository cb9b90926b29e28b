"""Client side of the parameter servers: the cluster map, calls and their fan-out, and model reads.

Used by workers (training), the launcher (evaluation, `params_sha256`, the parity check) and benchmarks.
Requests to different servers go out concurrently on a thread pool; tensors are sent as raw bytes. With ECRec
the client follows the cluster map: rows of a failed shard are read from their parity servers (degraded
reads). Updates: without ECRec, `push_rows` / `push_dense`; with it, `apply_update`, whose two-phase commit
lives in `ecrec.updater` (which drives this client's calls and map); retry rules in `ecrec.retries`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import torch

from ecrec import auth, rest
from ecrec.core.update import MapView
from ecrec.evaluation import auc, logloss
from ecrec.jobctx import JobContext
from ecrec.metrics import Metrics, latency_snapshot
from ecrec.proto import ecrec_pb2 as pb
from ecrec.proto import ecrec_pb2_grpc as pb_grpc
from ecrec.retries import RETRYABLE, UNREACHABLE, Retries, ServerUnavailable
from ecrec.server import GRPC_OPTIONS
from ecrec.streams import StreamPool
from ecrec.updater import UpdateDriver
from ecrec.wire import bytes_to_floats, floats_to_bytes, ids_to_bytes

log = logging.getLogger("ecrec.client")
READ_PAGE_ROWS = 1 << 18


@dataclass
class Pending:
    """RPCs in flight; `wait()` returns their responses or raises ServerUnavailable for the first failure."""

    calls: list[tuple[int, str, Future]]
    client: PSClient

    def wait(self, timeout: float | None = None) -> list:
        return [self.client._result(shard, method, fut, timeout) for shard, method, fut in self.calls]


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
        self.coordinator = coordinator.rstrip("/")
        self.http = rest.client(timeout=15.0, token=ctx.token) if coordinator else None
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
        self._map_lock = threading.Lock()  # the training thread and the update thread both adopt maps
        # Enough threads for the training thread's pulls and the update thread's fan-out at once.
        self._pool = ThreadPoolExecutor(max_workers=4 * ctx.num_servers + 4, thread_name_prefix="rpc")
        self.updates = UpdateDriver(self)  # before the first map: adopting one may flush its decisions
        self.update_cluster(cluster)

    @classmethod
    def from_coordinator(cls, ctx: JobContext, url: str, **kw) -> PSClient:
        r = rest.get(f"{url.rstrip('/')}/cluster", timeout=5.0)
        r.raise_for_status()
        return cls(ctx, r.json(), coordinator=url, **kw)

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
        if self.http is not None:
            with self._no_coordinator("reading the cluster map"):
                r = self.http.get(f"{self.coordinator}/cluster")
                r.raise_for_status()
                self.update_cluster(r.json())

    def report_failure(self, shard: int) -> None:
        """Tell the coordinator we could not reach `shard`; it probes, and we adopt the resulting map."""
        if self.http is None:
            raise RuntimeError(f"server {shard} is unreachable and this client has no coordinator")
        with self._no_coordinator(f"reporting server {shard} unreachable"):
            r = self.http.post(f"{self.coordinator}/v1/failures", json={"shard": shard, "reporter": "client"})
            r.raise_for_status()
            self.update_cluster(r.json()["cluster"])

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
        if self.http is not None:
            self.http.close()

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

    def _result(self, shard: int, method: str, fut: Future, timeout: float | None = None):
        try:
            return fut.result(timeout=timeout)
        except grpc.RpcError as e:
            self.metrics.of(self.metrics.rpc_errors, method=method, code=e.code().name).inc()
            raise ServerUnavailable(shard, e) from e

    @property
    def ft(self) -> bool:
        return self.ctx.ecrec and self.http is not None

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
        )
        while True:
            calls, wanted, orphaned, retry_chunks = [], {}, False, []
            for c in chunks:
                targets = self.dense_targets(c)
                if not targets:
                    orphaned = True
                    # Both replicas lost: more than this job can rebuild. The coordinator fails the job
                    # and names the shards; until it does (or a replacement comes), wait like any refusal.
                    retries.note(-1, "Pull", f"dense chunk {c} has no live replica")
                    retry_chunks.append(c)
                    continue
                wanted.setdefault(targets[0], []).append(c)
            rows_at: dict[int, torch.Tensor] = {}
            for s, pos, _local in ctx.placement.group_by_shard(g[todo]):
                pos = todo[pos]
                if self.ft and self.failed(s):  # degraded read at the parity servers
                    pservers, _idx = ctx.placement.parity_of(s, ctx.placement.local_row(g[pos]))
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
        holders = [h for h in self.ctx.dense_holders(chunk) if not (self.ft and self.failed(h))]
        return sorted(holders, key=lambda h: self.states.get(h) != "up")

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

    # -- whole records ---------------------------------------------------------------------------------
    def read_records(self, shard: int, kind: int, chunk: int = 0) -> torch.Tensor:
        pages, start, width = [], 0, self.ctx.record_width
        while True:
            req = pb.ReadRecordsRequest(
                epoch=self.epoch, kind=kind, start=start, count=READ_PAGE_ROWS, chunk=chunk
            )
            resp = self._result(shard, "ReadRecords", self.call(shard, "ReadRecords", req))
            width = resp.width or width
            if resp.count:
                pages.append(
                    torch.frombuffer(resp.records, dtype=torch.float32).view(resp.count, resp.width).clone()
                )
            start += resp.count
            if resp.count < READ_PAGE_ROWS:
                break
        return torch.cat(pages) if pages else torch.empty(0, width)

    def all_row_records(self) -> torch.Tensor:
        """Every embedding row record in global row order: [G, W]."""
        ctx, p = self.ctx, self.ctx.placement
        n = ctx.num_servers
        per = -(-p.num_rows // n)
        full = torch.zeros(per * n, ctx.record_width, dtype=torch.float32)
        grid = full.view(per, n, ctx.record_width)
        for s in range(n):
            recs = self.read_records(s, pb.DATA)
            grid[: recs.shape[0], s] = recs
        return full[: p.num_rows]

    def all_dense_records(self) -> torch.Tensor:
        """Dense-parameter records (param + optimizer state per scalar) in parameter order: [D, Wd]."""
        ctx = self.ctx
        return torch.cat(
            [self.read_records(self.dense_targets(c)[0], pb.DENSE, c) for c in range(ctx.num_servers)]
        )

    def params_sha256(self) -> str:
        """Hash of the whole logical model, independent of the number of servers and of placement."""
        h = hashlib.sha256()
        for t in (self.all_row_records(), self.all_dense_records()):
            h.update(t.contiguous().numpy().data)
        return h.hexdigest()

    def dense_replica_mismatches(self) -> int:
        """Dense chunks whose two replicas differ (0 in deterministic mode, where updates are ordered)."""
        bad = 0
        for c in range(self.ctx.num_servers):
            holders = self.dense_targets(c)
            if len(holders) == 2:
                a, b = (self.read_records(h, pb.DENSE, c) for h in holders)
                bad += int(not torch.equal(a.view(torch.int32), b.view(torch.int32)))
        return bad

    def staged_counts(self) -> list[int]:
        """Undecided 2PC state per server (0 everywhere once the job is quiet)."""
        return [
            int(self.stubs[s].Info(pb.InfoRequest(), timeout=self.timeout).staged)
            for s in range(self.ctx.num_servers)
        ]

    def read_versions(self, server: int, kind: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All records of one kind on a server with their versions (DATA: [n]; PARITY: pver [n, k])."""
        recs, vers = [], []
        for lo in range(0, n, READ_PAGE_ROWS):
            index = torch.arange(lo, min(n, lo + READ_PAGE_ROWS))
            req = pb.ReadRowsRequest(epoch=self.epoch, kind=kind, index=ids_to_bytes(index), src=-1)
            resp = self._result(server, "ReadRows", self.call(server, "ReadRows", req))
            recs.append(torch.frombuffer(resp.records, dtype=torch.float32).view(index.numel(), -1).clone())
            vers.append(torch.frombuffer(resp.versions, dtype=torch.int64).view(index.numel(), -1).clone())
        if not recs:
            return torch.empty(0, self.ctx.record_width), torch.empty(0, 1, dtype=torch.int64)
        return torch.cat(recs), torch.cat(vers)

    def parity_check(self, rounds: int = 5) -> dict:
        """Invariant I1: every parity record equals the encoding of its stripe's members, entries and optimizer
        state (bit-exact for xor). Works on a running job: a stripe whose member versions differ from those its
        parity reflects has a commit in flight and is checked again in the next round."""
        from ecrec.core.codes import make_code

        ctx, p = self.ctx, self.ctx.placement
        if any(self.failed(s) or self.states.get(s) == "recovering" for s in range(ctx.num_servers)):
            raise RuntimeError("parity check needs every server up (a shard is failed or recovering)")
        code = make_code(ctx.spec.fault_tolerance.ecrec.code)
        pending = {s: None for s in range(ctx.num_servers)}  # parity server -> indices still to check
        stripes = mismatches = 0
        for _round in range(rounds):
            data = [self.read_versions(s, pb.DATA, p.rows_on(s)) for s in range(ctx.num_servers)]
            for server in list(pending):
                parity, pver = self.read_versions(server, pb.PARITY, p.parity_rows_on(server))
                index = pending[server] if pending[server] is not None else torch.arange(parity.shape[0])
                shards, locs, present = p.stripe_members(server, index)
                members = torch.zeros(p.k, index.numel(), ctx.record_width)
                mvers = torch.zeros(index.numel(), p.k, dtype=torch.int64)
                for s in shards.unique().tolist():
                    sel = present & (shards == s)
                    ri, sj = sel.nonzero(as_tuple=True)
                    members[sj, ri] = data[s][0][locs[ri, sj]]
                    mvers[ri, sj] = data[s][1][locs[ri, sj]].view(-1)
                settled = (mvers == pver[index]).all(dim=1)
                expected = code.encode(members)
                got = parity[index]
                if code.name == "xor":
                    ok = (expected.view(torch.int32) == got.view(torch.int32)).all(dim=1)
                else:
                    ok = torch.isclose(expected, got, rtol=1e-4, atol=1e-5).all(dim=1)
                stripes += int(settled.sum())
                mismatches += int((settled & ~ok).sum())
                if bool(settled.all()):
                    del pending[server]
                else:
                    pending[server] = index[~settled]
            if not pending:
                break
            time.sleep(0.05)
        in_flight = sum(v.numel() for v in pending.values() if v is not None)
        self.metrics.of(self.metrics.parity_checks, result="ok").inc(stripes - mismatches)
        self.metrics.of(self.metrics.parity_checks, result="mismatch").inc(mismatches)
        result = {"stripes": stripes, "mismatches": mismatches, "in_flight": in_flight}
        if self.http is not None:  # the coordinator exports the result (ecrec_parity_check_*)
            with self._no_coordinator("reporting the parity check"):
                self.http.post(f"{self.coordinator}/v1/parity-checks", json=result).raise_for_status()
        return result


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
