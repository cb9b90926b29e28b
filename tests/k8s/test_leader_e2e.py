"""Two operators, one Lease (ecrec_operator.leader) on the real API server: only the leader acts, and killing it
mid-recovery hands the job over without a second replacement.

Both run as the chart runs its replicas (`--leader-elect`), with the operator ServiceAccount's token
(operator/deploy/rbac.yaml: its Lease only, in ecrec-system), on short timings (a 4 s lease) so the handover
takes seconds. The leader is SIGKILLed right after it created the replacement of a deleted server pod, before
the rebuild finished: no chance to release the Lease. The candidate takes over once the Lease has not changed
for its duration, carries on from what it observes, and the job ends with exactly one replacement.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from . import util
from .test_operator_e2e import Operator, sa_kubeconfig
from .testenv import REPO
from .util import wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NS = "leader-e2e"
LEASE = ("ecrec-system", "ecrec-operator")
TIMINGS = ("--leader-elect-lease-duration", "4", "--leader-elect-renew-deadline", "3")
TIMINGS += ("--leader-elect-retry-period", "0.5")


class Candidate(Operator):
    """One operator replica as the chart runs it (`--leader-elect`), under its own identity, on short timings."""

    def __init__(self, identity: str, kubeconfig: Path, log: Path):
        args = ("--leader-elect", "--leader-elect-identity", identity, *TIMINGS)
        super().__init__(kubeconfig, log, namespace=NS, args=args)

    def text(self) -> str:
        return self.log.read_text()


def holder(kube) -> str:
    ns, name = LEASE
    got = kube.kubectl("get", "lease", name, "-n", ns, "-o", "json", check=False)
    if got.returncode != 0:
        return ""
    return json.loads(got.stdout)["spec"].get("holderIdentity") or ""


@pytest.fixture(scope="module")
def candidates(kube, kubelet, ecrec_crd, tmp_path_factory):
    kube.kubectl("apply", "-f", str(REPO / "operator/deploy/rbac.yaml"))
    kube.kubectl("create", "namespace", NS, check=False)
    out = tmp_path_factory.mktemp("leader")
    kubeconfig = sa_kubeconfig(kube, out)
    a = Candidate("op-a", kubeconfig, out / "op-a.log")
    b = Candidate("op-b", kubeconfig, out / "op-b.log")
    a.start()
    wait_for("op-a to lead", lambda: holder(kube) == "op-a", timeout=120)
    b.start()
    wait_for("op-b to wait", lambda: "op-b waits; op-a leads" in b.text(), timeout=120)
    yield a, b
    a.stop(signal.SIGTERM)
    b.stop(signal.SIGTERM)
    print(f"operator logs: {a.log} {b.log}")
    kube.kubectl("delete", "ecrecjobs", "--all", "-n", NS, "--wait=false", check=False)
    kube.kubectl("delete", "pods", "--all", "-n", NS, "--wait=false", check=False)


def test_killing_the_leader_mid_recovery_hands_over_without_a_double_replacement(kube, candidates):
    a, b = candidates
    name = "leader-kill"
    kube.kubectl(
        "apply",
        "-f",
        "-",
        input=util.job_manifest(
            name, NS, **{"faultTolerance.ecrec.lockGroupRows": 64, **util.paced(25, pace=20)}
        ),
    )
    wait_for(
        "training to run",
        lambda: (util.get_job(kube, NS, name).get("status") or {}).get("step", 0) >= 20,
        timeout=180,
    )
    assert holder(kube) == "op-a" and "op-b leads" not in b.text()  # the candidate has not acted

    (victim,) = util.pods(kube, NS, f"ecrec.dev/job={name},ecrec.dev/role=server,ecrec.dev/shard=3")
    kube.kubectl("delete", "pod", "-n", NS, victim["metadata"]["name"], "--wait=false")
    wait_for(
        "the replacement pod",
        lambda: any(
            p["metadata"]["name"] == f"{name}-server-3-2"
            for p in util.pods(kube, NS, f"ecrec.dev/job={name},ecrec.dev/shard=3")
        ),
        timeout=120,
        every=0.1,
    )
    a.stop(signal.SIGKILL)  # the leader, mid-recovery: its Lease is not released
    wait_for("op-b to lead", lambda: holder(kube) == "op-b", timeout=60, every=0.2)

    status = util.wait_done(kube, NS, name)
    recs = [r for r in status["recoveries"] if r["shard"] == 3]
    assert recs and recs[-1]["state"] == "completed", status["recoveries"]
    assert status["parityCheck"]["mismatches"] == 0
    # Exactly one replacement pod for shard 3, and the status counts one.
    names = sorted(
        p["metadata"]["name"] for p in util.pods(kube, NS, f"ecrec.dev/job={name},ecrec.dev/shard=3")
    )
    assert not any(n.endswith("-3") for n in names), names
    assert status["replacements"] == 1
    log = b.text()
    assert log.index("op-b waits; op-a leads") < log.index("op-b leads"), log
