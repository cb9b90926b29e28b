"""The processes of a local job, forked from one that has already imported them.

Starting a role as a new interpreter (`ecrec server ...`) spends 1-2 s of CPU importing torch, gRPC and our
own modules before it does anything. `ecrec local` starts a coordinator, every server and every worker that
way, and a replacement for each one that dies — on the same cores that train, so a replacement server's
start used to be most of a recovery without warm spares. A fork server pays the imports once: it is started
with the job (`python -m ecrec.forkserver --out OUT`), imports every role's module, and then forks a child for
each process the launcher asks for; the child runs `ecrec ROLE ARGS` in the interpreter it inherited.

The children are real processes, as before: their own pid, session, log file and environment; SIGKILL kills
them; the launcher sees their exit codes (-n for a signal n, as `subprocess` gives them). Each child's parent
is the fork server, so each has the kernel kill it when the fork server dies (PR_SET_PDEATHSIG), and the fork
server dies with the launcher (the same, and the end of its request pipe): nothing outlives the job. In `ps` a
child shows the fork server's command line, which names the job's out directory; its name (`ps -o comm`,
`top`) is its own, e.g. `server-2`. The test kubelet (tests/k8s/kubelet/) starts pods' `ecrec` processes
the same way.

Wire format, one JSON object per line. Launcher -> fork server: {"argv", "env", "log", "name"[, "cwd"]}. Fork
server -> launcher: {"started": pid} or {"error": text} for each request, in order, and {"exited": pid,
"code": c} whenever a child exits.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ecrec.roles import ROLE_MODULES, run_role

# Every role's module (what the fork server is for), and the coordinator's app (its service, FastAPI, uvicorn),
# which its package's main imports only when called.
PRELOAD = (*ROLE_MODULES.values(), "ecrec.coordinator.app")
PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1
START_TIMEOUT = 120.0  # the fork server's own start (its imports) on a busy machine


class ForkServerError(RuntimeError):
    """The fork server is gone or refused a start."""


def _prctl(option: int, arg) -> bool:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0)
    except OSError:  # no glibc: the child only loses its name or the parent-death signal
        return False
    return True


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies. A parent that died before this call (SIGKILLed
    while starting its children) left it orphaned already: it then kills itself."""
    if _prctl(PR_SET_PDEATHSIG, signal.SIGKILL) and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with(parent: int):
    """preexec_fn for children of process `parent` (this one): see _die_with_parent."""
    return functools.partial(_die_with_parent, parent)


# -- the fork server -----------------------------------------------------------------------------------------


def _serve(requests_fd: int, replies_fd: int) -> dict:
    """The fork server's loop. Returns only in a child, with the request it was forked for; the fork server
    itself exits when the launcher closes the request pipe (or dies)."""
    for module in PRELOAD:
        importlib.import_module(module)
    from ecrec import rest

    rest.tls_context()  # every process makes one (certifi's trust store: 55-95 ms of CPU); forked, it has it
    import torch

    # A child cannot use CUDA once its parent initialized it (CUDA's state does not survive fork): each
    # worker initializes it itself. Checked on a GPU by hack/gpu-check.
    if torch.cuda.is_initialized():
        raise RuntimeError("the fork server initialized CUDA: its children could not use it")
    me = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to the wake-up pipe
    sel = selectors.DefaultSelector()
    sel.register(requests_fd, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    pending = b""

    def send(msg: dict) -> None:
        data = (json.dumps(msg) + "\n").encode()
        while data:
            data = data[os.write(replies_fd, data) :]

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
                reap()
                continue
            chunk = os.read(requests_fd, 1 << 16)
            if not chunk:  # the launcher closed the pipe or died: the children follow (PR_SET_PDEATHSIG)
                sys.exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    request = json.loads(line)
                    pid = os.fork()
                except (ValueError, OSError) as e:
                    send({"error": f"{type(e).__name__}: {e}"})
                    continue
                if pid == 0:
                    sel.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_r, wake_w, requests_fd, replies_fd):
                        os.close(fd)
                    request["parent"] = me
                    return request
                send({"started": pid})
            reap()  # a child may have exited while this loop ran


def _become(request: dict) -> list[str]:
    """In a child: take the process's own session, name, log, and environment. Returns the role's argv."""
    os.setsid()
    _die_with_parent(request["parent"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    _prctl(PR_SET_NAME, request["name"].encode()[:15])
    if request.get("cwd"):
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    sys.argv = ["ecrec", *request["argv"]]
    return list(request["argv"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ecrec.forkserver", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the job's out directory (named here so `ps` shows whose)")
    p.parse_args(argv)
    # The wire is the stdin and stdout this process was started with; fd 1 becomes stderr (the fork server's
    # log), so that nothing printed here can corrupt a reply.
    requests_fd, replies_fd = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    request = _serve(requests_fd, replies_fd)
    # Only a child gets here: it runs its role as `ecrec ROLE ARGS` would, in this interpreter, and exits
    # through Python's own shutdown (atexit, non-daemon threads joined), with the role's exit code.
    argv = _become(request)
    if argv and argv[0] in ROLE_MODULES:
        run_role(argv[0], argv[1:])
        return
    # Any other `ecrec` command (the test kubelet forks whatever runs the `ecrec` entrypoint): the CLI, in a
    # fresh interpreter, since this one preloads the roles and not the CLI (which imports the fork server).
    os.execv(sys.executable, [sys.executable, "-m", "ecrec.cli", *argv])


# -- the launcher's side ---------------------------------------------------------------------------------
class Forked:
    """A child of the fork server, with the part of `subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, server: ForkServer, pid: int):
        self._server, self.pid = server, pid
        self.exit: int | None = None  # set by the fork server's reader when this process (not its pid) exits
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that was reaped (it may be reused)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's handle on its fork server: `spawn` a role, learn when it exits, `close` at the end.

    The fork server dies with the thread that made this object (PR_SET_PDEATHSIG is per thread): make it from
    one that outlives its children, e.g. the main thread."""

    def __init__(self, out_dir: Path, log_path: Path, env: dict[str, str]):
        self._lock = threading.Lock()  # one request in flight: replies come in request order
        self._cond = threading.Condition()
        # Children by pid while they live: an exit is matched to the process, so a pid the system reuses for a
        # later child is never taken for the earlier one's.
        self._live: dict[int, Forked] = {}
        self._replies: list[Forked | dict] = []
        self._gone = False
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ecrec.forkserver", "--out", str(out_dir)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                preexec_fn=die_with(os.getpid()),  # it dies with this process, and its children with it
                env=env,
            )
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "exited" in msg:
                    child = self._live.pop(int(msg["exited"]), None)
                    if child is not None:
                        child.exit = int(msg["code"])
                elif "started" in msg:  # registered here, before its exit can be read
                    child = self._live[int(msg["started"])] = Forked(self, int(msg["started"]))
                    self._replies.append(child)
                else:
                    self._replies.append(msg)
                self._cond.notify_all()
        with self._cond:
            self._gone = True
            self._cond.notify_all()

    def spawn(
        self, argv: list[str], env: dict[str, str], log_path: Path, name: str, cwd: Path | None = None
    ) -> Forked:
        msg = {"argv": argv, "env": env, "log": str(log_path), "name": name}
        if cwd is not None:
            msg["cwd"] = str(cwd)
        request = json.dumps(msg) + "\n"
        with self._lock:
            try:
                self.proc.stdin.write(request.encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                raise ForkServerError(f"the fork server is gone (exit code {self.proc.poll()})") from None
            deadline = time.monotonic() + START_TIMEOUT
            with self._cond:
                while not self._replies and not self._gone:
                    if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                        raise ForkServerError(f"the fork server did not answer within {START_TIMEOUT:.0f}s")
                if not self._replies:
                    raise ForkServerError(f"the fork server is gone (exit code {self.proc.wait()})")
                reply = self._replies.pop(0)
        if isinstance(reply, dict):
            raise ForkServerError(f"the fork server could not start {name}: {reply.get('error')}")
        return reply

    def exit_code(self, child: Forked) -> int | None:
        with self._cond:
            if child.exit is not None:
                return child.exit
            # A child of a fork server that is gone was killed with it (PR_SET_PDEATHSIG).
            return -signal.SIGKILL if self._gone else None

    def wait_exit(self, child: Forked, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while child.exit is None and not self._gone:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(timeout=left)
        return self.exit_code(child)

    def close(self, timeout: float = 10.0) -> None:
        """End the fork server (its children should have exited: any left are SIGKILLed with it)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=timeout)


if __name__ == "__main__":
    main()
