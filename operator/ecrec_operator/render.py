"""The objects the operator creates for a job, as pure functions of its spec (no I/O, no cluster).

Names carry the incarnation (`<job>-server-<shard>-<incarnation>`), so a replacement never waits for an old
pod stuck Terminating; the shard id, rank, role and incarnation are labels, which is how the operator finds
them again after a restart. Every process binds its pod IP (`$(POD_IP)`, from the downward API) and names
itself with its pod name, which is unique per incarnation: that is the `instance` the coordinator tells
processes of one shard apart by. Servers and workers reach the coordinator through its Service.
"""

from __future__ import annotations

import json

from ecrec.core.reconcile import Proc
from ecrec.spec import Job

GROUP, VERSION, PLURAL = "ecrec.dev", "v1alpha1", "ecrecjobs"
LABEL_JOB = "ecrec.dev/job"
LABEL_ROLE = "ecrec.dev/role"
LABEL_SHARD = "ecrec.dev/shard"
LABEL_RANK = "ecrec.dev/rank"
LABEL_INCARNATION = "ecrec.dev/incarnation"
HTTP_PORT = 8080  # coordinator REST
GRPC_PORT = 7070  # parameter servers
METRICS_PORT = 9090  # every role's /metrics


def pod_name(job: str, role: str, index: int, incarnation: int) -> str:
    return (
        f"{job}-coordinator-{incarnation}" if role == "coordinator" else f"{job}-{role}-{index}-{incarnation}"
    )


def coordinator_service_name(job: str) -> str:
    return f"{job}-coordinator"


def coordinator_url(job: str, namespace: str) -> str:
    return f"http://{coordinator_service_name(job)}.{namespace}.svc:{HTTP_PORT}"


def labels(job: str, role: str, index: int | None = None, incarnation: int | None = None) -> dict[str, str]:
    out = {LABEL_JOB: job, LABEL_ROLE: role}
    if role == "server" and index is not None:
        out[LABEL_SHARD] = str(index)
    if role == "worker" and index is not None:
        out[LABEL_RANK] = str(index)
    if incarnation is not None:
        out[LABEL_INCARNATION] = str(incarnation)
    return out


def job_json(job: Job) -> str:
    """What every process reads its job from (`--job env:ECREC_JOB`)."""
    return json.dumps({"name": job.name, "spec": job.spec.to_dict()})


def coordinator_service(job: Job, namespace: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": coordinator_service_name(job.name),
            "namespace": namespace,
            "labels": labels(job.name, "coordinator"),
        },
        "spec": {
            "selector": labels(job.name, "coordinator"),
            "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": "http"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }


def pod(job: Job, namespace: str, role: str, index: int, incarnation: int, replacement: bool = False) -> dict:
    """The pod of one process: `role` coordinator | server | worker, `index` its shard id or rank."""
    spec = job.spec
    section = {"coordinator": spec.coordinator, "server": spec.servers, "worker": spec.workers}[role]
    common = ["--job", "env:ECREC_JOB"]
    if role == "coordinator":
        module = "ecrec.coordinator"
        args = [*common, "--host", "$(POD_IP)", "--port", str(HTTP_PORT), "--metrics-port", str(METRICS_PORT)]
        ports = [
            {"name": "http", "containerPort": HTTP_PORT},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ]
        probe = {"httpGet": {"path": "/healthz", "port": HTTP_PORT}, "periodSeconds": 2}
    elif role == "server":
        module = "ecrec.server"
        args = [
            *common,
            "--shard",
            str(index),
            "--coordinator",
            "$(ECREC_COORDINATOR)",
            "--bind",
            f"$(POD_IP):{GRPC_PORT}",
            "--metrics-addr",
            "$(POD_IP)",
            "--metrics-port",
            str(METRICS_PORT),
            "--instance",
            "$(POD_NAME)",
            *(["--replacement"] if replacement else []),
        ]
        ports = [
            {"name": "grpc", "containerPort": GRPC_PORT},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ]
        probe = {"tcpSocket": {"port": GRPC_PORT}, "periodSeconds": 2}
    else:
        module = "ecrec.worker"
        args = [
            *common,
            "--rank",
            str(index),
            "--coordinator",
            "$(ECREC_COORDINATOR)",
            "--metrics-addr",
            "$(POD_IP)",
            "--metrics-port",
            str(METRICS_PORT),
            "--instance",
            "$(POD_NAME)",
            "--incarnation",
            str(incarnation),
            *(["--replacement"] if replacement else []),
        ]
        ports = [{"name": "metrics", "containerPort": METRICS_PORT}]
        probe = None
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "ECREC_JOB", "value": job_json(job)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if role != "coordinator":  # (the test kubelet would wait for the coordinator's own Service to be ready)
        env.append({"name": "ECREC_COORDINATOR", "value": coordinator_url(job.name, namespace)})
    container: dict = {
        "name": role,
        "image": section.image,
        "command": ["python", "-m", module],
        "args": args,
        "env": env,
        "ports": ports,
    }
    if section.image_pull_policy:
        container["imagePullPolicy"] = section.image_pull_policy
    resources = {
        k: dict(v)
        for k, v in (("requests", section.resources.requests), ("limits", section.resources.limits))
        if v
    }
    if resources:
        container["resources"] = resources
    if probe:
        container["readinessProbe"] = probe
    pod_spec: dict = {
        "restartPolicy": "Never",  # a replacement is a new pod (next incarnation), never a restart
        "terminationGracePeriodSeconds": 10,
        "containers": [container],
    }
    if section.node_selector:
        pod_spec["nodeSelector"] = dict(section.node_selector)
    if section.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in section.tolerations
        ]
    if section.service_account_name:
        pod_spec["serviceAccountName"] = section.service_account_name
    meta: dict = {
        "name": pod_name(job.name, role, index, incarnation),
        "namespace": namespace,
        "labels": labels(job.name, role, index, incarnation),
    }
    meta["annotations"] = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def observe_pod(pod_obj: dict) -> Proc | None:
    """The reconciler's view of one of the job's pods (None for a pod that is not one of ours)."""
    meta = pod_obj.get("metadata", {})
    lab = meta.get("labels") or {}
    role = lab.get(LABEL_ROLE)
    if role not in ("coordinator", "server", "worker"):
        return None
    try:
        index = 0 if role == "coordinator" else int(lab[LABEL_SHARD if role == "server" else LABEL_RANK])
        incarnation = int(lab.get(LABEL_INCARNATION, "1"))
    except (KeyError, ValueError):
        return None
    status = pod_obj.get("status") or {}
    phase = status.get("phase", "Pending")
    exit_code = None
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            exit_code = term.get("exitCode")
    if meta.get("deletionTimestamp"):
        state = "deleting"
    elif phase == "Succeeded":
        state = "succeeded"
    elif phase == "Failed":
        state = "failed"
    elif phase == "Running":
        state = "running"
    else:
        state = "pending"
    return Proc(role, index, incarnation, state, meta.get("name", ""), exit_code)
