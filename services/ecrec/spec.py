"""The ECRecJob spec: one schema for both launchers, its YAML loader, `--set` overrides and the CRD.

This module owns the `ECRecJob` custom resource (group `ecrec.dev`, version `v1alpha1`): the pydantic models
of its `spec` (camelCase in YAML, snake_case in Python), model presets, cross-field validation, turning a
manifest or bare spec into a `Job`, and generating the CustomResourceDefinition from the same models so that
`ecrec local` and the Kubernetes operator can never disagree about what a job means.

Every validation failure is a `SpecError` whose message lists each problem on its own line as
`spec.<camelCase path>: <reason>`.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel

if TYPE_CHECKING:
    from ecrec.model import ModelConfig

GROUP = "ecrec.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ECRecJob"
PLURAL = "ecrecjobs"
DEFAULT_JOB_NAME = "ecrec-job"

# The 26 Criteo Kaggle (Display Advertising Challenge) cardinalities, in column order C1..C26.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
# Capped so that the x8 scale still fits in this machine's 24 GiB with optimizer state and parity.
CRITEO_TABLE_CAP = 100_000

# Values a preset fills in when the user leaves the field unset (camelCase keys, as in YAML).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "tableSizes": [1000, 500, 2000, 800],
        "embeddingDim": 8,
        "bottomMlp": [16, 8],
        "topMlp": [16, 1],
    },
    "small": {
        # Deliberately uneven and unsorted, like real categorical features.
        "tableSizes": [1200, 3000, 50000, 8000, 25000, 1000, 15000, 4000],
        "embeddingDim": 16,
        "bottomMlp": [64, 16],
        "topMlp": [64, 1],
    },
    "criteo-kaggle": {
        "tableSizes": [min(n, CRITEO_TABLE_CAP) for n in CRITEO_KAGGLE_CARDINALITIES],
        "embeddingDim": 16,
        "bottomMlp": [512, 256, 64, 16],
        "topMlp": [512, 256, 1],
    },
}
PresetName = Literal["tiny", "small", "criteo-kaggle"]
Strategy = Literal["none", "ecrec", "checkpoint", "checknrun", "cpr"]
Optimizer = Literal["sgd", "momentum", "adagrad", "rowwise_adagrad", "adam"]

PosInt = Annotated[int, Field(ge=1)]


def _quantity_to_str(v: Any) -> Any:
    # YAML users write `cpu: 2`; Kubernetes accepts int-or-string quantities, so do we.
    if isinstance(v, int | float) and not isinstance(v, bool):
        return str(v)
    return v


Quantity = Annotated[
    str,
    BeforeValidator(_quantity_to_str),
    WithJsonSchema(
        {"x-kubernetes-int-or-string": True, "description": "Kubernetes quantity, e.g. 500m, 2Gi"}
    ),
]


class SpecError(ValueError):
    """An invalid job: `problems` holds one `spec.<path>: <reason>` line per problem."""

    def __init__(self, problems: Sequence[str] | str, source: str | None = None) -> None:
        self.problems: tuple[str, ...] = (problems,) if isinstance(problems, str) else tuple(problems)
        self.source = source
        lines = "\n".join(self.problems)
        super().__init__(f"{source}:\n{lines}" if source else lines)


class _CrossFieldProblems(ValueError):
    """Raised inside validation; carries fully qualified lines so SpecError can list them as they are."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        super().__init__("\n".join(lines))


class _Section(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class ResourceRequirements(_Section):
    """Kubernetes container resources (quantities as strings)."""

    requests: dict[str, Quantity] = Field(default_factory=dict, description="Resource requests, e.g. cpu: 2")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Resource limits, e.g. memory: 4Gi")


class ModelSpec(_Section):
    """The DLRM: embedding tables, bottom MLP over the dense features, top MLP over the interaction."""

    preset: PresetName | None = Field(
        default=None,
        description="Fills every model field left unset: tiny (tests), small (demo), criteo-kaggle",
    )
    scale: PosInt = Field(
        default=1, description="Multiplies every table size (1, 2, 4, 8 = Criteo-Original/2S/4S/8S)"
    )
    embedding_dim: PosInt = Field(default=16, description="Embedding width d (16 unless the preset sets it)")
    num_dense_features: PosInt = Field(default=13, description="Number of dense (continuous) input features")
    table_sizes: Annotated[list[PosInt], Field(min_length=1)] | None = Field(
        default=None, description="Rows per embedding table before scale; required without a preset"
    )
    bottom_mlp: Annotated[list[PosInt], Field(min_length=1)] | None = Field(
        default=None, description="Bottom MLP widths after the dense input; the last must equal embeddingDim"
    )
    top_mlp: Annotated[list[PosInt], Field(min_length=1)] | None = Field(
        default=None, description="Top MLP widths after the interaction; the last must be 1"
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        name = data.get("preset")
        preset = PRESETS.get(name) if isinstance(name, str) else None
        if preset is None:
            return data  # no preset, or an unknown one that the Literal check reports
        out = dict(data)
        names = {to_camel(n): n for n in cls.model_fields}
        given = {a for a, n in names.items() if a in out or n in out}
        for alias, value in preset.items():
            if alias not in given:
                out[alias] = copy.deepcopy(value)
        # An explicit embeddingDim with the preset's bottom MLP: the MLP's last width is the embedding width
        # by construction, so follow the user instead of rejecting their one-field change.
        dim = out.get("embeddingDim", out.get("embedding_dim"))
        if "embeddingDim" in given and "bottomMlp" not in given and isinstance(dim, int) and dim >= 1:
            out["bottomMlp"] = [*preset["bottomMlp"][:-1], dim]
        return out

    @property
    def scaled_table_sizes(self) -> tuple[int, ...]:
        """Rows per table after `scale`: what the servers actually hold."""
        return tuple(n * self.scale for n in self.table_sizes or ())


class DataSpec(_Section):
    """Where training samples come from."""

    source: Literal["synthetic", "criteo"] = Field(
        default="synthetic", description="synthetic (Zipf ids, teacher-model labels) or criteo (TSV files)"
    )
    paths: list[str] = Field(default=[], description="Criteo-format TSV files; required when source=criteo")
    zipf_exponent: float = Field(default=1.05, gt=0, description="Skew of the synthetic ids per table")
    eval_samples: PosInt = Field(default=8192, description="Held-out samples used for AUC and log-loss")


class TrainingSpec(_Section):
    """The optimization loop."""

    steps: PosInt = Field(default=200, description="Training steps per worker")
    batch_size: PosInt = Field(default=256, description="Samples per step per worker")
    optimizer: Optimizer = Field(default="adagrad", description="Optimizer for embeddings and dense params")
    learning_rate: float = Field(default=0.05, gt=0, description="Learning rate")
    momentum: float = Field(default=0.9, ge=0, lt=1, description="Momentum (optimizer momentum)")
    beta1: float = Field(default=0.9, ge=0, lt=1, description="Adam beta1")
    beta2: float = Field(default=0.999, ge=0, lt=1, description="Adam beta2")
    eps: float | None = Field(default=None, gt=0, description="Epsilon; null = the optimizer's default")
    weight_decay: float = Field(default=0.0, ge=0, description="L2 weight decay")
    seed: int = Field(default=0, description="Seed for initialization and data")
    deterministic: bool = Field(
        default=False, description="One worker, every step waits for its push, fixed seeds and order"
    )


class ServersSpec(_Section):
    """Parameter servers (one per shard id)."""

    replicas: PosInt = Field(default=3, description="Number of servers N (shard ids 0..N-1)")
    threads: PosInt = Field(default=1, description="Torch threads per server process")
    image: str = Field(default="ecrec:latest", min_length=1, description="Container image")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements, description="Pod resources")


class WorkersSpec(_Section):
    """Trainers."""

    replicas: PosInt = Field(default=1, description="Number of workers")
    threads: int = Field(default=0, ge=0, description="Torch threads per worker; 0 = auto")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto uses CUDA when present")
    image: str = Field(default="ecrec:latest", min_length=1, description="Container image")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements, description="Pod resources")


class CoordinatorSpec(_Section):
    """The per-job coordinator: cluster map, failure detection, recovery driver."""

    heartbeat_interval_seconds: float = Field(default=0.5, gt=0, description="Server heartbeat period")
    failure_timeout_seconds: float = Field(
        default=3.0, gt=0, description="A server silent this long is marked failed"
    )
    image: str = Field(default="ecrec:latest", min_length=1, description="Container image")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements, description="Pod resources")


class EcrecSpec(_Section):
    """Erasure-coded parameter servers (the paper's method)."""

    k: PosInt = Field(default=4, description="Data row records per stripe")
    r: PosInt = Field(default=1, description="Parity records per stripe (only 1 is implemented)")
    code: Literal["xor", "sum"] = Field(default="xor", description="xor (bit-exact) or sum (paper, float)")
    two_phase_commit: bool = Field(default=True, description="Stage/commit updates; off to measure its cost")
    replicate_dense: bool = Field(default=True, description="Keep two replicas of every dense chunk")
    lock_group_rows: PosInt = Field(default=65536, description="Lost rows rebuilt per lock group")
    txn_timeout_seconds: float = Field(
        default=10.0, gt=0, description="A staged part whose worker never commits is aborted after this long"
    )


class CheckpointSpec(_Section):
    """Periodic full checkpoints."""

    interval_seconds: float = Field(default=30.0, gt=0, description="Seconds between checkpoints")
    path: str = Field(default="out/checkpoints", min_length=1, description="Checkpoint directory")


class ChecknrunSpec(_Section):
    """Check-N-Run: incremental, quantized checkpoints."""

    interval_seconds: float = Field(default=30.0, gt=0, description="Seconds between checkpoints")
    path: str = Field(default="out/checkpoints", min_length=1, description="Checkpoint directory")
    quantize_bits: Literal[4, 8, 16, 32] = Field(default=8, description="Bits per stored value")
    incremental: bool = Field(default=True, description="Store only rows changed since the last checkpoint")


class CprSpec(_Section):
    """CPR: partial recovery with frequent checkpoints of hot rows."""

    interval_seconds: float = Field(default=30.0, gt=0, description="Seconds between checkpoints")
    path: str = Field(default="out/checkpoints", min_length=1, description="Checkpoint directory")
    hot_row_fraction: float = Field(
        default=0.1, gt=0, le=1, description="Fraction of rows (most updated) saved more often"
    )


class FaultToleranceSpec(_Section):
    """How the job survives a server failure; only the selected strategy's settings are used."""

    strategy: Strategy = Field(default="none", description="none | ecrec | checkpoint | checknrun | cpr")
    ecrec: EcrecSpec = Field(default_factory=EcrecSpec, description="Settings for strategy ecrec")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Settings for checkpoint")
    checknrun: ChecknrunSpec = Field(default_factory=ChecknrunSpec, description="Settings for checknrun")
    cpr: CprSpec = Field(default_factory=CprSpec, description="Settings for cpr")


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

    @model_validator(mode="after")
    def _cross_field(self) -> JobSpec:
        problems = _cross_field_problems(self)
        if problems:
            raise _CrossFieldProblems(problems)
        return self

    def to_dict(self) -> dict[str, Any]:
        """camelCase, JSON-safe, defaults and preset-filled fields included; `job_from_dict` reads it back."""
        return self.model_dump(mode="json", by_alias=True)

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
        if ec.r != 1:
            out.append("spec.faultTolerance.ecrec.r: r >= 2 (Reed-Solomon) is not implemented yet")
    if s.training.deterministic and s.workers.replicas != 1:
        out.append(
            f"spec.workers.replicas: deterministic training needs exactly 1 worker, got {s.workers.replicas}"
        )
    if s.data.source == "criteo" and not s.data.paths:
        out.append("spec.data.paths: source criteo needs at least one Criteo-format TSV file")
    c = s.coordinator
    if c.failure_timeout_seconds <= c.heartbeat_interval_seconds:
        # Otherwise every healthy server would be declared failed between two heartbeats.
        out.append(
            f"spec.coordinator.failureTimeoutSeconds: must be greater than heartbeatIntervalSeconds "
            f"({c.failure_timeout_seconds} <= {c.heartbeat_interval_seconds})"
        )
    return out


# -- errors -------------------------------------------------------------------------------------------------


def _format_loc(loc: Sequence[int | str]) -> str:
    path = "spec"
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _section_at(loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The model class whose fields live at `loc` (camelCase path below spec), for typo suggestions."""
    cls: type[BaseModel] = JobSpec
    for part in loc:
        field = next((f for n, f in cls.model_fields.items() if part in (n, f.alias)), None)
        if field is None:
            return None
        ann = field.annotation
        candidates = get_args(ann) if get_origin(ann) is not None else (ann,)
        nxt = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            return None
        cls = nxt
    return cls


def _problem_lines(err: ValidationError) -> list[str]:
    lines: list[str] = []
    for e in err.errors():
        cause = e.get("ctx", {}).get("error")
        if isinstance(cause, _CrossFieldProblems):
            lines.extend(cause.lines)
            continue
        line = f"{_format_loc(e['loc'])}: {e['msg']}"
        if e["type"] == "extra_forbidden" and e["loc"] and isinstance(e["loc"][-1], str):
            cls = _section_at(e["loc"][:-1])
            if cls is not None:
                known = [f.alias or n for n, f in cls.model_fields.items()]
                close = difflib.get_close_matches(e["loc"][-1], known, n=1)
                if close:
                    line += f" (did you mean '{close[0]}'?)"
        lines.append(line)
    return lines


def parse_spec(spec_doc: Any) -> JobSpec:
    """Validate a spec mapping (camelCase keys); every problem is reported in one SpecError."""
    if not isinstance(spec_doc, Mapping):
        raise SpecError(f"spec: must be a mapping, got {type(spec_doc).__name__}")
    try:
        return JobSpec.model_validate(dict(spec_doc))
    except ValidationError as e:
        raise SpecError(_problem_lines(e)) from None


# -- jobs, manifests, overrides ------------------------------------------------------------------------------


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


_MANIFEST_KEYS = ("apiVersion", "kind", "metadata", "spec")


def job_from_dict(doc: Mapping[str, Any], overrides: Sequence[str] = ()) -> Job:
    """A `Job` from a full ECRecJob manifest or a bare spec mapping, with `--set` overrides applied to spec."""
    if not isinstance(doc, Mapping):
        raise SpecError(f"job: must be a mapping, got {type(doc).__name__}")
    if not any(k in doc for k in _MANIFEST_KEYS):
        return Job(DEFAULT_JOB_NAME, parse_spec(apply_overrides(dict(doc), overrides)))
    problems = []
    if doc.get("apiVersion") != API_VERSION:
        problems.append(f"apiVersion: must be {API_VERSION}, got {doc.get('apiVersion')!r}")
    if doc.get("kind") != KIND:
        problems.append(f"kind: must be {KIND}, got {doc.get('kind')!r}")
    metadata = doc.get("metadata") or {}
    name = metadata.get("name", DEFAULT_JOB_NAME) if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not name:
        problems.append("metadata.name: must be a non-empty string")
    if "spec" not in doc:
        problems.append("spec: Field required")
    if problems:
        raise SpecError(problems)
    spec_doc = doc["spec"]
    if not isinstance(spec_doc, Mapping):
        raise SpecError(f"spec: must be a mapping, got {type(spec_doc).__name__}")
    return Job(name, parse_spec(apply_overrides(dict(spec_doc), overrides)))


def apply_overrides(spec_doc: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `spec_doc` with each `dotted.path=value` set; values are parsed as YAML ("10" -> 10)."""
    out = copy.deepcopy(dict(spec_doc))
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError(f"override {item!r}: expected dotted.path=value, e.g. training.steps=50")
        parts = key.split(".")
        if parts[0] == "spec" and len(parts) > 1:
            parts = parts[1:]
        if any(not p for p in parts):
            raise SpecError(f"override {item!r}: empty path segment in {key!r}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise SpecError(f"override {item!r}: value is not valid YAML ({e})") from None
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                path = _format_loc(parts[: i + 1])
                raise SpecError(
                    f"{path}: cannot set {key!r}, {path} is a {type(child).__name__}, not a mapping"
                )
            node = child
        node[parts[-1]] = value
    return out


def load_job(path: str | Path, overrides: Sequence[str] = ()) -> Job:
    """A `Job` from a YAML file holding an ECRecJob manifest (possibly among other documents) or a bare spec."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(f"cannot read job file: {e.strerror or e}", source=str(p)) from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise SpecError(f"invalid YAML: {e}", source=str(p)) from None
    if len(docs) > 1:
        docs = [d for d in docs if isinstance(d, Mapping) and d.get("kind") == KIND]
    if len(docs) != 1:
        raise SpecError(f"expected exactly one {KIND} document, found {len(docs)}", source=str(p))
    try:
        return job_from_dict(docs[0], overrides)
    except SpecError as e:
        raise SpecError(e.problems, source=str(p)) from None


# -- CustomResourceDefinition --------------------------------------------------------------------------------

# Fields a preset may fill: a CRD default would make the apiserver set them explicitly, overriding the preset.
_PRESET_FILLED = ("embeddingDim", "tableSizes", "bottomMlp", "topMlp")
_KEEP = {
    "type", "properties", "items", "additionalProperties", "required", "enum", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems", "minLength", "maxLength", "default",
    "description", "nullable", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
}  # fmt: skip


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema (pydantic) -> Kubernetes structural OpenAPI v3: refs inlined, Optional -> nullable."""
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}  # the field's own description wins over the class docstring
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node.pop("allOf")[0], **node}
        return _structural(node, defs)
    if "$ref" in node:
        return _structural(node, defs)
    if "anyOf" in node:
        members = [m for m in node.pop("anyOf") if m.get("type") != "null"]
        if len(members) != 1:
            raise ValueError(f"cannot express a union of {len(members)} types in a structural schema")
        node = {**_structural(members[0], defs), **node, "nullable": True}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key not in _KEEP:
            continue  # title, $defs, additionalProperties: false (pruning does that job) ...
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key in ("items", "additionalProperties"):
            if isinstance(value, dict):
                out[key] = _structural(value, defs)
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema 2020-12 has numeric bounds; OpenAPI v3.0 (Kubernetes) has a bound plus a flag.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "default" and value is None:
            continue  # a null default means "unset"; nothing to default
        else:
            out[key] = value
    return out


def spec_openapi_schema() -> dict[str, Any]:
    """The structural openAPIV3Schema of `spec`, generated from `JobSpec`."""
    raw = JobSpec.model_json_schema(by_alias=True)
    schema = _structural(raw, raw.get("$defs", {}))
    for alias in _PRESET_FILLED:
        schema["properties"]["model"]["properties"][alias].pop("default", None)
    _default_sections(JobSpec, schema)
    return schema


def _default_sections(cls: type[BaseModel], schema: dict[str, Any]) -> None:
    # `default: {}` on an optional section makes the apiserver fill the defaults inside it too, so
    # `kubectl get -o yaml` shows the effective spec even when the user left the whole section out.
    for name, field in cls.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            node = schema["properties"][field.alias or name]
            if not field.is_required():
                node["default"] = {}
            _default_sections(sub, node)


def crd_manifest() -> dict[str, Any]:
    """The ECRecJob CustomResourceDefinition (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": "ecrecjob", "kind": KIND, "shortNames": ["ecj"]},
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                        {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
                        {"name": "Samples/s", "type": "number", "jsonPath": ".status.samplesPerSecond"},
                        {"name": "Replacements", "type": "integer", "jsonPath": ".status.replacements"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A fault-tolerant DLRM training job on erasure-coded parameter servers",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_openapi_schema(),
                                "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                            },
                        }
                    },
                }
            ],
        },
    }
