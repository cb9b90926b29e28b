"""The coordinator's REST API and process: `create_app` is a thin FastAPI adapter around `Coordinator` (parse
the request, call the service, return its answer; `ValueError` becomes 400, `Refused` 409, a write without the
job token 401), and `main` runs the process (arguments, the seed, the ticker, uvicorn).
"""

from __future__ import annotations

import argparse
import contextlib
import logging

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ecrec import auth
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
from ecrec.coordinator.service import Coordinator
from ecrec.core.cluster import Refused
from ecrec.faults import configure as configure_faults


def load_seed(source: str) -> dict:
    """A --resume argument: `env:VAR` (what the operator sets) or a JSON file (what ecrec local writes)."""
    import json
    import os
    from pathlib import Path

    if source.startswith("env:"):
        text = os.environ.get(source[4:], "")
        if not text:
            raise SystemExit(f"--resume {source}: the variable is unset or empty")
    else:
        text = Path(source).read_text()
    seed = json.loads(text)
    if not isinstance(seed, dict):
        raise SystemExit(f"--resume {source}: not a JSON object")
    return seed


def create_app(coord: Coordinator, lifespan=None) -> FastAPI:
    """The coordinator's HTTP API; `lifespan` as FastAPI takes it (main: start the ticker once serving)."""

    async def require_token(request: Request) -> None:
        # Reads stay open (probes, dashboards, scrapers); what changes the job needs the job token.
        if request.method not in ("GET", "HEAD") and not auth.valid(
            coord.token, request.headers.get(auth.HEADER)
        ):
            raise HTTPException(401, "this job's token is required")

    app = FastAPI(
        title="ecrec coordinator", version="v1", dependencies=[Depends(require_token)], lifespan=lifespan
    )

    @app.get(api.HEALTHZ)
    def healthz() -> dict:
        return {"ok": True}

    @app.get(api.CLUSTER)
    def cluster() -> dict:
        return coord.cluster_snapshot()

    @app.get(api.METRICS)
    def metrics() -> Response:
        return Response(generate_latest(coord.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(api.JOB)
    def job() -> dict:
        return {"name": coord.job.name, "spec": coord.spec.to_dict()}

    @app.get(api.STATUS)
    def status() -> dict:
        return coord.status()

    @app.exception_handler(ValueError)
    def bad_request(_request, exc: ValueError) -> JSONResponse:  # e.g. a shard id out of range
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(Refused)
    def refused(_request, exc: Refused) -> JSONResponse:  # does not fit the current state: nothing changed
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.post(api.SERVERS_REGISTER)
    def register_server(req: RegisterServer) -> dict:
        return coord.register_server(req)

    @app.post(api.SPARES_REGISTER)
    def register_spare(req: SpareIn) -> dict:
        return coord.register_spare(req)

    @app.post(api.SPARES_HEARTBEAT)
    def spare_heartbeat(req: SpareIn) -> dict:
        return coord.spare_heartbeat(req)

    @app.post(api.SERVERS_HEARTBEAT)
    def heartbeat(req: Heartbeat) -> dict:
        return coord.heartbeat(req)

    @app.post(api.FAILURES)
    def failures(req: FailureReport) -> dict:
        return coord.report_failure(req)

    @app.post(api.WORKERS_REGISTER)
    def register_worker(req: RegisterWorker) -> dict:
        return coord.register_worker(req)

    @app.get(api.WORKERS_START)
    def start(rank: int | None = None, instance: str = "") -> dict:
        return coord.start_state(rank, instance)

    @app.post(api.WORKERS_PROGRESS)
    def progress(req: Progress) -> dict:
        return coord.report_progress(req)

    @app.get(api.WORKERS_CONTROL)
    def control() -> dict:
        return coord.control().get("control") or {}

    @app.post(api.WORKERS_LOST)
    def worker_lost(req: WorkerLost) -> dict:
        return coord.worker_lost(req)

    @app.post(api.WORKERS_FINISHED)
    def worker_finished(req: WorkerFinished) -> dict:
        return coord.worker_finished(req)

    @app.post(api.EVENTS)
    def events(ev: EventIn) -> dict:
        return coord.add_event(ev)

    @app.post(api.RECOVERIES)
    def start_recovery(req: StartRecovery) -> dict:
        return coord.start_recovery(req.shard)

    @app.post(api.PARITY_CHECKS)
    def parity_checks(req: ParityCheck) -> dict:
        return coord.record_parity_check(req)

    @app.get(api.RECOVERIES)
    def recoveries() -> list[dict]:
        return coord.recoveries_view()

    return app


def main(argv: list[str] | None = None) -> None:
    from ecrec.jobctx import JobContext

    ap = argparse.ArgumentParser(prog="ecrec-coordinator")
    ap.add_argument("--job", required=True, help="job JSON file ({name, spec}), or env:VAR")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="also serve /metrics alone on this port (0: only on --port)",
    )
    ap.add_argument(
        "--generation",
        type=int,
        default=1,
        help="this coordinator's incarnation: > 1 replaces a dead one and needs --resume",
    )
    ap.add_argument(
        "--resume",
        default="",
        help="the dead coordinator's last status 'resume' part: a JSON file, or env:VAR",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    configure_faults("coordinator")
    if (args.generation > 1) != bool(args.resume):
        ap.error(
            "--generation > 1 and --resume go together: a replacement starts from its predecessor's state"
        )
    seed = load_seed(args.resume) if args.resume else None
    ctx = JobContext.load(args.job)
    coord = Coordinator(ctx.job, generation=args.generation, seed=seed, token=ctx.token)
    if args.metrics_port:
        coord.metrics.serve(args.metrics_port, args.host)

    @contextlib.asynccontextmanager
    async def serving(_app):  # uvicorn binds its socket right after: heartbeats can arrive from now on
        coord.run_ticker()
        yield

    app = create_app(coord, lifespan=serving)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
