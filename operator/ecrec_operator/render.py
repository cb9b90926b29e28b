"""The objects the operator creates for a job, as pure functions of its spec (no I/O, no cluster).

Names carry the incarnation (`<job>-server-<shard>-<incarnation>`), so a replacement never waits for an old
pod stuck Terminating; the shard id, rank, role and incarnation are labels, which is how the operator finds
them again after a restart. Every process binds its pod IP (`$(POD_IP)`, from the downward API) and names
itself with its pod name, which is unique per incarnation: that is the `instance` the coordinator tells
processes of one shard apart by. Servers and workers reach the coordinator through its Service.

Every pod is hardened by default (`PodDefaults`): non-root, seccomp RuntimeDefault, no privilege escalation,
all capabilities dropped, a read-only root filesystem with an emptyDir at /tmp for what the processes write
(HOME and the matplotlib/torch caches point there), and no service-account token (ECRec's processes never
call the Kubernetes API; a role given its own serviceAccountName keeps Kubernetes' rule). The Helm chart
hands the operator its own `PodDefaults` in a config file (`ecrec-operator --config`): security contexts,
the image for roles that keep the spec's default image, extra labels, image pull secrets and the settings
of the per-job NetworkPolicy (`network_policy`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from ecrec import auth
from ecrec.core.reconcile import Proc
from ecrec.core.roles import ROLES
from ecrec.podlabels import (
    INDEX_LABELS,
    LABEL_INCARNATION,
    LABEL_JOB,
    LABEL_ROLE,
    LABEL_SHARD,  # noqa: F401 (the handlers read it as render.LABEL_SHARD)
    pod_identity,
    spare_index,
)
from ecrec.roles import role_argv
from ecrec.spec import Job, JobSpec, ServersSpec, section_at
from ecrec.spec.template import CHECKPOINT_DIR, CHECKPOINT_VOLUME, SCRATCH_ENV, TMP_DIR, TMP_VOLUME

from . import podtemplate

GROUP, VERSION, PLURAL = "ecrec.dev", "v1alpha1", "ecrecjobs"
HTTP_PORT = 8080  # coordinator REST
GRPC_PORT = 7070  # parameter servers
METRICS_PORT = 9090  # every role's /metrics
SPEC_DEFAULT_IMAGE = ServersSpec.model_fields["image"].default  # `ecrec:latest`, the same for every role

# Pod Security Standards "restricted": what every job pod gets unless the operator's config says otherwise.
# No runAsUser: the images name their user numerically (USER 10001), which runAsNonRoot can check.
RESTRICTED_POD_SECURITY_CONTEXT: dict = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER_SECURITY_CONTEXT: dict = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
# The /tmp emptyDir where the processes and their libraries write (SCRATCH_ENV; the root filesystem is
# read-only) and the checkpoint strategies' volume (spec.faultTolerance.<strategy>.volumeClaim), in coordinator
# and server pods; a job writes under <CHECKPOINT_DIR>/<job name>/<path>, so jobs may share a claim. Declared
# with the spec, which refuses a pod template that reuses them.


@dataclass(frozen=True)
class NetworkPolicySettings:
    """The per-job NetworkPolicy: the job's pods take connections only from each other, from the operator
    (`operator_peers`, NetworkPolicy peers that select the operator's pod) and, on the metrics port only, from
    `metrics_from` (empty: from anywhere); they connect only to each other, to DNS (port 53) and to
    `extra_egress` (NetworkPolicy egress rules, e.g. to where the training data is)."""

    operator_peers: tuple[dict, ...] = ()
    metrics_from: tuple[dict, ...] = ()
    extra_egress: tuple[dict, ...] = ()


@dataclass(frozen=True)
class PodDefaults:
    """What the operator adds to every job pod it creates (the chart's `jobPods` values, via `--config`).

    `images` (role -> image) replaces the image of a role whose spec keeps the default (`ecrec:latest`); an
    image the job names is kept. `image_pull_policy` applies where the spec sets none. `labels` are added
    to the pods (the operator's own `ecrec.dev/*` labels win). `network_policy` None: no NetworkPolicy."""

    images: Mapping[str, str] = field(default_factory=dict)
    image_pull_policy: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    pod_security_context: Mapping[str, Any] = field(
        default_factory=lambda: dict(RESTRICTED_POD_SECURITY_CONTEXT)
    )
    container_security_context: Mapping[str, Any] = field(
        default_factory=lambda: dict(RESTRICTED_CONTAINER_SECURITY_CONTEXT)
    )
    labels: Mapping[str, str] = field(default_factory=dict)
    network_policy: NetworkPolicySettings | None = None

    KEYS = (
        "images",
        "imagePullPolicy",
        "imagePullSecrets",
        "podSecurityContext",
        "containerSecurityContext",
        "labels",
        "networkPolicy",
    )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PodDefaults:
        """From the config file's camelCase mapping; unknown keys are refused (a typo must not go unseen)."""
        unknown = sorted(set(d) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"unknown keys in the operator config: {unknown} (known: {list(cls.KEYS)})")
        images = dict(d.get("images") or {})
        if set(images) - set(ROLES):
            raise ValueError(f"images: roles are {list(ROLES)}, got {sorted(images)}")
        np = d.get("networkPolicy") or {}
        np_unknown = sorted(set(np) - {"enabled", "operatorPeers", "metricsFrom", "extraEgress"})
        if np_unknown:
            raise ValueError(f"unknown keys in the operator config's networkPolicy: {np_unknown}")
        kwargs: dict[str, Any] = {
            "images": {k: str(v) for k, v in images.items() if v},
            "image_pull_policy": d.get("imagePullPolicy") or None,
            "image_pull_secrets": tuple(str(s) for s in d.get("imagePullSecrets") or ()),
            "labels": {str(k): str(v) for k, v in (d.get("labels") or {}).items()},
            "network_policy": NetworkPolicySettings(
                operator_peers=tuple(np.get("operatorPeers") or ()),
                metrics_from=tuple(np.get("metricsFrom") or ()),
                extra_egress=tuple(np.get("extraEgress") or ()),
            )
            if np.get("enabled")
            else None,
        }
        for key, attr in (
            ("podSecurityContext", "pod_security_context"),
            ("containerSecurityContext", "container_security_context"),
        ):
            if d.get(key) is not None:  # {} means none at all; absent means the restricted default
                kwargs[attr] = dict(d[key])
        return cls(**kwargs)

    @classmethod
    def load(cls, path: str | Path) -> PodDefaults:
        """From a YAML (or JSON) file, e.g. the chart's ConfigMap mounted into the operator's pod."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, Mapping):
            raise ValueError(f"the operator config must be a mapping, not {type(data).__name__}")
        return cls.from_dict(data)


DEFAULTS = PodDefaults()  # what pod() and network_policy() use unless given others; main.py sets it


def configure(defaults: PodDefaults) -> None:
    """Sets the process-wide defaults (`ecrec-operator --config`), before the handlers run."""
    global DEFAULTS
    DEFAULTS = defaults


def pod_name(job: str, role: str, index: int, incarnation: int) -> str:
    return (
        f"{job}-coordinator-{incarnation}" if role == "coordinator" else f"{job}-{role}-{index}-{incarnation}"
    )


def coordinator_service_name(job: str) -> str:
    return f"{job}-coordinator"


def token_secret_name(job: str) -> str:
    return f"{job}-token"


def token_secret(job: Job, namespace: str, token: str) -> dict:
    """The job token (ecrec.auth), which every process of the job gets as ECREC_JOB_TOKEN."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": token_secret_name(job.name),
            "namespace": namespace,
            "labels": {LABEL_JOB: job.name},
        },
        "type": "Opaque",
        "stringData": {"token": token},
    }


def coordinator_url(job: str, namespace: str) -> str:
    return f"http://{coordinator_service_name(job)}.{namespace}.svc:{HTTP_PORT}"


def labels(job: str, role: str, index: int | None = None, incarnation: int | None = None) -> dict[str, str]:
    out = {LABEL_JOB: job, LABEL_ROLE: role}
    if role in INDEX_LABELS and index is not None:
        out[INDEX_LABELS[role]] = str(index)
    if incarnation is not None:
        out[LABEL_INCARNATION] = str(incarnation)
    return out


def kubernetes_problems(job: Job) -> list[str]:
    """What a spec the schema accepts still lacks to run on Kubernetes (ecrec local needs none of it)."""
    found = job.spec.fault_tolerance.checkpoints()
    if found is None:
        return []
    where, settings = f"spec.{found[0]}", found[1]
    out = []
    if not settings.volume_claim:
        out.append(
            f"{where}.volumeClaim: required on Kubernetes: the PersistentVolumeClaim the coordinator and the "
            "servers keep the checkpoints on"
        )
    path = PurePosixPath(settings.path)
    if path.is_absolute() or ".." in path.parts:
        out.append(
            f"{where}.path {settings.path!r}: must be relative on Kubernetes (a directory under the job's own "
            "in the volume claim)"
        )
    return out


def pod_job(job: Job) -> Job:
    """The job as its pods read it: a checkpoint strategy's `path` made absolute, under the claim's mount."""
    found = job.spec.fault_tolerance.checkpoints()
    if found is None:
        return job
    doc = job.spec.to_dict()
    section = section_at(doc, found[0])
    section["path"] = f"{CHECKPOINT_DIR}/{job.name}/{found[1].path}"
    return dataclasses.replace(job, spec=JobSpec.model_validate(doc))


def job_json(job: Job) -> str:
    """What every process reads its job from (`--job env:ECREC_JOB`)."""
    job = pod_job(job)
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


def pod(
    job: Job,
    namespace: str,
    role: str,
    index: int,
    incarnation: int,
    replacement: bool = False,
    defaults: PodDefaults | None = None,
    resume: tuple[int, dict] | None = None,
) -> dict:
    """The pod of one process: `role` coordinator | server | worker | spare, `index` its shard id, rank or
    spare index;
    `defaults` None: the process-wide `DEFAULTS`. `resume` (generation, seed): a coordinator that replaces a
    lost one and starts from its predecessor's state (`ecrec.core.reconcile.coordinator_seed`)."""
    d = DEFAULTS if defaults is None else defaults
    spec = job.spec
    section = {
        "coordinator": spec.coordinator,
        "server": spec.servers,
        "spare": spec.servers,
        "worker": spec.workers,
    }[role]
    # `ecrec ROLE ARGS` (ecrec.roles.role_argv): the pod IP, the Service of the coordinator and the pod's name,
    # as Kubernetes expands them from the env below
    argv = role_argv(
        role,
        index,
        job="env:ECREC_JOB",
        coordinator="$(ECREC_COORDINATOR)",
        instance="$(POD_NAME)",
        incarnation=incarnation,
        replacement=replacement,
        bind=f"$(POD_IP):{GRPC_PORT}",
        host="$(POD_IP)",
        port=HTTP_PORT,
        metrics_addr="$(POD_IP)",
        metrics_port=METRICS_PORT,
        resume=(resume[0], "env:ECREC_RESUME") if resume is not None else None,
    )
    if role == "coordinator":
        ports = [
            {"name": "http", "containerPort": HTTP_PORT},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ]
        probe = {"httpGet": {"path": "/healthz", "port": HTTP_PORT}, "periodSeconds": 2}
    elif role == "server":
        ports = [
            {"name": "grpc", "containerPort": GRPC_PORT},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ]
        probe = {"tcpSocket": {"port": GRPC_PORT}, "periodSeconds": 2}
    elif role == "spare":
        # A server without a shard until the coordinator assigns it a failed one; then the operator relabels
        # it (role server, the shard id, its incarnation). It listens on gRPC only from then: no probe.
        ports = [
            {"name": "grpc", "containerPort": GRPC_PORT},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ]
        probe = None
    else:
        ports = [{"name": "metrics", "containerPort": METRICS_PORT}]
        probe = None
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "ECREC_JOB", "value": job_json(job)},
        {
            "name": auth.ENV,
            "valueFrom": {"secretKeyRef": {"name": token_secret_name(job.name), "key": "token"}},
        },
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *({"name": k, "value": v} for k, v in SCRATCH_ENV.items()),
    ]
    if role == "coordinator" and resume is not None:
        env.append({"name": "ECREC_RESUME", "value": json.dumps(resume[1], separators=(",", ":"))})
    if role != "coordinator":  # (the test kubelet would wait for the coordinator's own Service to be ready)
        env.append({"name": "ECREC_COORDINATOR", "value": coordinator_url(job.name, namespace)})
    container: dict = {
        "name": role,
        "image": (
            d.images.get("server" if role == "spare" else role, section.image)
            if section.image == SPEC_DEFAULT_IMAGE
            else section.image
        ),
        "command": argv[:2],  # the images' ENTRYPOINT console script and the role
        "args": argv[2:],
        "env": env,
        "ports": ports,
        "volumeMounts": [{"name": TMP_VOLUME, "mountPath": TMP_DIR}],
    }
    found = spec.fault_tolerance.checkpoints()
    claim = found[1].volume_claim if found is not None else None
    if claim and role != "worker":  # workers never touch checkpoint files
        container["volumeMounts"].append({"name": CHECKPOINT_VOLUME, "mountPath": CHECKPOINT_DIR})
    if d.container_security_context:
        container["securityContext"] = _copy(d.container_security_context)
    if section.image_pull_policy or d.image_pull_policy:
        container["imagePullPolicy"] = section.image_pull_policy or d.image_pull_policy
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
        "volumes": [{"name": TMP_VOLUME, "emptyDir": {}}],
    }
    if claim and role != "worker":
        pod_spec["volumes"].append({"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": claim}})
    if d.pod_security_context:
        pod_spec["securityContext"] = _copy(d.pod_security_context)
    if d.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in d.image_pull_secrets]
    if section.node_selector:
        pod_spec["nodeSelector"] = dict(section.node_selector)
    if section.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in section.tolerations
        ]
    if section.service_account_name:
        pod_spec["serviceAccountName"] = section.service_account_name
    else:  # ECRec's processes never call the Kubernetes API: the namespace default's token is of no use
        pod_spec["automountServiceAccountToken"] = False
    meta: dict = {
        "name": pod_name(job.name, role, index, incarnation),
        "namespace": namespace,
        # The job's own template labels over the operator config's, the operator's own over both.
        "labels": {
            **d.labels,
            **section.template.metadata.labels,
            **labels(job.name, role, index, incarnation),
        },
    }
    meta["annotations"] = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }
    out = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
    spread = podtemplate.server_spread(job.name, spec.servers) if role in podtemplate.SPREAD_ROLES else None
    return podtemplate.merge(out, section.template, spread)


def network_policy(job: Job, namespace: str, defaults: PodDefaults | None = None) -> dict | None:
    """The job's NetworkPolicy (None when the defaults have none): see `NetworkPolicySettings`. One per job,
    since a policy cannot say "pods of the same job as this one": its selectors name the job."""
    np = (DEFAULTS if defaults is None else defaults).network_policy
    if np is None:
        return None
    own = {"podSelector": {"matchLabels": {LABEL_JOB: job.name}}}
    metrics: dict = {"ports": [{"protocol": "TCP", "port": METRICS_PORT}]}
    if np.metrics_from:
        metrics["from"] = _copy(list(np.metrics_from))
    ingress: list[dict] = [{"from": [own]}]
    if np.operator_peers:
        ingress.append({"from": _copy(list(np.operator_peers))})
    ingress.append(metrics)
    dns = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": network_policy_name(job.name),
            "namespace": namespace,
            "labels": {LABEL_JOB: job.name},
        },
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: job.name}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": [{"to": [own]}, dns, *_copy(list(np.extra_egress))],
        },
    }


def network_policy_name(job: str) -> str:
    return f"{job}-ecrec"


def _copy(obj: Any) -> Any:
    """A deep copy of plain JSON-like data: a manifest never shares a dict with the defaults."""
    return json.loads(json.dumps(obj))


def observe_pod(pod_obj: dict) -> Proc | None:
    """The reconciler's view of one of the job's pods (None for a pod that is not one of ours)."""
    meta = pod_obj.get("metadata", {})
    if (ident := pod_identity(meta.get("labels"))) is None:
        return None
    role, index, incarnation = ident
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
    spare = spare_index(meta.get("labels"))
    return Proc(role, index, incarnation, state, meta.get("name", ""), exit_code, spare=spare)
