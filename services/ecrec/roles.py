"""`ecrec ROLE ARGS`: which module runs each role's process, and the dispatch to it.

The images' ENTRYPOINT (through the CLI), the operator's pods and `ecrec local`'s fork server all start a
process this way. A module of its own so that the fork server, which preloads every role's module, need not
import the CLI (which imports the launcher, which imports the fork server).
"""

from __future__ import annotations

import importlib

from ecrec.core.roles import ROLES, SPARE

# The module whose main(argv) gets ARGS, by role.
ROLE_MODULES = {"coordinator": "ecrec.coordinator", "server": "ecrec.server", "worker": "ecrec.worker"}
assert tuple(ROLE_MODULES) == ROLES


def run_role(role: str, argv: list[str]) -> None:
    """`ecrec coordinator|server|worker ARGS`: the process of one role, ARGS handed to its module's main."""
    importlib.import_module(ROLE_MODULES[role]).main(argv)


def role_argv(
    role: str,
    index: int = 0,
    *,
    job: str,
    coordinator: str = "",
    instance: str = "",
    incarnation: int = 1,
    replacement: bool = False,
    bind: str = "",
    host: str = "",
    port: int | str | None = None,
    metrics_addr: str = "",
    metrics_port: int | None = None,
    resume: tuple[int, str] | None = None,
) -> list[str]:
    """`ecrec ROLE ARGS` of one process of a job: what `ecrec local` forks and what the operator's pods run.

    `role` is coordinator, server, spare (a server without a shard yet) or worker; `index` the shard id, spare
    index or rank. `job` is where the process reads the job (a file, or `env:VAR`); the rest are where it
    listens and whom it calls, which the two launchers choose differently (loopback ports here, the pod IP
    and Services there; a launcher may pass `$(VAR)` references that Kubernetes expands). `resume`
    (generation, source): a coordinator replacing a lost one, started from its predecessor's state."""
    if role not in (*ROLES, SPARE):
        raise ValueError(f"role: {role!r} is not one of {', '.join((*ROLES, SPARE))}")
    args = ["--job", job]
    if role == "coordinator":
        args += [*(["--host", host] if host else []), *(["--port", str(port)] if port is not None else [])]
        if resume is not None:
            args += ["--generation", str(resume[0]), "--resume", resume[1]]
    elif role == "server":
        args += ["--shard", str(index)]
    elif role == SPARE:
        args += ["--spare", str(index)]
    else:
        args += ["--rank", str(index), "--incarnation", str(incarnation)]
    if role in ("server", SPARE) and bind:
        args += ["--bind", bind]
    if role == "coordinator":
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port)]
    else:  # servers, spares and workers: the coordinator, their /metrics, who they are, whether they replace
        args += ["--coordinator", coordinator]
        if metrics_addr:
            args += ["--metrics-addr", metrics_addr]
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port)]
        if instance:
            args += ["--instance", instance]
        if replacement and role != SPARE:
            args.append("--replacement")
    return ["ecrec", "server" if role == SPARE else role, *args]
