"""ecrec.forkserver: the processes of a local job, forked from one interpreter that imported them once."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ecrec.forkserver import ForkServer
from tests.conftest import REPO, make_ctx


@pytest.fixture
def server(tmp_path):
    fs = ForkServer(tmp_path, tmp_path / "forkserver.log", dict(os.environ))
    yield fs
    fs.close()


def wait_for(what, cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def text(path: Path) -> str:
    return path.read_text() if path.exists() else ""  # the child creates its log


def gone(pid: int) -> bool:
    try:
        return ") Z " in Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True


def test_a_child_runs_an_ecrec_command_with_its_own_log_and_exit_code(server, tmp_path):
    ok, bad = tmp_path / "ok.log", tmp_path / "bad.log"
    child = server.spawn(
        ["validate", str(REPO / "examples/local-small.yaml")], dict(os.environ), ok, "validate"
    )
    assert child.wait(timeout=60) == 0
    assert "local-small" in ok.read_text()  # the effective spec, printed to the child's own log
    child = server.spawn(["validate", str(tmp_path / "missing.yaml")], dict(os.environ), bad, "validate")
    assert child.wait(timeout=60) not in (0, None)
    assert "missing.yaml" in bad.read_text()
    assert "missing.yaml" not in ok.read_text()


def test_a_long_running_role_gets_its_environment_session_and_name_and_dies_by_sigkill(server, tmp_path):
    # The job reaches the server only through the environment the launcher passed for this child.
    env = {**os.environ, "ECREC_TEST_JOB": make_ctx().to_json()}
    log = tmp_path / "server-0.log"
    argv = ["server", "--job", "env:ECREC_TEST_JOB", "--shard", "0", "--standalone"]
    child = server.spawn(argv, env, log, "server-0", cwd=tmp_path)
    wait_for("the server to serve", lambda: "serving on" in text(log))
    assert child.poll() is None
    assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "server-0"
    assert os.readlink(f"/proc/{child.pid}/cwd") == str(tmp_path)  # the working directory asked for
    assert os.getsid(child.pid) == child.pid  # its own session: a signal to the launcher's group misses it
    assert "ECREC_TEST_JOB" not in Path(f"/proc/{server.proc.pid}/environ").read_text()
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert gone(child.pid)


def test_children_die_with_the_fork_server(tmp_path):
    # (PR_SET_PDEATHSIG; that the fork server dies with its launcher, and so the whole job, is
    # tests/test_local.py::test_launcher_sigkill_takes_children_down.)
    fs = ForkServer(tmp_path, tmp_path / "forkserver.log", dict(os.environ))
    try:
        env = {**os.environ, "ECREC_TEST_JOB": make_ctx().to_json()}
        log = tmp_path / "server.log"
        child = fs.spawn(
            ["server", "--job", "env:ECREC_TEST_JOB", "--shard", "1", "--standalone"], env, log, "s"
        )
        wait_for("the server to serve", lambda: "serving on" in text(log))
        os.kill(fs.proc.pid, signal.SIGKILL)
        wait_for("the child to die with the fork server", lambda: gone(child.pid), timeout=10)
        assert child.wait(timeout=10) == -signal.SIGKILL  # what the launcher sees: it was killed
        with pytest.raises(RuntimeError, match="fork server is gone"):
            fs.spawn(["validate", "x"], dict(os.environ), tmp_path / "x.log", "x")
    finally:
        fs.close()
