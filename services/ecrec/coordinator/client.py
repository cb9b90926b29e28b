"""The one client of the coordinator's REST API (`ecrec.coordinator.contract`).

Servers, spares, workers, the local launcher, the operator, `ecrec chaos` and `ecrec verify` all call the
coordinator through `CoordinatorClient`: a method per path, request bodies as the contract's models, answers
as the JSON the coordinator sends. It does no retrying of its own — each caller knows how long it may wait
(a worker trains on while no coordinator answers, a server gives up registering after a deadline) — and it
raises:

- `Refused` for a 409: the request does not fit the job's current state and changed nothing. It is an
  `httpx.HTTPStatusError`, so a caller that treats every failed call alike still can;
- `httpx.HTTPStatusError` for any other error status (400/422 malformed, 401 without the token, 5xx);
- `httpx.TransportError` (an `httpx.HTTPError` too) when no coordinator answers.
"""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import BaseModel

from ecrec import rest
from ecrec.coordinator import contract as api
from ecrec.coordinator.contract import (
    EventIn,
    FailureReport,
    Heartbeat,
    ParityCheck,
    Progress,
    RegisterServer,
    RegisterWorker,
    SpareIn,
    StartRecovery,
    WorkerFinished,
    WorkerLost,
)


class Refused(httpx.HTTPStatusError):
    """409: the coordinator refused a request that does not fit the job's state; nothing changed."""

    @property
    def detail(self) -> str:
        try:
            return str(self.response.json().get("detail", ""))
        except ValueError:
            return self.response.text


class CoordinatorClient:
    """Calls of one process to one coordinator, over one kept-alive HTTP client (with the job token)."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.http = rest.client(timeout=timeout, token=token)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the wire ------------------------------------------------------------------------------------------

    @staticmethod
    def _answer(r: httpx.Response) -> Any:
        if r.status_code == 409:
            raise Refused(f"refused: {r.text}", request=r.request, response=r)
        r.raise_for_status()
        return r.json()

    def get(self, path: str, *, timeout: float | None = None, **params: Any) -> Any:
        kw: dict[str, Any] = {"params": params} if params else {}
        if timeout is not None:
            kw["timeout"] = timeout
        return self._answer(self.http.get(self.url + path, **kw))

    def post(self, path: str, body: BaseModel, *, timeout: float | None = None) -> Any:
        # Only the fields the caller set go on the wire: the coordinator's defaults stay its own.
        kw: dict[str, Any] = {"json": body.model_dump(mode="json", exclude_unset=True)}
        if timeout is not None:
            kw["timeout"] = timeout
        return self._answer(self.http.post(self.url + path, **kw))

    # -- reads (open to anyone) ----------------------------------------------------------------------------

    def healthz(self) -> dict:
        return self.get(api.HEALTHZ)

    def cluster(self) -> dict:
        """The cluster map: `epoch`, `ready`, `shards` [{state, address, incarnation, instance, ...}]."""
        return self.get(api.CLUSTER)

    def job(self) -> dict:
        """`{name, spec}` of the job this coordinator runs."""
        return self.get(api.JOB)

    def status(self) -> dict:
        """Phase, reason, samples and rates, cluster, recoveries, checkpointing, events, `resume`."""
        return self.get(api.STATUS)

    def recoveries(self) -> list[dict]:
        return self.get(api.RECOVERIES)

    def workers_start(self, rank: int, instance: str) -> dict:
        """`{started, startedAt[, registered]}`: has training started; is this worker registered here."""
        return self.get(api.WORKERS_START, rank=rank, instance=instance)

    def workers_control(self) -> dict:
        """What the checkpoint strategies tell workers now (`CheckpointCycle.control`)."""
        return self.get(api.WORKERS_CONTROL)

    # -- servers and spares --------------------------------------------------------------------------------

    def register_server(self, req: RegisterServer) -> dict:
        """`{epoch, cluster, instance}` for a process admitted as its shard."""
        return self.post(api.SERVERS_REGISTER, req)

    def server_heartbeat(self, req: Heartbeat) -> dict:
        """`{ok, cluster, epoch, workersGone}`; `ok` false: this process is no longer its shard's."""
        return self.post(api.SERVERS_HEARTBEAT, req)

    def register_spare(self, req: SpareIn, *, timeout: float | None = None) -> dict:
        """`{registered, assigned, finished}`: a warm spare's registration (a long poll of `req.wait`)."""
        return self.post(api.SPARES_REGISTER, req, timeout=timeout)

    def spare_heartbeat(self, req: SpareIn, *, timeout: float | None = None) -> dict:
        return self.post(api.SPARES_HEARTBEAT, req, timeout=timeout)

    def report_failure(self, shard: int, reporter: str, *, timeout: float | None = None) -> dict:
        """Ask the coordinator to confirm (probe) a shard that did not answer: `{epoch, cluster}` after the probe."""
        return self.post(api.FAILURES, FailureReport(shard=shard, reporter=reporter), timeout=timeout)

    def start_recovery(self, shard: int) -> dict:
        """Start (or answer the record of) the rebuild of a failed shard's registered replacement."""
        return self.post(api.RECOVERIES, StartRecovery(shard=shard))

    # -- workers -------------------------------------------------------------------------------------------

    def register_worker(self, req: RegisterWorker) -> dict:
        return self.post(api.WORKERS_REGISTER, req)

    def report_progress(self, req: Progress) -> dict:
        return self.post(api.WORKERS_PROGRESS, req)

    def worker_lost(self, req: WorkerLost) -> dict:
        return self.post(api.WORKERS_LOST, req)

    def worker_finished(self, rank: int, instance: str) -> dict:
        return self.post(api.WORKERS_FINISHED, WorkerFinished(rank=rank, instance=instance))

    # -- launchers and tools -------------------------------------------------------------------------------

    def add_event(self, ev: EventIn) -> dict:
        return self.post(api.EVENTS, ev)

    def record_parity_check(self, req: ParityCheck) -> dict:
        return self.post(api.PARITY_CHECKS, req)
