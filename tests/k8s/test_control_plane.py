"""Smoke test of the Kubernetes test control plane (hack/kube-testenv) with the ECRecJob CRD from `ecrec crd`:
the API server stores valid jobs with the schema's defaults, refuses invalid ones with a reason, and the
controller-manager garbage-collects objects owned by a deleted job and deletes namespaces."""

from __future__ import annotations

import copy
import ipaddress
import json
import time
from pathlib import Path

import pytest
import yaml

from .testenv import REPO, KubeTestEnv

pytestmark = pytest.mark.k8s

EXAMPLE = REPO / "examples" / "local-small.yaml"


def example_job(name: str) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": name}
    return doc


def wait_gone(kube: KubeTestEnv, *args: str, timeout: float = 60.0) -> float:
    """Polls `kubectl get ARGS` until NotFound; returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        proc = kube.kubectl("get", *args, "-o", "name", check=False)
        if proc.returncode != 0 and "NotFound" in proc.stderr:
            return time.monotonic() - t0
        assert proc.returncode == 0, proc.stderr
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{args} still there after {timeout} s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ns(kube: KubeTestEnv, ecrec_crd: str) -> str:
    name = "ecrec-smoke"
    kube.kubectl("create", "namespace", name)
    return name


def test_server_is_local_v1_20(kube: KubeTestEnv):
    assert kube.server.startswith("https://127.0.0.1:")
    version = json.loads(kube.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.20."), version
    assert kube.status().returncode == 0


def test_listens_on_loopback_only(kube: KubeTestEnv):
    listening = listening_sockets(kube.pids().values())
    assert listening, "found no listening sockets of etcd / kube-apiserver"
    for pid, addr in listening:
        assert addr.startswith(("127.", "::1", "::ffff:127.")), f"pid {pid} listens on {addr}"
    # etcd: client + peer port; kube-apiserver: its secure port; kube-controller-manager: none (--port=0)
    assert kube.pids()["kube-controller-manager"] not in {pid for pid, _ in listening}


def test_crd_established(kube: KubeTestEnv, ecrec_crd: str):
    crd = json.loads(kube.kubectl("get", f"crd/{ecrec_crd}", "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions.get("Established") == "True", conditions
    assert conditions.get("NamesAccepted") == "True", conditions
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1alpha1"]


def test_valid_job_is_stored_with_defaults(kube: KubeTestEnv, ns: str):
    kube.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    job = json.loads(kube.kubectl("get", "ecrecjob", "local-small", "-n", ns, "-o", "json").stdout)
    spec = job["spec"]
    assert job["apiVersion"] == "ecrec.dev/v1alpha1" and job["kind"] == "ECRecJob"
    assert spec["servers"]["replicas"] == 5
    assert spec["workers"]["replicas"] == 2
    assert spec["faultTolerance"]["strategy"] == "ecrec"
    assert spec["faultTolerance"]["ecrec"]["k"] == 4
    # fields left out of the example get the CRD schema's defaults on the server
    assert spec["data"]["evalSamples"] == 8192
    assert spec["faultTolerance"]["ecrec"]["r"] == 1
    # short name and printer columns
    table = kube.kubectl("get", "ecj", "-n", ns).stdout
    assert "PHASE" in table and "REPLACEMENTS" in table and "local-small" in table


INVALID = [
    pytest.param(
        ("servers", "replicas"), -1, "in body should be greater than or equal to 1", id="replicas-negative"
    ),
    pytest.param(("servers", "replicas"), "many", "in body must be of type integer", id="replicas-string"),
    pytest.param(("faultTolerance", "strategy"), "raid5", 'Unsupported value: "raid5"', id="strategy-enum"),
    pytest.param(("training", "learningRate"), 0, "in body should be greater than 0", id="lr-zero"),
    pytest.param(("model", "tableSizes"), [], "in body should have at least 1 items", id="tables-empty"),
]


@pytest.mark.parametrize("path, value, reason", INVALID)
def test_invalid_job_is_refused_by_the_server(kube: KubeTestEnv, ns: str, path, value, reason):
    doc = example_job("bad-job")
    node = doc["spec"]
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    # --validate=false: kubectl sends it as is, so the refusal is the API server's, not kubectl's
    proc = kube.kubectl(
        "apply", "--validate=false", "-n", ns, "-f", "-", input=yaml.safe_dump(doc), check=False
    )
    assert proc.returncode != 0, proc.stdout
    # the API server's 422: 'The ECRecJob "bad-job" is invalid: spec.servers.replicas: Invalid value: -1:
    # spec.servers.replicas in body should be greater than or equal to 1'
    assert 'The ECRecJob "bad-job" is invalid: ' in proc.stderr, proc.stderr
    assert f"spec.{'.'.join(path)}" in proc.stderr and reason in proc.stderr, proc.stderr
    missing = kube.kubectl("get", "ecrecjob", "bad-job", "-n", ns, check=False)
    assert missing.returncode != 0 and "NotFound" in missing.stderr


def test_job_without_model_is_refused(kube: KubeTestEnv, ns: str):
    doc = example_job("no-model")
    del doc["spec"]["model"]
    proc = kube.kubectl(
        "apply", "--validate=false", "-n", ns, "-f", "-", input=yaml.safe_dump(doc), check=False
    )
    assert proc.returncode != 0
    assert 'The ECRecJob "no-model" is invalid: spec.model: Required value' in proc.stderr, proc.stderr


def test_garbage_collector_deletes_what_a_job_owns(kube: KubeTestEnv, ns: str):
    kube.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(example_job("gc-owner")))
    owner = json.loads(kube.kubectl("get", "ecrecjob", "gc-owner", "-n", ns, "-o", "json").stdout)
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "gc-owned",
            "namespace": ns,
            "ownerReferences": [
                {
                    "apiVersion": "ecrec.dev/v1alpha1",
                    "kind": "ECRecJob",
                    "name": "gc-owner",
                    "uid": owner["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "data": {"k": "v"},
    }
    unowned = copy.deepcopy(cm)
    unowned["metadata"]["name"] = "gc-unowned"
    del unowned["metadata"]["ownerReferences"]
    kube.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [cm, unowned]})
    )

    kube.kubectl("delete", "ecrecjob", "gc-owner", "-n", ns, "--wait=true", "--timeout=30s")
    took = wait_gone(kube, "configmap", "gc-owned", "-n", ns, timeout=30)
    assert took < 30
    kube.kubectl("get", "configmap", "gc-unowned", "-n", ns)  # what the job did not own stays


def test_namespace_deletion(kube: KubeTestEnv, ecrec_crd: str):
    kube.kubectl("create", "namespace", "ecrec-doomed")
    kube.kubectl("apply", "-n", "ecrec-doomed", "-f", "-", input=yaml.safe_dump(example_job("doomed")))
    kube.kubectl("create", "configmap", "doomed", "-n", "ecrec-doomed", "--from-literal=a=b")
    kube.kubectl("delete", "namespace", "ecrec-doomed", "--wait=false")
    wait_gone(kube, "namespace", "ecrec-doomed", timeout=60)


# ---------------------------------------------------------------------------------------------- helpers --


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink()
        except OSError:
            continue
        name = str(target)
        if name.startswith("socket:["):
            inodes.add(name[8:-1])
    return inodes


def _decode(addr_hex: str, v6: bool) -> str:
    if not v6:
        return ".".join(str(int(addr_hex[i : i + 2], 16)) for i in (6, 4, 2, 0))
    words = [addr_hex[i : i + 8] for i in range(0, 32, 8)]
    raw = b"".join(bytes.fromhex(w)[::-1] for w in words)  # each 32-bit word is little-endian
    ip = ipaddress.IPv6Address(raw)
    return str(ip) if ip.ipv4_mapped is None else f"::ffff:{ip.ipv4_mapped}"


def listening_sockets(pids) -> list[tuple[int, str]]:
    """(pid, local address) of every listening TCP socket and bound UDP socket the processes own."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    out = []
    for table, v6, udp in (
        ("tcp", False, False),
        ("tcp6", True, False),
        ("udp", False, True),
        ("udp6", True, True),
    ):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if inode in owner and (udp or state == "0A"):
                addr, _port = local.split(":")
                out.append((owner[inode], _decode(addr, v6)))
    return out
