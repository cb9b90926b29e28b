"""A role's pod template (`servers.template`, `workers.template`, `coordinator.template`): what a user adds to
the pods the operator renders, in the shape of a Kubeflow replica spec's `template`, and the rules that keep
the API server from refusing it or the job from breaking (`template_problems`).

Kubernetes only: `ecrec local` accepts and ignores it. The operator's own names (the `ecrec.dev/` labels, the
environment and volumes it gives every process) are declared here, below the operator, so that the spec can
refuse a template that collides with them and the renderer uses the same names.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from ecrec.spec.base import _Section
from ecrec.spec.pods import DNS1123_LABEL, DNS1123_SUBDOMAIN, Toleration

# -- the operator's own names (ecrec_operator.render uses these) ------------------------------------------
OPERATOR_LABEL_PREFIX = "ecrec.dev/"  # job, role, shard, rank, spare, incarnation: how pods are found again
OPERATOR_ANNOTATIONS = ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path")
TMP_VOLUME, TMP_DIR = "tmp", "/tmp"
CHECKPOINT_VOLUME, CHECKPOINT_DIR = "checkpoints", "/var/lib/ecrec/checkpoints"
OPERATOR_VOLUMES = {TMP_VOLUME: TMP_DIR, CHECKPOINT_VOLUME: CHECKPOINT_DIR}
# Every variable the operator sets in a process's environment: the pod's identity, the job and its token,
# the coordinator's address and the scratch paths under the read-only root filesystem.
SCRATCH_ENV = {
    "HOME": TMP_DIR,
    "MPLCONFIGDIR": f"{TMP_DIR}/matplotlib",
    "TORCHINDUCTOR_CACHE_DIR": f"{TMP_DIR}/torchinductor",
    "TRITON_CACHE_DIR": f"{TMP_DIR}/triton",
    "XDG_CACHE_HOME": f"{TMP_DIR}/.cache",
}
OPERATOR_ENV = frozenset(
    {
        "POD_IP",
        "POD_NAME",
        "ECREC_JOB",
        "ECREC_JOB_TOKEN",
        "ECREC_COORDINATOR",
        "ECREC_RESUME",
        "PYTHONUNBUFFERED",
        *SCRATCH_ENV,
    }
)
CONTAINER = "ecrec"  # the name a template's container entry uses for the role's one container

# -- Kubernetes' name rules (apimachinery validation), as the API server applies them ------------------------
_NAME63 = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_DNS1123_LABEL = re.compile(DNS1123_LABEL)
_DNS1123_SUBDOMAIN = re.compile(DNS1123_SUBDOMAIN)
_LABEL_NAME = re.compile(f"^{_NAME63}$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")  # the rule of every apiserver before 1.30


def label_key_problem(key: str) -> str | None:
    """Why `key` is no valid label (or annotation) key, `[prefix/]name`; None when it is one."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and not prefix:
        return "the prefix before '/' must not be empty"
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return f"prefix {prefix!r} must be a DNS subdomain (lowercase, digits, '-', '.'; at most 253)"
    if not name or len(name) > 63 or not _LABEL_NAME.match(name):
        return (
            f"name {name!r} must be 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter "
            "or digit"
        )
    return None


def label_value_problem(value: str) -> str | None:
    if value == "" or (len(value) <= 63 and _LABEL_NAME.match(value)):
        return None
    return (
        "must be empty or 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
    )


# -- the template's models -----------------------------------------------------------------------------------
_FREE = {"x-kubernetes-preserve-unknown-fields": True}
FreeForm = Annotated[
    dict[str, Any],
    Field(json_schema_extra=_FREE),  # kept whole by the API server, checked by it when the pod is created
]


class TemplateMetadata(_Section):
    """Labels and annotations added to the role's pods (the operator's own always win; see template rules)."""

    labels: dict[str, str] = Field(
        default_factory=dict, description="Added to the pods; keys under ecrec.dev/ are the operator's"
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Added to the pods; ecrec.dev/ keys and the prometheus.io/ scrape annotations are the "
        "operator's",
    )


class EnvVar(_Section):
    """A core/v1 EnvVar: `value`, or `valueFrom` (secretKeyRef, configMapKeyRef, fieldRef, ...) as is."""

    name: str = Field(min_length=1, description="Variable name; those the operator sets are refused")
    value: str | None = Field(default=None, description="Its value (may use $(OTHER_VAR))")
    value_from: FreeForm | None = Field(
        default=None, description="A core/v1 EnvVarSource, passed to the pod as written"
    )


class VolumeMount(_Section):
    """A core/v1 VolumeMount of one of the template's volumes."""

    name: str = Field(min_length=1, description="A volume of template.spec.volumes")
    mount_path: str = Field(min_length=1, description="Absolute path in the container")
    read_only: bool | None = Field(default=None, description="Mount read-only")
    sub_path: str | None = Field(
        default=None, description="A path inside the volume to mount instead of its root"
    )


class Container(_Section):
    """Additions to the role's one container (sidecars are not supported)."""

    # Named `ecrec` whatever the role (the container's own name is the role's), as a Kubeflow template names
    # its main container, so one template shape fits every role.
    name: Literal["ecrec"] = Field(
        default=CONTAINER,
        description="Always ecrec: the role's process",
        json_schema_extra={"enum": [CONTAINER]},
    )
    env: list[EnvVar] = Field(default_factory=list, description="Environment added to the process's")
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, description="Mounts of template.spec.volumes"
    )


class Volume(_Section):
    """A core/v1 Volume: name and exactly one source (persistentVolumeClaim, configMap, csi ...) as written."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_FREE)

    name: str = Field(min_length=1, description="A DNS-1123 label; tmp and checkpoints are the operator's")

    def sources(self) -> list[str]:
        return sorted(self.model_extra or {})


class Affinity(_Section):
    """A core/v1 Affinity; each part is passed to the pod as written (the API server checks its inside)."""

    node_affinity: FreeForm | None = Field(default=None, description="core/v1 NodeAffinity")
    pod_affinity: FreeForm | None = Field(default=None, description="core/v1 PodAffinity")
    pod_anti_affinity: FreeForm | None = Field(default=None, description="core/v1 PodAntiAffinity")


class TopologySpreadConstraint(_Section):
    """A core/v1 TopologySpreadConstraint."""

    max_skew: int = Field(ge=1, description="Most pods one domain may have above the least-loaded one")
    topology_key: str = Field(min_length=1, description="The node label whose values are the domains")
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(
        description="DoNotSchedule: the pod stays Pending; ScheduleAnyway: a preference only"
    )
    label_selector: FreeForm | None = Field(
        default=None, description="The pods counted (matchLabels / matchExpressions)"
    )
    min_domains: int | None = Field(default=None, ge=1, description="DoNotSchedule only: domains at least")
    match_label_keys: list[str] | None = Field(
        default=None, description="Pod label keys added to the selector"
    )
    node_affinity_policy: Literal["Honor", "Ignore"] | None = Field(
        default=None, description="Honor | Ignore"
    )
    node_taints_policy: Literal["Honor", "Ignore"] | None = Field(default=None, description="Honor | Ignore")


class TemplatePodSpec(_Section):
    """What a template adds to the pod's spec (each list appended to the operator's, each map merged)."""

    affinity: Affinity | None = Field(default=None, description="Node and pod (anti-)affinity")
    tolerations: list[Toleration] = Field(default_factory=list, description="Added to the role's tolerations")
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Merged with the role's nodeSelector; a key in both must have the same value",
    )
    priority_class_name: str | None = Field(
        default=None, max_length=253, description="A PriorityClass (e.g. for preemption under Kueue)"
    )
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list,
        description="Added to the pod's; for servers, after the one over servers.failureDomain",
    )
    volumes: list[Volume] = Field(
        default_factory=list, description="Volumes for the container's volumeMounts"
    )
    containers: list[Container] = Field(
        default_factory=list,
        max_length=1,
        description="At most one entry, named ecrec: env and volumeMounts of the role's process",
    )


class PodTemplate(_Section):
    """A role's pod template (see `Template`)."""

    metadata: TemplateMetadata = Field(default_factory=TemplateMetadata, description="Labels, annotations")
    spec: TemplatePodSpec = Field(default_factory=TemplatePodSpec, description="Pod spec additions")

    def container(self) -> Container:
        return self.spec.containers[0] if self.spec.containers else Container()


Template = Annotated[
    PodTemplate,
    Field(
        default_factory=PodTemplate,
        description="Kubernetes only (ecrec local ignores it). A Kubeflow-style pod template merged into the "
        "pods the operator renders for the role: labels and annotations added (never replacing the operator's "
        "own); affinity, tolerations, nodeSelector, priorityClassName, topologySpreadConstraints and volumes "
        "added to the pod; env and volumeMounts added to its container (containers: [{name: ecrec, ...}]). "
        "Affinity, a volume's source, an env valueFrom and a spread's labelSelector are passed as written "
        "(the API server checks them when it creates the pod); the rest is checked when the job is created",
    ),
]


# -- the rules -------------------------------------------------------------------------------------------------
def template_problems(path: str, t: PodTemplate, node_selector: Mapping[str, str]) -> list[str]:
    """What the API server would refuse, or what would break the job, in a role's template (`path` is
    `spec.<role>.template`); `node_selector` is the role's own nodeSelector, merged with the template's."""
    out: list[str] = []
    meta, spec = f"{path}.metadata", f"{path}.spec"
    for key, value in t.metadata.labels.items():
        out += _key_problems(f"{meta}.labels", key)
        if (why := label_value_problem(value)) is not None:
            out.append(f"{meta}.labels.{key}: value {value!r} {why}")
        if key.startswith(OPERATOR_LABEL_PREFIX):
            out.append(
                f"{meta}.labels.{key}: ecrec.dev/ labels are the operator's (it finds its pods by them)"
            )
    for key in t.metadata.annotations:
        out += _key_problems(f"{meta}.annotations", key)
        if key.startswith(OPERATOR_LABEL_PREFIX) or key in OPERATOR_ANNOTATIONS:
            out.append(f"{meta}.annotations.{key}: set by the operator")
    for key, value in t.spec.node_selector.items():
        out += _key_problems(f"{spec}.nodeSelector", key)
        if (why := label_value_problem(value)) is not None:
            out.append(f"{spec}.nodeSelector.{key}: value {value!r} {why}")
        if key in node_selector and node_selector[key] != value:
            out.append(
                f"{spec}.nodeSelector.{key}: {value!r} contradicts the role's nodeSelector ({node_selector[key]!r}); "
                "no node could match both"
            )
    pcn = t.spec.priority_class_name
    if pcn is not None and not _DNS1123_SUBDOMAIN.match(pcn):
        out.append(f"{spec}.priorityClassName: {pcn!r} must be a DNS subdomain (lowercase, digits, '-', '.')")
    out += toleration_problems(f"{spec}.tolerations", t.spec.tolerations)
    out += _spread_problems(f"{spec}.topologySpreadConstraints", t.spec.topology_spread_constraints)
    out += _volume_problems(spec, t)
    out += _env_problems(f"{spec}.containers[0].env", t.container().env)
    return out


def toleration_problems(path: str, tolerations: Iterable[Toleration]) -> list[str]:
    out: list[str] = []
    for i, tol in enumerate(tolerations):
        at = f"{path}[{i}]"
        if tol.operator == "Exists" and tol.value:
            out.append(f"{at}.value: must be empty when operator is Exists")
        if tol.operator == "Equal" and not tol.key:
            out.append(
                f"{at}.key: required when operator is Equal (operator Exists without a key tolerates all)"
            )
        if tol.toleration_seconds is not None and tol.effect != "NoExecute":
            out.append(f"{at}.tolerationSeconds: only valid with effect NoExecute")
    return out


def _key_problems(path: str, key: str) -> list[str]:
    why = label_key_problem(key)
    return [] if why is None else [f"{path}.{key}: invalid key: {why}"]


def _spread_problems(path: str, constraints: list[TopologySpreadConstraint]) -> list[str]:
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    for i, c in enumerate(constraints):
        at = f"{path}[{i}]"
        if (why := label_key_problem(c.topology_key)) is not None:
            out.append(f"{at}.topologyKey: invalid label key {c.topology_key!r}: {why}")
        if c.min_domains is not None and c.when_unsatisfiable != "DoNotSchedule":
            out.append(f"{at}.minDomains: only valid with whenUnsatisfiable DoNotSchedule")
        pair = (c.topology_key, c.when_unsatisfiable)
        if pair in seen:
            out.append(
                f"{at}: a second constraint over {c.topology_key} with {c.when_unsatisfiable} (refused)"
            )
        seen.add(pair)
    return out


def _volume_problems(spec: str, t: PodTemplate) -> list[str]:
    out: list[str] = []
    names = [v.name for v in t.spec.volumes]
    for i, v in enumerate(t.spec.volumes):
        at = f"{spec}.volumes[{i}]"
        if len(v.name) > 63 or not _DNS1123_LABEL.match(v.name):
            out.append(f"{at}.name: {v.name!r} must be a DNS-1123 label (lowercase, digits, '-'; at most 63)")
        if v.name in OPERATOR_VOLUMES:
            out.append(f"{at}.name: {v.name!r} is the operator's own volume (at {OPERATOR_VOLUMES[v.name]})")
        if len(v.sources()) != 1:
            found = ", ".join(v.sources()) or "none"
            out.append(f"{at}: needs exactly one source (persistentVolumeClaim, configMap, ...), got {found}")
    for name, n in Counter(names).items():
        if n > 1:
            out.append(f"{spec}.volumes: {name!r} declared {n} times")
    paths: Counter[str] = Counter()
    for i, m in enumerate(t.container().volume_mounts):
        at = f"{spec}.containers[0].volumeMounts[{i}]"
        if m.name not in names:
            out.append(
                f"{at}.name: {m.name!r} is not one of template.spec.volumes ({', '.join(names) or 'none'})"
            )
        if not m.mount_path.startswith("/"):
            out.append(f"{at}.mountPath: {m.mount_path!r} must be absolute")
        # A mount at or above one of the operator's would hide it (a mount below one is harmless).
        hidden = next((d for d in OPERATOR_VOLUMES.values() if _under(d, m.mount_path)), None)
        if hidden is not None:
            out.append(f"{at}.mountPath: {m.mount_path!r} would hide the operator's mount at {hidden}")
        paths[m.mount_path.rstrip("/")] += 1
    out += [f"{spec}.containers[0].volumeMounts: {p!r} mounted {n} times" for p, n in paths.items() if n > 1]
    return out


def _under(path: str, directory: str) -> bool:
    path, directory = path.rstrip("/"), directory.rstrip("/")
    return path == directory or path.startswith(directory + "/")


def _env_problems(path: str, env: list[EnvVar]) -> list[str]:
    out: list[str] = []
    for i, e in enumerate(env):
        at = f"{path}[{i}]"
        if not _ENV_NAME.match(e.name):
            out.append(
                f"{at}.name: {e.name!r} must be letters, digits, '_', '-' or '.', not starting with a digit"
            )
        if e.name in OPERATOR_ENV:
            out.append(f"{at}.name: {e.name} is set by the operator")
        if e.value is not None and e.value_from is not None:
            out.append(f"{at}: value and valueFrom are exclusive")
    for name, n in Counter(e.name for e in env).items():
        if n > 1:
            out.append(f"{path}: {name} set {n} times")
    return out
