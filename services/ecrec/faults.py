"""Fault points: SIGKILL this process at a named step of the update or recovery protocol (invariant I4).

Set `ECREC_FAULT_POINT="<process>:<point>[@n][!stop]"`, e.g. `server-1:commit:after_apply@20`, to kill the
process named `<process>` (server-<shard>, worker-<rank>) the n-th time (default 1st) it reaches `<point>`;
with `!stop` it SIGSTOPs itself instead: a hung process, which the job must find out by its silence. With
`ECREC_FAULT_ONCE=<file>` the kill happens once per job: the first process to fire creates the file, so a
respawned replacement does not kill itself again. Unset, a fault point costs one dict lookup.

Points (docs/protocol.md): on a server stage:after_local, commit:after_apply, delta:after_stage,
decide:after_apply, acting:after_stage, recover:mid_group, recover:after_group; on a worker
worker:after_stage, worker:before_commit, worker:mid_commit, worker:before_decide, worker:after_deliver; on the coordinator
(process `coordinator`) coordinator:server_registered (a server admitted, before the answer),
coordinator:recovery_started, coordinator:recovered_{dense,data,parity} (after each
Recover step of that kind), coordinator:recovery_completed.
"""

from __future__ import annotations

import os
import signal

POINTS = (
    "stage:after_local",
    "commit:after_apply",
    "delta:after_stage",
    "decide:after_apply",
    "acting:after_stage",
    "recover:mid_group",
    "recover:after_group",
    "worker:after_stage",
    "worker:before_commit",
    "worker:mid_commit",
    "worker:before_decide",
    "worker:after_deliver",
    "coordinator:server_registered",
    "coordinator:recovery_started",
    "coordinator:recovered_dense",
    "coordinator:recovered_data",
    "coordinator:recovered_parity",
    "coordinator:recovery_completed",
    "checkpoint:before_write",
    "checkpoint:after_write",
)

_process = ""
_target: tuple[str, str, int] | None = None
_signal = signal.SIGKILL
_hits = 0


def configure(process: str) -> None:
    """Name this process (server-1, worker-0, coordinator) and read ECREC_FAULT_POINT."""
    global _process, _target, _hits, _signal
    _process, _target, _hits, _signal = process, None, 0, signal.SIGKILL
    spec = os.environ.get("ECREC_FAULT_POINT", "")
    if not spec:
        return
    spec, _, action = spec.partition("!")
    if action not in ("", "stop"):
        raise ValueError(f"ECREC_FAULT_POINT: unknown action !{action}; valid: !stop")
    _signal = signal.SIGSTOP if action == "stop" else signal.SIGKILL
    who, _, rest = spec.partition(":")
    point, _, n = rest.partition("@")
    if point not in POINTS:
        raise ValueError(f"ECREC_FAULT_POINT: unknown point {point!r}; valid: {', '.join(POINTS)}")
    _target = (who, point, int(n or 1))


def fault_point(point: str) -> None:
    global _hits
    if _target is None or _target[1] != point or _target[0] != _process:
        return
    _hits += 1
    if _hits != _target[2]:
        return
    once = os.environ.get("ECREC_FAULT_ONCE")
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    os.kill(os.getpid(), _signal)
