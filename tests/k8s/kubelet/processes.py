"""The container processes: started in their own session, tied to the thread that starts them.

Each container process runs in its own session (so its whole process group is signalled) and gets
PR_SET_PDEATHSIG=SIGKILL (through `setpriv`, else prctl): it dies with the kubelet thread that started it,
hence with the kubelet.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1
SETPRIV = shutil.which("setpriv")


def _die_with_parent() -> None:  # fallback without setpriv; runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def spawn(argv: list[str], env: dict[str, str], cwd: Path, stdout: Any) -> subprocess.Popen:
    """Starts argv (argv[0] absolute) in a new session that is SIGKILLed when the calling thread dies."""
    preexec = None
    if SETPRIV:
        argv = [SETPRIV, "--pdeathsig", "KILL", "--", *argv]
    else:
        preexec = _die_with_parent
    return subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=preexec,
    )


def killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
