"""The test kubelet (tests/k8s/kubelet/) against the real API server: it registers its node, binds and runs
pods as local processes on their own loopback IPs, reports their status (phase, conditions, probes, exit
codes, restarts), resolves Service DNS names in env, honours restartPolicy and graceful deletion, refuses
unknown images, and leaves no process behind when it stops or dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from .testenv import REPO, KubeTestEnv

pytestmark = pytest.mark.k8s

NS = "kubelet-test"
IMAGE = "ghcr.io/ecrec/ecrec:dev"  # any image named ecrec runs from the repo's .venv


# ---------------------------------------------------------------------------------------------- helpers --
def pod_manifest(name: str, command: list[str], **spec) -> dict:
    """A one-container pod of the ecrec image; `spec` keys go to the pod spec, `env`/`probe` to the container."""
    container = {"name": "main", "image": spec.pop("image", IMAGE), "command": command}
    for key in ("env", "readinessProbe", "livenessProbe", "ports", "volumeMounts", "args"):
        if key in spec:
            container[key] = spec.pop(key)
    labels = spec.pop("labels", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"terminationGracePeriodSeconds": 5, "containers": [container], **spec},
    }


def py(code: str) -> list[str]:
    return ["python", "-c", textwrap.dedent(code)]


def apply(kube: KubeTestEnv, *objs: dict) -> None:
    kube.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)})
    )


def get_pod(core, name: str) -> dict | None:
    from kubernetes.client.exceptions import ApiException

    try:
        return json.loads(core.read_namespaced_pod(name, NS, _preload_content=False).data)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def wait_pod(core, name: str, pred, timeout: float = 20.0, what: str = "") -> dict:
    """Polls the pod until pred(pod) holds; fails with its last status."""
    deadline = time.monotonic() + timeout
    pod = None
    while time.monotonic() < deadline:
        pod = get_pod(core, name)
        if pod is not None and pred(pod):
            return pod
        time.sleep(0.1)
    status = json.dumps((pod or {}).get("status"), indent=1)
    raise AssertionError(f"pod {name}: not {what or 'as expected'} within {timeout} s; status: {status}")


def conditions(pod: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}


def ready(pod: dict) -> bool:
    return conditions(pod).get("Ready") == "True"


def phase_is(*phases: str):
    return lambda pod: pod.get("status", {}).get("phase") in phases


def main_status(pod: dict) -> dict:
    """The first container's status ({} before the kubelet wrote any)."""
    return (pod["status"].get("containerStatuses") or [{}])[0]


def pod_log(kubelet, name: str, container: str = "main") -> str:
    return (kubelet.out_dir / "pods" / f"{NS}_{name}" / f"{container}.log").read_text()


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return ") Z " not in stat


def pgrep(marker: str) -> list[int]:
    proc = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split() if int(p) != os.getpid()]


def wait_until(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


HTTP_SERVER = ["python", "-m", "http.server", "8080", "--bind", "$(POD_IP)"]
POD_IP_ENV = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
HTTP_PROBE = {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1}


@pytest.fixture(scope="module")
def web(kube: KubeTestEnv, core, ns: str) -> dict:
    """A Running+Ready pod serving HTTP on its pod IP:8080, and a Service `web` (port 80 -> 8080) in front."""
    pod = pod_manifest(
        "web",
        HTTP_SERVER,
        env=POD_IP_ENV,
        readinessProbe=HTTP_PROBE,
        labels={"app": "web", "tier": "front"},
        ports=[{"name": "http", "containerPort": 8080}],
    )
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": NS},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    apply(kube, pod, svc)
    return wait_pod(core, "web", ready, what="Ready")


# ------------------------------------------------------------------------------------------------ tests --
def test_node_registered_with_capacity(core, kubelet):
    node = json.loads(core.read_node("ecrec-local-0", _preload_content=False).data)
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
    capacity = node["status"]["capacity"]
    assert int(capacity["cpu"]) >= 1 and capacity["memory"].endswith("Ki") and capacity["pods"] == "110"
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "ecrec-local-0"
    assert node["status"]["addresses"][0] == {"type": "InternalIP", "address": "127.0.0.1"}


def test_http_pod_running_and_ready_on_its_own_loopback_ip(kube: KubeTestEnv, core, kubelet, web):
    status = web["status"]
    assert web["spec"]["nodeName"] == "ecrec-local-0"
    assert status["phase"] == "Running"
    assert conditions(web) == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    ip = status["podIP"]
    a, b, c, d = (int(x) for x in ip.split("."))
    assert (a, b) == (127, 0) and c not in (0, 10) and 1 <= d <= 254, ip
    assert status["podIPs"] == [{"ip": ip}] and status["hostIP"] == "127.0.0.1"
    cs = main_status(web)
    assert cs["ready"] is True and cs["started"] is True and cs["restartCount"] == 0
    assert "running" in cs["state"] and cs["image"] == IMAGE
    # the process serves on its pod IP, reachable from here (one network namespace: all of 127/8 is lo)
    with urllib.request.urlopen(f"http://{ip}:8080/", timeout=5) as resp:
        assert resp.status == 200
    assert f"'--bind', '{ip}'" in pod_log(kubelet, "web")  # $(POD_IP) expanded in the command
    # kubectl sees what a real kubelet would report
    wide = kube.kubectl("get", "pod", "web", "-n", NS, "-o", "wide").stdout
    assert "1/1" in wide and "Running" in wide and ip in wide and "ecrec-local-0" in wide


def test_downward_api_and_var_expansion(kube: KubeTestEnv, core, kubelet, ns):
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "ROLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['role']"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "ADDR", "value": "$(POD_IP):7000"},
        {"name": "ESCAPED", "value": "$$(POD_IP)"},
    ]
    code = """
        import json, os, sys
        keys = ["POD_NAME", "POD_NS", "POD_IP", "ROLE", "NODE", "ADDR", "ESCAPED", "HOSTNAME"]
        print("ENV=" + json.dumps({k: os.environ.get(k) for k in keys}))
        print("ARGV=" + json.dumps(sys.argv[1:]))
        print("EXE=" + sys.executable)
        print("PATH0=" + os.environ["PATH"].split(os.pathsep)[0])
        print("LEAKED=" + str("KUBECONFIG" in os.environ or "PYTEST_CURRENT_TEST" in os.environ))
    """
    pod = pod_manifest(
        "downward",
        py(code),
        args=["$(POD_NAME)", "$(UNKNOWN)"],
        env=env,
        labels={"role": "server"},
        restartPolicy="Never",
    )
    apply(kube, pod)
    done = wait_pod(core, "downward", phase_is("Succeeded", "Failed"), what="finished")
    assert done["status"]["phase"] == "Succeeded", pod_log(kubelet, "downward")
    term = main_status(done)["state"]["terminated"]
    assert term["exitCode"] == 0 and term["reason"] == "Completed"
    assert conditions(done)["Ready"] == "False"
    out = pod_log(kubelet, "downward")
    lines = dict(
        line.split("=", 1) for line in out.splitlines() if not line.startswith("=====") and "=" in line
    )
    ip = done["status"]["podIP"]
    assert json.loads(lines["ENV"]) == {
        "POD_NAME": "downward",
        "POD_NS": NS,
        "POD_IP": ip,
        "ROLE": "server",
        "NODE": "ecrec-local-0",
        "ADDR": f"{ip}:7000",
        "ESCAPED": "$(POD_IP)",
        "HOSTNAME": "downward",
    }
    assert json.loads(lines["ARGV"]) == ["downward", "$(UNKNOWN)"]  # unknown references stay as written
    assert lines["EXE"].startswith(str(REPO / ".venv" / "bin"))  # `python` is the repo's venv
    assert lines["PATH0"] == str(REPO / ".venv" / "bin")
    assert lines["LEAKED"] == "False"  # only the pod spec's env, not the kubelet's


def test_image_entrypoint_is_the_ecrec_cli(kube: KubeTestEnv, core, kubelet, ns):
    pod = pod_manifest("entrypoint", [], args=["--help"], restartPolicy="Never")
    del pod["spec"]["containers"][0]["command"]  # args only: the image's ENTRYPOINT (`ecrec`) runs them
    apply(kube, pod)
    done = wait_pod(core, "entrypoint", phase_is("Succeeded", "Failed"), what="finished")
    out = pod_log(kubelet, "entrypoint")
    assert done["status"]["phase"] == "Succeeded", out
    assert "usage: ecrec" in out


def test_service_dns_names_in_env_resolve_to_a_ready_pod(kube: KubeTestEnv, core, kubelet, web):
    cluster_ip = core.read_namespaced_service("web", NS).spec.cluster_ip
    code = """
        import os, urllib.request
        print("URL=" + os.environ["URL"])
        print("PLAIN=" + os.environ["PLAIN"])
        with urllib.request.urlopen(os.environ["URL"], timeout=5) as r:
            print("STATUS=%d" % r.status)
    """
    env = [
        {"name": "URL", "value": f"http://web.{NS}.svc.cluster.local:80/"},
        {"name": "PLAIN", "value": f"web.{NS}.svc,other.example.com"},
    ]
    apply(kube, pod_manifest("dns-client", py(code), env=env, restartPolicy="Never"))
    done = wait_pod(core, "dns-client", phase_is("Succeeded", "Failed"), what="finished")
    out = pod_log(kubelet, "dns-client")
    assert done["status"]["phase"] == "Succeeded", out
    # the name becomes the Service's ClusterIP, on loopback; the proxy there forwards port 80 to the pod's
    # targetPort (named `http` = 8080), as kube-proxy does
    assert cluster_ip.startswith("127.0.10.")
    assert f"URL=http://{cluster_ip}:80/" in out
    assert f"PLAIN={cluster_ip},other.example.com" in out
    assert "STATUS=200" in out


def test_service_name_waits_for_a_ready_pod(kube: KubeTestEnv, core, kubelet, ns):
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "late", "namespace": NS},
        "spec": {"selector": {"app": "late"}, "ports": [{"port": 8080}]},
    }
    client = pod_manifest(
        "late-client",
        py("import os; print('ADDR=' + os.environ['ADDR'])"),
        restartPolicy="Never",
        env=[{"name": "ADDR", "value": f"late.{NS}.svc:8080"}],
    )
    apply(kube, svc, client)
    waiting = wait_pod(
        core, "late-client", lambda p: "waiting for a ready pod" in json.dumps(p["status"]), what="waiting"
    )
    assert waiting["status"]["phase"] == "Pending"
    assert main_status(waiting)["state"]["waiting"]["reason"] == "ContainerCreating"
    server = pod_manifest(
        "late", HTTP_SERVER, env=POD_IP_ENV, readinessProbe=HTTP_PROBE, labels={"app": "late"}
    )
    apply(kube, server)
    done = wait_pod(core, "late-client", phase_is("Succeeded"), what="Succeeded")
    cluster_ip = core.read_namespaced_service("late", NS).spec.cluster_ip
    assert f"ADDR={cluster_ip}:8080" in pod_log(kubelet, "late-client")
    assert done["status"]["podIP"] != get_pod(core, "late")["status"]["podIP"]


def test_a_service_address_leads_to_the_pod_that_replaced_the_one_behind_it(
    kube: KubeTestEnv, core, kubelet, ns
):
    # What the ECRec coordinator's failover needs of the cluster: a process keeps the Service's address while
    # the pod behind it is deleted and another takes its place; new connections reach the new pod.
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "moving", "namespace": NS},
        "spec": {"selector": {"app": "moving"}, "ports": [{"port": 9000, "targetPort": 8080}]},
    }
    server = "import http.server, os; open('who', 'w').write(os.environ['POD_NAME'])\n" + (
        "http.server.test(http.server.SimpleHTTPRequestHandler, port=8080, bind=os.environ['POD_IP'])"
    )
    name_env = [*POD_IP_ENV, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]

    def backend(name: str) -> dict:
        return pod_manifest(
            name, py(server), env=name_env, readinessProbe=HTTP_PROBE, labels={"app": "moving"}
        )

    client_code = """
        import os, time, urllib.request
        seen = []
        while len(set(seen)) < 2:
            try:
                with urllib.request.urlopen("http://" + os.environ["ADDR"] + "/who", timeout=2) as r:
                    who = r.read().decode()
                if not seen or seen[-1] != who:
                    print("SERVED-BY=" + who, flush=True)
                seen.append(who)
            except OSError as e:
                print("ERR", e, flush=True)
            time.sleep(0.2)
    """
    apply(kube, svc, backend("moving-1"))
    wait_pod(core, "moving-1", ready, what="Ready")
    client = pod_manifest(
        "moving-client",
        py(client_code),
        restartPolicy="Never",
        env=[{"name": "ADDR", "value": f"moving.{NS}.svc:9000"}],
    )
    apply(kube, client)
    log = kubelet.out_dir / "pods" / f"{NS}_moving-client" / "main.log"
    assert wait_until(lambda: log.exists() and "SERVED-BY=moving-1" in log.read_text(), 60)
    core.delete_namespaced_pod("moving-1", NS)
    apply(kube, backend("moving-2"))
    done = wait_pod(core, "moving-client", phase_is("Succeeded", "Failed"), what="finished")
    out = pod_log(kubelet, "moving-client")
    assert done["status"]["phase"] == "Succeeded", out
    assert out.index("SERVED-BY=moving-1") < out.index("SERVED-BY=moving-2"), out


def test_tcp_and_exec_readiness_probes(kube: KubeTestEnv, core, kubelet, ns, tmp_path):
    flag = tmp_path / "ready-flag"
    pod = pod_manifest("probes", HTTP_SERVER, env=POD_IP_ENV)
    pod["spec"]["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": 8080}, "periodSeconds": 1}
    pod["spec"]["containers"].append(
        {
            "name": "side",
            "image": "ecrec:dev",
            "command": ["sleep", "300"],
            "readinessProbe": {"exec": {"command": ["test", "-f", str(flag)]}, "periodSeconds": 1},
        }
    )
    apply(kube, pod)

    def main_ready_side_not(p):
        st = {c["name"]: c for c in p["status"].get("containerStatuses") or []}
        return st.get("main", {}).get("ready") and st.get("side", {}).get("started") and not ready(p)

    unready = wait_pod(core, "probes", main_ready_side_not, what="main ready, side not")
    assert unready["status"]["phase"] == "Running"
    assert "side" in next(c for c in unready["status"]["conditions"] if c["type"] == "Ready")["message"]
    flag.write_text("ok")
    wait_pod(core, "probes", ready, timeout=10, what="Ready after the exec probe passes")


def test_restart_policy_never_exit_3_fails_the_pod(kube: KubeTestEnv, core, kubelet, ns):
    apply(kube, pod_manifest("exit3", py("import sys; print('bye'); sys.exit(3)"), restartPolicy="Never"))
    pod = wait_pod(core, "exit3", phase_is("Failed", "Succeeded"), what="finished")
    assert pod["status"]["phase"] == "Failed"
    cs = main_status(pod)
    assert cs["state"]["terminated"]["exitCode"] == 3 and cs["state"]["terminated"]["reason"] == "Error"
    assert cs["restartCount"] == 0 and cs["ready"] is False
    time.sleep(0.5)
    assert main_status(get_pod(core, "exit3"))["restartCount"] == 0  # and it is not restarted
    assert "bye" in pod_log(kubelet, "exit3")


def test_restart_policy_always_restarts(kube: KubeTestEnv, core, kubelet, ns):
    apply(
        kube,
        pod_manifest("crashy", py("import sys; sys.exit(1)"), restartPolicy="Always"),
        pod_manifest("once-ok", py("print('fine')"), restartPolicy="OnFailure"),
    )
    pod = wait_pod(
        core,
        "crashy",
        lambda p: main_status(p).get("restartCount", 0) >= 2,
        timeout=15,
        what="restarted twice",
    )
    assert pod["status"]["phase"] == "Running"
    assert main_status(pod)["lastState"]["terminated"]["exitCode"] == 1
    assert pod_log(kubelet, "crashy").count("===== ") >= 3  # one header line per start
    ok = wait_pod(core, "once-ok", phase_is("Succeeded"), what="Succeeded")  # OnFailure + exit 0: done
    assert main_status(ok)["restartCount"] == 0


def test_kubectl_delete_sends_sigterm_then_removes_the_pod(kube: KubeTestEnv, core, kubelet, ns, tmp_path):
    marker = tmp_path / "got-sigterm"
    code = f"""
        import os, signal, sys, time
        def bye(sig, frame):
            open({str(marker)!r}, "w").write("SIGTERM %d" % os.getpid())
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("ready", flush=True)
        time.sleep(300)
    """
    apply(kube, pod_manifest("graceful", py(code), terminationGracePeriodSeconds=20))
    wait_pod(core, "graceful", ready, what="Ready")
    assert wait_until(lambda: "ready" in pod_log(kubelet, "graceful"))
    [pid] = kubelet.pids()[f"{NS}/graceful"]
    t0 = time.monotonic()
    kube.kubectl("delete", "pod", "graceful", "-n", NS, "--timeout=30s")  # waits until the object is gone
    took = time.monotonic() - t0
    assert marker.read_text() == f"SIGTERM {pid}"
    assert get_pod(core, "graceful") is None
    assert not alive(pid)
    # Below the 20 s grace period (not a tighter bound: on a machine loaded to 10+ runnable processes the
    # kubectl round trips alone took over 10 s once).
    assert took < 18, f"delete took {took:.1f} s: the process exited at once, no need for the 20 s grace"


def test_delete_sigkills_after_the_grace_period(kube: KubeTestEnv, core, kubelet, ns):
    code = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(300)
    """
    apply(kube, pod_manifest("stubborn", py(code), terminationGracePeriodSeconds=1))
    wait_pod(core, "stubborn", ready, what="Ready")
    [pid] = kubelet.pids()[f"{NS}/stubborn"]
    t0 = time.monotonic()
    kube.kubectl("delete", "pod", "stubborn", "-n", NS, "--timeout=30s")
    took = time.monotonic() - t0
    assert 0.9 <= took < 8, took
    assert not alive(pid) and get_pod(core, "stubborn") is None


def test_unknown_image_fails_the_pod_with_a_reason(kube: KubeTestEnv, core, kubelet, ns):
    apply(kube, pod_manifest("alien", ["sleep", "300"], image="docker.io/library/busybox:1.36"))
    pod = wait_pod(core, "alien", phase_is("Failed"), what="Failed")
    assert pod["status"]["reason"] == "ErrImagePull"
    assert (
        "busybox" in pod["status"]["message"] and "not known to the test kubelet" in pod["status"]["message"]
    )
    waiting = main_status(pod)["state"]["waiting"]
    assert waiting["reason"] == "ErrImagePull"
    assert kubelet.pids().get(f"{NS}/alien", []) == []


def test_init_container_and_volumes(kube: KubeTestEnv, core, kubelet, ns):
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "job", "namespace": NS},
        "data": {"job.json": '{"name": "j1"}'},
    }
    pod = pod_manifest(
        "volumes",
        py(
            "import json,sys; print('JOB=' + json.load(open(sys.argv[1]))['name']); print('DATA=' + open(sys.argv[2]).read())"
        ),
        args=["/etc/ecrec/job.json", "/data/from-init"],
        restartPolicy="Never",
        volumeMounts=[{"name": "job", "mountPath": "/etc/ecrec"}, {"name": "scratch", "mountPath": "/data"}],
        volumes=[{"name": "job", "configMap": {"name": "job"}}, {"name": "scratch", "emptyDir": {}}],
    )
    pod["spec"]["initContainers"] = [
        {
            "name": "init",
            "image": IMAGE,
            "command": ["sh", "-c", "echo hello > /data/from-init"],
            "volumeMounts": [{"name": "scratch", "mountPath": "/data"}],
        }
    ]
    apply(kube, cm, pod)
    done = wait_pod(core, "volumes", phase_is("Succeeded", "Failed"), what="finished")
    out = pod_log(kubelet, "volumes")
    assert done["status"]["phase"] == "Succeeded", out
    assert "JOB=j1" in out and "DATA=hello" in out
    init = done["status"]["initContainerStatuses"][0]
    assert init["state"]["terminated"]["exitCode"] == 0 and conditions(done)["Initialized"] == "True"


def test_stop_terminates_every_process(kube: KubeTestEnv, core, kubelet, ns, tmp_path):
    from .kubelet import TestKubelet

    marker = f"ecrec-stop-{uuid.uuid4().hex[:8]}"
    # nodeName set: these skip scheduling and belong to the second kubelet only
    code = py(f"import time; time.sleep(300)  # {marker}")
    pods = [pod_manifest(f"stop-{i}", code, nodeName="ecrec-stop-test") for i in range(2)]
    second = TestKubelet(kube.kubeconfig, tmp_path / "out", node_name="ecrec-stop-test", bind_pending=False)
    second.start()
    try:
        apply(kube, *pods)
        for p in pods:
            wait_pod(core, p["metadata"]["name"], ready, what="Ready")
        assert len(pgrep(marker)) == 2
    finally:
        t0 = time.monotonic()
        second.stop()
        took = time.monotonic() - t0
    assert pgrep(marker) == []
    assert took < 8, took
    node = json.loads(core.read_node("ecrec-stop-test", _preload_content=False).data)
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "False"
    for p in pods:  # nobody runs them any more: remove them at once
        kube.kubectl("delete", "pod", p["metadata"]["name"], "-n", NS, "--grace-period=0", "--force")


def test_unschedulable_pod_stays_pending(kube: KubeTestEnv, core, kubelet, ns):
    apply(kube, pod_manifest("nowhere", ["sleep", "300"], nodeSelector={"disk": "ssd"}))
    pod = wait_pod(
        core, "nowhere", lambda p: conditions(p).get("PodScheduled") == "False", what="Unschedulable"
    )
    cond = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
    assert cond["reason"] == "Unschedulable" and "node selector" in cond["message"]
    assert not pod["spec"].get("nodeName") and pod["status"]["phase"] == "Pending"


def test_liveness_probe_failure_restarts_the_container(kube: KubeTestEnv, core, kubelet, ns, tmp_path):
    sick = tmp_path / "sick"
    pod = pod_manifest("liveness", ["sleep", "300"], terminationGracePeriodSeconds=1)
    pod["spec"]["containers"][0]["livenessProbe"] = {
        "exec": {"command": ["sh", "-c", f"test ! -e {sick}"]},
        "periodSeconds": 1,
        "failureThreshold": 1,
    }
    apply(kube, pod)
    wait_pod(core, "liveness", ready, what="Ready")
    [pid] = kubelet.pids()[f"{NS}/liveness"]
    sick.write_text("x")
    p = wait_pod(core, "liveness", lambda p: main_status(p).get("restartCount") == 1, what="restarted")
    assert not alive(pid)
    assert main_status(p)["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGTERM
    sick.unlink()  # healthy again: it stays up
    wait_pod(core, "liveness", ready, what="Ready again")


def start_cli_kubelet(kube: KubeTestEnv, out: Path, node: str) -> subprocess.Popen:
    """`python -m tests.k8s.kubelet` as `make k8s-up` runs it; returns once it says it is ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.k8s.kubelet", "--kubeconfig", str(kube.kubeconfig), "--out", str(out)]
        + ["--node", node, "--no-bind"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # it logs to OUT/kubelet.log as well
        text=True,
    )
    line = proc.stdout.readline()
    assert "ready" in line, line
    return proc


def test_processes_die_with_a_killed_kubelet_and_a_new_one_adopts_the_pod(
    kube: KubeTestEnv, core, ns, tmp_path
):
    marker = f"ecrec-orphan-{uuid.uuid4().hex[:8]}"
    procs = [start_cli_kubelet(kube, tmp_path / "out", "ecrec-cli-test")]
    try:
        code = py(f"import time; time.sleep(300)  # {marker}")
        apply(kube, pod_manifest("orphan", code, nodeName="ecrec-cli-test"))
        first = wait_pod(core, "orphan", ready, what="Ready")
        [pid] = pgrep(marker)
        os.kill(procs[0].pid, signal.SIGKILL)  # no stop(), no cleanup: PR_SET_PDEATHSIG must do it
        procs[0].wait(10)
        assert wait_until(lambda: not alive(pid), timeout=5), "the pod's process outlived its kubelet"
        assert (tmp_path / "out" / "pods" / f"{NS}_orphan" / "main.log").exists()
        # a new kubelet on that node runs the pod again: same IP, one restart more
        procs.append(start_cli_kubelet(kube, tmp_path / "out", "ecrec-cli-test"))
        again = wait_pod(core, "orphan", lambda p: ready(p) and main_status(p)["restartCount"] == 1)
        assert again["status"]["podIP"] == first["status"]["podIP"]
        assert pgrep(marker) and pgrep(marker) != [pid]
        procs[-1].send_signal(signal.SIGTERM)  # the CLI's clean exit: stop() kills the pod's process
        assert procs[-1].wait(15) == 0
        assert pgrep(marker) == []
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        kube.kubectl("delete", "pod", "orphan", "-n", NS, "--grace-period=0", "--force", check=False)
