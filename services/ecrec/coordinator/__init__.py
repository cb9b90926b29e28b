"""The coordinator: cluster map, failure detection, job progress, recovery and checkpoint drivers, REST API.

`contract` (paths and bodies) and `client` (the typed client every other process uses) import nothing heavy,
so importing this package does not load the service (FastAPI, uvicorn, gRPC): `main` imports it when called.

The rooms, each importing only those below it: `app` (the FastAPI adapter and the process's `main`) over
`service` (`Coordinator`: the job's state behind one lock, applying what each request does), which delegates
to `admission` (servers and spares), `recovery` (the rebuild driver), `checkpoints` (the checkpoint driver),
`records` (recovery records) and `views` (status, metrics, phase); `probe` asks whether a server is still
there. The decisions themselves are pure, in `ecrec.core` (`cluster`, `workers`, `spares`, `recovery`,
`checkpointing`).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """`ecrec coordinator ARGS`: run the coordinator process."""
    from ecrec.coordinator.app import main as run

    run(argv)
