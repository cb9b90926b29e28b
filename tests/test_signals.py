"""SIGTERM in every role: each process, started as a pod starts it (`ecrec ROLE ARGS`), exits promptly.

A pod's process is PID 1 of its container, which ignores a signal it has no handler for. Where unprivileged
namespaces are allowed, each process here is PID 1 of a PID namespace of its own (`unshare`), as in a pod: a
role without a handler would not exit at all (checked first with a `sleep`). Elsewhere a process without a
handler dies of the signal instead (returncode -SIGTERM), so the roles must exit with a code of their own —
except the coordinator: uvicorn re-raises the signal after its graceful shutdown, which PID 1 ignores (it then
exits 0) and any other process dies of.

The worker exits with 128 + SIGTERM (ecrec.termination): the launchers' reconciler reads it as a lost worker
to replace, not as the job's failure, and the coordinator hears neither an error nor "done" from it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import REPO, make_ctx

from ecrec import auth, rest
from ecrec.core.reconcile import Observed, Proc, reconcile
from ecrec.termination import EXIT_CODE, Terminated, Termination

# Seconds from SIGTERM to exit. The server and coordinator end through the interpreter's finalization, whose
# garbage collection of torch's heap took 1-4 s here at a load average of 13 on 2 cores (once 11 s): the
# point checked is that they stop by themselves, which PID 1 without a handler never would.
PROMPT = 20.0
WORKER_PROMPT = 4.5  # under the worker's watchdog (ecrec.termination.GRACE): it stopped by itself


def _pid1_works() -> bool:
    try:
        r = subprocess.run([*PID1, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


PID1 = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child"]
AS_PID1 = _pid1_works()


def _role_pid(p: subprocess.Popen) -> int:
    """The role's process: under unshare, its child (PID 1 of the namespace)."""
    if not AS_PID1:
        return p.pid
    end = time.monotonic() + 10
    while time.monotonic() < end:
        children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    raise AssertionError("unshare started no child")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A job's processes, each `python -m ecrec.cli ROLE ...` with its own log."""

    def __init__(self, tmp: Path, **overrides):
        self.tmp = tmp
        self.token = auth.new_token()
        self.ctx = make_ctx("signals", training__steps=100000, **overrides)
        self.job = tmp / "job.json"
        self.job.write_text(self.ctx.to_json())
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = rest.client(timeout=5.0, token=self.token)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, role: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - the process owns it
        env = {**os.environ, auth.ENV: self.token, "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen(
            [
                *(PID1 if AS_PID1 else []),
                sys.executable,
                "-m",
                "ecrec.cli",
                role,
                "--job",
                str(self.job),
                *args,
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.procs[name] = p
        return p

    def coordinator(self) -> None:
        self.start("coordinator", "coordinator", "--port", str(self.port))
        self.until(lambda: self.get("/healthz") is not None, "the coordinator answers")

    def server(self, shard: int) -> subprocess.Popen:
        return self.start(f"server-{shard}", "server", "--shard", str(shard), "--coordinator", self.url)

    def spare(self, index: int) -> subprocess.Popen:
        return self.start(f"spare-{index}", "server", "--spare", str(index), "--coordinator", self.url)

    def worker(self, rank: int) -> subprocess.Popen:
        return self.start(f"worker-{rank}", "worker", "--rank", str(rank), "--coordinator", self.url)

    def get(self, path: str) -> dict | None:
        try:
            r = self.http.get(f"{self.url}{path}")
            r.raise_for_status()
            return r.json()
        except httpx.HTTPError:
            return None

    def until(self, ready, what: str, timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if ready():
                return
            for name, p in self.procs.items():
                assert p.poll() is None, f"{name} exited with {p.returncode} before {what}:\n{self.log(name)}"
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting until {what}")

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def sigterm(self, name: str) -> tuple[int, float]:
        """SIGTERM `name`'s process: its exit code and how long it took to exit."""
        p = self.procs[name]
        t0 = time.monotonic()
        os.kill(_role_pid(p), signal.SIGTERM)
        try:
            code = p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise AssertionError(f"{name} did not exit within 30 s of SIGTERM:\n{self.log(name)}") from None
        return code, time.monotonic() - t0

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        self.http.close()


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path, faultTolerance__strategy="ecrec", faultTolerance__ecrec__k=1, servers__spares=1)
    yield j
    j.close()


def _worker_status(job: Job, rank: int = 0) -> dict:
    status = job.get("/v1/status") or {}
    return next((w for w in status.get("workers", []) if int(w.get("rank", -1)) == rank), {})


@pytest.mark.slow
def test_sigterm_stops_every_role_promptly(job):
    job.coordinator()
    for shard in range(job.ctx.spec.servers.replicas):
        job.server(shard)
    job.spare(0)
    job.worker(0)
    job.until(lambda: int(_worker_status(job).get("step", 0)) >= 5, "the worker trains")

    # The worker, mid-training: it finishes its step, tells the coordinator how far it got, and exits as
    # a process the signal killed (lost, to be replaced), long before its watchdog.
    code, took = job.sigterm("worker-0")
    log = job.log("worker-0")
    assert code == EXIT_CODE, log
    assert took < WORKER_PROMPT, (took, log)
    assert "SIGTERM: worker 0 stopped after step" in log and "not stopped within" not in log, log
    last = int(log.rsplit("stopped after step ", 1)[1].split(";")[0])
    w = _worker_status(job)
    assert int(w["step"]) == last, (w, log)  # its last report arrived: a replacement resumes right there
    assert not w.get("done") and not w.get("error"), w
    status = job.get("/v1/status") or {}
    assert status.get("phase") not in ("Failed", "Succeeded"), status  # the job is not failed by it

    # The launchers replace it: exit code 128 + 15 reads as killed, not as an error of its own.
    procs = (
        Proc("coordinator", 0, 1, "running"),
        *(Proc("server", s, 1, "running") for s in range(job.ctx.spec.servers.replicas)),
        Proc("worker", 0, 1, "failed", w["instance"], exit_code=code),
    )
    obs = Observed(job.ctx.spec.servers.replicas, 1, procs, status, coordinator_incarnation=1, num_spares=0)
    actions = [(a.kind, a.role) for a in reconcile(obs)]
    assert ("report_worker_lost", "worker") in actions and ("create", "worker") in actions, actions
    assert all(kind != "fail" for kind, _ in actions), actions

    # The spare server (waiting for a failed shard), the servers, the coordinator: each exits 0 at once.
    for name in ("spare-0", "server-0", "server-1", "coordinator"):
        code, took = job.sigterm(name)
        ok = (0,) if AS_PID1 or name != "coordinator" else (0, -signal.SIGTERM)  # uvicorn re-raises it
        assert code in ok, (name, code, job.log(name))
        assert took < PROMPT, (name, took)


@pytest.mark.slow
def test_sigterm_while_the_worker_waits_for_the_start(job):
    """Outside a step (here: registered, the servers not there yet) the worker stops at once."""
    job.coordinator()
    job.worker(0)
    job.until(lambda: _worker_status(job).get("instance"), "the worker registered")
    time.sleep(1.0)  # into its wait for the start
    code, took = job.sigterm("worker-0")
    assert code == EXIT_CODE, job.log("worker-0")
    assert took < WORKER_PROMPT, took
    assert "Traceback" not in job.log("worker-0") and "not stopped within" not in job.log("worker-0")
    code, _ = job.sigterm("coordinator")
    assert code in ((0,) if AS_PID1 else (0, -signal.SIGTERM)), job.log("coordinator")


@pytest.mark.skipif(not AS_PID1, reason="no unprivileged PID namespaces here")
def test_pid1_ignores_sigterm_without_a_handler():
    """What the tests above rely on: PID 1 of a namespace, like a pod's process, ignores an unhandled SIGTERM."""
    p = subprocess.Popen([*PID1, sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(_role_pid(p), signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=1.5)
    finally:
        p.kill()
        p.wait()


# -- the handler's rules, without processes --------------------------------------------------------------


class _Exits:
    def __init__(self):
        self.codes: list[int] = []

    def __call__(self, code: int) -> None:
        self.codes.append(code)


def test_termination_defers_within_a_step_and_raises_at_its_end():
    exits = _Exits()
    term = Termination(grace=60, exit=exits)
    done = []
    with pytest.raises(Terminated):
        with term.step():
            term._handle(signal.SIGTERM, None)  # noted only
            done.append("the rest of the step")
    assert done == ["the rest of the step"] and term.requested.is_set()
    assert exits.codes == []


def test_termination_raises_at_once_outside_a_step():
    term = Termination(grace=60, exit=_Exits())
    with pytest.raises(Terminated):
        term._handle(signal.SIGTERM, None)
    term._handle(signal.SIGTERM, None)  # a second SIGTERM while winding down: nothing more


def test_a_step_failing_after_sigterm_is_abandoned_not_an_error():
    term = Termination(grace=60, exit=_Exits())
    with pytest.raises(Terminated) as e:
        with term.step():
            term._handle(signal.SIGTERM, None)
            raise ConnectionError("its server shut down too")
    assert isinstance(e.value.__cause__, ConnectionError)
    # without a SIGTERM the error is the step's own
    with pytest.raises(ConnectionError):
        with Termination(grace=60, exit=_Exits()).step():
            raise ConnectionError("a real failure")


def test_finishing_never_raises_and_the_watchdog_bounds_the_wind_down():
    exits = _Exits()
    term = Termination(grace=0.05, exit=exits)
    term.finishing()
    term._handle(signal.SIGTERM, None)  # no raise: the last report goes out, and it exits 0
    end = time.monotonic() + 5
    while not exits.codes and time.monotonic() < end:
        time.sleep(0.01)
    assert exits.codes == [EXIT_CODE]
