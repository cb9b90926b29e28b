"""`ecrec bench handlers`: where a worker step's CPU goes in the code itself, without gRPC or other processes.

One process holds every server's store and servicer; a real `PSClient` drives real worker steps (pull, then the
strategy's update) through stubs that call the servicers directly. Measured with the thread's own CPU clock:
each servicer method (the whole handler: validation, store, protobuf answer), and the client's Python work
(process CPU minus the handlers'). What this leaves out — gRPC's per-call machinery, the model's forward and
backward, contention between processes — is what `ecrec bench overhead` measures whole; together they say how
much of ECRec's cost is our code and how much is the messages.

`--workers W` runs W clients, each step in an order shuffled anew (seeded): a live job's workers reach the
servers in no fixed order, so a parity server gets some of a row's deltas ahead of their predecessor and holds
them (docs/benchmarks.md, "Deliveries riding") — a cost one worker never causes. The "delta batches held"
column counts it.
"""

from __future__ import annotations

import contextlib
import random
import resource
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ecrec.bench import Column, emit_table, load_job_with
from ecrec.client import PSClient
from ecrec.jobctx import JobContext
from ecrec.metrics import Metrics
from ecrec.server import ClusterView, ParameterServicer
from ecrec.store import ShardStore
from ecrec.worker import data_source

CASES = [
    ("No FT", ["faultTolerance.strategy=none"]),
    ("ECRec k=2", ["faultTolerance.strategy=ecrec", "faultTolerance.ecrec.k=2"]),
    ("ECRec k=4", ["faultTolerance.strategy=ecrec", "faultTolerance.ecrec.k=4"]),
    (
        "ECRec k=4 rowLocks",
        ["faultTolerance.strategy=ecrec", "faultTolerance.ecrec.k=4", "faultTolerance.ecrec.commit=rowLocks"],
    ),
]
WARMUP = 10


class _Context:
    """The grpc.ServicerContext a handler sees: no deadline, never cancelled; an abort raises."""

    def time_remaining(self):
        return None

    def is_active(self) -> bool:
        return True

    def abort(self, code, details):
        raise RuntimeError(f"{code.name}: {details}")


class _Stub:
    """A server stub whose calls run the servicer's method in this thread, timed per method.

    Handlers run one at a time (`one_at_a_time`, shared by every stub): the client's fan-out would otherwise
    run five servers' handlers at once on one interpreter, and each torch op's release and re-take of the GIL
    then roughly doubles every handler's CPU (measured: ECRec k=4 10.4 vs 5.3 ms per step) — a cost the real
    servers, each its own process, do not pay. (What they do pay, contention between one server's concurrent
    handlers and gRPC's threads, is `ecrec bench overhead`'s to measure.)"""

    def __init__(
        self, servicer: ParameterServicer, cpu: Counter, calls: Counter, one_at_a_time: threading.Lock
    ):
        self._servicer, self._cpu, self._calls, self._lock = servicer, cpu, calls, one_at_a_time

    def run_concurrently(self) -> None:
        """From now on the handlers run as they are called, at once (closing clients together needs that)."""
        self._lock = contextlib.nullcontext()

    def __getattr__(self, method: str):
        handler, context = getattr(self._servicer, method), _Context()

        def call(request, timeout=None, metadata=None):
            with self._lock:
                start = time.thread_time()
                try:
                    return handler(request, context)
                finally:
                    self._cpu[method] += time.thread_time() - start
                    self._calls[method] += 1

        return call


def _process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(ctx: JobContext, steps: int, workers: int = 1) -> dict:
    """Handler CPU per method and client CPU, per worker step, over `steps` steps of each of `workers`
    clients (each step's order shuffled) after a warm-up; and the delta batches parity servers held."""
    n = ctx.num_servers
    cluster = {
        "epoch": 1,
        "shards": [
            {"shard": s, "state": "up", "address": f"in-process:{s}", "incarnation": 1, "instance": f"s{s}"}
            for s in range(n)
        ],
    }
    cpu, calls, one_at_a_time = Counter(), Counter(), threading.Lock()
    stubs, stores = {}, []
    for s in range(n):
        stores.append(ShardStore(ctx, s))
        servicer = ParameterServicer(
            stores[-1], Metrics(ctx.name, "server", str(s)), ClusterView(snapshot=cluster), epoch=1
        )
        stubs[s] = _Stub(servicer, cpu, calls, one_at_a_time)
    # A coordinator address makes the client run the fault-tolerant path; nothing here fails, so it is never
    # called.
    clients = [
        PSClient(ctx, cluster, coordinator="http://127.0.0.1:9" if ctx.ecrec else "") for _ in range(workers)
    ]
    held = {"delivered": 0, "held": 0}
    try:
        for client in clients:
            for s in range(n):
                client.stubs[s] = client.streams[s].stub = stubs[s]
        data, batch_size = data_source(ctx), ctx.spec.training.batch_size
        gen, order = torch.Generator().manual_seed(0), random.Random(0)
        start_cpu = 0.0
        for step in range(WARMUP + steps):
            if step == WARMUP:
                cpu.clear()
                calls.clear()
                held = _held(stores)
                start_cpu = _process_cpu()
            for rank in order.sample(range(workers), workers):
                _step(
                    ctx, clients[rank], data.batch(step * workers + rank, batch_size), f"w{rank}-{step}", gen
                )
        total = _process_cpu() - start_cpu
        held = {k: v - held[k] for k, v in _held(stores).items()}
        cpu, calls = Counter(cpu), Counter(calls)  # what the steps cost, not what closing the clients does
    finally:
        _close(clients, stubs.values())
    handlers, worker_steps = sum(cpu.values()), steps * workers
    return {
        "workers": workers,
        "handlers_ms": 1e3 * handlers / worker_steps,
        "client_ms": 1e3 * max(0.0, total - handlers) / worker_steps,
        "delta_batches": held,
        "methods": {
            m: {"us_per_call": 1e6 * cpu[m] / calls[m], "calls_per_step": calls[m] / worker_steps}
            for m in cpu
        },
    }


def _step(ctx: JobContext, client: PSClient, batch, txn: str, gen: torch.Generator) -> None:
    """One worker step's messages: the pull, then the strategy's update (random gradients: no model)."""
    uniq = torch.unique((batch.ids + ctx.table_offsets).reshape(-1))
    client.pull(uniq)
    grads = torch.randn(uniq.numel(), ctx.dim, generator=gen) * 0.01
    dense = torch.randn(ctx.dense_numel, generator=gen) * 0.01
    if ctx.ecrec:
        client.apply_update(txn, uniq, grads, dense)
    else:
        client.push_rows(uniq, grads, txn).wait()
        client.push_dense(dense, txn).wait()


def _close(clients: list[PSClient], stubs: Iterable[_Stub]) -> None:
    """Close the clients together, their handlers no longer one at a time: a client's last deltas go out as it
    closes, and may wait at a parity server for a predecessor that another closing client brings."""
    for stub in stubs:
        stub.run_concurrently()
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        for done in [pool.submit(c.close) for c in clients]:
            done.result()


def _held(stores: list[ShardStore]) -> dict[str, int]:
    """Delta batches the parity servers took so far, and of those the ones with rows held for a predecessor."""
    return {
        "delivered": sum(st.stats["deltas_delivered"] for st in stores),
        "held": sum(st.stats["deltas_held"] for st in stores),
    }


def bench_handlers(
    job: str, steps: int, sets: list[str], out_dir: Path | None, workers: int = 1
) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a server runs (servers.threads: 1)
    rows = []
    try:
        for label, case in CASES:
            ctx = JobContext(load_job_with(job, [*sets, *case]))
            rows.append({"case": label, **measure(ctx, steps, workers)})
    finally:
        torch.set_num_threads(threads)
    for r in rows:
        per = ", ".join(
            f"{m} {v['us_per_call']:.0f} us x {v['calls_per_step']:.1f}"
            for m, v in sorted(r["methods"].items(), key=lambda kv: -kv[1]["us_per_call"])
        )
        print(f"  {r['case']}: {per}", flush=True)
    base = rows[0]
    columns = [
        Column("configuration", lambda r: r["case"]),
        Column("handler CPU ms / step", lambda r: round(r["handlers_ms"], 3), "{:.2f}"),
        Column("client CPU ms / step", lambda r: round(r["client_ms"], 3), "{:.2f}"),
        Column(
            "handler CPU vs No FT",
            lambda r: round(r["handlers_ms"] / base["handlers_ms"], 3),
            "{:.2f}",
        ),
        Column("RPCs / step", lambda r: round(sum(v["calls_per_step"] for v in r["methods"].values()), 2)),
        Column("delta batches held", lambda r: _held_share(r["delta_batches"]), "{:.0%}"),
        Column(
            "slowest handler",
            lambda r: max(r["methods"].items(), key=lambda kv: kv[1]["us_per_call"])[0],
        ),
        Column(
            "its us / call",
            lambda r: round(max(v["us_per_call"] for v in r["methods"].values())),
            "{:,}",
        ),
    ]
    title = f"# ecrec bench handlers: {job} {' '.join(sets)} steps={steps} workers={workers}"
    emit_table(title, columns, rows, out_dir)
    return rows


def _held_share(batches: dict[str, int]) -> float:
    """Of the delta batches parity servers took, the share with rows held for a predecessor (0 without any)."""
    return batches["held"] / batches["delivered"] if batches["delivered"] else 0.0
