"""`ecrec chaos` end to end: a real API server, the test kubelet, the operator (its ServiceAccount, as in
test_operator_e2e.py), an ECRecJob, and `ecrec chaos` as a subprocess with an admin kubeconfig. Faults are
injected one at a time; the job must succeed with exact parity, and each server fault must show up as a
completed recovery in the job's status."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from .test_operator_e2e import NS, get_job, job_manifest, operator, pods, wait_done, wait_for  # noqa: F401
from .testenv import REPO

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

# Jobs long enough for their faults and recoveries (each takes a replacement pod's start-up), even on a busy
# machine: the chaos stops early, and the test fails, if the job finishes first.
STEPS_THREE_FAULTS, STEPS_ONE_FAULT = 4000, 1500


def chaos(kube, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "ecrec.cli", "chaos", "-n", NS, *args],
        env={**os.environ, "KUBECONFIG": str(kube.kubeconfig)},
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    print(proc.stderr)
    print(proc.stdout)
    return proc


ROW = re.compile(
    r"^\s*(\d+)\s+(pod-kill|pod-failure) (server|worker|coordinator) (\d+)(?: \([\d.]+s\))?\s+(\S+)"
    r"\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(.*?)\s*$"
)
FIELDS = (
    "n",
    "action",
    "role",
    "index",
    "pod",
    "injected",
    "detected",
    "continued",
    "recovered",
    "rows",
    "outcome",
)


def table(stdout: str) -> list[dict]:
    """The rows of the printed table, one dict per fault."""
    rows = []
    for line in stdout.splitlines():
        m = ROW.match(line)
        if m:
            row = dict(zip(FIELDS, m.groups(), strict=True))
            row["n"], row["index"] = int(row["n"]), int(row["index"])
            rows.append(row)
    return rows


def recovered(row: dict) -> bool:
    return row["outcome"].split(" ")[0] == "recovered" and row["recovered"].startswith("+")


def start(kube, name: str, steps: int) -> None:
    kube.kubectl("apply", "-f", "-", input=job_manifest(name, **{"training.steps": steps}))
    wait_for(
        "training to run",
        lambda: (get_job(kube, name).get("status") or {}).get("step", 0) >= 10,
        timeout=180,
    )


def completed_recoveries(status: dict, shard: int) -> list[dict]:
    return [
        r for r in status.get("recoveries") or [] if r["shard"] == shard and r.get("state") == "completed"
    ]


def test_three_pod_kills_one_at_a_time_and_the_job_succeeds(kube, operator):  # noqa: F811
    name = "e2e-chaos"
    start(kube, name, STEPS_THREE_FAULTS)
    # Seed 25 draws worker 0, the coordinator, then server 2: the candidates are the 8 pods sorted by name
    # (a replacement keeps its predecessor's place), so the choice is reproducible.
    proc = chaos(kube, "--job", name, "--role", "any", "--count", "3", "--interval", "2", "--seed", "25")
    assert proc.returncode == 0, proc.stderr + json.dumps(get_job(kube, name).get("status"), indent=1)
    rows = table(proc.stdout)
    assert [r["n"] for r in rows] == [1, 2, 3], proc.stdout
    assert {r["role"] for r in rows} == {"server", "worker", "coordinator"}, (
        "pick another seed: the draw must hit every role"
    )
    assert all(r["action"] == "pod-kill" and recovered(r) for r in rows), rows
    assert len({r["pod"] for r in rows}) == 3  # each fault hit a pod that was running then

    status = wait_done(kube, name, timeout=600)
    assert status["parityCheck"]["mismatches"] == 0 and status["parityCheck"]["stripes"] > 0
    assert status["replacements"] >= 3
    for shard in {r["index"] for r in rows if r["role"] == "server"}:
        hits = sum(1 for r in rows if r["role"] == "server" and r["index"] == shard)
        recs = completed_recoveries(status, shard)
        assert len(recs) >= hits and all(r["rowsRecovered"] > 0 for r in recs), status["recoveries"]
    live = {p["metadata"]["name"] for p in pods(kube, f"ecrec.dev/job={name}")}
    assert not live & {r["pod"] for r in rows}, "a killed pod is still there"


def test_a_paused_server_is_declared_failed_by_the_coordinator_and_replaced(kube, operator):  # noqa: F811
    name = "e2e-pause"
    start(kube, name, STEPS_ONE_FAULT)
    proc = chaos(
        kube, "--job", name, "--action", "pod-failure", "--role", "server", "--count", "1", "--duration", "30"
    )
    assert proc.returncode == 0, proc.stderr
    [row] = table(proc.stdout)
    assert row["action"] == "pod-failure" and row["role"] == "server", row
    assert recovered(row) and row["detected"].startswith("+"), row
    assert "injector annotation" in proc.stderr  # no Chaos Mesh here: the test kubelet's stand-in paused it
    # The coordinator noticed (its recovery record has a detection time) and the operator deleted the paused
    # pod, whose phase had stayed Running, because the coordinator declared it failed.
    events = kube.kubectl("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={name}").stdout
    assert f"Deleted pod {row['pod']}: the coordinator declared it failed" in events, events
    status = wait_done(kube, name, timeout=600)
    [rec] = completed_recoveries(status, row["index"])
    assert rec["detectedAt"] and rec["rowsRecovered"] > 0
    assert status["parityCheck"]["mismatches"] == 0
