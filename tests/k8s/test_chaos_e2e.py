"""`ecrec chaos --action pod-failure` end to end: a real API server, the test kubelet, the operator (its
ServiceAccount, as in test_operator_e2e.py), an ECRecJob, and `ecrec chaos` as a subprocess with an admin
kubeconfig. The paused server must be found out by the coordinator (its pod stays Running) and replaced.

`--role any --count 3` (pod-kill of a worker, the coordinator and a server) runs after a real `helm install`,
scraped by Prometheus: tests/k8s/test_helm_e2e.py."""

from __future__ import annotations

import pytest

from . import util
from .test_operator_e2e import NS, get_job, job_manifest, operator, wait_done, wait_for  # noqa: F401

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

# Training time for one fault and its recovery (a replacement pod's start-up), paced (util.paced) so that no
# machine finishes first: on a busy machine the pause began ~16 s into training and the recovery was done ~28 s in.
SECONDS_ONE_FAULT = 60


def start(kube, name: str, seconds: float) -> None:
    kube.kubectl("apply", "-f", "-", input=job_manifest(name, **util.paced(seconds)))
    wait_for(
        "training to run",
        lambda: (get_job(kube, name).get("status") or {}).get("step", 0) >= 10,
        timeout=180,
    )


def test_a_paused_server_is_declared_failed_by_the_coordinator_and_replaced(kube, operator):  # noqa: F811
    name = "e2e-pause"
    start(kube, name, SECONDS_ONE_FAULT)
    proc = util.chaos(
        kube.kubeconfig,
        NS,
        *("--job", name, "--action", "pod-failure", "--role", "server", "--count", "1", "--duration", "30"),
    )
    assert proc.returncode == 0, proc.stderr
    [row] = util.chaos_table(proc.stdout)
    assert row["action"] == "pod-failure" and row["role"] == "server", row
    assert util.recovered(row) and row["detected"].startswith("+"), row
    assert "injector annotation" in proc.stderr  # no Chaos Mesh here: the test kubelet's stand-in paused it
    # The coordinator noticed (its recovery record has a detection time) and the operator deleted the paused
    # pod, whose phase had stayed Running, because the coordinator declared it failed.
    events = kube.kubectl("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={name}").stdout
    assert f"Deleted pod {row['pod']}: the coordinator declared it failed" in events, events
    status = wait_done(kube, name, timeout=600)
    [rec] = util.completed_recoveries(status, row["index"])
    assert rec["detectedAt"] and rec["rowsRecovered"] > 0
    assert status["parityCheck"]["mismatches"] == 0
