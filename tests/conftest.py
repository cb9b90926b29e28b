"""Shared fixtures: small job specs and helpers to find leftover processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ecrec.jobctx import JobContext
from ecrec.spec import job_from_dict


def make_ctx(name: str = "test", **overrides) -> JobContext:
    """A tiny job; `overrides` are dotted spec paths with '.' written as '__' (training__steps=5)."""
    spec: dict = {
        "model": {"preset": "tiny"},
        "training": {"steps": 20, "batchSize": 64, "optimizer": "adagrad", "seed": 7},
        "servers": {"replicas": 2},
        "workers": {"replicas": 1},
        "coordinator": {"heartbeatIntervalSeconds": 0.2, "failureTimeoutSeconds": 2.0},
        "data": {"evalSamples": 1024},
    }
    sets = [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    doc = {"apiVersion": "ecrec.dev/v1alpha1", "kind": "ECRecJob", "metadata": {"name": name}, "spec": spec}
    return JobContext(job_from_dict(doc, sets))


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains `text` (e.g. a job's private out dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if text in cmd and ") Z " not in stat:  # zombies are already dead
            pids.append(int(entry.name))
    return pids


REPO = Path(__file__).resolve().parents[1]


def ctrl_c_reaches_it() -> None:
    """preexec_fn for a launcher the tests stop with Ctrl-C (SIGINT). A shell that runs the suite in the
    background (`make test &`, nohup, CI runners without a terminal) starts it with SIGINT ignored, an ignored
    signal stays ignored across exec, and Python then installs no KeyboardInterrupt handler: the tests' Ctrl-C
    would reach nobody, and the job would run on, taking the CPU from every later test."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_with_ctrl_c(proc: subprocess.Popen, timeout: float = 60) -> int:
    """Ctrl-C the launcher and wait; one that does not stop in time is killed (its children follow it:
    PR_SET_PDEATHSIG) before the test fails, so nothing outlives the test."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the launcher did not stop within {timeout:g}s of Ctrl-C") from None
    return proc.returncode


def start_background_job(out: Path, *sets: str, capture: bool = False) -> subprocess.Popen:
    """`ecrec local examples/local-small.yaml` (tiny model, endless steps) as a child process writing to `out`."""
    overrides = [a for s in ("training.steps=100000", "model.preset=tiny", *sets) for a in ("--set", s)]
    pipe = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ecrec.cli",
            "local",
            "examples/local-small.yaml",
            *overrides,
            "--quiet",
            "--out",
            str(out),
        ],
        cwd=REPO,
        stdout=pipe,
        stderr=pipe,
        text=True,
        preexec_fn=ctrl_c_reaches_it,
    )


@pytest.fixture
def tiny_ctx() -> JobContext:
    return make_ctx()


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny tensors (`pytest.mark.usefixtures("one_torch_thread")`): torch's intra-op thread
    pool costs ~10x more than it saves on them."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
