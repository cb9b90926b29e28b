"""The `status` of an ECRecJob: `JobStatus` and its sections, as the operator writes it (status subresource).

Every field is optional, so an instance holding only what changed is the body of a merge patch; the CRD's
status schema and printer columns are generated from the same models (`ecrec.spec.crd`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, model_validator

from ecrec.spec.base import _Section

# Checking: training is over and the operator runs the final checks (evaluation, parity); Succeeded is written
# with their results and completionTime in one status write, so whoever waits for it finds them there.
# Suspended: runPolicy.suspend is true and the job has no pods.
PHASES = ("Pending", "Running", "Degraded", "Recovering", "Checking", "Succeeded", "Failed", "Suspended")
Phase = Literal[
    "Pending", "Running", "Degraded", "Recovering", "Checking", "Succeeded", "Failed", "Suspended"
]
# Condition types the operator sets (Kubeflow's, plus ECRec's two degraded states); `type` is not an enum so
# that an older CRD never refuses a newer operator's condition.
CONDITION_TYPES = (
    "Created",
    "Running",
    "Degraded",
    "Recovering",
    "Checking",  # trained; the final checks run (the job is not Succeeded yet)
    "Restarting",
    "Succeeded",
    "Failed",
    "SpecChangeIgnored",  # an edit of a started job's spec that was not applied (ecrec_operator.pinning)
    "Suspended",  # runPolicy.suspend: the job's pods are deleted and none are created
    "FailureDomainsAtRisk",  # more than r servers share a failure domain (servers.failureDomain)
)
ShardStateName = Literal["pending", "up", "failed", "recovering"]  # ecrec.core.cluster.ShardState
RecoveryState = Literal[
    "detected", "waiting", "running", "completed", "failed"
]  # core.recovery.RecoveryRecord


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
        "(a replacement server is being rebuilt), Restarting (a pod is being replaced), Succeeded, Failed, "
        "Suspended (runPolicy.suspend), FailureDomainsAtRisk (more than r servers share a failure domain)",
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
        "Failed (see reason), Suspended (runPolicy.suspend: no pods)",
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
