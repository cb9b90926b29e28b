"""ecrec.cputrace: CPU by process read from /proc, and what each role spent in each phase of a recovery."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from ecrec.bench import format_recovery_cpu, recovery_cpu, recovery_phases
from ecrec.cputrace import CpuSampler, cpu_at, cpu_by_phase, process_cpu_seconds, roles_through_a_kill

linux = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")


def child(role: str, index: int, name: str, proc=None, spare: int | None = None):
    return SimpleNamespace(role=role, index=index, name=name, instance=f"{name}-x", proc=proc, spare=spare)


@linux
def test_a_busy_process_accumulates_cpu_and_a_sleeping_one_does_not():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    try:
        sampler = CpuSampler()
        kids = [
            child("worker", 0, "busy", busy),
            child("server", 1, "idle", idle),
            child("server", 2, "done", done),
        ]
        time.sleep(0.3)  # past the interpreters' start
        sampler.sample(kids, 0.0)
        time.sleep(0.6)
        sampler.sample(kids, 0.6)
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    (t0, first), (t1, last) = sampler.samples
    # a reaped child is not read (its pid may belong to another process by now)
    assert set(first) == set(last) == {"busy-x", "idle-x"}
    assert last["busy-x"] - first["busy-x"] >= 0.15  # spinning for 0.6 s on cores shared with the rest
    assert last["idle-x"] - first["idle-x"] <= 0.05
    assert process_cpu_seconds(busy.pid) is None  # gone
    assert process_cpu_seconds(os.getpid()) > 0


def test_cpu_between_samples_is_interpolated_and_held_after_the_last():
    samples = [(0.0, {"a": 1.0}), (1.0, {"a": 2.0, "b": 0.5}), (2.0, {"b": 1.5})]
    assert cpu_at(samples, "a", 0.5) == pytest.approx(1.5)
    assert cpu_at(samples, "a", 1.8) == pytest.approx(2.0)  # died after its last sample: held
    assert cpu_at(samples, "b", 0.2) == pytest.approx(0.5)  # before its first sample: its first value
    assert cpu_at(samples, "c", 1.0) == 0.0
    (row,) = cpu_by_phase(samples, {"a": "workers", "b": "workers"}, [("p", 0.5, 1.5)])
    # a: 1.5 -> 2.0, b: 0.5 -> 1.0 over one second
    assert row["cores"] == {"workers": pytest.approx(1.0)} and row["total"] == pytest.approx(1.0)
    (empty,) = cpu_by_phase(samples, {"a": "workers"}, [("none", 1.0, 1.0)])
    assert empty["cores"] == {} and empty["total"] == 0


def test_roles_through_a_kill_tell_the_killed_server_from_what_replaced_it():
    kids = [
        child("coordinator", 0, "coordinator"),
        child("worker", 0, "worker-0"),
        child("server", 1, "server-1"),
        child("server", 2, "server-2"),  # the killed one
        child("server", 2, "spare-0", spare=0),  # adopted as shard 2
        child("spare", 1, "spare-1"),  # started after the recovery
        child("server", 2, "server-2b"),  # a restarted server 2 (no spare)
    ]
    groups = roles_through_a_kill({k.instance: k for k in kids}, shard=2)
    assert groups == {
        "coordinator-x": "coordinator",
        "worker-0-x": "workers",
        "server-1-x": "servers",
        "server-2-x": "servers",
        "spare-0-x": "replacement",
        "spare-1-x": "spares",
        "server-2b-x": "replacement",
    }


def test_recovery_cpu_splits_a_run_into_its_phases_with_the_throughput_in_each():
    # 1000 samples/s; nothing from the kill (8.0) to detection (8.1); half rate to full recovery (8.6)
    report = {
        "recoveries": [{"killed_at": 8.0, "detected_at": 8.1, "started_at": 8.35, "completed_at": 8.6}],
        "samples_series": [[0.0, 0], [8.0, 8000], [8.1, 8000], [8.6, 8250], [10.0, 9650]],
        "events": [
            {"kind": "replacement_registered", "t": 3.0},  # a spare at the start: not this recovery's
            {"kind": "replacement_registered", "t": 8.3},
        ],
    }
    phases = recovery_phases(report)
    assert [(round(a, 2), round(b, 2)) for _n, a, b in phases] == [
        (6.0, 8.0),
        (8.0, 8.1),
        (8.1, 8.3),
        (8.3, 8.6),
        (8.6, 9.6),
    ]
    kids = {"w": child("worker", 0, "w"), "r": child("server", 2, "r", spare=0)}
    sampler = SimpleNamespace(
        # the worker uses 1 core but 0.2 from the kill to full recovery; the replacement 0.5 from 8.1 on
        samples=[(6.0, {"w": 0.0, "r": 0.0}), (8.0, {"w": 2.0, "r": 0.0}), (8.1, {"w": 2.02, "r": 0.0})]
        + [(8.6, {"w": 2.12, "r": 0.25}), (9.6, {"w": 3.12, "r": 0.75})],
        children=kids,
    )
    rows = recovery_cpu(report, sampler)
    assert [r["cores"]["workers"] for r in rows] == pytest.approx([1.0, 0.2, 0.2, 0.2, 1.0])
    assert [r["cores"]["replacement"] for r in rows] == pytest.approx([0.0, 0.0, 0.5, 0.5, 0.5])
    assert [r["throughput"] for r in rows] == pytest.approx([1.0, 0.0, 0.5, 0.5, 1.0])
    text = format_recovery_cpu(rows, kill=8.0)
    assert "degraded (-> replacement registered)" in text and "+0.10..+0.30  0.50  workers 0.20" in text
