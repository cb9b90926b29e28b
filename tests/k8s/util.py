"""Helpers the end-to-end modules share: waiting, the e2e job manifest, reading jobs and pods, `ecrec chaos`.

`kube` is anything with a `kubectl(*args, **kw)` method (KubeTestEnv, or test_helm_e2e's Cluster)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from .testenv import REPO


def wait_for(what: str, fn, timeout: float, every: float = 0.3):
    """fn()'s first truthy value, polling every `every` seconds; AssertionError after `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


# Jobs that must still train when a fault lands are paced (training.maxStepsPerSecond), not sized for a fast
# machine: `paced(S)` trains for at least S seconds on any machine that makes PACE steps a second, and no
# longer than steps / its own pace on a slower one. The tiny model makes ~45 steps/s on a quiet 2-core machine,
# ~15 beside a second control plane and Prometheus.
PACE = 10.0


def paced(seconds: float, pace: float = PACE) -> dict:
    """job_manifest overrides for a job that trains for at least `seconds` at `pace` steps a second."""
    return {"training.steps": int(seconds * pace), "training.maxStepsPerSecond": pace}


def job_manifest(name: str, namespace: str, **spec_overrides) -> str:
    """examples/k8s-small.yaml with the tiny model, 500 steps and no spare; `spec_overrides` as dotted
    paths."""
    doc = yaml.safe_load((REPO / "examples/k8s-small.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    spec = doc["spec"]
    spec["model"] = {"preset": "tiny"}
    spec["training"].update({"steps": 500, "batchSize": 256})
    # Deleted pods are reported at once (the operator's pod events); the timeout is for hung ones. Every
    # heartbeat crosses the test kubelet's Service proxy on a loaded machine: give it room.
    spec["coordinator"].update({"heartbeatIntervalSeconds": 0.5, "failureTimeoutSeconds": 10})
    # Without the example's warm spare: these tests follow a lost server's own replacement pod (a spare's
    # takeover has its own test, test_operator_e2e.py::test_a_warm_spare_pod_takes_over...).
    spec["servers"]["spares"] = 0
    for path, value in spec_overrides.items():
        node = spec
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return yaml.safe_dump(doc)


def get_job(kube, namespace: str, name: str) -> dict:
    return json.loads(kube.kubectl("get", "ecj", name, "-n", namespace, "-o", "json").stdout)


def pods(kube, namespace: str, selector: str) -> list[dict]:
    out = kube.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout
    return json.loads(out)["items"]


def wait_done(kube, namespace: str, name: str, timeout: float = 300) -> dict:
    """The job's status once it Succeeded and its final checks ran; fails at once if it Failed."""

    def done():
        st = get_job(kube, namespace, name).get("status") or {}
        assert st.get("phase") != "Failed", st
        return st if st.get("phase") == "Succeeded" and st.get("completionTime") else None

    return wait_for("the job to succeed", done, timeout=timeout, every=1)


# ------------------------------------------------------------------------------------------ ecrec chaos --
def chaos(kubeconfig: Path | str, namespace: str, *args: str) -> subprocess.CompletedProcess:
    """`ecrec chaos -n NAMESPACE ARGS` as a user runs it (kubeconfig from $KUBECONFIG)."""
    proc = subprocess.run(
        [sys.executable, "-m", "ecrec.cli", "chaos", "-n", namespace, *args],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
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


def chaos_table(stdout: str) -> list[dict]:
    """The rows of the table `ecrec chaos` prints, one dict per fault."""
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


def completed_recoveries(status: dict, shard: int) -> list[dict]:
    return [
        r for r in status.get("recoveries") or [] if r["shard"] == shard and r.get("state") == "completed"
    ]
