"""The committed CRD (charts/ecrec/crds/ecrecjobs.yaml) on the real 1.20 API server: accepted as written,
examples/k8s-small.yaml stored with the schema's defaults (the same ones pydantic fills), bad Kubernetes fields
refused, `kubectl explain` and `kubectl get ecj` useful, and a status written through the status subresource
read back as written (kopf's bookkeeping kept, unknown fields pruned)."""

from __future__ import annotations

import json
import subprocess
import time
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from ecrec.spec import JobStatus, SpecError, crd_manifest, job_from_dict, load_job

from .testenv import REPO, KubeTestEnv

pytestmark = pytest.mark.k8s

CRD_FILE = REPO / "charts" / "ecrec" / "crds" / "ecrecjobs.yaml"
EXAMPLE = REPO / "examples" / "k8s-small.yaml"
CRD_NAME = "ecrecjobs.ecrec.dev"
NS = "ecrec-crd"
JOB = "k8s-small"


def run(kube: KubeTestEnv, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
    """kubectl that must succeed; its stderr in the failure message otherwise."""
    proc = kube.kubectl(*args, input=input, check=False)
    assert proc.returncode == 0, f"kubectl {' '.join(args)}:\n{proc.stderr}"
    return proc


def get_job(kube: KubeTestEnv, name: str = JOB) -> dict[str, Any]:
    return json.loads(run(kube, "get", "ecrecjob", name, "-n", NS, "-o", "json").stdout)


def pruned(value: Any) -> Any:
    """`value` without nulls and empty maps/lists: what is unset means the same on both sides."""
    if isinstance(value, dict):
        out = {k: pruned(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        return [pruned(v) for v in value]
    return value


@pytest.fixture(scope="module")
def crd(kube: KubeTestEnv) -> dict[str, Any]:
    """The committed CRD file applied and Established; the API server's copy of it."""
    run(kube, "apply", "-f", str(CRD_FILE))
    kube.wait_crd_established(CRD_NAME)
    return json.loads(run(kube, "get", f"crd/{CRD_NAME}", "-o", "json").stdout)


@pytest.fixture(scope="module")
def job(kube: KubeTestEnv, crd: dict[str, Any]) -> dict[str, Any]:
    """examples/k8s-small.yaml applied as is, as the API server stored it."""
    run(kube, "create", "namespace", NS)
    run(kube, "apply", "-n", NS, "-f", str(EXAMPLE))
    return get_job(kube)


def test_crd_is_accepted_as_written(crd: dict[str, Any]):
    conditions = {c["type"]: c for c in crd["status"]["conditions"]}
    assert conditions["Established"]["status"] == "True", conditions
    assert conditions["NamesAccepted"]["status"] == "True", conditions
    # A non-structural schema is stored but flagged (and pruning/defaulting is then off).
    assert "NonStructuralSchema" not in conditions, conditions["NonStructuralSchema"]["message"]
    names = crd["status"]["acceptedNames"]
    assert (names["kind"], names["shortNames"], names["categories"]) == ("ECRecJob", ["ecj"], ["ecrec"])
    [served] = crd["spec"]["versions"]
    [ours] = crd_manifest()["spec"]["versions"]
    # Nothing dropped or rewritten: every default, enum, bound, pattern and description is enforced as written.
    assert served["schema"] == ours["schema"]
    assert served["additionalPrinterColumns"] == ours["additionalPrinterColumns"]
    assert served["subresources"] == {"status": {}}


def test_server_fills_the_same_defaults_as_pydantic(job: dict[str, Any]):
    doc = yaml.safe_load(EXAMPLE.read_text())
    stored = job["spec"]
    assert stored != doc["spec"]  # the API server added the defaults the file leaves out
    assert stored["runPolicy"]["cleanPodPolicy"] == "Running"
    assert stored["runPolicy"]["backoffLimit"] == 10
    assert stored["coordinator"]["failureTimeoutSeconds"] == 3.0
    assert stored["faultTolerance"]["ecrec"]["r"] == 1 and stored["data"]["evalSamples"] == 8192
    assert stored["workers"]["resources"]["requests"] == {"cpu": 1, "memory": "1Gi"}  # int-or-string kept
    assert "imagePullPolicy" in stored["servers"] and "serviceAccountName" not in stored["workers"]
    # Field for field the effective spec `ecrec local` computes, but for what a preset fills (no CRD default:
    # the API server would otherwise override the preset) and quantities the file wrote as numbers.
    effective = load_job(EXAMPLE).spec.to_dict()
    for alias in ("embeddingDim", "numDenseFeatures", "tableSizes", "bottomMlp", "topMlp"):
        effective["model"].pop(alias)
    effective["workers"]["resources"]["requests"]["cpu"] = 1
    assert pruned(stored) == pruned(effective)


def test_toleration_operator_defaults_to_equal(kube: KubeTestEnv, job: dict[str, Any]):
    manifest = job_from_dict({"model": {"preset": "tiny"}}).to_manifest()
    manifest["metadata"]["name"] = "tolerant"
    manifest["spec"]["workers"]["tolerations"] = [{"key": "gpu", "value": "a100", "effect": "NoSchedule"}]
    run(kube, "apply", "-n", NS, "-f", "-", input=json.dumps(manifest))
    [tol] = get_job(kube, "tolerant")["spec"]["workers"]["tolerations"]
    assert tol == {"key": "gpu", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}


INVALID = [
    pytest.param(
        ("servers", "resources", "requests", "memory"), "2 GB", "spec.servers.resources.requests.memory",
        "should match", id="quantity",
    ),
    pytest.param(
        ("runPolicy", "cleanPodPolicy"), "Sometimes", "spec.runPolicy.cleanPodPolicy", 'Unsupported value: "Sometimes"',
        id="clean-pod-policy",
    ),
    pytest.param(
        ("runPolicy", "activeDeadlineSeconds"), 0, "spec.runPolicy.activeDeadlineSeconds",
        "should be greater than or equal to 1", id="deadline",
    ),
    pytest.param(
        ("workers", "serviceAccountName"), "Not_A_Name", "spec.workers.serviceAccountName", "should match",
        id="service-account",
    ),
    pytest.param(
        ("coordinator", "imagePullPolicy"), "Sometimes", "spec.coordinator.imagePullPolicy", "Unsupported value",
        id="pull-policy",
    ),
    pytest.param(
        # 1.20 names no list index in the path
        ("servers", "tolerations"), [{"key": "a", "effect": "NoWay"}], "spec.servers.tolerations.effect",
        "Unsupported value", id="toleration-effect",
    ),
]  # fmt: skip


@pytest.mark.parametrize("path, value, field, reason", INVALID)
def test_bad_kubernetes_fields_are_refused_by_the_server(
    kube: KubeTestEnv, job: dict[str, Any], path, value, field, reason
):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": "bad-job"}
    node = doc["spec"]
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    with pytest.raises(SpecError):  # pydantic refuses it first: `ecrec validate` and the server agree
        job_from_dict(doc)
    proc = kube.kubectl(
        "apply", "--validate=false", "-n", NS, "-f", "-", input=yaml.safe_dump(doc), check=False
    )
    assert proc.returncode != 0, proc.stdout
    assert 'The ECRecJob "bad-job" is invalid: ' in proc.stderr, proc.stderr
    assert field in proc.stderr and reason in proc.stderr, proc.stderr


def explain(kube: KubeTestEnv, field: str, timeout: float = 60) -> str:
    """`kubectl explain FIELD`; the API server publishes a new CRD's OpenAPI a few seconds after it is created."""
    deadline = time.monotonic() + timeout
    while True:
        proc = kube.kubectl("explain", field, check=False)
        if proc.returncode == 0:
            return proc.stdout
        if time.monotonic() > deadline:
            raise AssertionError(f"kubectl explain {field}: {proc.stderr}")
        time.sleep(1)


def test_explain_describes_the_ecrec_strategy(kube: KubeTestEnv, crd: dict[str, Any]):
    text = " ".join(explain(kube, "ecrecjob.spec.faultTolerance.ecrec").split())  # unwrap kubectl's lines
    assert "KIND: ECRecJob" in text and "v1alpha1" in text  # kubectl's header differs between versions
    assert "Settings for strategy ecrec" in text and "erasure-coded across the servers" in text
    for field in ("k", "r", "code", "twoPhaseCommit", "replicateDense", "lockGroupRows", "txnTimeoutSeconds"):
        assert f"{field} <" in text, f"{field} missing from kubectl explain:\n{text}"
    assert "Parity costs 1/k of the embedding memory" in text
    assert "recovery is bit-exact" in text
    run_policy = " ".join(explain(kube, "ecrecjob.spec.runPolicy.cleanPodPolicy").split())
    assert "Kubeflow" in run_policy and "Running" in run_policy


def test_get_shows_the_printer_columns(kube: KubeTestEnv, job: dict[str, Any]):
    header, *rows = run(kube, "get", "ecj", "-n", NS).stdout.splitlines()
    assert header.split() == [
        "NAME", "PHASE", "STEP", "SAMPLES/S", "SERVERS", "RECOVERIES", "REPLACEMENTS", "AGE",
    ]  # fmt: skip
    assert any(row.split()[0] == JOB for row in rows), rows
    wide = run(kube, "get", "ecj", JOB, "-n", NS, "-o", "wide").stdout.splitlines()[0].split()
    assert wide[-2:] == ["REASON", "AUC"]
    # The category: `kubectl get ecrec` lists every ECRec resource kind.
    assert f"ecrecjob.ecrec.dev/{JOB}" in run(kube, "get", "ecrec", "-n", NS, "-o", "name").stdout


def status_patch(kube: KubeTestEnv, patch: dict[str, Any], check: bool = True) -> subprocess.CompletedProcess:
    args = (
        "patch",
        "ecrecjob",
        JOB,
        "-n",
        NS,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(patch),
    )
    return run(kube, *args) if check else kube.kubectl(*args, check=False)


def test_status_round_trips_through_the_status_subresource(kube: KubeTestEnv, job: dict[str, Any]):
    t = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    status = JobStatus.model_validate(
        {
            "observedGeneration": job["metadata"]["generation"],
            "phase": "Degraded",
            "reason": "ShardFailed",
            "conditions": [
                {"type": "Created", "status": "True", "reason": "ECRecJobCreated", "lastTransitionTime": t},
                {
                    "type": "Degraded",
                    "status": "True",
                    "reason": "ShardFailed",
                    "message": "server 2 missed its heartbeats",
                    "lastUpdateTime": t,
                    "lastTransitionTime": t,
                },
            ],
            "startTime": t,
            "step": 120,
            "totalSteps": 300,
            "samplesPerSecond": 5120.5,
            "servers": {
                "up": 4,
                "total": 5,
                "shards": [
                    {
                        "shard": s,
                        "state": "failed" if s == 2 else "up",
                        "incarnation": 1,
                        "pod": f"{JOB}-server-{s}",
                    }
                    for s in range(5)
                ],
            },
            "replicaStatuses": {
                "server": {"active": 4, "failed": 1},
                "worker": {"active": 2},
                "coordinator": {"active": 1},
            },
            "recoveries": [
                {
                    "shard": 2,
                    "state": "waiting",
                    "killedAt": t,
                    "detectedAt": t,
                    "continuedAt": t,
                    "rowsRecovered": 0,
                }
            ],
            "replacements": 1,
            "eval": {"auc": 0.7125, "logloss": 0.5},
            "parityCheck": {"stripes": 27000, "mismatches": 0, "checkedAt": t},
        }
    ).to_dict()
    kopf = {
        "progress": {"ecrec_create": {"started": "2026-01-02T03:04:05.123456", "retries": 0}},
        "dummy": "x",
    }
    status_patch(kube, {"status": {**status, "kopf": kopf, "notInTheSchema": 1}})

    after = get_job(kube)
    assert after["status"] == {**status, "kopf": kopf}  # unknown fields pruned, kopf's kept as written
    assert after["metadata"]["generation"] == job["metadata"]["generation"]  # status writes leave spec alone
    assert after["spec"] == job["spec"]

    [row] = run(kube, "get", "ecj", JOB, "-n", NS, "--no-headers").stdout.splitlines()
    assert row.split()[:7] == [JOB, "Degraded", "120/300", "5120.5", "4/5", "1", "1"], row
    wide = run(kube, "get", "ecj", JOB, "-n", NS, "-o", "wide", "--no-headers").stdout.split()
    assert wide[-2:] == ["ShardFailed", "0.7125"], wide

    # A status sent through the main resource is ignored once the status subresource is on.
    run(
        kube,
        "patch",
        "ecrecjob",
        JOB,
        "-n",
        NS,
        "--type=merge",
        "-p",
        json.dumps({"status": {"phase": "Failed"}}),
    )
    assert get_job(kube)["status"]["phase"] == "Degraded"

    # A later patch changes only what it names (a JobStatus holding only the changes is that patch).
    status_patch(kube, {"status": JobStatus(phase="Running", samples_per_second=6000.0).to_dict()})
    after = get_job(kube)["status"]
    assert (after["phase"], after["samplesPerSecond"], after["stepText"]) == ("Running", 6000.0, "120/300")


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({"phase": "Exploded"}, 'status.phase: Unsupported value: "Exploded"'),
        (
            {"conditions": [{"type": "Running", "status": "Yes"}]},
            "status.conditions.status: Unsupported value",
        ),
        ({"conditions": [{"status": "True"}]}, "status.conditions.type: Required value"),
        ({"eval": {"auc": 1.5}}, "status.eval.auc"),
        ({"startTime": "yesterday"}, "status.startTime"),
    ],
)
def test_invalid_status_is_refused(kube: KubeTestEnv, job: dict[str, Any], bad: dict[str, Any], reason: str):
    with pytest.raises(ValueError):
        JobStatus.model_validate(bad)  # the operator's own model refuses it before the API server does
    proc = status_patch(kube, {"status": bad}, check=False)
    assert proc.returncode != 0, proc.stdout
    assert 'The ECRecJob "k8s-small" is invalid' in proc.stderr and reason in proc.stderr, proc.stderr
