"""Stray requests against a live job: randomized malformed, stale and misrouted calls to every gRPC method of
every server and every mutating REST endpoint of the coordinator.

A request a server or the coordinator cannot fit to its current state must be refused and change nothing
(issue "one stray request stops a whole job"). The fuzzer makes requests that are wrong in at least one way
— bytes of the wrong length, ids out of range or owned by another shard, junk or misaddressed txn ids, shard
and chunk ids out of range, epochs ahead of the coordinator, recoveries of healthy shards, progress from a
process that is not the registered worker — and counts the answers. It never sends a request that is right in
every field (a well-formed update would be a real update, not a stray one). The test and `ecrec bench fuzz`
run a deterministic job with and without it and require bit-identical parameters and exact parity.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable

import grpc
import httpx
import torch

from ecrec import auth
from ecrec.coordinator import contract as api
from ecrec.coordinator.client import CoordinatorClient
from ecrec.grpcopts import GRPC_OPTIONS
from ecrec.jobctx import JobContext
from ecrec.proto import ecrec_pb2 as pb
from ecrec.proto import ecrec_pb2_grpc as pb_grpc
from ecrec.wire import floats_to_bytes, ids_to_bytes

GRPC_METHODS = (
    "Pull",
    "Push",
    "PushDense",
    "ReadRecords",
    "Stage",
    "Commit",
    "Abort",
    "Delta",
    "DecideDeltas",
    "StageDeltas",
    "DecideMany",
    "Outcome",
    "ReadRows",
    "ReadMany",
    "DegradedPull",
    "Recover",
    "CopyDense",
)
REST_ENDPOINTS = (
    api.SERVERS_REGISTER,
    api.SERVERS_HEARTBEAT,
    api.FAILURES,
    api.WORKERS_REGISTER,
    api.WORKERS_PROGRESS,
    api.WORKERS_LOST,
    api.EVENTS,
    api.RECOVERIES,
    api.SPARES_REGISTER,
    api.SPARES_HEARTBEAT,
)


class Fuzzer:
    def __init__(self, ctx: JobContext, coordinator: str, seed: int = 0, timeout: float = 1.0):
        self.ctx, self.timeout = ctx, timeout
        self.rng = random.Random(seed)
        # Its bodies are malformed on purpose: they go raw, over the client's connection (`http`, `url`).
        self.coordinator = CoordinatorClient(coordinator, token=ctx.token, timeout=10.0)
        self.stubs: dict[str, pb_grpc.ParameterServerStub] = {}
        self.channels: list[grpc.Channel] = []
        self.answers: Counter[tuple[str, str]] = Counter()  # (method or endpoint, status) -> count
        self.cluster = self.coordinator.cluster()

    # -- pieces of requests --------------------------------------------------------------------------------
    def _stub(self, shard: int) -> pb_grpc.ParameterServerStub:
        addr = self.cluster["shards"][shard]["address"]
        if addr not in self.stubs:
            ch = auth.channel(addr, self.ctx.token, options=GRPC_OPTIONS)
            self.channels.append(ch)
            self.stubs[addr] = pb_grpc.ParameterServerStub(ch)
        return self.stubs[addr]

    def _epoch(self) -> int:
        e = int(self.cluster["epoch"])
        return self.rng.choice([0, e, e + self.rng.randint(1, 5), 2**40, max(1, e - 1)])

    def _shard_id(self) -> int:
        return self.rng.choice(
            [-7, -1, self.ctx.num_servers, self.ctx.num_servers + 9, *range(self.ctx.num_servers)]
        )

    def _read(self, epoch: int) -> pb.ReadRowsRequest:
        r = self.rng
        return pb.ReadRowsRequest(
            epoch=epoch,
            kind=r.choice([0, 1, 2, 9]),
            index=ids_to_bytes(torch.randint(-3, 50, (r.randint(0, 8),))),
            src=self._shard_id(),
        )

    def _ids(self, shard: int, bad: bool) -> bytes:
        """Global row ids: owned by `shard` unless `bad`, then out of range, another shard's, duplicated, or not
        int64 at all."""
        p = self.ctx.placement
        n = self.rng.randint(1, 16)
        local = torch.randint(0, max(1, p.rows_on(shard)), (n,)).unique()
        g = p.global_id(shard, local)
        if not bad:
            return ids_to_bytes(g)
        how = self.rng.randrange(5)
        if how == 0:
            return ids_to_bytes(g + p.num_rows * 7)
        if how == 1:
            return ids_to_bytes(g + 1)  # the next shard's rows
        if how == 2:
            return ids_to_bytes(torch.cat([g, g]))
        if how == 3:
            return ids_to_bytes(-g - 1)
        return bytes(self.rng.randrange(256) for _ in range(self.rng.choice([3, 7, 13])))

    def _floats(self, n: int, width: int, bad: bool) -> bytes:
        if not bad:
            return floats_to_bytes(torch.randn(n, width))
        if self.rng.random() < 0.5:
            return floats_to_bytes(torch.full((n, width), float("nan")))
        return floats_to_bytes(torch.randn(max(0, n * width + self.rng.choice([-1, 1, 5])), 1))

    def _txn(self, target: int | None = None) -> str:
        """A txn id no worker will ever use: malformed, or of the worker-step form under a step name workers
        do not have ("z..."), possibly addressed to another server."""
        t = self.rng.randrange(self.ctx.num_servers) if target is None else target
        return self.rng.choice(
            [
                "",
                "junk",
                f"z{self.rng.randrange(9)}-{self.rng.randrange(10**6)}/{t}.-1.{self.rng.randrange(9)}",
                f"z1-2/{t}.{self._shard_id()}.0",
                f"w0-1/{t}.-1",
                "x" * 300,
                f"w0-{self.rng.randrange(10**4)}/{self.ctx.num_servers + 3}.-1.0",
            ]
        )

    def _delta(self, shard: int, bad: bool) -> pb.DeltaRequest:
        k, w = self.ctx.placement.k, self.ctx.record_width
        n = self.rng.randint(1, 6)
        return pb.DeltaRequest(
            epoch=self._epoch(),
            txn=self._txn(),
            src=self._shard_id(),
            index=ids_to_bytes(torch.randint(-2, self.ctx.placement.parity_rows_on(shard) + 3, (n,))),
            slot=ids_to_bytes(torch.randint(-1, k + 2, (n,))),
            delta=self._floats(n, w, bad),
            version=ids_to_bytes(torch.randint(-1, 3, (n,))),
            immediate=self.rng.random() < 0.3,
            parity_server=self.rng.choice([shard, self._shard_id()]),
        )

    # -- one request per method ------------------------------------------------------------------------------
    def _grpc_request(self, method: str, shard: int):
        """A request for `method` at `shard`, wrong in at least one field (or a pure read)."""
        r, ep, dim = self.rng, self._epoch, self.ctx.dim
        bad = r.random() < 0.7
        if method == "Pull":
            chunks = r.choice([[], [shard], [shard, shard], [r.randrange(2**32)]])  # dense chunks too
            warm = r.random() < 0.2  # a read-ahead: rebuilds nothing on a server that is not a replacement
            return pb.PullRequest(epoch=ep(), ids=self._ids(shard, bad), dense_chunks=chunks, warm=warm)
        if method == "Push":
            return pb.PushRequest(epoch=ep(), ids=self._ids(shard, True), grads=self._floats(3, dim, True))
        if method == "PushDense":
            return pb.DensePushRequest(epoch=ep(), chunk=r.randrange(2**32), grads=self._floats(5, 1, True))
        if method == "ReadRecords":
            return pb.ReadRecordsRequest(
                epoch=ep(), kind=r.choice([0, 1, 2, 7]), start=r.choice([0, 2**40]), count=r.randrange(100)
            )
        if method == "Stage":
            # Always wrong somewhere: a txn no worker uses and, mostly, bad ids or grads; a well-formed one at
            # the right server stages rows that are never committed and expire (txnTimeout), changing nothing.
            ids = self._ids(shard, bad)
            return pb.StageRequest(
                epoch=ep(),
                txn=self._txn(r.choice([shard, None])),
                ids=ids,
                grads=self._floats(max(1, len(ids) // 8), dim, bad),
                src=r.choice([-1, self._shard_id()]),
                dense_chunks=r.choice([[], [shard], [shard, shard], [r.randrange(99)]]),
                dense_grads=r.choice([[], [b"\0" * 4]]),
                decisions=[pb.DeltaDecision(txn=self._txn(), src=self._shard_id(), commit=r.random() < 0.5)],
            )
        if method in ("Commit", "Abort", "Outcome"):
            return pb.TxnRequest(epoch=ep(), txn=self._txn(r.choice([shard, None])))
        if method == "Delta":
            return self._delta(shard, bad)
        if method == "StageDeltas":
            return pb.StageDeltasRequest(
                epoch=ep(), batches=[self._delta(shard, bad) for _ in range(r.randint(1, 3))]
            )
        if method == "DecideDeltas":
            return pb.DeltaDecision(
                epoch=ep(), txn=self._txn(), src=self._shard_id(), commit=r.random() < 0.5
            )
        if method == "DecideMany":
            return pb.DecisionsRequest(
                epoch=ep(),
                decisions=[
                    pb.DeltaDecision(txn=self._txn(), src=self._shard_id(), commit=r.random() < 0.5)
                    for _ in range(r.randint(1, 4))
                ],
            )
        if method == "ReadRows":
            return self._read(ep())
        if method == "ReadMany":
            return pb.ReadManyRequest(epoch=ep(), reads=[self._read(ep()) for _ in range(r.randint(0, 3))])
        if method == "DegradedPull":
            return pb.DegradedPullRequest(epoch=ep(), src=self._shard_id(), ids=self._ids(shard, bad))
        if method == "Recover":
            return pb.RecoverRequest(
                epoch=ep(),
                kind=r.choice([0, 1, 2, 5]),
                start=r.choice([0, 5, 2**40]),
                count=r.randrange(2**20),
            )
        if method == "CopyDense":
            return pb.CopyDenseRequest(
                epoch=ep(), chunk=r.choice([shard, (shard + 1) % self.ctx.num_servers, 2**31])
            )
        raise ValueError(method)

    def _rest_request(self, endpoint: str) -> dict | str:
        r = self.rng
        shard = self._shard_id()
        if r.random() < 0.1:
            return "{not json"
        if endpoint == api.SERVERS_REGISTER:
            return {
                "shard": shard,
                "address": r.choice(["127.0.0.1:1", "", "nowhere:0"]),
                "instance": r.choice(["", "fuzz", f"f{r.randrange(10**6)}"]),
                "replacement": r.random() < 0.7,
            }
        if endpoint == api.SERVERS_HEARTBEAT:
            return {"shard": shard, "address": "127.0.0.1:1", "instance": "fuzz", "epoch": 2**40}
        if endpoint == api.FAILURES:
            return {"shard": shard, "reporter": "fuzz"}
        if endpoint in (api.WORKERS_REGISTER, api.WORKERS_LOST):
            return {"rank": r.choice([-1, 0, 1, 99]), "instance": r.choice(["", "fuzz"])}
        if endpoint == api.WORKERS_PROGRESS:
            return {
                "rank": r.choice([-1, 0, 99]),
                "instance": "fuzz",
                "step": r.randrange(10**6),
                "samples": r.randrange(10**9),
                "done": True,
            }
        if endpoint == api.EVENTS:
            return {
                "kind": r.choice(["bogus", "", "x" * 100, "note"]),
                "shard": shard,
                "at": r.choice([None, 1e12]),
            }
        if endpoint == api.RECOVERIES:
            return {"shard": shard}
        if endpoint in (api.SPARES_REGISTER, api.SPARES_HEARTBEAT):
            # a stray spare is kept until its heartbeats stop; one assigned a shard that never takes it
            # over is released after failureTimeoutSeconds (ecrec.core.spares)
            return {
                "instance": r.choice(["", "fuzz", f"f{r.randrange(10**6)}"]),
                "address": r.choice(["127.0.0.1:1", "", "nowhere:0"]),
                "cpuSeconds": r.choice([None, -1.0, 1e300]),
            }
        raise ValueError(endpoint)

    # -- driving -------------------------------------------------------------------------------------------------
    def one(self) -> tuple[str, str]:
        """Send one stray request; returns (what, status)."""
        if self.rng.random() < 0.75:
            method = self.rng.choice(GRPC_METHODS)
            shard = self.rng.randrange(self.ctx.num_servers)
            try:
                req = self._grpc_request(method, shard)
                getattr(self._stub(shard), method)(req, timeout=self.timeout)
                status = "OK"
            except grpc.RpcError as e:
                status = e.code().name
            what = method
        else:
            what = self.rng.choice(REST_ENDPOINTS)
            body = self._rest_request(what)
            http, url = self.coordinator.http, self.coordinator.url + what
            try:
                if isinstance(body, str):
                    resp = http.post(url, content=body, headers={"content-type": "application/json"})
                else:
                    resp = http.post(url, json=body)
                status = str(resp.status_code)
            except httpx.HTTPError as e:
                status = type(e).__name__
        self.answers[(what, status)] += 1
        return what, status

    def run(self, count: int, rate: float = 20.0, stop: threading.Event | None = None) -> Counter:
        """Send `count` stray requests at about `rate` per second (or until `stop` is set)."""
        for _ in range(count):
            if stop is not None and stop.is_set():
                break
            t0 = time.monotonic()
            self.one()
            time.sleep(max(0.0, 1.0 / rate - (time.monotonic() - t0)))
        return self.answers

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        self.coordinator.close()


def fuzz_while_training(
    ctx: JobContext, count: int, seed: int = 0, rate: float = 20.0
) -> tuple[Callable, Callable[[], Counter]]:
    """An `on_tick` hook for run_local that starts a fuzzer thread once training has started, and a function
    that waits for it and returns its answers."""
    state: dict = {}

    stop = threading.Event()

    def on_tick(cluster, status) -> None:
        if status.get("phase") in ("Succeeded", "Failed"):
            stop.set()  # the stray requests are about training; the report's reads come after
        if "thread" in state or status.get("startedAt") is None:
            return
        # The launcher's context carries the job token: these strays come from inside the job (stale or
        # confused processes), which the token cannot keep out; outsiders are refused before any of this.
        fuzzer = Fuzzer(cluster.ctx, cluster.coordinator_url, seed)
        state["fuzzer"] = fuzzer
        state["thread"] = threading.Thread(
            target=fuzzer.run, args=(count, rate, stop), daemon=True, name="fuzz"
        )
        state["thread"].start()

    def answers() -> Counter:
        stop.set()
        if "thread" not in state:
            return Counter()
        state["thread"].join()
        state["fuzzer"].close()
        return state["fuzzer"].answers

    return on_tick, answers


def unexpected(answers: Counter) -> dict[str, int]:
    """Answers no stray request should get: UNKNOWN (an exception escaped), INTERNAL, or a 5xx."""
    bad: dict[str, int] = {}
    for (what, status), n in answers.items():
        if status in ("UNKNOWN", "INTERNAL") or status.startswith("5"):
            bad[f"{what} {status}"] = bad.get(f"{what} {status}", 0) + n
    return bad


def fuzz_job(ctx: JobContext, count: int, seed: int, out_dir, rate: float = 20.0) -> dict:
    """Run the deterministic job twice, undisturbed and under `count` stray requests, and compare: the stray
    requests must change nothing (same params_sha256, exact parity, nothing left staged)."""
    from pathlib import Path

    from ecrec.local import run_local

    if not ctx.spec.training.deterministic:
        raise ValueError("fuzz compares parameter hashes: the job must set training.deterministic")
    out_dir = Path(out_dir)
    base = run_local(ctx, out_dir / "undisturbed", progress=False)
    on_tick, answers = fuzz_while_training(ctx, count, seed, rate)
    fuzzed = run_local(ctx, out_dir / "fuzzed", progress=False, on_tick=on_tick)
    got = answers()
    by_status: Counter = Counter()
    for (_what, status), n in got.items():
        by_status[status] += n
    return {
        "requests": sum(got.values()),
        "answers": dict(sorted(by_status.items())),
        "unexpected": unexpected(got),
        "same_params": fuzzed["params_sha256"] == base["params_sha256"],
        "params_sha256": {"undisturbed": base["params_sha256"], "fuzzed": fuzzed["params_sha256"]},
        "parity_check": fuzzed.get("parity_check"),
        "staged_after": fuzzed.get("staged_after"),
        "elapsed_s": {"undisturbed": base["elapsed_s"], "fuzzed": fuzzed["elapsed_s"]},
    }
