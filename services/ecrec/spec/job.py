"""The job model: `JobSpec` (the whole spec), the rules that span its sections, and `Job` (a named spec).

`JobSpec` is one schema for `ecrec local` and the Kubernetes operator. Its after-validator runs the
cross-field rules (sizes that must agree, servers enough for k + r, what the API server would refuse in a
role's pods) and raises every problem at once as `_CrossFieldProblems`. `KUBERNETES_ONLY_FIELDS` lists the
fields only the operator reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from ecrec.core.errors import SUM_HAS_NO_R2
from ecrec.spec.base import _Section
from ecrec.spec.errors import _CrossFieldProblems
from ecrec.spec.pods import ROLE_POD_FIELDS
from ecrec.spec.presets import MOVIELENS100K_NUM_DENSE, MOVIELENS100K_TABLE_SIZES
from ecrec.spec.quantities import parse_quantity
from ecrec.spec.resource import API_VERSION, KIND
from ecrec.spec.sections import (
    CoordinatorSpec,
    DataSpec,
    FaultToleranceSpec,
    ModelSpec,
    RunPolicy,
    ServersSpec,
    TrainingSpec,
    WorkersSpec,
)
from ecrec.spec.template import label_key_problem, label_value_problem, template_problems, toleration_problems

if TYPE_CHECKING:
    from ecrec.model import ModelConfig


class JobSpec(_Section):
    """The spec of an ECRecJob: one schema for `ecrec local` and the Kubernetes operator."""

    model: ModelSpec = Field(description="The DLRM: a preset and/or explicit sizes")
    data: DataSpec = Field(default_factory=DataSpec, description="Training data")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Optimization settings")
    servers: ServersSpec = Field(default_factory=ServersSpec, description="Parameter servers")
    workers: WorkersSpec = Field(default_factory=WorkersSpec, description="Trainers")
    coordinator: CoordinatorSpec = Field(default_factory=CoordinatorSpec, description="Coordinator")
    fault_tolerance: FaultToleranceSpec = Field(
        default_factory=FaultToleranceSpec, description="Fault-tolerance strategy and its settings"
    )
    run_policy: RunPolicy = Field(
        default_factory=RunPolicy,
        description="Kubernetes only (ecrec local ignores it): cleanup, deadline and retry limit, as Kubeflow's "
        "runPolicy",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> JobSpec:
        problems = _cross_field_problems(self)
        if problems:
            raise _CrossFieldProblems(problems)
        return self

    def to_dict(self) -> dict[str, Any]:
        """camelCase, JSON-safe, defaults and preset-filled fields included; `job_from_dict` reads it back."""
        return self.model_dump(mode="json", by_alias=True)

    def without_kubernetes_fields(self) -> JobSpec:
        """This spec with every Kubernetes-only field (`KUBERNETES_ONLY_FIELDS`) back at its default: what
        `ecrec local` runs is the same for both."""
        doc = self.to_dict()
        for path in KUBERNETES_ONLY_FIELDS:
            *parents, leaf = path.split(".")
            node = doc
            for part in parents:
                node = node[part]
            node.pop(leaf)
        return JobSpec.model_validate(doc)

    def model_config_resolved(self) -> ModelConfig:
        """The model shape after preset and scale, as the model code wants it."""
        from ecrec.model import ModelConfig

        m = self.model
        return ModelConfig(
            num_dense=m.num_dense_features,
            dim=m.embedding_dim,
            table_sizes=m.scaled_table_sizes,
            bottom_mlp=tuple(m.bottom_mlp or ()),
            top_mlp=tuple(m.top_mlp or ()),
        )


ROLE_SECTIONS = ("servers", "workers", "coordinator")  # the spec sections of the roles (ecrec.core.roles)
# camelCase paths below spec of the fields only the Kubernetes operator reads.
KUBERNETES_ONLY_FIELDS: tuple[str, ...] = (
    *(f"{role}.{field}" for role in ROLE_SECTIONS for field in ROLE_POD_FIELDS),
    "servers.failureDomain",
    "servers.failureDomainPolicy",
    "runPolicy",
)


def _cross_field_problems(s: JobSpec) -> list[str]:
    out: list[str] = []
    m = s.model
    for alias, value in (("tableSizes", m.table_sizes), ("bottomMlp", m.bottom_mlp), ("topMlp", m.top_mlp)):
        if value is None:
            out.append(f"spec.model.{alias}: required when model.preset is not set")
    if m.bottom_mlp and m.bottom_mlp[-1] != m.embedding_dim:
        out.append(
            f"spec.model.bottomMlp: last width {m.bottom_mlp[-1]} must equal embeddingDim {m.embedding_dim}"
        )
    if m.top_mlp and m.top_mlp[-1] != 1:
        out.append(f"spec.model.topMlp: last width {m.top_mlp[-1]} must be 1 (the click logit)")
    if s.fault_tolerance.strategy == "ecrec":
        ec = s.fault_tolerance.ecrec
        if s.servers.replicas < ec.k + ec.r:
            out.append(
                f"spec.servers.replicas: strategy ecrec needs at least k + r = {ec.k + ec.r} servers, "
                f"got {s.servers.replicas}"
            )
        if ec.r == 2 and ec.code != "xor":
            out.append(f"spec.faultTolerance.ecrec.r: {SUM_HAS_NO_R2}")
        elif ec.r > 2:
            out.append(f"spec.faultTolerance.ecrec.r: r is 1 (P) or 2 (P and Q, as in RAID-6), got {ec.r}")
    if s.training.deterministic and s.workers.replicas != 1:
        out.append(
            f"spec.workers.replicas: deterministic training needs exactly 1 worker, got {s.workers.replicas}"
        )
    if s.servers.spares and s.fault_tolerance.strategy == "none":
        out.append("spec.servers.spares: strategy none rebuilds no server: a spare would never be used")
    if s.data.source == "criteo" and not s.data.paths:
        out.append("spec.data.paths: source criteo needs at least one Criteo-format TSV file")
    if s.data.source == "movielens100k":
        out += _movielens_problems(m)
    c = s.coordinator
    if c.failure_timeout_seconds <= c.heartbeat_interval_seconds:
        # Otherwise every healthy server would be declared failed between two heartbeats.
        out.append(
            f"spec.coordinator.failureTimeoutSeconds: must be greater than heartbeatIntervalSeconds "
            f"({c.failure_timeout_seconds} <= {c.heartbeat_interval_seconds})"
        )
    for role in ROLE_SECTIONS:
        out += _pod_problems(f"spec.{role}", getattr(s, role))
    return out


def _movielens_problems(m: ModelSpec) -> list[str]:
    """The model must have MovieLens-100k's tables (each id fits its table) and dense features."""
    out: list[str] = []
    fix = "use model.preset: movielens100k"
    want = list(MOVIELENS100K_TABLE_SIZES)
    if m.table_sizes is not None and list(m.scaled_table_sizes) != want:
        scaled = f" (after scale {m.scale})" if m.scale != 1 else ""
        out.append(
            f"spec.model.tableSizes: source movielens100k needs the dataset's {len(want)} tables of {want} rows "
            f"(user, movie, genre, age bucket, gender, occupation, zip prefix, release decade), got "
            f"{list(m.scaled_table_sizes)}{scaled}: {fix}"
        )
    if m.num_dense_features != MOVIELENS100K_NUM_DENSE:
        out.append(
            f"spec.model.numDenseFeatures: source movielens100k has {MOVIELENS100K_NUM_DENSE} dense features, "
            f"got {m.num_dense_features}: {fix}"
        )
    return out


def _pod_problems(path: str, role: ServersSpec | WorkersSpec | CoordinatorSpec) -> list[str]:
    """What the API server would refuse when the operator creates the role's pods, found before it does."""
    out: list[str] = []
    res = role.resources
    for kind, quantities in (("requests", res.requests), ("limits", res.limits)):
        for name, q in quantities.items():
            if parse_quantity(q) < 0:
                out.append(f"{path}.resources.{kind}.{name}: must not be negative, got {q}")
    for name, request in res.requests.items():
        limit = res.limits.get(name)
        if limit is not None and parse_quantity(request) > parse_quantity(limit):
            out.append(f"{path}.resources.requests.{name}: {request} exceeds the limit {limit}")
    out += toleration_problems(f"{path}.tolerations", role.tolerations)
    for key, value in role.node_selector.items():
        if (why := label_key_problem(key)) is not None:
            out.append(f"{path}.nodeSelector.{key}: invalid key: {why}")
        if (why := label_value_problem(value)) is not None:
            out.append(f"{path}.nodeSelector.{key}: value {value!r} {why}")
    out += template_problems(f"{path}.template", role.template, role.node_selector)
    if isinstance(role, ServersSpec):
        out += _failure_domain_problems(path, role)
    return out


def _failure_domain_problems(path: str, servers: ServersSpec) -> list[str]:
    out: list[str] = []
    if (why := label_key_problem(servers.failure_domain)) is not None:
        out.append(f"{path}.failureDomain: invalid label key {servers.failure_domain!r}: {why}")
    ours = (servers.failure_domain, servers.failure_domain_policy)
    for i, c in enumerate(servers.template.spec.topology_spread_constraints):
        if (c.topology_key, c.when_unsatisfiable) == ours:
            # The API server refuses two constraints with the same key and whenUnsatisfiable.
            out.append(
                f"{path}.template.spec.topologySpreadConstraints[{i}]: the operator already spreads the servers "
                f"over {c.topology_key} ({c.when_unsatisfiable}): set servers.failureDomain(Policy) instead"
            )
    return out


@dataclass(frozen=True)
class Job:
    """A named, validated job: what both launchers run."""

    name: str
    spec: JobSpec

    def to_manifest(self) -> dict[str, Any]:
        """The full ECRecJob manifest (what `kubectl apply` takes)."""
        # Unset (null) fields are left out: they mean the same and some apiservers reject a null enum.
        spec = self.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
        return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": self.name}, "spec": spec}
