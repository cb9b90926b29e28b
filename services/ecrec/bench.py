"""Benchmarks (`ecrec bench ...`). Results are ratios measured in one run; see docs/benchmarks.md."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from ecrec.jobctx import JobContext
from ecrec.local import _die_with_parent, free_port, machine_description
from ecrec.proto import ecrec_pb2 as pb
from ecrec.proto import ecrec_pb2_grpc as pb_grpc
from ecrec.server import GRPC_OPTIONS
from ecrec.spec import job_from_dict
from ecrec.store import ShardStore
from ecrec.wire import floats_to_bytes, ids_to_bytes


def _bench_ctx(rows: int, dim: int, optimizer: str) -> JobContext:
    doc = {
        "metadata": {"name": "bench-server"},
        "apiVersion": "ecrec.dev/v1alpha1",
        "kind": "ECRecJob",
        "spec": {
            "model": {"tableSizes": [rows], "embeddingDim": dim, "bottomMlp": [dim], "topMlp": [1]},
            "training": {"optimizer": optimizer},
            "servers": {"replicas": 1},
        },
    }
    return JobContext(job_from_dict(doc))


def _rate(fn, batch: int, seconds: float) -> float:
    """Rows per second of `fn` (one call = `batch` rows), median of 5 timed rounds of ~seconds/5 each."""
    fn()  # warm-up
    rates = []
    for _ in range(5):
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / 5:
            fn()
            n += 1
        rates.append(n * batch / elapsed)
    return statistics.median(rates)


def _cycler(pool: list[torch.Tensor]):
    state = {"i": 0}

    def pick() -> torch.Tensor:
        state["i"] += 1
        return pool[state["i"] % len(pool)]

    return pick


def bench_server(rows: int, dim: int, optimizer: str, batches: list[int], seconds: float) -> list[dict]:
    torch.set_num_threads(1)
    ctx = _bench_ctx(rows, dim, optimizer)
    with tempfile.TemporaryDirectory() as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(ctx.to_json())
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ecrec.server",
                "--job",
                str(job_file),
                "--shard",
                "0",
                "--standalone",
                "--bind",
                f"127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        try:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = pb_grpc.ParameterServerStub(channel)
            stub.Info(pb.InfoRequest(), wait_for_ready=True, timeout=120)
            store = ShardStore(ctx, 0)  # the same tables and optimizer, in this process
            results = []
            gen = torch.Generator().manual_seed(0)
            for b in batches:
                pool = [torch.randperm(rows, generator=gen)[:b] for _ in range(4)]
                grads = torch.randn(b, dim, generator=gen) * 1e-3
                pick = _cycler(pool)

                def grpc_pull(pick=pick) -> None:
                    resp = stub.Pull(pb.PullRequest(ids=ids_to_bytes(pick())))
                    torch.frombuffer(resp.rows, dtype=torch.float32).view(-1, dim)

                def grpc_push(pick=pick, grads=grads) -> None:
                    stub.Push(pb.PushRequest(ids=ids_to_bytes(pick()), grads=floats_to_bytes(grads)))

                row = {
                    "batch": b,
                    "pull_grpc": _rate(grpc_pull, b, seconds),
                    "pull_inproc": _rate(lambda pick=pick: store.pull(pick()), b, seconds),
                    "push_grpc": _rate(grpc_push, b, seconds),
                    "push_inproc": _rate(
                        lambda pick=pick, grads=grads: store.push(pick(), grads), b, seconds
                    ),
                }
                results.append(row)
            channel.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    print(
        f"# ecrec bench server: {rows:,} rows x dim {dim}, optimizer {optimizer}, record width "
        f"{ctx.record_width} floats"
    )
    print(f"# machine: {machine_description()}")
    print(
        "| batch rows | pull gRPC rows/s | pull in-process rows/s | pull ratio | push gRPC rows/s | "
        "push in-process rows/s | push ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['batch']:,} | {r['pull_grpc']:,.0f} | {r['pull_inproc']:,.0f} | "
            f"{r['pull_grpc'] / r['pull_inproc']:.2f} | {r['push_grpc']:,.0f} | {r['push_inproc']:,.0f} | "
            f"{r['push_grpc'] / r['push_inproc']:.2f} |"
        )
    return results


# ---------------------------------------------------------------------------------------------------------
# Whole-job benchmarks: ECRec's overhead in normal operation and its behaviour through a failure.


def steady_rate(report: dict, start: float = 2.0, end: float | None = None) -> float:
    """Median samples/s of the throughput series within [start, end) seconds (skips the warm-up ramp)."""
    vals = [r for t, r in report["throughput_series"] if t >= start and (end is None or t < end)]
    return statistics.median(vals) if vals else float("nan")  # a window shorter than one sample


TRAINING_RPCS = (
    "Pull",
    "PullDense",
    "Push",
    "PushDense",
    "Stage",
    "StageDeltas",
    "Commit",
    "DecideMany",
    "Abort",
    "Delta",
    "DecideDeltas",
    "Outcome",
)


def rpcs_per_step(report: dict) -> float:
    """Training RPCs the servers served per worker step (worker -> server and server -> server)."""
    spec = report["spec"]
    steps = spec["training"]["steps"] * spec["workers"]["replicas"]
    served = report.get("rpcs_served", {})
    return sum(served.get(m, 0) for m in TRAINING_RPCS) / steps if steps else float("nan")


def _run(ctx: JobContext, out: Path, **kw) -> dict:
    from ecrec.local import run_local

    return run_local(ctx, out, progress=False, **kw)


OVERHEAD_CASES = [
    ("No FT", ["faultTolerance.strategy=none"]),
    ("ECRec k=2", ["faultTolerance.strategy=ecrec", "faultTolerance.ecrec.k=2"]),
    ("ECRec k=4", ["faultTolerance.strategy=ecrec", "faultTolerance.ecrec.k=4"]),
    (
        "ECRec k=4, no 2PC",
        [
            "faultTolerance.strategy=ecrec",
            "faultTolerance.ecrec.k=4",
            "faultTolerance.ecrec.twoPhaseCommit=false",
        ],
    ),
    (
        "ECRec k=4, no dense replication",
        [
            "faultTolerance.strategy=ecrec",
            "faultTolerance.ecrec.k=4",
            "faultTolerance.ecrec.replicateDense=false",
        ],
    ),
]


def bench_overhead(job: str, steps: int, sets: list[str], out_dir: Path) -> list[dict]:
    rows = []
    for label, case in OVERHEAD_CASES:
        ctx = JobContext(load_job_with(job, [*sets, f"training.steps={steps}", *case]))
        report = _run(ctx, out_dir / label.replace(" ", "_").replace(",", "").replace("=", ""))
        rows.append(
            {
                "case": label,
                "mean": report["samples_per_s"],
                "steady": steady_rate(report),
                "elapsed_s": report["elapsed_s"],
                "auc": report["eval"]["auc"],
                "rpcs_per_step": rpcs_per_step(report),
            }
        )
        print(
            f"  {label}: mean {report['samples_per_s']:,.0f} samples/s, steady {rows[-1]['steady']:,.0f}",
            flush=True,
        )
    base = rows[0]
    print(f"# ecrec bench overhead: {job} {' '.join(sets)} steps={steps}")
    print(f"# machine: {machine_description()}")
    print(
        "| configuration | mean samples/s | steady samples/s | throughput vs No FT (steady) | "
        "training-time overhead | server RPCs per worker step | eval AUC |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["steady"] / base["steady"] if base["steady"] else float("nan")
        over = r["elapsed_s"] / base["elapsed_s"] - 1
        print(
            f"| {r['case']} | {r['mean']:,.0f} | {r['steady']:,.0f} | {ratio:.2f} | {over:+.1%} | "
            f"{r['rpcs_per_step']:.1f} | {r['auc']:.4f} |"
        )
    return rows


def _ratio(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.2f}"


def load_job_with(path: str, overrides: list[str]):
    from ecrec.spec import load_job

    return load_job(path, overrides)


def bench_recovery(
    job: str, scales: list[int], groups: list[int], kill_at: float, steps: int, sets: list[str], out_dir: Path
) -> list[dict]:
    rows = []
    for scale in scales:
        for group in groups:
            ctx = JobContext(
                load_job_with(
                    job,
                    [
                        *sets,
                        f"model.scale={scale}",
                        f"training.steps={steps}",
                        "faultTolerance.strategy=ecrec",
                        f"faultTolerance.ecrec.lockGroupRows={group}",
                    ],
                )
            )
            report = _run(ctx, out_dir / f"scale{scale}_group{group}", kills=[(2, kill_at)])
            (rec,) = report["recoveries"]
            started = next(e["t"] for e in report["events"] if e["kind"] == "recovery_started")
            normal = steady_rate(report, 2.0, rec["killed_at"])
            during = steady_rate(report, rec["detected_at"], rec["completed_at"])
            rebuild = steady_rate(report, started, rec["completed_at"])
            row = {
                "scale": scale,
                "rows": ctx.model.num_rows,
                "group": group,
                "continue_s": rec["continued_at"] - rec["killed_at"],
                "full_s": rec["completed_at"] - rec["killed_at"],
                "rebuild_s": rec["completed_at"] - started,
                "rows_recovered": rec["rows_recovered"],
                "normal": normal,
                "during_ratio": during / normal if normal else float("nan"),
                "rebuild_ratio": rebuild / normal if normal else float("nan"),
                "parity_mismatches": report["parity_check"]["mismatches"],
            }
            rows.append(row)
            print(
                f"  scale {scale} group {group}: continue {row['continue_s']:.2f}s, full {row['full_s']:.1f}s "
                f"(rebuild {row['rebuild_s']:.2f}s), during/normal {row['during_ratio']:.2f}",
                flush=True,
            )
    print(f"# ecrec bench recovery: {job} {' '.join(sets)}, server 2 SIGKILLed at {kill_at}s")
    print(f"# machine: {machine_description()}")
    print(
        "| model rows | lock group rows | time to continue | time to full recovery | of which rebuild | "
        "rows rebuilt | throughput kill→recovered / normal | throughput while rebuilding / normal | "
        "parity mismatches |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['rows']:,} | {r['group']:,} | {r['continue_s']:.2f} s | {r['full_s']:.1f} s | "
            f"{r['rebuild_s']:.2f} s | {r['rows_recovered']:,} | {r['during_ratio']:.2f} | "
            f"{_ratio(r['rebuild_ratio'])} | {r['parity_mismatches']} |"
        )
    return rows
