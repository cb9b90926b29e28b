"""The coordinator's REST contract: every path and every request body, in one place.

The coordinator's app (`ecrec.coordinator.app`) serves these paths and validates these bodies; the one client
of them (`ecrec.coordinator.client.CoordinatorClient`) is what servers, workers, the local launcher, the
operator, `ecrec chaos` and `ecrec verify` call. Everything that changes the job is under `/v1`; `/healthz`
and `/metrics` keep the names probes and scrapers expect. Answers are JSON objects, described on the client's
methods. A request that does not fit the job's current state is refused with 409 and `{"detail": reason}`
(nothing changed); a malformed one gets 400 or 422; a write without the job token 401.

No I/O here: pydantic models and strings only, so any process may import it cheaply.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from ecrec.core.recovery import MAX_STEP_TIMES

# Open to anyone (probes, scrapers, dashboards): reads.
HEALTHZ = "/healthz"
METRICS = "/metrics"
CLUSTER = "/v1/cluster"  # GET: the cluster map (epoch, shards' state, address, incarnation)
JOB = "/v1/job"  # GET: {name, spec}
STATUS = "/v1/status"  # GET: phase, progress, recoveries, checkpointing, resume state
RECOVERIES = "/v1/recoveries"  # GET: recovery records; POST StartRecovery: start one
WORKERS_START = "/v1/workers/start"  # GET ?rank=&instance=: has the job started
WORKERS_CONTROL = "/v1/workers/control"  # GET: what the checkpoint strategies tell workers now
# Writes (the job token): who sends them is on each model below.
SERVERS_REGISTER = "/v1/servers/register"  # RegisterServer
SERVERS_HEARTBEAT = "/v1/servers/heartbeat"  # Heartbeat
SPARES_REGISTER = "/v1/spares/register"  # SpareIn
SPARES_HEARTBEAT = "/v1/spares/heartbeat"  # SpareIn
FAILURES = "/v1/failures"  # FailureReport
WORKERS_REGISTER = "/v1/workers/register"  # RegisterWorker
WORKERS_PROGRESS = "/v1/workers/progress"  # Progress
WORKERS_LOST = "/v1/workers/lost"  # WorkerLost
WORKERS_FINISHED = "/v1/workers/finished"  # WorkerFinished
EVENTS = "/v1/events"  # EventIn
PARITY_CHECKS = "/v1/parity-checks"  # ParityCheck


class RegisterServer(BaseModel):
    shard: int
    address: str
    instance: str  # the process's own id, unique per process
    metricsUrl: str = ""
    replacement: bool = False
    cpuSeconds: float | None = None  # the process's own CPU time so far (ecrec.core.cpu)


class Heartbeat(BaseModel):
    shard: int
    address: str
    instance: str
    epoch: int = 0
    recovered: bool = False
    rowsRecovered: int = Field(default=0, ge=0)  # a replacement's rows rebuilt so far
    # What a successor coordinator needs to admit a process its seed does not list (a rejoin).
    incarnation: int = 0
    metricsUrl: str = ""
    cpuSeconds: float | None = None
    # It forwards no logged delta now, nor has one on its way (the fallback's rollback asked it to hold them).
    forwardsHeld: bool = False


class SpareIn(BaseModel):
    """A warm spare's registration and heartbeat (ecrec.core.spares)."""

    instance: str
    address: str = ""
    metricsUrl: str = ""
    cpuSeconds: float | None = None
    # A heartbeat may wait this long for an assignment (a long poll): the spare hears of its shard the moment
    # it is assigned, not at its next heartbeat (capped at half the failure timeout: it is also a heartbeat).
    wait: float = Field(default=0.0, ge=0.0, le=60.0)


class StartRecovery(BaseModel):
    shard: int


class FailureReport(BaseModel):
    shard: int
    reporter: str = ""


class RegisterWorker(BaseModel):
    rank: int
    instance: str
    incarnation: int = 1  # 1 for the rank's first process, +1 for each replacement
    replacement: bool = False  # takes over a rank whose process was reported lost, resuming its steps
    # A worker that registered with an earlier coordinator generation and is not in this one's seed.
    rejoin: bool = False
    step: int = 0
    samples: int = 0
    cpuSeconds: float | None = None


class WorkerLost(BaseModel):
    rank: int
    instance: str  # the registered process that died
    replacing: bool = False  # a replacement will resume the rank's steps: the job waits for it
    reason: str = Field(default="", max_length=200)  # how the launcher saw it go ("exited with code 139")


class WorkerFinished(BaseModel):
    rank: int
    instance: str  # the registered process that exited 0: it trained its steps and a coordinator heard so


class RpcLatency(BaseModel):
    buckets: list[float]  # cumulative counts per bucket of ecrec.metrics.LATENCY_BUCKETS, then +Inf
    sum: float


class Progress(BaseModel):
    rank: int
    instance: str
    step: int
    samples: int
    loss: float | None = None  # null when the worker has no finite loss to report
    done: bool = False
    error: str | None = None
    lastStepAt: float | None = None  # wall-clock time the worker's latest step completed
    # when each step since the previous report completed (the latest MAX_STEP_TIMES): a recovery's time to
    # continue is the first of them after the detection, not the report's latest step
    stepTimes: list[float] = Field(default_factory=list, max_length=MAX_STEP_TIMES)
    # Checkpoint strategies: the checkpoint it is paused for, the rollback generation it has caught up with.
    paused: int | None = None
    stopped: int = 0
    resumed: int = 0  # the rollback generation whose resume point its counters start from
    # Counters of this worker process since it started (exported by the coordinator, ecrec.metrics):
    degradedReads: dict[int, int] = {}  # failed shard -> rows read by decoding
    degradedWrites: dict[int, int] = {}  # failed shard -> rows updated at their acting home
    rpcLatency: dict[str, RpcLatency] = {}  # method -> its ecrec_rpc_latency_seconds buckets
    cpuSeconds: float | None = None  # the process's own CPU time so far (ecrec.core.cpu)


class ParityCheck(BaseModel):
    stripes: int
    mismatches: int
    in_flight: int = 0


EVENT_KINDS = ("server_killed", "worker_killed", "pod_deleted", "pod_replaced", "note")


class EventIn(BaseModel):
    kind: str  # one of EVENT_KINDS: what an outside actor (launcher, operator) did
    shard: int | None = None
    at: float | None = None  # wall-clock time.time(); defaults to now
    detail: dict | None = None
