"""Benchmarks (`ecrec bench ...`). Results are ratios measured in one run; see docs/benchmarks.md."""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from ecrec.core.roles import ROLES as CORE_ROLES
from ecrec.forkserver import die_with
from ecrec.grpcopts import GRPC_OPTIONS
from ecrec.jobctx import JobContext
from ecrec.local import free_port, machine_description
from ecrec.proto import ecrec_pb2 as pb
from ecrec.proto import ecrec_pb2_grpc as pb_grpc
from ecrec.spec import job_from_dict
from ecrec.store import ShardStore
from ecrec.streams import StreamPool
from ecrec.wire import floats_to_bytes, ids_to_bytes

# The roles (ecrec.core.roles) in the order of the tables' CPU columns: the costliest first.
ROLES = ("worker", "server", "coordinator")
assert sorted(ROLES) == sorted(CORE_ROLES)


@dataclass(frozen=True)
class Column:
    """One column of a benchmark's table: its header is also its key in summary.json."""

    name: str
    value: Callable[[dict], Any]
    fmt: str = "{}"  # how the printed table shows the value (summary.json keeps the number)


def emit_table(title: str, columns: list[Column], rows: list[dict], out_dir: Path | None) -> list[dict]:
    """Print a benchmark's markdown table under its title and the machine, and write the same rows to
    OUT/summary.json (one object per row, the column headers as keys; NaN as null) for scripts."""
    summary = [{c.name: _number(c.value(r)) for c in columns} for r in rows]
    print(title)
    print(f"# machine: {machine_description()}")
    print("| " + " | ".join(c.name for c in columns) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|")
    for row in summary:
        cells = ("—" if row[c.name] is None else c.fmt.format(row[c.name]) for c in columns)
        print("| " + " | ".join(cells) + " |")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _number(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else v


def _round(x: float, digits: int | None = None) -> float:
    """round() that lets NaN through (a window without samples: printed as —, null in summary.json)."""
    return x if math.isnan(x) else round(x, digits)


def cpu_columns() -> list[Column]:
    """CPU seconds per 1,000 samples trained, by role (the processes' own counters: ecrec.core.cpu)."""
    return [
        Column(f"{role} CPU s / 1k samples", lambda r, role=role: r["cpu"][role], "{:.3f}") for role in ROLES
    ]


def _cpu(report: dict) -> dict[str, float]:
    per = (report.get("cpu") or {}).get("per_1000_samples") or {}
    return {role: float("nan") if per.get(role) is None else per[role] for role in ROLES}


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


def _process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of another process, from /proc; None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_per_call(fn, server_pid: int, seconds: float) -> tuple[float, float]:
    """(this process's, the server's) CPU µs per call of `fn`, over about `seconds` of calls (NaN for the
    server without /proc). The server's clock ticks in 1/CLK_TCK s (10 ms): the calls run long enough to
    make many ticks."""
    fn()
    n, start = 0, time.perf_counter()
    client0, server0 = time.process_time(), _process_cpu_s(server_pid)
    while time.perf_counter() - start < max(seconds, 1.0):
        fn()
        n += 1
    client, server = time.process_time() - client0, _process_cpu_s(server_pid)
    if server is None or server0 is None:
        return 1e6 * client / n, float("nan")
    return 1e6 * client / n, 1e6 * (server - server0) / n


def bench_server(
    rows: int, dim: int, optimizer: str, batches: list[int], seconds: float, out_dir: Path | None = None
) -> list[dict]:
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
            preexec_fn=die_with(os.getpid()),
        )
        try:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = pb_grpc.ParameterServerStub(channel)
            stub.Info(pb.InfoRequest(), wait_for_ready=True, timeout=120)
            streams = StreamPool(stub, size=1)  # as a worker calls: a message on a long-lived stream

            def unary(method: str, request, timeout: float):
                return getattr(stub, method)(request, timeout=timeout)

            store = ShardStore(ctx, 0)  # the same tables and optimizer, in this process
            results = []
            gen = torch.Generator().manual_seed(0)
            for b in batches:
                pool = [torch.randperm(rows, generator=gen)[:b] for _ in range(4)]
                grads = torch.randn(b, dim, generator=gen) * 1e-3
                pick = _cycler(pool)

                def grpc_pull(call, pick=pick) -> None:
                    resp = call("Pull", pb.PullRequest(ids=ids_to_bytes(pick())), 30.0)
                    torch.frombuffer(resp.rows, dtype=torch.float32).view(-1, dim)

                def grpc_push(call, pick=pick, grads=grads) -> None:
                    call("Push", pb.PushRequest(ids=ids_to_bytes(pick()), grads=floats_to_bytes(grads)), 30.0)

                row = {"batch": b}
                for transport, call in (("stream", streams.call), ("unary", unary)):
                    row[f"pull_{transport}"] = _rate(lambda call=call: grpc_pull(call), b, seconds)
                # What one pull on the stream costs each side in CPU, not in time: on shared cores the CPU is
                # what a call takes from everything else.
                row["pull_client_cpu_us"], row["pull_server_cpu_us"] = _cpu_per_call(
                    lambda: grpc_pull(streams.call), proc.pid, seconds
                )
                row["pull_inproc"] = _rate(lambda pick=pick: store.pull(pick()), b, seconds)
                for transport, call in (("stream", streams.call), ("unary", unary)):
                    row[f"push_{transport}"] = _rate(lambda call=call: grpc_push(call), b, seconds)
                row["push_inproc"] = _rate(
                    lambda pick=pick, grads=grads: store.push(pick(), grads), b, seconds
                )
                results.append(row)
            streams.close()
            channel.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    title = (
        f"# ecrec bench server: {rows:,} rows x dim {dim}, optimizer {optimizer}, record width "
        f"{ctx.record_width} floats"
    )
    columns = [Column("batch rows", lambda r: r["batch"], "{:,}")]
    for op in ("pull", "push"):
        columns += [
            Column(f"{op} gRPC rows/s", lambda r, op=op: _round(r[f"{op}_stream"]), "{:,}"),
            Column(f"{op} unary rows/s", lambda r, op=op: _round(r[f"{op}_unary"]), "{:,}"),
            Column(f"{op} in-process rows/s", lambda r, op=op: _round(r[f"{op}_inproc"]), "{:,}"),
            Column(
                f"{op} ratio", lambda r, op=op: _round(r[f"{op}_stream"] / r[f"{op}_inproc"], 3), "{:.2f}"
            ),
            Column(
                f"{op} unary ratio",
                lambda r, op=op: _round(r[f"{op}_unary"] / r[f"{op}_inproc"], 3),
                "{:.2f}",
            ),
        ]
    columns += [
        Column("pull client CPU µs / call", lambda r: _round(r["pull_client_cpu_us"]), "{:,}"),
        Column("pull server CPU µs / call", lambda r: _round(r["pull_server_cpu_us"]), "{:,}"),
    ]
    emit_table(title, columns, results, out_dir)
    return results


# ---------------------------------------------------------------------------------------------------------
# Whole-job benchmarks: ECRec's overhead in normal operation and its behaviour through a failure.


def steady_rate(report: dict, start: float = 2.0, end: float | None = None) -> float:
    """Median samples/s of the throughput series within [start, end) seconds (skips the warm-up ramp)."""
    vals = [r for t, r in report["throughput_series"] if t >= start and (end is None or t < end)]
    return statistics.median(vals) if vals else float("nan")  # a window shorter than one sample


def samples_at(report: dict, t: float) -> float:
    """Total samples trained `t` seconds into training, interpolated linearly between the coordinator's
    observations of the total (`samples_series`); NaN outside them."""
    series = report.get("samples_series") or []
    for (t0, n0), (t1, n1) in itertools.pairwise(series):
        if t0 <= t <= t1:
            return n0 + (n1 - n0) * (t - t0) / (t1 - t0) if t1 > t0 else float(n1)
    return float("nan")


def samples_rate(report: dict, start: float, end: float) -> float:
    """Samples/s over [start, end]: every sample trained in the window, over its length — where
    `steady_rate`, a median of trailing 1 s rates, says little about a window of one or two seconds."""
    if not end > start:
        return float("nan")
    return (samples_at(report, end) - samples_at(report, start)) / (end - start)


TRAINING_RPCS = (
    "Pull",
    "Push",
    "PushDense",
    "Stage",
    "StageDeltas",
    "DeliverDeltas",
    "Commit",
    "DecideMany",
    "Abort",
    "Delta",
    "DecideDeltas",
    "Outcome",
)


def run_summary(report: dict, load: dict) -> dict:
    """What the overhead and scaling tables keep of one run's report."""
    return {
        "mean": report["samples_per_s"],
        "steady": steady_rate(report),
        "elapsed_s": report["elapsed_s"],
        "auc": report["eval"]["auc"],
        "rpcs_per_step": rpcs_per_step(report),
        "cpu": _cpu(report),
        "load": load,
        # invariant I1 after the run (ECRec only): a speed-up that broke parity is no speed-up
        "parity_mismatches": (report.get("parity_check") or {}).get("mismatches"),
    }


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
    (
        "ECRec k=4, unary calls",
        ["faultTolerance.strategy=ecrec", "faultTolerance.ecrec.k=4", "workers.callStreams=0"],
    ),
    # two parity records per stripe (P and Q) survive two servers lost at once; they need k + 2 servers, so
    # r = 1 on as many servers beside them tells Q's cost from a sixth server's
    (
        "ECRec k=4, 6 servers",
        ["faultTolerance.strategy=ecrec", "faultTolerance.ecrec.k=4", "servers.replicas=6"],
    ),
    (
        "ECRec k=4 r=2, 6 servers",
        [
            "faultTolerance.strategy=ecrec",
            "faultTolerance.ecrec.k=4",
            "faultTolerance.ecrec.r=2",
            "servers.replicas=6",
        ],
    ),
]


def alternating(configs: list, rounds: int):
    """(round, configuration) for every configuration once per round: forward, then backward, so that a
    drift of the machine's speed does not always favour the same configurations."""
    for r in range(rounds):
        for config in configs if r % 2 == 0 else configs[::-1]:
            yield r, config


def bench_overhead(job: str, steps: int, sets: list[str], out_dir: Path, rounds: int = 1) -> list[dict]:
    """Every configuration of OVERHEAD_CASES once per round. With several rounds the order alternates
    (forward, then backward, so that a drift of the machine's speed does not always favour the same
    configurations), each row gives medians over the rounds, and its ratio to No FT is the median of the
    per-round ratios — each against the No FT run of its own round, minutes apart at most — which the table
    also lists: on a machine whose speed drifts, single runs compare badly."""
    runs: dict[str, list[dict]] = {label: [] for label, _ in OVERHEAD_CASES}
    for r, (label, case) in alternating(OVERHEAD_CASES, rounds):
        ctx = JobContext(load_job_with(job, [*sets, f"training.steps={steps}", *case]))
        name = label.replace(" ", "_").replace(",", "").replace("=", "")
        report = _run(ctx, out_dir / name if rounds == 1 else out_dir / f"round{r + 1}" / name)
        runs[label].append(run_summary(report, load_balance(report.get("server_load") or [])))
        print(
            f"  {label}: mean {report['samples_per_s']:,.0f} samples/s, "
            f"steady {runs[label][-1]['steady']:,.0f}",
            flush=True,
        )
    base = runs[OVERHEAD_CASES[0][0]]
    rows = [overhead_row(label, runs[label], base) for label, _ in OVERHEAD_CASES]
    columns = [
        Column("configuration", lambda r: r["case"]),
        Column("mean samples/s", lambda r: _round(r["mean"]), "{:,}"),
        Column("steady samples/s", lambda r: _round(r["steady"]), "{:,}"),
        Column("throughput vs No FT (steady)", lambda r: _round(r["ratio"], 3), "{:.2f}"),
        Column("ratio per round", lambda r: " / ".join(f"{x:.2f}" for x in r["ratios"])),
        Column("training-time overhead", lambda r: _round(r["overhead"], 4), "{:+.1%}"),
        Column("server RPCs per worker step", lambda r: _round(r["rpcs_per_step"], 2), "{:.1f}"),
        *cpu_columns(),
        Column("server work max/mean", lambda r: _round(r["load"]["work"], 3), "{:.2f}"),
        Column("server CPU max/mean", lambda r: _round(r["load"]["cpu"], 3), "{:.2f}"),
        Column("eval AUC", lambda r: r["auc"], "{:.4f}"),
        Column("parity mismatches (most in a run)", lambda r: r["parity_mismatches"], "{:,}"),
    ]
    title = f"# ecrec bench overhead: {job} {' '.join(sets)} steps={steps}"
    emit_table(title + (f" rounds={rounds} (medians)" if rounds > 1 else ""), columns, rows, out_dir)
    return rows


def overhead_row(label: str, runs: list[dict], base: list[dict]) -> dict:
    """One configuration's row of `bench overhead` from its runs, round by round against No FT's (`base`)."""
    ratios = [
        r["steady"] / b["steady"] if b["steady"] else float("nan") for r, b in zip(runs, base, strict=True)
    ]
    overheads = [r["elapsed_s"] / b["elapsed_s"] - 1 for r, b in zip(runs, base, strict=True)]
    return {
        "case": label,
        "ratios": ratios,
        "ratio": _median(ratios),
        "overhead": _median(overheads),
        **{key: _median([r[key] for r in runs]) for key in ("mean", "steady", "auc", "rpcs_per_step")},
        "cpu": {role: _median([r["cpu"][role] for r in runs]) for role in ROLES},
        "load": {key: _median([r["load"][key] for r in runs]) for key in ("work", "cpu")},
        "parity_mismatches": max(
            (r["parity_mismatches"] for r in runs if r.get("parity_mismatches") is not None), default=None
        ),
    }


def _median(values: list[float]) -> float:
    """The median of the values that are numbers (NaN where a run had none)."""
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(kept) if kept else float("nan")


def load_balance(server_load: list[dict]) -> dict[str, float]:
    """Most-loaded server over the mean, by rows updated (pushed, staged, parity deltas) and by CPU seconds
    (ecrec.local.server_load); NaN where a server did not report (it died: its counters died with it)."""

    def ratio(values: list) -> float:
        if not values or any(v is None for v in values) or not statistics.mean(values) > 0:
            return float("nan")
        return max(values) / statistics.mean(values)

    return {
        "work": ratio([s.get("work") for s in server_load]),
        "cpu": ratio([s.get("cpu_s") for s in server_load]),
    }


RECOVERY_KEYS = (
    "continue_s",
    "full_s",
    "rebuild_s",
    "rows_recovered",
    "normal",
    "during_ratio",
    "lost_s",
    "rebuild_ratio",
)


def recovery_run(report: dict) -> dict:
    """One `bench recovery` run's numbers. Throughput is samples trained over a window (`samples_rate`):
    normal from 2 s (after the warm-up) to the kill, "during" from the kill to full recovery — the issue's
    measure, stall included — and "rebuild" from the replacement's first lock group to full recovery."""
    recs = report["recoveries"]
    if not recs:
        raise SystemExit("ecrec bench recovery: the kill did not land: training ended first (raise --steps)")
    # Several servers lost at once (`--lost 2`): from the first kill until the last of them is rebuilt.
    rec = {
        "killed_at": min(r["killed_at"] for r in recs),
        "continued_at": max(r["continued_at"] for r in recs),
        "completed_at": max(r["completed_at"] for r in recs),
        "rows_recovered": sum(r["rows_recovered"] for r in recs),
    }
    started = next(e["t"] for e in report["events"] if e["kind"] == "recovery_started")
    normal = samples_rate(report, 2.0, rec["killed_at"])
    during = samples_rate(report, rec["killed_at"], rec["completed_at"])
    rebuild = samples_rate(report, started, rec["completed_at"])
    return {
        "continue_s": rec["continued_at"] - rec["killed_at"],
        "full_s": rec["completed_at"] - rec["killed_at"],
        "rebuild_s": rec["completed_at"] - started,
        "rows_recovered": rec["rows_recovered"],
        "normal": normal,
        "during_ratio": during / normal if normal else float("nan"),
        # What the recovery cost in all: the samples it did not train, as seconds of normal training. The
        # ratio alone favours slow recoveries (a fixed stall weighs less in a longer window); this does not.
        "lost_s": (rec["completed_at"] - rec["killed_at"]) * (1 - during / normal)
        if normal
        else float("nan"),
        "rebuild_ratio": rebuild / normal if normal else float("nan"),
        "parity_mismatches": report["parity_check"]["mismatches"],
        "stripes_read_again": report.get("stripes_read_again", 0),
        "cpu": _cpu(report),
    }


def recovery_timeline(report: dict, step: float = 0.1, before: float = 0.3, after: float = 0.3) -> dict:
    """Where a recovery's cost falls: throughput / normal in `step`-second bins from `before` seconds before
    the kill to `after` seconds after full recovery, and the first event of each kind in that window, both in
    seconds after the kill."""
    (rec,) = report["recoveries"]
    kill, end = rec["killed_at"], rec["completed_at"] + after
    normal = samples_rate(report, 2.0, kill)
    bins, t = [], kill - before
    while t < end - 1e-9:
        bins.append([round(t - kill, 3), round(samples_rate(report, t, t + step) / normal, 2)])
        t += step
    events: dict[str, float] = {}
    for e in report["events"]:
        if kill - before <= e["t"] <= end:
            events.setdefault(e["kind"], round(e["t"] - kill, 3))
    return {"step": step, "bins": bins, "events": events}


def format_timeline(timeline: dict) -> str:
    bins = " ".join(f"{t:+.1f}:{r:.2f}" for t, r in timeline["bins"])
    events = ", ".join(f"{kind} {t:+.2f}" for kind, t in timeline["events"].items())
    head = f"    throughput / normal by {timeline['step']:g} s after the kill"
    return f"{head}: {bins}\n    events (s after the kill): {events}"


def recovery_phases(report: dict, after: float = 1.0) -> list[tuple[str, float, float]]:
    """A recovery's phases in seconds since the job started: the 2 s before the kill, the kill until the
    coordinator declared the server failed, degraded mode until the replacement registered, its rebuild, and
    `after` seconds after full recovery."""
    (rec,) = report["recoveries"]
    kill, detected, done = rec["killed_at"], rec["detected_at"], rec["completed_at"]
    registered = next(
        (e["t"] for e in report["events"] if e["kind"] == "replacement_registered" and e["t"] >= kill),
        rec["started_at"],
    )
    return [
        ("before the kill", kill - 2.0, kill),
        ("kill -> detected", kill, detected),
        ("degraded (-> replacement registered)", detected, registered),
        ("rebuild", registered, done),
        (f"{after:g} s after", done, done + after),
    ]


def recovery_cpu(report: dict, sampler, shard: int = 2) -> list[dict]:
    """Cores each role used in each phase of the run's recovery, and throughput / normal in it."""
    from ecrec.cputrace import cpu_by_phase, roles_through_a_kill

    (rec,) = report["recoveries"]
    normal = samples_rate(report, 2.0, rec["killed_at"])
    rows = cpu_by_phase(
        sampler.samples, roles_through_a_kill(sampler.children, shard), recovery_phases(report)
    )
    for row in rows:
        rate = samples_rate(report, row["from"], row["to"]) if row["to"] > row["from"] else float("nan")
        row["throughput"] = rate / normal if normal else float("nan")
    return rows


CPU_GROUPS = ("workers", "servers", "replacement", "spares", "coordinator")


def format_recovery_cpu(rows: list[dict], kill: float) -> str:
    lines = ["    CPU cores by phase (s after the kill; throughput / normal):"]
    for r in rows:
        cores = ", ".join(f"{g} {r['cores'].get(g, 0.0):.2f}" for g in CPU_GROUPS)
        lines.append(
            f"      {r['phase']:<38} {r['from'] - kill:+.2f}..{r['to'] - kill:+.2f}  {r['throughput']:.2f}  "
            f"{cores}; all {r['total']:.2f}"
        )
    return "\n".join(lines)


def load_job_with(path: str, overrides: list[str]):
    from ecrec.spec import load_job

    return load_job(path, overrides)


def bench_recovery(
    job: str,
    scales: list[int],
    groups: list[int],
    kill_at: float,
    steps: int,
    sets: list[str],
    out_dir: Path,
    rounds: int = 1,
    timeline: bool = False,
    lost: int = 1,
) -> list[dict]:
    """Server 2 SIGKILLed `kill_at` seconds into training (`lost` = 2: servers 2 and 3 at the same moment, on
    six servers with r = 2 unless `sets` say otherwise), for every (scale, lock group rows); with several
    rounds every configuration runs once per round, in alternating order, and each row gives medians over
    the rounds and lists each round's throughput ratio (a recovery lasts one or two seconds: one run says
    little about the throughput through it). `timeline`: each run also prints `recovery_timeline`."""
    configs = [(scale, group) for scale in scales for group in groups]
    runs: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    model_rows: dict[tuple[int, int], int] = {}
    for r, (scale, group) in alternating(configs, rounds):
        ctx = JobContext(
            load_job_with(
                job,
                [
                    *(["faultTolerance.ecrec.r=2", "servers.replicas=6"] if lost == 2 else []),
                    *sets,
                    f"model.scale={scale}",
                    f"training.steps={steps}",
                    "faultTolerance.strategy=ecrec",
                    f"faultTolerance.ecrec.lockGroupRows={group}",
                ],
            )
        )
        name = f"scale{scale}_group{group}"
        out = out_dir / name if rounds == 1 else out_dir / f"round{r + 1}" / name
        sampler = None
        if timeline:
            from ecrec.cputrace import CpuSampler

            sampler = CpuSampler()
        try:
            hook = {"on_tick": sampler.on_tick} if sampler is not None else {}
            report = _run(ctx, out, kills=[(2 + i, kill_at) for i in range(lost)], **hook)
        finally:
            if sampler is not None:
                sampler.stop()
        model_rows[(scale, group)] = ctx.model.num_rows
        run = recovery_run(report)
        runs[(scale, group)].append(run)
        print(
            f"  scale {scale} group {group}: continue {run['continue_s']:.2f}s, full {run['full_s']:.1f}s "
            f"(rebuild {run['rebuild_s']:.2f}s), kill→recovered / normal {run['during_ratio']:.2f}, "
            f"stripes read again {run['stripes_read_again']}",
            flush=True,
        )
        if timeline:
            print(format_timeline(recovery_timeline(report)), flush=True)
            read = sampler is not None and any(snap for _t, snap in sampler.samples)  # none off Linux
            if read:
                phases = recovery_cpu(report, sampler)
                (out / "cpu_phases.json").write_text(json.dumps(phases, indent=1))
                print(format_recovery_cpu(phases, report["recoveries"][0]["killed_at"]), flush=True)
    rows = []
    for (scale, group), rs in runs.items():
        rows.append(
            {
                "scale": scale,
                "rows": model_rows[(scale, group)],
                "group": group,
                "ratios": [r["during_ratio"] for r in rs],
                **{key: _median([r[key] for r in rs]) for key in RECOVERY_KEYS},
                "parity_mismatches": max(r["parity_mismatches"] for r in rs),
                "cpu": {role: _median([r["cpu"][role] for r in rs]) for role in ROLES},
            }
        )
    columns = [
        Column("model rows", lambda r: r["rows"], "{:,}"),
        Column("lock group rows", lambda r: r["group"], "{:,}"),
        Column("time to continue s", lambda r: _round(r["continue_s"], 3), "{:.2f}"),
        Column("time to full recovery s", lambda r: _round(r["full_s"], 3), "{:.1f}"),
        Column("of which rebuild s", lambda r: _round(r["rebuild_s"], 3), "{:.2f}"),
        Column("rows rebuilt", lambda r: round(r["rows_recovered"]), "{:,}"),
        Column("throughput kill→recovered / normal", lambda r: _round(r["during_ratio"], 3), "{:.2f}"),
        Column("ratio per round", lambda r: " / ".join(f"{x:.2f}" for x in r["ratios"])),
        Column("training lost s (at normal throughput)", lambda r: _round(r["lost_s"], 3), "{:.2f}"),
        Column("throughput while rebuilding / normal", lambda r: _round(r["rebuild_ratio"], 3), "{:.2f}"),
        *cpu_columns(),
        Column("parity mismatches (most in a run)", lambda r: r["parity_mismatches"]),
    ]
    killed = "server 2" if lost == 1 else f"servers {', '.join(str(2 + i) for i in range(lost))} (r = 2)"
    title = f"# ecrec bench recovery: {job} {' '.join(sets)}, {killed} SIGKILLed at {kill_at}s"
    emit_table(title + (f" rounds={rounds} (medians)" if rounds > 1 else ""), columns, rows, out_dir)
    return rows
