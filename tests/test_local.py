"""`ecrec local` end to end: real processes on loopback, real gRPC, clean shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ecrec.data import CHECK_LINES, SyntheticData, write_criteo_tsv
from ecrec.local import run_local
from tests.conftest import REPO, make_ctx, processes_mentioning, start_background_job

pytestmark = pytest.mark.slow


def test_local_job_trains_reports_and_leaves_no_processes(tmp_path):
    ctx = make_ctx("e2e", servers__replicas=2, workers__replicas=2, training__steps=60)
    report = run_local(ctx, tmp_path / "run", progress=False)
    for key in ("samples_per_s", "throughput_series", "eval", "params_sha256", "events", "spec"):
        assert key in report
    assert report["samples"] == 2 * 60 * 64
    assert report["samples_per_s"] > 0 and report["final_checks_s"] > 0
    assert 0.0 <= report["eval"]["auc"] <= 1.0 and report["eval"]["logloss"] > 0
    assert report["eval"]["auc"] > 0.55, report["eval"]  # it learned something from the teacher
    assert report["spec"]["servers"]["replicas"] == 2
    kinds = [e["kind"] for e in report["events"]]
    assert "training_started" in kinds and "training_finished" in kinds
    # Every step pushes to both servers; No FT needs no 2PC or parity messages.
    served = report["rpcs_served"]
    assert served["Push"] >= 2 * 60 * 2 and served["Pull"] > 0, served
    assert not {"Stage", "Commit", "Delta", "DecideDeltas"} & set(served), served
    # Each role's CPU seconds from the processes' own counters: workers compute every step, servers serve
    # every push and pull; per 1,000 samples as the benchmarks print them.
    cpu = report["cpu"]
    assert set(cpu["seconds"]) == {"coordinator", "server", "worker"}, cpu
    assert cpu["seconds"]["worker"] > 0 and cpu["seconds"]["server"] > 0, cpu
    for role, seconds in cpu["seconds"].items():
        assert cpu["per_1000_samples"][role] == pytest.approx(1000 * seconds / report["samples"], abs=1e-4)
    # Per server: the rows it updated (each server got its own rows' pushes) and its process's CPU seconds.
    load = report["server_load"]
    assert [s["shard"] for s in load] == [0, 1], load
    assert all(s["work"] == s.get("push", 0) > 0 and "stage" not in s for s in load), (
        load
    )  # No FT: pushes only
    assert all(s["cpu_s"] > 0 for s in load), load  # matched to the shard by its process's instance
    assert processes_mentioning(str(tmp_path)) == []


def test_deterministic_runs_hash_equal_across_runs_and_server_counts(tmp_path):
    hashes = {}
    for label, servers in (("a3", 3), ("b3", 3), ("c5", 5)):
        ctx = make_ctx(
            label,
            servers__replicas=servers,
            training__deterministic="true",
            training__steps=25,
            training__optimizer="adam",
        )
        hashes[label] = run_local(ctx, tmp_path / label, progress=False)["params_sha256"]
    assert hashes["a3"] == hashes["b3"] == hashes["c5"]
    # And the hash does depend on the training: a different seed gives another model.
    other = make_ctx(
        "d3",
        servers__replicas=3,
        training__deterministic="true",
        training__steps=25,
        training__optimizer="adam",
        training__seed=8,
    )
    assert run_local(other, tmp_path / "d3", progress=False)["params_sha256"] != hashes["a3"]


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ecrec.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        **kw,
    )


def test_cli_rejects_invalid_spec_before_starting_anything(tmp_path):
    out = tmp_path / "out"
    res = _cli("local", "examples/local-small.yaml", "--set", "training.batchSize=-4", "--out", str(out))
    assert res.returncode == 2
    assert "spec.training.batchSize" in res.stderr
    assert not out.exists()


def test_cli_run_writes_report_and_plot(tmp_path):
    out = tmp_path / "out"
    res = _cli(
        "local",
        "examples/local-small.yaml",
        "--set",
        "training.steps=15",
        "--set",
        "servers.replicas=2",
        "--set",
        "faultTolerance.strategy=none",
        "--set",
        "workers.replicas=1",
        "--set",
        "model.preset=tiny",
        "--quiet",
        "--out",
        str(out),
        "--report",
        str(out / "r.json"),
        "--plot",
        str(out / "tp.png"),
    )
    assert res.returncode == 0, res.stderr
    report = json.loads((out / "r.json").read_text())
    assert report["spec"]["training"]["steps"] == 15
    assert (out / "tp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out / "r.json") in res.stderr and str(out / "tp.png") in res.stderr


def test_ctrl_c_stops_every_process(tmp_path):
    out = tmp_path / "out"
    proc = start_background_job(out, capture=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list((out / "logs").glob("worker-*.log")):
        time.sleep(0.2)
    time.sleep(3.0)  # let training get going
    assert len(processes_mentioning(str(out))) >= 3
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # it did not stop: kill it (its children follow) before the test fails
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert processes_mentioning(str(out)) == []


def test_failed_worker_fails_the_job_and_cleans_up(tmp_path):
    # A data file that is bad past the lines `ecrec local` checks before starting: the workers find it.
    data = tmp_path / "train.tsv"
    write_criteo_tsv(data, SyntheticData(make_ctx().model.table_sizes, seed=1), CHECK_LINES)
    with open(data, "a") as f:
        f.write("2" + "\t0" * (len(make_ctx().model.table_sizes) + 13) + "\n")
    out = tmp_path / "out"
    res = _cli(
        "local",
        "examples/local-small.yaml",
        "--set",
        "model.preset=tiny",
        "--set",
        "data.source=criteo",
        "--set",
        f"data.paths=[{data}]",
        "--quiet",
        "--out",
        str(out),
    )
    assert res.returncode == 1
    assert "job failed" in res.stderr and "worker" in res.stderr
    assert f"{data}:{CHECK_LINES + 1}: label must be 0 or 1" in (out / "logs/worker-0.log").read_text()
    assert processes_mentioning(str(out)) == []


def test_launcher_sigkill_takes_children_down(tmp_path):
    out = tmp_path / "out"
    proc = start_background_job(out)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(processes_mentioning(str(out))) < 3:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and processes_mentioning(str(out)):
        time.sleep(0.2)
    assert processes_mentioning(str(out)) == []


def test_generated_criteo_files_train_end_to_end(tmp_path):
    data = tmp_path / "train.tsv"
    res = _cli(
        "data",
        "generate",
        "examples/local-small.yaml",
        "--set",
        "model.preset=tiny",
        "-o",
        str(data),
        "-n",
        "20000",
    )
    assert res.returncode == 0, res.stderr
    assert len(data.read_text().splitlines()) == 20000
    ctx = make_ctx("criteo", data__source="criteo", data__paths=f"[{data}]", training__steps=40)
    report = run_local(ctx, tmp_path / "run", progress=False)
    assert report["spec"]["data"]["source"] == "criteo"
    assert report["eval"]["auc"] > 0.55, report["eval"]


def test_chaos_with_concurrent_kills_takes_down_that_many_distinct_servers_at_one_moment():
    """`ecrec local --chaos N --concurrent C`: each chaos event kills C distinct random servers at the same
    moment, the next event only once every shard is up again; C = 1 draws the same shards a seed drew before
    the option existed."""
    from types import SimpleNamespace

    from ecrec.local import Supervisor

    class Cluster:
        def __init__(self) -> None:
            self.ctx = SimpleNamespace(num_servers=6)
            self.children = {f"server-{s}": SimpleNamespace(alive=True) for s in range(6)}
            self.killed: list[tuple[str, float]] = []
            self.coordinator = SimpleNamespace(add_event=lambda _e: None)

        def kill(self, name: str) -> None:
            self.killed.append((name, clock[0]))

    def status(up: bool) -> dict:
        state = "up" if up else "recovering"
        return {
            "startedAt": 0.0,
            "step": 1,
            "cluster": {"shards": [{"state": state}] * 6},
            "phase": "Running",
        }

    import ecrec.local as local

    clock = [0.0]
    real_time = local.time.time
    local.time.time = lambda: clock[0]
    try:
        sup, cluster = Supervisor(chaos=2, seed=3, concurrent=2), Cluster()
        for t in range(0, 20):
            clock[0] = float(t)
            sup._kill_due(cluster, status(up=len(cluster.killed) != 2 or t > 10))
        one = Supervisor(chaos=1, seed=3)
        one._kill_due(Cluster(), status(up=True))
    finally:
        local.time.time = real_time
    assert len(cluster.killed) == 4
    (a, ta), (b, tb), (c, tc), (d, td) = cluster.killed
    assert a != b and ta == tb and c != d and tc == td and tc > 10  # the second event after the recovery
    import random

    rng = random.Random(3)
    assert one.next_chaos[0] == [rng.randrange(6)]
