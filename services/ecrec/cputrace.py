"""CPU by process over time, read from /proc while a local job runs, and what each role spent in each phase of
a recovery (`ecrec bench recovery --timeline`): on a machine whose cores every process shares, throughput
through a recovery is what the recovery leaves to the workers, so where it goes must be measured.

The processes' counters are read from outside, every `interval` seconds, so the numbers include what no
process reports itself (a spare's start, a killed server's last moments) and cost none of the job's CPU but
the sampler's own (~1% of a core at 50 ms). Linux only: elsewhere every reading is None and nothing is printed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far; None if it cannot be read (gone, not Linux)."""
    try:
        # the command name (field 2) may hold spaces and parentheses: fields are counted after its last ")"
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


class CpuSampler:
    """Every `interval` seconds, the CPU seconds of each live child of a `LocalCluster` (its `history`: every
    process it started). Start it from run_local's `on_tick` hook (`sampler.on_tick`); times are seconds
    since the job started (status `startedAt`), as the report's events are."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.children: dict[str, object] = {}  # key -> the cluster's Child
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_tick(self, cluster, status: dict) -> None:
        if self._thread is None and status.get("startedAt") is not None:
            self._thread = threading.Thread(
                target=self._run, args=(cluster, float(status["startedAt"])), daemon=True, name="cpu-sampler"
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, cluster, origin: float) -> None:
        while not self._stop.wait(self.interval):
            self.sample(cluster.history, time.time() - origin)

    def sample(self, children: Iterable, t: float) -> None:
        snap = {}
        for child in list(children):
            # only live children: a reaped child's pid may already belong to another process
            if child.proc is None or child.proc.poll() is not None:
                continue
            cpu = process_cpu_seconds(child.proc.pid)
            if cpu is not None:
                key = child.instance or child.name
                snap[key] = cpu
                self.children[key] = child
        self.samples.append((t, snap))


def roles_through_a_kill(children: dict[str, object], shard: int) -> dict[str, str]:
    """Each sampled process's group for a run in which server `shard` was killed: workers, coordinator,
    servers, replacement (whatever served `shard` after the first: a restarted server or an adopted spare),
    spares (those still waiting at the end)."""
    # the killed one: started with the job as that shard, so sampled before any other
    killed = next(
        (k for k, c in children.items() if c.role == "server" and c.index == shard and c.spare is None), None
    )
    out = {}
    for key, child in children.items():
        if child.role == "worker":
            out[key] = "workers"
        elif child.role == "coordinator":
            out[key] = "coordinator"
        elif child.role == "spare":
            out[key] = "spares"
        elif child.index == shard and key != killed:
            out[key] = "replacement"
        else:
            out[key] = "servers"
    return out


def cpu_at(samples: list[tuple[float, dict[str, float]]], key: str, t: float) -> float:
    """Process `key`'s CPU seconds at time t: linear between its samples, its last value after its last one
    (it died or stopped being read), its first before its first (it had not started, or its start before
    the first reading is not counted: at most one interval)."""
    points = [(s, snap[key]) for s, snap in samples if key in snap]
    if not points:
        return 0.0
    if t <= points[0][0]:
        return points[0][1]
    for (t0, c0), (t1, c1) in zip(points, points[1:], strict=False):
        if t0 <= t <= t1:
            return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1
    return points[-1][1]


def cpu_by_phase(
    samples: list[tuple[float, dict[str, float]]],
    groups: dict[str, str],
    phases: list[tuple[str, float, float]],
) -> list[dict]:
    """Cores each group used in each phase (CPU seconds over the phase's length)."""
    out = []
    for name, t0, t1 in phases:
        cores: dict[str, float] = {}
        if t1 > t0:
            for key, group in groups.items():
                used = cpu_at(samples, key, t1) - cpu_at(samples, key, t0)
                cores[group] = cores.get(group, 0.0) + used / (t1 - t0)
        out.append({"phase": name, "from": t0, "to": t1, "cores": cores, "total": sum(cores.values())})
    return out
