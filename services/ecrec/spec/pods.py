"""Each role's pod settings (image, pull policy, resources, node selector, tolerations, service account).

Kubernetes only: the operator writes them into the role's pods and `ecrec local` accepts and ignores them.
Declared once here, so the three roles (servers, workers, coordinator) describe them the same way.
`ROLE_POD_FIELDS` names them, camelCase, for `KUBERNETES_ONLY_FIELDS`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ecrec.spec.base import _Section
from ecrec.spec.quantities import Quantity


class ResourceRequirements(_Section):
    """Kubernetes container resources: quantities per resource name (cpu, memory, nvidia.com/gpu, ...)."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        description="What the scheduler reserves for the container, e.g. cpu: 500m, memory: 1Gi",
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        description="The most the container may use, e.g. memory: 4Gi; each request must not exceed its limit",
    )


class Toleration(_Section):
    """A Kubernetes toleration (core/v1 Toleration): lets the role's pods run on nodes with a matching taint."""

    key: str | None = Field(
        default=None, description="Taint key to match; unset with operator Exists matches every taint"
    )
    operator: Literal["Exists", "Equal"] = Field(
        default="Equal", description="Equal: the taint's value must equal value; Exists: any value (no value)"
    )
    value: str | None = Field(default=None, description="Taint value to match (operator Equal)")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; unset matches every effect"
    )
    toleration_seconds: int | None = Field(
        default=None,
        description="Effect NoExecute only: how long the pod stays on a node after the taint appears; "
        "unset = forever",
    )


# Each role's pod settings: Kubernetes only (`ecrec local` accepts and ignores them). One declaration each, so the
# three roles describe them the same way.
_K8S = "Kubernetes only (ecrec local ignores it). "
Image = Annotated[
    str, Field(default="ecrec:latest", min_length=1, description=_K8S + "Container image of the role's pods")
]
ImagePullPolicy = Annotated[
    Literal["Always", "IfNotPresent", "Never"] | None,
    Field(
        default=None,
        description=_K8S
        + "Always | IfNotPresent | Never; unset = Kubernetes' rule (Always for a :latest tag, "
        "else IfNotPresent). Use IfNotPresent for an image loaded into the nodes (kind load, minikube)",
    ),
]
Resources = Annotated[
    ResourceRequirements,
    Field(
        default_factory=ResourceRequirements,
        description=_K8S + "CPU, memory and other resources of each of the role's pods",
    ),
]
NodeSelector = Annotated[
    dict[str, str],
    Field(
        default_factory=dict,
        description=_K8S
        + "Node labels the role's pods require, e.g. node.kubernetes.io/instance-type: m5.xlarge",
    ),
]
Tolerations = Annotated[
    list[Toleration],
    Field(default_factory=list, description=_K8S + "Taints the role's pods tolerate"),
]
# Kubernetes' name formats (a DNS-1123 label: a Service, a volume; a subdomain: most object names).
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ServiceAccountName = Annotated[
    str | None,
    Field(
        default=None,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        description=_K8S + "ServiceAccount the role's pods run as (e.g. one bound to a cloud identity for "
        "reading training data); unset = the namespace's default. ECRec's own processes need no API access",
    ),
]
FailureDomain = Annotated[
    str,
    Field(
        default="kubernetes.io/hostname",
        min_length=1,
        description=_K8S + "The node label whose values are the failure domains the servers (and spares) are "
        "spread over: kubernetes.io/hostname (one node each, the default) or topology.kubernetes.io/zone. "
        "More than faultTolerance.ecrec.r servers in one domain after scheduling sets the job's condition "
        "FailureDomainsAtRisk (one domain lost would lose more shards than parity rebuilds)",
    ),
]
FailureDomainPolicy = Annotated[
    Literal["ScheduleAnyway", "DoNotSchedule"],
    Field(
        default="ScheduleAnyway",
        description=_K8S + "whenUnsatisfiable of the servers' spread over failureDomain (maxSkew 1). "
        "ScheduleAnyway (default): a preference; a 5-server job still starts on 3 nodes (2+2+1) and a "
        "replacement server is never held back while a domain is down or full, since a job waiting for a pod "
        "is worse than one with two shards in a domain, which FailureDomainsAtRisk reports. DoNotSchedule: a "
        "pod that would make the spread uneven stays Pending (a replacement too, until a domain has room)",
    ),
]
ROLE_POD_FIELDS = (
    "template",
    "image",
    "imagePullPolicy",
    "resources",
    "nodeSelector",
    "tolerations",
    "serviceAccountName",
)
