"""The test kubelet's stand-in for Chaos Mesh's pod-failure (what `ecrec chaos --action pod-failure` uses here):
a new `chaos.ecrec.dev/pause-id` annotation SIGSTOPs the pod's process groups for `pause-seconds`, then SIGCONT;
the pod stays Running; a paused pod that is deleted still handles its SIGTERM."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ecrec.chaos import PAUSE_ID, PAUSE_NODE_LABEL, PAUSE_SECONDS

from .test_kubelet import IMAGE, alive, py, wait_until
from .testenv import KubeTestEnv

pytestmark = pytest.mark.k8s

NS = "kubelet-pause"


def run_pod(kube: KubeTestEnv, core, name: str, code: str, grace: int = 5) -> dict:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "terminationGracePeriodSeconds": grace,
            "containers": [{"name": "main", "image": IMAGE, "command": py(code)}],
        },
    }
    kube.kubectl("apply", "-f", "-", input=json.dumps(pod))
    assert wait_until(lambda: phase(core, name) == "Running", 30), f"pod {name} not Running"
    return pod


def phase(core, name: str) -> str | None:
    from kubernetes.client.exceptions import ApiException

    try:
        pod = json.loads(core.read_namespaced_pod(name, NS, _preload_content=False).data)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return (pod.get("status") or {}).get("phase")


def annotate(core, name: str, annotations: dict[str, str]) -> None:
    core.patch_namespaced_pod(name, NS, {"metadata": {"annotations": annotations}})


def state(pid: int) -> str:
    """The process state letter of /proc/PID/stat: T = stopped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def count(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


def test_the_node_says_it_honours_the_pause_annotation(core, kubelet):
    node = json.loads(core.read_node(kubelet.node_name, _preload_content=False).data)
    assert node["metadata"]["labels"][PAUSE_NODE_LABEL] == "true"


def test_a_pause_stops_the_whole_process_group_then_continues_it(kube, core, kubelet, ns, tmp_path):
    counter, child_pid = tmp_path / "counter", tmp_path / "child.pid"
    code = f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(child_pid)!r}, "w").write(str(child.pid))
        n = 0
        while True:
            n += 1
            open({str(counter)!r}, "w").write(str(n))
            time.sleep(0.02)
    """
    run_pod(kube, core, "pausable", code)
    [pid] = kubelet.pids()[f"{NS}/pausable"]
    assert wait_until(lambda: child_pid.exists() and count(counter) > 0, 30)
    child = int(child_pid.read_text())
    assert state(pid) != "T" and state(child) != "T"

    asked = time.monotonic()
    annotate(core, "pausable", {PAUSE_SECONDS: "6", PAUSE_ID: "fault-1"})
    assert wait_until(lambda: state(pid) == "T" and state(child) == "T", 20), (state(pid), state(child))
    n = count(counter)
    time.sleep(1.0)
    # Stopped all along: no progress, and the pod is still Running (only its process is unresponsive).
    assert state(pid) == "T" and count(counter) == n
    assert phase(core, "pausable") == "Running"

    assert wait_until(lambda: state(pid) != "T" and state(child) != "T" and count(counter) > n, 60)
    assert time.monotonic() - asked >= 6.0  # SIGCONT only once the pause is over
    assert alive(pid) and phase(core, "pausable") == "Running"

    # The same id again (any other change to the pod) is not a new fault ...
    annotate(core, "pausable", {"unrelated": "change"})
    assert not wait_until(lambda: state(pid) == "T", 2.0)
    # ... a new id is.
    annotate(core, "pausable", {PAUSE_SECONDS: "300", PAUSE_ID: "fault-2"})
    assert wait_until(lambda: state(pid) == "T", 20)
    kube.kubectl("delete", "pod", "pausable", "-n", NS, "--grace-period=1", "--timeout=60s")
    assert not alive(pid) and not alive(child)


def test_a_paused_pod_that_is_deleted_handles_its_sigterm(kube, core, kubelet, ns, tmp_path):
    marker, armed = tmp_path / "got-sigterm", tmp_path / "armed"
    code = f"""
        import os, signal, sys, time
        def bye(sig, frame):
            open({str(marker)!r}, "w").write("SIGTERM %d" % os.getpid())
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        open({str(armed)!r}, "w").close()
        while True:
            time.sleep(0.05)
    """
    run_pod(kube, core, "paused-then-deleted", code, grace=120)
    [pid] = kubelet.pids()[f"{NS}/paused-then-deleted"]
    assert wait_until(armed.exists, 30)  # the handler is installed
    annotate(core, "paused-then-deleted", {PAUSE_SECONDS: "600", PAUSE_ID: "x"})
    assert wait_until(lambda: state(pid) == "T", 20)
    # Without a SIGCONT the SIGTERM would stay pending until the SIGKILL at the end of the 120 s grace period,
    # and the handler would never write the marker.
    kube.kubectl("delete", "pod", "paused-then-deleted", "-n", NS, "--wait=false")
    assert wait_until(lambda: marker.exists() and phase(core, "paused-then-deleted") is None, 90)
    assert marker.read_text() == f"SIGTERM {pid}"
    assert not alive(pid)
