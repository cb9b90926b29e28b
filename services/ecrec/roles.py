"""`ecrec ROLE ARGS`: which module runs each role's process, and the dispatch to it.

The images' ENTRYPOINT (through the CLI), the operator's pods and `ecrec local`'s fork server all start a
process this way. A module of its own so that the fork server, which preloads every role's module, need not
import the CLI (which imports the launcher, which imports the fork server).
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import os
import signal
import sys

from ecrec.core.roles import ROLES, SPARE

# The module whose main(argv) gets ARGS, by role.
ROLE_MODULES = {"coordinator": "ecrec.coordinator", "server": "ecrec.server", "worker": "ecrec.worker"}
assert tuple(ROLE_MODULES) == ROLES


# The cores this process may run on (`0-5,8`), set per role by `ecrec local --cpus` (and the benchmarks): servers
# on cores of their own, as pods with CPU requests have on a cluster, and workers not competing with them.
CPUS_ENV = "ECREC_CPUS"
DUMP_STACKS = signal.SIGUSR1


def parse_cpus(text: str) -> set[int]:
    """`0-5,8` -> {0, 1, 2, 3, 4, 5, 8}; ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{text!r}: cores as a list of numbers and ranges, e.g. 0-5,8")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"{text!r}: range {part.strip()} runs backwards")
        cpus.update(range(a, b + 1))
    return cpus


def role_cpus(items: list[str]) -> dict[str, str]:
    """`--cpus ROLE=CORES` arguments as {role: cores}, each role once, each core one this process may use."""
    out: dict[str, str] = {}
    allowed = os.sched_getaffinity(0)
    for item in items:
        role, sep, spec = item.partition("=")
        if not sep or role not in ROLES:
            raise ValueError(
                f"--cpus {item!r}: ROLE=CORES with ROLE one of {', '.join(ROLES)} (e.g. server=0-5)"
            )
        if role in out:
            raise ValueError(f"--cpus: {role} given twice")
        if missing := sorted(parse_cpus(spec) - allowed):
            raise ValueError(
                f"--cpus {item}: cores {missing} are not available here (this process may use {len(allowed)})"
            )
        out[role] = spec
    return out


def cores() -> int:
    """How many cores this process may use (its affinity: all of the machine's unless pinned)."""
    return len(os.sched_getaffinity(0))


def run_role(role: str, argv: list[str]) -> None:
    """`ecrec coordinator|server|worker ARGS`: the process of one role, ARGS handed to its module's main; on
    the cores ECREC_CPUS names, if set."""
    if spec := os.environ.get(CPUS_ENV):
        try:
            os.sched_setaffinity(0, parse_cpus(spec))
        except (ValueError, OSError) as e:  # OSError: cores this machine does not have
            raise SystemExit(f"{CPUS_ENV}={spec}: {e}") from None
    # `kill -USR1 PID` writes every thread's stack to the log (stderr): where a stuck process waits. `ecrec
    # local` asks each process for it when a job fails.
    faulthandler.register(DUMP_STACKS, file=sys.stderr, all_threads=True)
    module = importlib.import_module(ROLE_MODULES[role])
    # What is imported by now (torch, gRPC, numpy, ours: ~200k objects) lives as long as the process: out of
    # the collector's reach, a full collection scans only what the role allocates. Each full collection over
    # them took 0.1-0.6 s of a busy 2-core machine, a few per process per job, stalling the role's threads
    # (a stalled worker holds back every delivery queued behind its own; docs/benchmarks.md).
    gc.freeze()
    module.main(argv)


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
