"""The `ecrec` command line: a thin layer over the launcher, data tools and benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ecrec.spec import SpecError, load_job


def _job(args):
    from ecrec.jobctx import JobContext

    return JobContext(load_job(args.job, args.set or ()))


def cmd_local(args) -> int:
    from rich.console import Console

    from ecrec.local import JobFailed, run_local, write_report
    from ecrec.plot import plot_report

    console = Console(stderr=True)
    ctx = _job(args)
    if ctx.spec.fault_tolerance.strategy not in ("none", "ecrec"):
        console.print(
            f"[red]error:[/] faultTolerance.strategy '{ctx.spec.fault_tolerance.strategy}' is not "
            "implemented yet; use 'none' or 'ecrec'"
        )
        return 2
    try:
        kills = [_parse_kill(k, ctx.num_servers) for k in args.kill or ()]
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    if (kills or args.chaos) and not ctx.ecrec:
        console.print(
            "[red]error:[/] --kill/--chaos need faultTolerance.strategy 'ecrec' (nothing could recover)"
        )
        return 2
    if args.rebuild_error and not ctx.spec.training.deterministic:
        console.print(
            "[red]error:[/] --rebuild-error needs --set training.deterministic=true (and "
            "workers.replicas=1): it compares with the same run without faults"
        )
        return 2
    out = Path(args.out)
    s = ctx.spec
    console.print(
        f"[bold]{ctx.name}[/]: {s.servers.replicas} servers, {s.workers.replicas} workers, "
        f"{ctx.model.num_rows:,} embedding rows x {ctx.dim} ({s.training.optimizer}), "
        f"{ctx.dense_numel:,} dense params, strategy {s.fault_tolerance.strategy}; logs in {out / 'logs'}"
    )
    try:
        report = run_local(
            ctx,
            out,
            progress=not args.quiet,
            kills=kills,
            chaos=args.chaos,
            seed=args.seed if args.seed is not None else ctx.spec.training.seed,
            rebuild_error=args.rebuild_error,
        )
    except JobFailed as e:
        console.print(f"[red]job failed:[/] {e}")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; all processes stopped[/]")
        return 130
    report_path = Path(args.report) if args.report else out / "report.json"
    write_report(report, report_path)
    plot_path = plot_report(report, args.plot) if args.plot else None
    console.print(
        f"[green]done[/] in {report['elapsed_s']:.1f}s: {report['samples']:,} samples, "
        f"mean {report['samples_per_s']:,.0f} samples/s; eval AUC {report['eval']['auc']:.4f}, "
        f"log-loss {report['eval']['logloss']:.4f}"
    )
    console.print(f"params_sha256 {report['params_sha256']}")
    if "parity_check" in report:
        pc = report["parity_check"]
        console.print(f"parity check: {pc['stripes']:,} stripes, {pc['mismatches']} mismatches")
    for r in report.get("recoveries", []):
        console.print(
            f"recovery of shard {r['shard']}: killed {r['killed_at']}s, detected {r['detected_at']}s, "
            f"training continued {r['continued_at']}s, completed {r['completed_at']}s, "
            f"{r['rows_recovered']:,} rows rebuilt"
        )
    for kind, e in report.get("rebuild_error", {}).items():
        if kind != "reference":
            errs = ", ".join(f"{n} {v['max_abs']:.3g}/{v['mean_abs']:.3g}" for n, v in e["parts"].items())
            console.print(
                f"{kind} records vs the run without faults: {e['records']:,}, max/mean |error| {errs}"
            )
    console.print(f"report: {report_path}" + (f"\nthroughput plot: {plot_path}" if plot_path else ""))
    return 0


def _parse_kill(text: str, num_servers: int) -> tuple[int, float]:
    shard, sep, at = text.partition("@")
    try:
        s, t = int(shard), float(at)
    except ValueError:
        raise ValueError(f"--kill {text!r}: expected SHARD@SECONDS, e.g. 1@10") from None
    if not sep or not 0 <= s < num_servers or t < 0:
        raise ValueError(f"--kill {text!r}: shard must be in [0, {num_servers}) and seconds >= 0")
    return s, t


def cmd_verify(args) -> int:
    """Check I1 on a running job through its coordinator."""
    import httpx

    from ecrec.client import PSClient
    from ecrec.jobctx import JobContext
    from ecrec.spec import job_from_dict

    url = args.coordinator.rstrip("/")
    doc = httpx.get(f"{url}/v1/job", timeout=10).json()
    ctx = JobContext(
        job_from_dict(
            {
                "apiVersion": "ecrec.dev/v1alpha1",
                "kind": "ECRecJob",
                "metadata": {"name": doc["name"]},
                "spec": doc["spec"],
            }
        )
    )
    if not ctx.ecrec:
        print(
            "error: the job does not use faultTolerance.strategy 'ecrec': there is no parity", file=sys.stderr
        )
        return 2
    client = PSClient.from_coordinator(ctx, url)
    try:
        result = client.parity_check()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(result))
    return 0 if result["mismatches"] == 0 else 1


def cmd_validate(args) -> int:
    ctx = _job(args)
    print(json.dumps({"name": ctx.name, "spec": ctx.spec.to_dict()}, indent=2))
    return 0


def cmd_crd(args) -> int:
    from ecrec.spec import crd_yaml

    sys.stdout.write(crd_yaml())  # what `make crd` commits as charts/ecrec/crds/ecrecjobs.yaml
    return 0


def cmd_data_generate(args) -> int:
    from ecrec.data import SyntheticData, write_criteo_tsv

    ctx = _job(args)
    m, d = ctx.model, ctx.spec.data
    src = SyntheticData(
        m.table_sizes, m.num_dense, d.zipf_exponent, seed=ctx.spec.training.seed, eval_samples=d.eval_samples
    )
    write_criteo_tsv(args.output, src, args.samples)
    print(f"wrote {args.samples} samples in Criteo TSV format to {args.output} ({len(m.table_sizes)} tables)")
    return 0


def cmd_bench_server(args) -> int:
    from ecrec.bench import bench_server

    bench_server(
        rows=args.rows,
        dim=args.dim,
        optimizer=args.optimizer,
        batches=[int(b) for b in args.batches.split(",")],
        seconds=args.seconds,
    )
    return 0


def cmd_bench_overhead(args) -> int:
    from ecrec.bench import bench_overhead

    bench_overhead(args.job, args.steps, args.set or [], Path(args.out))
    return 0


def cmd_bench_recovery(args) -> int:
    from ecrec.bench import bench_recovery

    bench_recovery(
        args.job,
        [int(x) for x in args.scales.split(",")],
        [int(x) for x in args.groups.split(",")],
        args.kill_at,
        args.steps,
        args.set or [],
        Path(args.out),
    )
    return 0


def cmd_bench_fuzz(args) -> int:
    from ecrec.fuzz import fuzz_job

    # Deterministic (one worker, each step committed before the next): the two runs must hash equal.
    args.set = ["training.deterministic=true", "workers.replicas=1", *(args.set or [])]
    result = fuzz_job(_job(args), args.count, args.seed, Path(args.out), rate=args.rate)
    print(json.dumps(result, indent=2))
    ok = result["same_params"] and not result["unexpected"] and result["parity_check"]["mismatches"] == 0
    print("stray requests changed nothing" if ok else "FAILED: stray requests changed the job (see above)")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ecrec", description="Erasure-coded fault-tolerant DLRM training")
    sub = ap.add_subparsers(dest="command", required=True)

    def job_args(p):
        p.add_argument("job", help="ECRecJob manifest (YAML) or bare spec")
        p.add_argument(
            "--set",
            action="append",
            metavar="PATH=VALUE",
            help="override a spec field, e.g. --set training.steps=50 (repeatable)",
        )

    p = sub.add_parser("local", help="run a job as local processes on 127.0.0.1")
    job_args(p)
    p.add_argument("--out", default="out", help="directory for logs and outputs (default: out)")
    p.add_argument("--report", help="write the JSON report here (default: OUT/report.json)")
    p.add_argument("--plot", help="write a throughput-over-time PNG here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--kill",
        action="append",
        metavar="SHARD@SECONDS",
        help="SIGKILL that server's process this long after training started (repeatable)",
    )
    p.add_argument(
        "--chaos",
        type=int,
        default=0,
        metavar="N",
        help="N kills of random shards at random times, one at a time",
    )
    p.add_argument("--seed", type=int, help="seed of --chaos (default: training.seed)")
    p.add_argument(
        "--rebuild-error",
        action="store_true",
        help="deterministic jobs: run again without faults and report the error of every decoded record",
    )
    p.set_defaults(fn=cmd_local)

    p = sub.add_parser("validate", help="validate a job and print the effective spec")
    job_args(p)
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("verify", help="check every stripe's parity on a running job (invariant I1)")
    p.add_argument("--coordinator", required=True, help="coordinator URL, e.g. http://127.0.0.1:8080")
    p.set_defaults(fn=cmd_verify)

    p = sub.add_parser("crd", help="print the ECRecJob CustomResourceDefinition")
    p.set_defaults(fn=cmd_crd)

    data = sub.add_parser("data", help="data tools").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("generate", help="write synthetic data in Criteo TSV format")
    job_args(p)
    p.add_argument("--output", "-o", required=True)
    p.add_argument("--samples", "-n", type=int, default=100_000)
    p.set_defaults(fn=cmd_data_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    p = bench.add_parser("server", help="one server's push/pull rows/s over gRPC vs in-process")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--optimizer", default="adagrad")
    p.add_argument("--batches", default="1024,8192,32768")
    p.add_argument("--seconds", type=float, default=3.0, help="measurement time per case")
    p.set_defaults(fn=cmd_bench_server)

    p = bench.add_parser("overhead", help="No FT vs ECRec k=2/k=4/no 2PC/no dense replication, one run")
    p.add_argument("--job", default="examples/local-small.yaml")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--set", action="append", metavar="PATH=VALUE")
    p.add_argument("--out", default="out/bench-overhead")
    p.set_defaults(fn=cmd_bench_overhead)

    p = bench.add_parser(
        "recovery", help="kill a server: time to continue, throughput, time to full recovery"
    )
    p.add_argument("--job", default="examples/local-small.yaml")
    p.add_argument("--scales", default="1,4", help="model.scale values (table sizes x scale)")
    p.add_argument("--groups", default="4096,65536", help="lockGroupRows values")
    p.add_argument("--kill-at", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--set", action="append", metavar="PATH=VALUE")
    p.add_argument("--out", default="out/bench-recovery")
    p.set_defaults(fn=cmd_bench_recovery)

    p = bench.add_parser(
        "fuzz", help="stray requests against a live deterministic job: they must change nothing"
    )
    job_args(p)
    p.add_argument("--count", type=int, default=500, help="stray requests to send")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/bench-fuzz")
    p.set_defaults(fn=cmd_bench_fuzz)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.fn(args)
    except SpecError as e:
        print(f"error: invalid job spec:\n{e}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
