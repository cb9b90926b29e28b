"""The `ecrec` command line: a thin layer over the launcher, data tools and benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ecrec import auth
from ecrec.roles import ROLE_MODULES, run_role  # `ecrec ROLE ARGS` runs ROLE's process (ecrec.roles)
from ecrec.spec import SpecError, load_job


def _job(args):
    from ecrec.jobctx import JobContext

    return JobContext(load_job(args.job, args.set or ()))


def _add_cpus(p) -> None:
    p.add_argument(
        "--cpus",
        action="append",
        metavar="ROLE=CORES",
        help="run a role's processes on these cores only (repeatable), e.g. --cpus server=0-5 --cpus worker=6-15: "
        "servers on cores of their own",
    )


def cmd_local(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from ecrec.data import check_data
    from ecrec.local import JobFailed, run_local, write_report
    from ecrec.plot import plot_report
    from ecrec.roles import role_cpus

    console = Console(stderr=True)
    ctx = _job(args)
    try:
        kills = [_parse_kill(k, ctx.num_servers, ctx.spec.workers.replicas) for k in args.kill or ()]
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    try:
        cpus = role_cpus(args.cpus or [])
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    if not 1 <= args.concurrent <= ctx.num_servers:
        console.print(f"[red]error:[/] --concurrent: between 1 and the job's {ctx.num_servers} servers")
        return 2
    if not 0 <= args.replace_after < float("inf"):
        console.print(f"[red]error:[/] --replace-after {args.replace_after}: seconds, 0 or more")
        return 2
    server_kills = any(isinstance(target, int) for target, _at in kills)
    if (server_kills or args.chaos) and ctx.spec.fault_tolerance.strategy == "none":
        console.print(
            "[red]error:[/] killing servers (--kill/--chaos) needs a faultTolerance.strategy other than "
            "'none' (nothing could recover)"
        )
        return 2
    if args.rebuild_error and not ctx.spec.training.deterministic:
        console.print(
            "[red]error:[/] --rebuild-error needs --set training.deterministic=true (and "
            "workers.replicas=1): it compares with the same run without faults"
        )
        return 2
    problems = check_data(ctx.spec)
    if problems:  # before any process starts, and on one line: not a worker's traceback later
        more = f" (and {len(problems) - 1} more: ecrec validate lists them)" if len(problems) > 1 else ""
        console.print(f"[red]error:[/] {escape(problems[0])}{more}", soft_wrap=True)
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
            concurrent=args.concurrent,
            seed=args.seed if args.seed is not None else ctx.spec.training.seed,
            rebuild_error=args.rebuild_error,
            cpus=cpus,
            replace_after=args.replace_after,
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
    ref = report["eval"].get("reference")  # data.source movielens100k: LR and FM on the same split
    if ref:
        scores = (
            f"{name.upper()} AUC {r['auc']:.4f}, log-loss {r['logloss']:.4f}" for name, r in ref.items()
        )
        console.print(f"reference models on the same split: {'; '.join(scores)}")
    console.print(f"params_sha256 {report['params_sha256']}")
    if report["kills_missed"]:
        console.print(
            f"[yellow]never killed (the job finished first): {', '.join(report['kills_missed'])}[/]"
        )
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


def _parse_kill(text: str, num_servers: int, num_workers: int = 1) -> tuple[int | str, float | str]:
    """A --kill: (shard id, or "coordinator", or "worker-<rank>"; seconds, or "step:N")."""
    target, sep, at = text.partition("@")
    try:
        if target == "coordinator":
            s: int | str = target
        elif target.startswith("worker-"):
            s = f"worker-{int(target.removeprefix('worker-'))}"
        else:
            s = int(target)
        t: float | str = f"step:{int(at[5:])}" if at.startswith("step:") else float(at)
    except ValueError:
        raise ValueError(
            f"--kill {text!r}: expected SHARD@SECONDS, SHARD@step:N, worker-RANK@SECONDS or coordinator@SECONDS, "
            "e.g. 1@10"
        ) from None
    at_ok = int(t[5:]) >= 0 if isinstance(t, str) else t >= 0
    shard_ok = not isinstance(s, int) or 0 <= s < num_servers
    rank_ok = (
        not (isinstance(s, str) and s.startswith("worker-"))
        or 0 <= int(s.removeprefix("worker-")) < num_workers
    )
    if not sep or not shard_ok or not rank_ok or not at_ok:
        raise ValueError(
            f"--kill {text!r}: shard must be in [0, {num_servers}), a worker's rank in [0, {num_workers}), and "
            "seconds or step >= 0"
        )
    return s, t


def cmd_verify(args) -> int:
    """Check I1 on a running job through its coordinator."""
    import httpx

    from ecrec.client import PSClient
    from ecrec.coordinator.client import CoordinatorClient
    from ecrec.coordinator.contract import ParityCheck
    from ecrec.jobctx import JobContext
    from ecrec.modelread import parity_check
    from ecrec.spec import job_from_spec

    url = args.coordinator.rstrip("/")
    with CoordinatorClient(url, timeout=10) as coordinator:
        doc = coordinator.job()
    ctx = JobContext(
        job_from_spec(doc["name"], doc["spec"]),
        token=Path(args.token_file).read_text().strip() if args.token_file else auth.from_env(),
    )
    if not ctx.ecrec:
        print(
            "error: the job does not use faultTolerance.strategy 'ecrec': there is no parity", file=sys.stderr
        )
        return 2
    client = PSClient.from_coordinator(ctx, url)
    try:
        result = parity_check(client)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    with CoordinatorClient(url, token=ctx.token, timeout=15.0) as coordinator:
        try:  # the coordinator exports the result (ecrec_parity_check_*); the check stands without it
            coordinator.record_parity_check(ParityCheck(**result))
        except httpx.HTTPError as e:
            print(f"warning: the coordinator did not take the result: {e}", file=sys.stderr)
    print(json.dumps(result))
    return 0 if result["mismatches"] == 0 else 1


def cmd_validate(args) -> int:
    from ecrec.data import check_data

    ctx = _job(args)
    problems = [] if args.skip_data_check else check_data(ctx.spec)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        return 2
    print(json.dumps({"name": ctx.name, "spec": ctx.spec.to_dict()}, indent=2))
    return 0


def cmd_dashboard(args) -> int:
    from ecrec import dashboard

    if not args.png:
        sys.stdout.write(dashboard.dashboard_json())  # what `make dashboard` commits
        return 0
    if not (args.prometheus and args.job):
        print("error: --png needs --prometheus and --job", file=sys.stderr)
        return 2
    start, end = dashboard.job_window(args.prometheus, args.job, args.start, args.end)
    data = dashboard.panel_data(args.prometheus, args.job, start, end)
    drawn = dashboard.render_png(data, Path(args.png), start, title=f"ECRec job {args.job}")
    empty = [title for title, n in drawn.items() if not n]
    print(f"wrote {args.png}" + (f"; no data for: {', '.join(empty)}" if empty else ""))
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
        out_dir=Path(args.out),
    )
    return 0


def cmd_bench_codes(args) -> int:
    from ecrec.codebench import bench_codes

    bench_codes(k=args.k, width=args.width, rows=args.rows, seconds=args.seconds, out_dir=Path(args.out))
    return 0


def cmd_bench_overhead(args) -> int:
    from ecrec.bench import bench_overhead

    if args.rounds < 1:
        raise SystemExit("ecrec bench overhead: --rounds must be at least 1")
    bench_overhead(args.job, args.steps, args.set or [], Path(args.out), rounds=args.rounds)
    return 0


def cmd_bench_scaling(args) -> int:
    from ecrec.roles import role_cpus
    from ecrec.scalingbench import bench_scaling

    def ints(text: str, what: str) -> list[int]:
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(
                f"ecrec bench scaling: {what} {text!r}: comma-separated integers, e.g. 2,4,8"
            ) from None

    try:
        bench_scaling(
            args.job,
            ints(args.workers, "--workers"),
            args.steps,
            args.set or [],
            Path(args.out),
            ks=ints(args.ks, "--ks"),
            zipf=args.zipf,
            rounds=args.rounds,
            seed_per_round=args.seed_per_round,
            cpus=role_cpus(args.cpus or []),
        )
    except ValueError as e:
        raise SystemExit(f"ecrec bench scaling: {e}") from None
    return 0


def cmd_bench_handlers(args) -> int:
    from ecrec.handlerbench import bench_handlers

    if args.workers < 1:
        raise SystemExit("ecrec bench handlers: --workers is at least 1")
    bench_handlers(args.job, args.steps, args.set or [], Path(args.out), args.workers)
    return 0


def cmd_bench_recovery(args) -> int:
    from ecrec.bench import bench_recovery

    if args.rounds < 1:
        raise SystemExit("ecrec bench recovery: --rounds must be at least 1")
    if args.lost not in (1, 2):
        raise SystemExit("ecrec bench recovery: --lost is 1 or 2 (servers killed at the same moment)")
    bench_recovery(
        args.job,
        [int(x) for x in args.scales.split(",")],
        [int(x) for x in args.groups.split(",")],
        args.kill_at,
        args.steps,
        args.set or [],
        Path(args.out),
        rounds=args.rounds,
        timeline=args.timeline,
        lost=args.lost,
    )
    return 0


def cmd_bench_scale(args) -> int:
    from ecrec.scalebench import bench_scale, parse_scales

    try:
        scales = parse_scales(args.scales)
    except ValueError as e:
        raise SystemExit(f"ecrec bench scale: {e}") from None
    if args.rounds < 1:
        raise SystemExit("ecrec bench scale: --rounds must be at least 1")
    kill_step = args.kill_step if args.kill_step is not None else args.steps // 3
    if not 1 <= kill_step < args.steps:
        raise SystemExit(
            f"ecrec bench scale: --kill-step {kill_step}: a step in [1, --steps {args.steps}): the kill lands "
            "mid-training"
        )
    bench_scale(args.job, scales, args.steps, kill_step, args.set or [], Path(args.out), rounds=args.rounds)
    return 0


def cmd_bench_paper(args) -> int:
    from ecrec.paperbench import bench_paper

    work = Path(args.work) if args.work else None
    if args.only_cached and not work:
        print("error: --only-cached needs --work (the directory whose runs.json to use)", file=sys.stderr)
        return 2
    bench_paper(
        Path(args.out),
        quick=args.quick,
        work=work,
        render_only=args.render_only,
        only_cached=args.only_cached,
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


def cmd_chaos(args) -> int:
    """Pod and node faults against a running ECRecJob, one at a time; a table of the recoveries."""
    from ecrec.chaos import ChaosError, Options, print_table, run

    action = "node-loss" if args.node is not None and args.action is None else args.action or "pod-kill"
    duration = args.duration if args.duration is not None else 60.0 if action == "node-loss" else 20.0
    opts = Options(
        job=args.job,
        namespace=args.namespace,
        action=action,
        node=args.node,
        role=args.role,
        interval=args.interval,
        count=args.count,
        seed=args.seed,
        duration=duration,
        injector=args.injector,
        grace_period=args.grace_period,
        timeout=args.timeout,
        kubeconfig=args.kubeconfig,
        context=args.context,
    )
    try:
        faults, seed, code = run(opts)
    except ChaosError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: a fault in progress stays as it is", file=sys.stderr)
        return 130
    print_table(faults, seed, args.output)
    return code


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
    _add_cpus(p)
    p.add_argument(
        "--kill",
        action="append",
        metavar="SHARD@SECONDS",
        help="SIGKILL that server's process (or a worker's: worker-RANK@SECONDS, or the coordinator's: "
        "coordinator@SECONDS) this long after training started, or once training reached a step "
        "(SHARD@step:N) (repeatable)",
    )
    p.add_argument(
        "--chaos",
        type=int,
        default=0,
        metavar="N",
        help="N kills of random shards at random times, one at a time",
    )
    p.add_argument(
        "--concurrent",
        type=int,
        default=1,
        metavar="C",
        help="--chaos: each kill takes down C distinct random servers at the same moment (C <= r survives)",
    )
    p.add_argument("--seed", type=int, help="seed of --chaos (default: training.seed)")
    p.add_argument(
        "--replace-after",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="start a killed server's replacement this long after its death, as a pod's scheduling and start "
        "would (default 0: at once; training runs degraded meanwhile)",
    )
    p.add_argument(
        "--rebuild-error",
        action="store_true",
        help="deterministic jobs: run again without faults and report the error of every decoded record",
    )
    p.set_defaults(fn=cmd_local)

    for role in ROLE_MODULES:  # dispatched in main(); listed here for --help
        p = sub.add_parser(
            role,
            add_help=False,
            help=f"run one {role} process (what its pod runs); `ecrec {role} --help` lists its options",
        )
        p.add_argument("args", nargs=argparse.REMAINDER)
        p.set_defaults(fn=lambda a, role=role: run_role(role, a.args) or 0)

    p = sub.add_parser("validate", help="validate a job and its data files; print the effective spec")
    job_args(p)
    p.add_argument(
        "--skip-data-check",
        action="store_true",
        help="do not open data.paths (they are on the pods' volumes, not here)",
    )
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("verify", help="check every stripe's parity on a running job (invariant I1)")
    p.add_argument("--coordinator", required=True, help="coordinator URL, e.g. http://127.0.0.1:8080")
    p.add_argument(
        "--token-file",
        help="the job token (ecrec local writes OUT/job.token; default: $ECREC_JOB_TOKEN)",
    )
    p.set_defaults(fn=cmd_verify)

    p = sub.add_parser("crd", help="print the ECRecJob CustomResourceDefinition")
    p.set_defaults(fn=cmd_crd)

    p = sub.add_parser("dashboard", help="print the Grafana dashboard, or render it from a Prometheus as PNG")
    p.add_argument("--png", help="render the panels into this PNG instead (needs --prometheus and --job)")
    p.add_argument("--prometheus", help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--job", help="the job's name (the ecrec_job label)")
    p.add_argument("--start", type=float, help="unix time of the first point (default: the job's start)")
    p.add_argument("--end", type=float, help="unix time of the last point (default: now)")
    p.set_defaults(fn=cmd_dashboard)

    p = sub.add_parser(
        "chaos",
        help="pod and node faults (pod-kill, pod-failure, node-loss) against a running ECRecJob, one at a time",
    )
    p.add_argument("--job", required=True, help="the ECRecJob's name")
    p.add_argument(
        "-n", "--namespace", help="its namespace (default: the kubeconfig context's, else default)"
    )
    p.add_argument(
        "--action",
        choices=("pod-kill", "pod-failure", "node-loss"),
        help="pod-kill: delete the pod; pod-failure: pause its process for --duration; node-loss: lose the "
        "--node for --duration, as when its machine dies (default: pod-kill, node-loss with --node)",
    )
    p.add_argument(
        "--node",
        metavar="NAME|random",
        help="node-loss: the node to lose, or random (a node running a pod of the job); --role does not apply",
    )
    p.add_argument(
        "--role",
        choices=("server", "worker", "coordinator", "any"),
        default="any",
        help="whose pod (default: any = a random server or worker)",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=10.0,
        help="seconds between a recovery and the next fault (default: 10)",
    )
    p.add_argument("--count", type=int, default=1, help="faults to inject (default: 1)")
    p.add_argument("--seed", type=int, help="seed of the target choice (default: random, printed)")
    p.add_argument(
        "--duration",
        type=float,
        help="pod-failure: seconds the process is paused (default: 20); node-loss: seconds the node stays down "
        "(default: 60)",
    )
    p.add_argument(
        "--injector",
        choices=("auto", "chaos-mesh", "annotation", "taint"),
        default="auto",
        help="pod-failure: a Chaos Mesh PodChaos, or the pause annotation the test kubelet honours (auto = "
        "chaos-mesh where PodChaos exists, else annotation where the pod's node honours it); node-loss: the "
        "node-down annotation the test kubelet honours, or taint = cordon, NoExecute taint and the job's pods "
        "there deleted (auto = annotation where the node honours it, else taint)",
    )
    p.add_argument(
        "--grace-period",
        type=int,
        default=0,
        help="pod-kill: the delete's grace period (default: 0, as Chaos Mesh)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the job to recover (default: 300)"
    )
    p.add_argument("--kubeconfig", help="default: $KUBECONFIG, else ~/.kube/config, else in-cluster")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.set_defaults(fn=cmd_chaos)

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
    p.add_argument("--out", default="out/bench-server", help="summary.json goes here")
    p.set_defaults(fn=cmd_bench_server)

    p = bench.add_parser("codes", help="encode/delta/decode rows/s of the xor (r=1) and P + Q (r=2) codes")
    p.add_argument("--k", type=int, default=4, help="data records per stripe")
    p.add_argument("--width", type=int, default=64, help="floats per record")
    p.add_argument("--rows", type=int, default=4096, help="stripes per call")
    p.add_argument("--seconds", type=float, default=2.0, help="measurement time per case")
    p.add_argument("--out", default="out/bench-codes", help="summary.json goes here")
    p.set_defaults(fn=cmd_bench_codes)

    p = bench.add_parser(
        "overhead", help="No FT vs ECRec k=2/k=4/no 2PC/no dense replication/unary calls/r=2"
    )
    p.add_argument("--job", default="examples/local-small.yaml")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, in alternating order; report medians and each round's ratio",
    )
    p.add_argument("--set", action="append", metavar="PATH=VALUE")
    p.add_argument("--out", default="out/bench-overhead")
    p.set_defaults(fn=cmd_bench_overhead)

    p = bench.add_parser(
        "scaling", help="No FT vs ECRec at several worker counts: does ECRec keep up as workers grow"
    )
    p.add_argument("--job", default="examples/local-small.yaml")
    p.add_argument("--workers", default="2,4", help="worker counts, comma-separated (default 2,4)")
    p.add_argument("--ks", default="4", help="ECRec's k values, comma-separated (default 4)")
    p.add_argument(
        "--zipf", type=float, default=None, help="data.zipfExponent of every run (default: the job's)"
    )
    p.add_argument("--steps", type=int, default=300, help="training steps per worker")
    p.add_argument("--rounds", type=int, default=1, help="rounds in alternating order; medians reported")
    p.add_argument(
        "--seed-per-round",
        action="store_true",
        help="round r trains with training.seed = r (data and initialization): AUC compared over seeds",
    )
    p.add_argument("--set", action="append", metavar="PATH=VALUE")
    _add_cpus(p)
    p.add_argument("--out", default="out/bench-scaling", help="summary.json goes here")
    p.set_defaults(fn=cmd_bench_scaling)

    p = bench.add_parser(
        "handlers",
        help="CPU per worker step in the servers' handlers and the client, in-process, No FT vs ECRec",
    )
    p.add_argument("--job", default="examples/local-small.yaml")
    p.add_argument("--steps", type=int, default=100, help="steps of each worker")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="clients taking turns in a shuffled order each step (several hold deltas at parity servers)",
    )
    p.add_argument("--set", action="append", metavar="PATH=VALUE")
    p.add_argument("--out", default="out/bench-handlers")
    p.set_defaults(fn=cmd_bench_handlers)

    p = bench.add_parser(
        "recovery", help="kill a server: time to continue, throughput, time to full recovery"
    )
    p.add_argument("--job", default="examples/local-small.yaml")
    p.add_argument("--scales", default="1,4", help="model.scale values (table sizes x scale)")
    p.add_argument("--groups", default="4096,65536", help="lockGroupRows values")
    p.add_argument("--kill-at", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, in alternating order; report medians and each round's ratio",
    )
    p.add_argument("--set", action="append", metavar="PATH=VALUE")
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also print each run's throughput / normal by 0.1 s around the kill, and the recovery's events",
    )
    p.add_argument(
        "--lost",
        type=int,
        default=1,
        help="servers SIGKILLed at the same moment: 1 (server 2), or 2 (servers 2 and 3; r = 2 on six servers)",
    )
    p.add_argument("--out", default="out/bench-recovery")
    p.set_defaults(fn=cmd_bench_recovery)

    p = bench.add_parser(
        "scale",
        help="tables x1/x8/x64: No FT and ECRec throughput, a server killed (ECRec recovery, Ckpt short "
        "restore), server memory per record",
    )
    p.add_argument("--job", default="examples/local-small.yaml")
    p.add_argument("--scales", default="1,8,64", help="model.scale values, comma-separated (default 1,8,64)")
    p.add_argument("--steps", type=int, default=300, help="training steps per worker")
    p.add_argument(
        "--kill-step",
        type=int,
        default=None,
        help="SIGKILL server 2 once training reached this step (default: a third of --steps)",
    )
    p.add_argument("--rounds", type=int, default=1, help="rounds in alternating order; medians reported")
    p.add_argument("--set", action="append", metavar="PATH=VALUE")
    p.add_argument("--out", default="out/bench-scale", help="summary.json and each job's report go here")
    p.set_defaults(fn=cmd_bench_scale)

    p = bench.add_parser(
        "fuzz", help="stray requests against a live deterministic job: they must change nothing"
    )
    job_args(p)
    p.add_argument("--count", type=int, default=500, help="stray requests to send")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/bench-fuzz")
    p.set_defaults(fn=cmd_bench_fuzz)

    p = bench.add_parser(
        "paper",
        help="the ECRec paper's evaluation (Figs. 5-13) scaled to this machine: results, figures, report",
    )
    p.add_argument("--out", default="out/bench-paper", help="results.json, PNG figures and report.md go here")
    p.add_argument("--quick", action="store_true", help="a reduced set (tiny model, few steps): minutes")
    p.add_argument(
        "--work",
        help="keep the jobs' directories (logs) here (default: a temporary directory); jobs already finished "
        "there with the same settings are not run again",
    )
    p.add_argument(
        "--render-only", action="store_true", help="redraw figures and report from OUT/results.json"
    )
    p.add_argument(
        "--only-cached",
        action="store_true",
        help="run no job: report what the jobs in WORK/runs.json give (a reduced run, said so in the report)",
    )
    p.set_defaults(fn=cmd_bench_paper)
    return ap


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ROLE_MODULES:  # before argparse: every other argument, --help too, is the role's
        run_role(argv[0], argv[1:])
        return
    args = build_parser().parse_args(argv)
    try:
        code = args.fn(args)
    except SpecError as e:
        print(f"error: invalid job spec:\n{e}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
