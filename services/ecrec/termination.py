"""SIGTERM for the worker: finish the step under way, then exit as a process the signal killed.

In a container the role's process is PID 1, and PID 1 ignores a signal it has no handler for: without one,
a deleted worker pod would train on until its grace period ends and the kubelet SIGKILLs it. The servers and
the coordinator (uvicorn) handle SIGTERM themselves; the worker installs `Termination`:
- inside `with term.step():` (one training step: pull, compute, push, the previous update acknowledged) the
  signal is only noted, and `Terminated` is raised when the step is done; the wind-down then waits for the
  step's own update, so nothing is left half-staged;
- anywhere else (setting up, waiting for the start, holding for a checkpoint or a rollback) the handler raises
  `Terminated` at once, in the main thread (Python runs handlers there, between bytecodes);
- after `term.finishing()` (the last report of a worker that trained all its steps) nothing is raised: it
  exits 0 as it would have;
- whatever the main thread is doing, a watchdog ends the process with EXIT_CODE `grace` seconds after the
  signal, should the clean path hang (a server or the coordinator that does not answer). Pods get 10 s
  (ecrec_operator.render), `ecrec local`'s shutdown 5 s.

EXIT_CODE is 128 + SIGTERM, what a pod and a shell report for a process the signal killed. Both launchers'
reconciler (ecrec.core.reconcile) reads 128 + n as "killed": the worker is reported lost and replaced under
its rank, resuming where its last report left off; an exit code 1-127 would fail the job instead.

Lock discipline: `requested` is an Event; `_depth` is touched only by the main thread (its `step()` blocks
and the handler, which Python runs in the main thread), so it needs no lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("ecrec.worker")

EXIT_CODE = 128 + signal.SIGTERM
GRACE = 5.0  # seconds from SIGTERM to the watchdog's exit: under a pod's grace period and `ecrec local`'s


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, so that no `except Exception` reports it as the worker's error (the
    coordinator would fail the job on it)."""


class Termination:
    def __init__(self, grace: float = GRACE, exit: Callable[[int], object] = os._exit):
        self.grace = grace
        self._exit = exit
        self.requested = threading.Event()
        self._depth = 0  # > 0 in step() (for good after finishing()): the handler only notes the signal

    def install(self) -> Termination:
        """Handle SIGTERM from now on (call from the main thread)."""
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested.is_set():  # a second SIGTERM: the first one's wind-down is under way
            return
        self.requested.set()
        log.info("SIGTERM: stopping (at the latest in %gs)", self.grace)
        threading.Thread(target=self._watchdog, daemon=True, name="sigterm-watchdog").start()
        if self._depth == 0:
            raise Terminated

    def _watchdog(self) -> None:
        time.sleep(self.grace)
        log.warning("SIGTERM: not stopped within %gs; exiting with %d", self.grace, EXIT_CODE)
        logging.shutdown()  # flush the log: os._exit skips it
        self._exit(EXIT_CODE)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """A stretch the signal does not interrupt: a SIGTERM within it raises Terminated at its end. A step that
        fails after a SIGTERM (its server shut down too: a whole job being deleted) is abandoned the same way:
        no error of the job's to report."""
        self._depth += 1
        try:
            yield
        except Exception as e:
            if self._depth == 1 and self.requested.is_set():
                raise Terminated from e
            raise
        finally:
            self._depth -= 1
        if self._depth == 0 and self.requested.is_set():
            raise Terminated

    def finishing(self) -> None:
        """From now on a SIGTERM never raises: the worker is sending its last report and then exits 0 (the
        watchdog still bounds it)."""
        self._depth += 1
