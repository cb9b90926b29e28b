"""`ecrec local`: run a job as real processes on 127.0.0.1 — coordinator, servers, workers.

The launcher is the local twin of the Kubernetes operator: it starts the processes, waits for readiness,
watches them, shows progress, evaluates the model and writes the report. Whatever happens (a failed start,
Ctrl-C, an exception), every child is terminated: children run in their own session (so a terminal's Ctrl-C
reaches only the launcher, which then stops them in order) and die with the launcher through
PR_SET_PDEATHSIG even if the launcher is SIGKILLed. They are forked from the job's fork server
(ecrec.forkserver), which imported every role's module once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ecrec import auth, rest
from ecrec.coordinator.client import CoordinatorClient, Refused
from ecrec.coordinator.contract import EventIn, WorkerLost
from ecrec.core.reconcile import Action, Observed, Proc, coordinator_seed, reconcile
from ecrec.forkserver import Forked, ForkServer
from ecrec.jobctx import JobContext
from ecrec.roles import CPUS_ENV, DUMP_STACKS, role_argv
from ecrec.spec import JobSpec, section_at


class JobFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: Forked | None = None  # a child of the job's fork server
    role: str = ""  # coordinator | server | worker | spare (a server once adopted)
    index: int = 0  # shard id or rank
    incarnation: int = 1
    instance: str = ""  # the id it registers with at the coordinator
    spare: int | None = None  # a server started as a warm spare: that spare's index

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def observed(self) -> Proc:
        """This process in the reconciler's terms (a signal n reads as exit code 128 + n, as in a pod)."""
        code = self.proc.poll() if self.proc is not None else None
        if code is None:
            return Proc(self.role, self.index, self.incarnation, "running", self.instance, spare=self.spare)
        exit_code = code if code >= 0 else 128 - code
        return Proc(
            self.role,
            self.index,
            self.incarnation,
            "succeeded" if code == 0 else "failed",
            self.instance,
            exit_code,
            spare=self.spare,
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalCluster:
    """The processes of one local job."""

    ctx: JobContext
    out_dir: Path
    children: dict[str, Child] = field(default_factory=dict)
    coordinator_url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    cpus: dict[str, str] = field(default_factory=dict)  # role -> the cores its processes run on (ECREC_CPUS)
    history: list[Child] = field(default_factory=list)  # every process started, dead ones too

    def __post_init__(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "logs").mkdir(exist_ok=True)
        self.job_file = self.out_dir / "job.json"
        if self.ctx.spec.fault_tolerance.checkpoints():  # a relative checkpoint directory lives under OUT
            self.ctx = _absolute_checkpoint_path(self.ctx, self.out_dir)
        self.job_file.write_text(self.ctx.to_json())
        # The job's token (ecrec.auth): every process gets it by env, the launcher's own calls carry it.
        if self.ctx.token is None:
            self.ctx = dataclasses.replace(self.ctx, token=auth.new_token())
        self.env[auth.ENV] = self.ctx.token
        token_file = self.out_dir / "job.token"  # for `ecrec verify --token-file`; only for this user
        token_file.touch(mode=0o600)
        token_file.chmod(0o600)
        token_file.write_text(self.ctx.token)

    @functools.cached_property
    def coordinator(self) -> CoordinatorClient:
        """The launcher's client of the coordinator, made at its first call (`start` picks the URL first)."""
        return CoordinatorClient(self.coordinator_url, token=self.ctx.token, timeout=10.0)

    # -- processes -------------------------------------------------------------------------------------
    def _child_env(self) -> dict[str, str]:
        # a native crash (a signal) dumps every thread's Python stack into the process's log
        return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **self.env}

    @functools.cached_property
    def forkserver(self) -> ForkServer:
        """Started with the first process: every process of the job is forked from it (ecrec.forkserver)."""
        log = self.out_dir / "logs" / "forkserver.log"
        return ForkServer(self.out_dir, log, self._child_env())

    def spawn(self, name: str, role: str, index: int = 0, incarnation: int = 1, **flags) -> Child:
        """Fork the process `name` of `role` (ecrec.roles.role_argv; `flags` are its own, e.g. `replacement`)."""
        instance = f"{name}-{incarnation}-{uuid.uuid4().hex[:6]}"
        member = {"coordinator": self.coordinator_url, "instance": instance} if role != "coordinator" else {}
        argv = role_argv(role, index, job=str(self.job_file), incarnation=incarnation, **member, **flags)
        child = Child(
            name,
            argv,  # what it runs, as a pod would: `ecrec ROLE ARGS`
            self.out_dir / "logs" / f"{name}.log",
            role=role,
            index=index,
            incarnation=incarnation,
            instance=instance,
        )
        env = self._child_env()
        if cores := self.cpus.get("server" if role == "spare" else role):
            env[CPUS_ENV] = cores
        child.proc = self.forkserver.spawn(child.argv[1:], env, child.log_path, name)
        self.children[name] = child
        self.history.append(child)
        return child

    def spawn_server(self, shard: int, incarnation: int = 1, replacement: bool = False) -> Child:
        return self.spawn(f"server-{shard}", "server", shard, incarnation, replacement=replacement)

    def spawn_spare(self, index: int) -> Child:
        """A warm spare (servers.spares): a server process without a shard until the coordinator assigns one."""
        return self.spawn(f"spare-{index}", "spare", index)

    def adopt(self, instance: str, shard: int, incarnation: int) -> None:
        """The spare `instance` registered as `shard`: from now on it is that shard's server (what --kill and
        the reconciler address as server-<shard>); its log stays spare-<i>.log."""
        child = next(c for c in self.history if c.instance == instance)
        self.children.pop(child.name, None)
        child.spare = child.index if child.role == "spare" else child.spare
        child.role, child.index, child.incarnation = "server", shard, incarnation
        child.name = f"server-{shard}"
        self.children[child.name] = child

    def spawn_worker(self, rank: int, incarnation: int = 1, replacement: bool = False) -> Child:
        return self.spawn(f"worker-{rank}", "worker", rank, incarnation, replacement=replacement)

    def observe(self) -> tuple[Proc, ...]:
        return tuple(c.observed() for c in self.history)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        child = self.children[name]
        if child.alive:
            child.proc.send_signal(sig)
            child.proc.wait()

    def dump_stacks(self, settle: float = 0.5) -> None:
        """Every live process writes its threads' stacks to its log (roles.DUMP_STACKS)."""
        for c in self.children.values():
            if c.alive:  # the job failed: one that dies of it (not yet in run_role) loses nothing
                c.proc.send_signal(DUMP_STACKS)
        time.sleep(settle)  # faulthandler writes from its own handler; give it time before SIGTERM

    def shutdown(self, grace: float = 5.0) -> None:
        """Stop workers, then servers, then the coordinator: SIGTERM, then SIGKILL after `grace` seconds."""
        order = sorted(
            self.children.values(),
            key=lambda c: (c.name.startswith("coordinator"), c.name.startswith("server")),
        )
        for c in order:
            if c.alive:
                c.proc.terminate()
        deadline = time.monotonic() + grace
        for c in order:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        if "forkserver" in self.__dict__:
            self.forkserver.close()
        if "coordinator" in self.__dict__:
            self.coordinator.close()

    # -- readiness -------------------------------------------------------------------------------------
    def _wait(self, what: str, ready, timeout: float, watch: list[Child], on_coordinator_lost=None) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for c in watch:
                c = self.children.get(c.name, c)  # the current process of that name
                if c.proc is not None and c.proc.poll() is not None:
                    if c.role == "coordinator" and on_coordinator_lost is not None:
                        on_coordinator_lost()  # replaced like during training; the others rejoin it
                        continue
                    raise JobFailed(
                        f"{c.name} exited with code {c.proc.returncode} while waiting for {what}:\n"
                        f"{c.log_tail()}"
                    )
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise JobFailed(f"timed out after {timeout:.0f}s waiting for {what}")

    def spawn_coordinator(self, incarnation: int = 1, generation: int = 1, seed: dict | None = None) -> Child:
        """The coordinator, always on the same port: servers and workers keep its URL across a failover, as
        they keep a Service's name on Kubernetes. A replacement starts from `seed` (docs/protocol.md)."""
        resume = None
        if seed is not None:
            path = self.out_dir / f"coordinator-{incarnation}.resume.json"
            path.write_text(json.dumps(seed))
            resume = (generation, str(path))
        port = self.coordinator_url.rsplit(":", 1)[1]
        return self.spawn("coordinator", "coordinator", 0, incarnation, port=port, resume=resume)

    def start(self, timeout: float = 120.0, on_coordinator_lost=None) -> None:
        """Start the coordinator, the servers and spares, and once the servers registered the workers. `on_coordinator_lost`
        replaces a coordinator that dies meanwhile (without it, that fails the start)."""
        self.coordinator_url = f"http://127.0.0.1:{free_port()}"
        coord = self.spawn_coordinator()
        self._wait("the coordinator", lambda: self.coordinator.healthz()["ok"], timeout, [coord])
        (self.out_dir / "coordinator.url").write_text(self.coordinator_url)
        servers = [self.spawn_server(s) for s in range(self.ctx.num_servers)]
        for i in range(
            self.ctx.spec.servers.spares
        ):  # started with the servers: ready before they are needed
            self.spawn_spare(i)
        self._wait(
            "servers to register",
            lambda: self.coordinator.cluster()["ready"],
            timeout,
            [coord, *servers],
            on_coordinator_lost,
        )
        for rank in range(self.ctx.spec.workers.replicas):
            self.spawn_worker(rank)


def machine_description() -> dict:
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _kill_due(at: float | str, seconds: float, step: int) -> bool:
    """A kill's `at`: seconds since training started, or "step:N" (once the slowest worker reached step N:
    the same point of the job however fast this machine trains)."""
    if isinstance(at, str):
        return step >= int(at.removeprefix("step:"))
    return at <= seconds


class Supervisor:
    """The local twin of the operator: kills servers on schedule (`--kill`, `--chaos`) and carries out what the
    reconciler shared with the operator (ecrec.core.reconcile) decides — replacements under the same shard id
    or rank, failure reports, recoveries — with processes instead of pods."""

    def __init__(
        self,
        kills: list[tuple[int | str, float | str]] = (),
        chaos: int = 0,
        seed: int = 0,
        hold_seed: Callable[[dict], bool] | None = None,
        concurrent: int = 1,
        replace_after: float = 0.0,
    ):
        import random

        self.kills = list(kills)
        self.chaos_left = chaos
        self.concurrent = concurrent  # servers each chaos kill takes down at the same moment
        self.rng = random.Random(seed)
        self.next_chaos: tuple[list[int], float] | None = None
        self.respawns = 0
        self.resume: dict | None = None  # the coordinator's state as of its last status: a successor's seed
        # tests: a seed it returns True for is kept, as if every later pass had missed the status
        self.hold_seed = hold_seed
        self.events: list[EventIn] = []  # events for the coordinator, not yet delivered
        self.started_at: float | None = None
        self.replace_after = replace_after
        self._dead_since: dict[int, float] = {}  # shard -> when its replacement was first wanted

    def tick(self, cluster: LocalCluster, status: dict | None) -> None:
        """One pass; `status` is None while no coordinator answers."""
        if status is not None:
            self._remember(status)
            self.started_at = status.get("startedAt")
            if self.started_at is not None and status["phase"] not in ("Succeeded", "Failed"):
                self._kill_due(cluster, status)
            self._post_events(cluster)
        self.reconcile(cluster, status)

    def _remember(self, status: dict) -> None:
        """Keep the coordinator's state as a successor's seed (unless a test holds an older one)."""
        if self.resume is None or self.hold_seed is None or not self.hold_seed(self.resume):
            self.resume = status.get("resume") or self.resume

    def _kill_due(self, cluster: LocalCluster, status: dict) -> None:
        t = time.time() - status["startedAt"]
        n = cluster.ctx.num_servers
        if self.chaos_left and self.next_chaos is None and _all_recovered(status):
            # (one server: randrange, the sequence a seed gave before --concurrent)
            shards = (
                [self.rng.randrange(n)]
                if self.concurrent == 1
                else self.rng.sample(range(n), self.concurrent)
            )
            self.next_chaos = (shards, t + self.rng.uniform(1.0, 4.0))
        due = [k for k in self.kills if _kill_due(k[1], t, status["step"])]
        if self.next_chaos is not None and self.next_chaos[1] <= t:
            due += [(shard, self.next_chaos[1]) for shard in self.next_chaos[0]]
            self.next_chaos = None
            self.chaos_left -= 1
        for target, _at in due:
            if (target, _at) in self.kills:
                self.kills.remove((target, _at))
            if target == "coordinator":
                if cluster.children["coordinator"].alive:
                    cluster.kill("coordinator")
                continue
            if isinstance(target, str):  # "worker-<rank>": reported lost and replaced by `reconcile`
                if cluster.children[target].alive:
                    at = time.time()
                    cluster.kill(target)
                    self.events.append(
                        EventIn(
                            kind="worker_killed", at=at, detail={"rank": int(target.removeprefix("worker-"))}
                        )
                    )
                continue
            name = f"server-{target}"
            if cluster.children[name].alive:
                # the time before the signal: a worker can see the dead server and the coordinator declare it
                # failed before `kill` has reaped the process
                at = time.time()
                cluster.kill(name)
                self.events.append(EventIn(kind="server_killed", shard=target, at=at))
        self._post_events(cluster)

    def _replacement_due(self, shard: int) -> bool:
        """`--replace-after`: a replacement server starts that long after it was first wanted. A pod takes
        seconds to be scheduled and started; a local fork ~0.1 s, and degraded mode would last no longer."""
        since = self._dead_since.setdefault(shard, time.monotonic())
        return time.monotonic() - since >= self.replace_after

    def _post_events(self, cluster: LocalCluster) -> None:
        """What the supervisor did, told to the coordinator; kept until one answers (it may be dead too)."""
        while self.events:
            try:
                cluster.coordinator.add_event(self.events[0])
            except httpx.HTTPError:
                return
            self.events.pop(0)

    def reconcile(self, cluster: LocalCluster, status: dict | None) -> None:
        ctx = cluster.ctx
        obs = Observed(
            num_servers=ctx.num_servers,
            num_workers=ctx.spec.workers.replicas,
            procs=cluster.observe(),
            status=status,
            replacements=self.respawns,
            recoverable=ctx.spec.fault_tolerance.strategy != "none",
            settle_after_finish=True,  # the report's checks need every shard whole after training
            num_spares=ctx.spec.servers.spares,
        )
        for action in reconcile(obs):
            self._do(cluster, action)

    def _do(self, cluster: LocalCluster, a: Action) -> None:
        if a.kind == "fail":
            try:  # a process that fails says why to the coordinator first: that is the job's reason
                reason = cluster.coordinator.status()["reason"]
            except httpx.HTTPError:
                reason = None
            if reason:
                raise JobFailed(f"job failed: {reason}")
            dead = [c for c in cluster.history if (c.role, c.index) == (a.role, a.index) and not c.alive]
            raise JobFailed(f"job failed: {a.reason}" + (f":\n{dead[-1].log_tail()}" if dead else ""))
        if a.kind == "create" and a.role == "coordinator":
            if a.replacement:
                generation, seed = coordinator_seed(self.resume, cluster.observe(), a.incarnation)
                cluster.spawn_coordinator(a.incarnation, generation, seed)
            else:
                cluster.spawn_coordinator(a.incarnation)
        elif a.kind == "create" and a.role == "server":
            if a.replacement and not self._replacement_due(a.index):
                return
            self._dead_since.pop(a.index, None)
            cluster.spawn_server(a.index, a.incarnation, a.replacement)
        elif a.kind == "create" and a.role == "worker":
            cluster.spawn_worker(a.index, a.incarnation, a.replacement)
        elif a.kind == "create" and a.role == "spare":
            cluster.spawn_spare(a.index)
        elif a.kind == "adopt":
            cluster.adopt(a.instance, a.index, a.incarnation)
        elif a.kind == "delete":
            for c in cluster.history:
                if c.instance == a.instance:
                    c.proc.kill()
        elif a.kind in ("report_failed", "start_recovery", "report_worker_lost", "report_worker_finished"):
            try:
                self._tell_coordinator(cluster, a)
                if a.kind == "report_failed":
                    # The seed as of the failure's declaration, before the replacement starts: a successor
                    # started from an older one would take the dead server for up until it probed it. (The
                    # replacement, forked in a few ms, may register before the next pass reads the status.)
                    if (status := _status(cluster)) is not None:
                        self._remember(status)
            except httpx.TransportError:
                # The coordinator died mid-request (or is being replaced): the next pass decides again from
                # what it observes then, and tells its successor.
                pass
        if a.kind == "create" and a.replacement:
            self.respawns += 1

    @staticmethod
    def _tell_coordinator(cluster: LocalCluster, a: Action) -> None:
        """One report; an error answer is ignored (the next pass decides again), except a recovery's other
        than a refusal. No answer at all (httpx.TransportError) is the caller's."""
        coordinator = cluster.coordinator
        if a.kind == "start_recovery":
            with contextlib.suppress(Refused):  # not registered yet; asked again next tick
                coordinator.start_recovery(a.index)
            return
        with contextlib.suppress(httpx.HTTPStatusError):
            if a.kind == "report_failed":
                coordinator.report_failure(a.index, "supervisor")
            elif a.kind == "report_worker_finished":
                coordinator.worker_finished(a.index, a.instance)
            else:
                coordinator.worker_lost(
                    WorkerLost(rank=a.index, instance=a.instance, replacing=True, reason=a.reason)
                )


def _all_recovered(status: dict) -> bool:
    return all(s["state"] == "up" for s in status["cluster"]["shards"])


def run_local(
    ctx: JobContext,
    out_dir: Path,
    *,
    progress: bool = True,
    start_timeout: float = 120.0,
    kills: list[tuple[int | str, float | str]] = (),
    chaos: int = 0,
    concurrent: int = 1,
    seed: int = 0,
    fault: str | None = None,
    on_tick=None,
    rebuild_error: bool = False,
    env: dict[str, str] | None = None,
    hold_seed: Callable[[dict], bool] | None = None,
    cpus: dict[str, str] | None = None,
    replace_after: float = 0.0,
) -> dict:
    """Run the job to completion and return the report. Raises JobFailed (after cleaning up) on failure.

    `fault` is an ECREC_FAULT_POINT spec (see ecrec.faults) fired once in this job. `rebuild_error` (needs
    deterministic training) logs every record the servers decode, runs the job again without faults and adds
    how far the decoded records were from that run's (ecrec.rebuild_error). `env` goes to the children.
    `hold_seed` (tests): once the coordinator's saved state satisfies it, a successor coordinator starts from
    that state however much later its predecessor dies (the seed a launcher saved just before it missed
    the last few changes). `cpus`: role -> the cores its processes run on (`0-5`; a spare's are the servers').
    `replace_after`: seconds between a server's death and the start of its replacement (spares are not held)."""
    from ecrec import finalchecks
    from ecrec import rebuild_error as rebuild
    from ecrec.client import PSClient

    if rebuild_error and not ctx.spec.training.deterministic:
        raise ValueError("rebuild_error needs training.deterministic: true (it compares with a rerun)")
    cluster = LocalCluster(ctx, out_dir, cpus=dict(cpus or {}))
    ctx = cluster.ctx  # with the job token
    cluster.env.update(env or {})
    if rebuild_error:
        decoded = out_dir / "rebuild-error" / "decoded"
        for old in decoded.glob("*.bin"):
            old.unlink()
        cluster.env[rebuild.DECODE_LOG_ENV] = str(decoded)
    fired = out_dir / "fault.fired"
    if fault:
        fired.unlink(missing_ok=True)
        cluster.env.update({"ECREC_FAULT_POINT": fault, "ECREC_FAULT_ONCE": str(fired)})
    spec = ctx.spec
    total = spec.training.steps * spec.workers.replicas * spec.training.batch_size
    if not 1 <= concurrent <= ctx.num_servers:
        raise ValueError(f"concurrent: between 1 and the {ctx.num_servers} servers, got {concurrent}")
    supervisor = Supervisor(kills, chaos, seed, hold_seed, concurrent, replace_after)

    def tick(cl: LocalCluster, status: dict | None) -> None:
        supervisor.tick(cl, status)
        if on_tick is not None and status is not None:
            on_tick(cl, status)

    extra: dict = {}
    try:
        cluster.start(timeout=start_timeout, on_coordinator_lost=lambda: supervisor.reconcile(cluster, None))
        status = _watch(cluster, total, progress, tick)
        extra["cpu"] = cpu_per_samples(status)  # as training ended: what the roles spent on it
        recoverable = ctx.spec.fault_tolerance.strategy != "none"
        if recoverable:
            _wait_recovered(cluster, supervisor)
        # Before evaluation adds its reads; every server's /metrics read once for both.
        served_by = cluster.coordinator.cluster()
        scraped = scrape_servers(served_by)
        extra["rpcs_served"] = rpcs_served(served_by, scraped)
        extra["server_load"] = server_load(served_by, status.get("serverCpuSeconds") or {}, scraped)
        extra["parts_expired"] = parts_expired(scraped)
        extra["stripes_read_again"] = sum(  # one series per server (label shard)
            _sum_over_servers(scraped, "ecrec_server_stripes_read_again", "_total", "shard").values()
        )
        extra["delta_batches"] = {  # deltaLog: how many deliveries came ahead of their predecessor
            kind: sum(_sum_over_servers(scraped, family, "_total", "shard").values())
            for kind, family in (
                ("delivered", "ecrec_server_delta_batches"),
                ("held", "ecrec_server_delta_batches_held"),
            )
        }
        client = PSClient(ctx, cluster.coordinator.cluster())
        checks_began = time.monotonic()
        try:  # evaluation, the digest, the parity check (posted for the coordinator's /metrics), ...
            found = finalchecks.check(client, coordinator=cluster.coordinator, report=True)
        finally:
            client.close()
        extra["final_checks_s"] = round(time.monotonic() - checks_began, 3)
        ev, digest, data = found.eval, found.params_sha256, found.data
        if ctx.ecrec:
            extra["parity_check"] = found.parity_check
            extra["staged_after"] = found.staged_after
            extra["dense_replica_mismatches"] = found.dense_replica_mismatches
        status = cluster.coordinator.status()
    except JobFailed:
        cluster.dump_stacks()  # where each process waits, in its log: why the job failed
        raise
    finally:
        cluster.shutdown()
    if recoverable:
        extra["recoveries"] = [
            {
                k: r[k]
                for k in (
                    "shard",
                    "killed_at",
                    "detected_at",
                    "continued_at",
                    "started_at",
                    "completed_at",
                    "rows_recovered",
                    "seconds",
                )
            }
            for r in status["recoveries"]
        ]
        extra["replacements"] = supervisor.respawns
    if "checkpointing" in status:
        extra["checkpointing"] = status["checkpointing"]
    if fault:
        extra["fault"] = {"point": fault, "fired": fired.exists()}
    # Kills the job finished before (a step or a time it never reached while running), so that a run that was
    # to be disturbed and was not says so instead of passing for one that recovered.
    extra["kills_missed"] = [f"{target}@{at}" for target, at in supervisor.kills]
    if rebuild_error:
        extra["rebuild_error"] = rebuild.measure(ctx, out_dir / "rebuild-error", run_local, progress=progress)
    evaluation = {"auc": ev["auc"], "logloss": ev["logloss"], "samples": ev["samples"]}
    # Logistic regression and a factorization machine on the same split: a bar for the DLRM's numbers.
    reference = finalchecks.reference(spec, data)
    if reference:
        evaluation["reference"] = reference
    return {
        **extra,
        "job": ctx.name,
        "samples_per_s": status["meanSamplesPerSecond"],
        "samples": status["samples"],
        "elapsed_s": status["elapsedSeconds"],
        "throughput_series": status["throughputSeries"],
        "samples_series": status["samplesSeries"],
        "eval": evaluation,
        "params_sha256": digest,
        "events": [{k: v for k, v in e.items() if k != "wall"} for e in status["events"]],
        "spec": spec.to_dict(),
        "machine": machine_description(),
        "logs": str(out_dir / "logs"),
    }


def cpu_per_samples(status: dict) -> dict:
    """CPU seconds by role (the processes' own counters, ecrec.core.cpu) and per 1,000 samples trained."""
    seconds = status.get("cpuSeconds") or {}
    samples = status.get("samples") or 0
    per = {role: round(1000 * s / samples, 4) if samples else None for role, s in seconds.items()}
    return {"seconds": seconds, "per_1000_samples": per}


def scrape_servers(cluster: dict) -> dict[int, list]:
    """Each live server's /metrics, parsed, by shard id (no families for a server that did not answer: it
    died after training, and its counters died with it; its replacement counts from zero)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[int, list] = {}
    for shard in cluster["shards"]:
        url, text = shard.get("metricsUrl"), ""
        if url:
            try:
                text = rest.get(url, timeout=5.0).text
            except httpx.HTTPError:
                text = ""
        out[shard["shard"]] = list(text_string_to_metric_families(text))
    return out


def _sum_by_label(families: list, family: str, suffix: str, label: str) -> dict[str, int]:
    """The samples of `family` whose name ends in `suffix`, summed by the value of `label`."""
    out: dict[str, int] = {}
    for f in families:
        if f.name == family:
            for sample in f.samples:
                if sample.name.endswith(suffix):
                    key = sample.labels[label]
                    out[key] = out.get(key, 0) + int(sample.value)
    return out


def rpcs_served(cluster: dict, scraped: dict[int, list] | None = None) -> dict[str, int]:
    """RPCs the live server processes have served, by method, summed over servers (from their /metrics).

    Counts both worker -> server and server -> server calls: the message cost of a configuration."""
    scraped = scraped if scraped is not None else scrape_servers(cluster)
    return dict(sorted(_sum_over_servers(scraped, "ecrec_rpc_latency_seconds", "_count", "method").items()))


def parts_expired(scraped: dict[int, list]) -> dict[str, int]:
    """Staged parts the live servers aborted because their worker never decided them, by how its death was
    known (worker_gone: the coordinator said so; timeout: txnTimeoutSeconds), summed over servers."""
    return {"worker_gone": 0, "timeout": 0} | _sum_over_servers(
        scraped, "ecrec_server_parts_expired", "_total", "reason"
    )


def _sum_over_servers(scraped: dict[int, list], family: str, suffix: str, label: str) -> dict[str, int]:
    """One labelled counter of every server's scrape, by label value, summed over the servers."""
    out: dict[str, int] = {}
    for families in scraped.values():
        for value, n in _sum_by_label(families, family, suffix, label).items():
            out[value] = out.get(value, 0) + n
    return out


def server_rows(cluster: dict, scraped: dict[int, list] | None = None) -> list[dict]:
    """Per server, `ecrec_rows_total` by kind (pull, push, stage, delta, ...) from its /metrics."""
    scraped = scraped if scraped is not None else scrape_servers(cluster)
    return [
        {"shard": shard, **_sum_by_label(families, "ecrec_rows", "_total", "kind")}
        for shard, families in scraped.items()
    ]


def row_work(rows: dict) -> int:
    """A server's update work (paper §5.2): rows pushed, staged as data server or acting home, and parity
    deltas taken."""
    return rows.get("push", 0) + rows.get("stage", 0) + rows.get("delta", 0)


def server_load(
    cluster: dict, cpu_by_instance: dict[str, float], scraped: dict[int, list] | None = None
) -> list[dict]:
    """Per shard: its update work (`row_work`) and the CPU seconds its current process spent since
    registering. The spread over shards is the load balance of the paper's §5.2."""
    instances = {s["shard"]: s.get("instance") for s in cluster["shards"]}
    return [
        {**r, "work": row_work(r), "cpu_s": cpu_by_instance.get(instances.get(r["shard"]) or "")}
        for r in server_rows(cluster, scraped)
    ]


def _wait_recovered(cluster: LocalCluster, supervisor: Supervisor, timeout: float = 300.0) -> None:
    """Training may end before a recovery does: the report's checks need every shard rebuilt."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        status = _status(cluster)
        if (
            status is not None
            and _all_recovered(status)
            and all(r["state"] == "completed" for r in status["recoveries"])
        ):
            return
        supervisor.tick(cluster, status)  # a replacement (or the coordinator) may die after training ended
        time.sleep(0.2)
    raise JobFailed("timed out waiting for recoveries to complete after training")


def _status(cluster: LocalCluster) -> dict | None:
    """The coordinator's status, or None while it does not answer (killed, or its successor starting)."""
    try:
        return cluster.coordinator.status()
    except httpx.HTTPError:
        return None


def _watch(cluster: LocalCluster, total_samples: int, progress: bool, on_tick) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>9} samples/s  {task.fields[phase]}"),
        TimeElapsedColumn(),
        disable=not progress,
        transient=False,
    )
    with bar:
        task = bar.add_task("training", total=total_samples, rate="-", phase="Pending")
        while True:
            status = _status(cluster)
            if status is None:  # no coordinator: it is being replaced (the supervisor starts the next one)
                if on_tick is not None:
                    on_tick(cluster, None)
                time.sleep(0.25)
                continue
            bar.update(
                task,
                completed=status["samples"],
                rate=f"{status['samplesPerSecond']:.0f}",
                phase=status["phase"],
            )
            if on_tick is not None:
                on_tick(cluster, status)
            if status["phase"] == "Succeeded":
                return status
            if status["phase"] == "Failed":
                raise JobFailed(f"job failed: {status['reason']}")
            time.sleep(0.25)


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


def _absolute_checkpoint_path(ctx: JobContext, out_dir: Path) -> JobContext:
    doc = ctx.spec.to_dict()
    where, settings = ctx.spec.fault_tolerance.checkpoints()
    section = section_at(doc, where)
    path = Path(settings.path)
    section["path"] = str(path if path.is_absolute() else (out_dir / path).resolve())
    job = dataclasses.replace(ctx.job, spec=JobSpec.model_validate(doc))
    return dataclasses.replace(ctx, job=job)
