"""How the client side retries: which gRPC statuses mean "try again", and the bookkeeping of one retried
operation (what was refused, when to give up, how long to back off)."""

from __future__ import annotations

import logging
import threading
import time

import grpc

log = logging.getLogger("ecrec.client")
# Dead? Ask the coordinator. CANCELLED comes from a server that is shutting down (a pod being deleted cancels
# the calls in flight): the client itself never cancels.
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
RETRYABLE = (*UNREACHABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED)


class Stalled(RuntimeError):
    """A call made no progress for the job's progressTimeoutSeconds; the message names the last refusal."""


class Retries:
    """Why a call is being retried, for the log and for the reason it gives up with.

    Counts refusals by (server, method, status) and logs them at most once a second; gives up (`Stalled`)
    after `timeout` seconds without progress, naming the last server and status. Backs off while nothing
    progresses, so a server that keeps refusing is not asked thousands of times a second."""

    def __init__(self, what: str, timeout: float, interrupt: threading.Event | None = None):
        """`interrupt`: once set, `check` gives up at once (`Interrupted`): the job rolls back."""
        self.what, self.timeout, self.interrupt = what, timeout, interrupt
        self.deadline = time.monotonic() + timeout
        self.counts: dict[tuple[int, str, str], int] = {}
        self.last: str | None = None
        self.logged_at = time.monotonic()
        self.fruitless = 0  # refusals since the last progress

    def progress(self) -> None:
        self.deadline = time.monotonic() + self.timeout
        self.fruitless = 0

    def note(self, server: int, method: str, err: grpc.RpcError | str) -> None:
        if isinstance(err, grpc.RpcError):
            code, detail = err.code().name, err.details()
        else:
            code, detail = "REFUSED", err
        key = (server, method, code)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.last = f"server {server} {method}: {code}: {detail}"
        self.fruitless += 1
        now = time.monotonic()
        if now - self.logged_at >= 1.0:
            summary = ", ".join(f"server {s} {m} {c} x{n}" for (s, m, c), n in sorted(self.counts.items()))
            log.warning(
                "%s: retrying (%s in %.1fs); last: %s", self.what, summary, now - self.logged_at, self.last
            )
            self.counts, self.logged_at = {}, now

    def check(self) -> None:
        if self.interrupt is not None and self.interrupt.is_set():
            raise Interrupted(self.what)
        if time.monotonic() > self.deadline:
            raise Stalled(
                f"{self.what}: no progress for {self.timeout:g}s; last refusal: {self.last or 'none (no answer)'}"
            )

    def backoff(self) -> float:
        """Seconds to wait before the next try: nothing for the first few, then growing to 0.2 s."""
        return 0.0 if self.fruitless < 4 else min(0.2, 0.001 * 2 ** min(self.fruitless - 4, 8))


class ServerUnavailable(RuntimeError):
    def __init__(self, shard: int, cause: grpc.RpcError):
        super().__init__(f"server {shard} unavailable: {cause.code().name}: {cause.details()}")
        self.shard, self.cause = shard, cause


class Interrupted(ServerUnavailable):
    """A retried call given up because the job rolls back to a checkpoint (strategy ecrec's fallback, when
    more than r servers are lost): what it waited for comes back only by the restore. Handled where a lost
    server is (the worker stops for the rollback); no server to blame (`shard` -1)."""

    def __init__(self, what: str):
        RuntimeError.__init__(self, f"{what}: interrupted by a rollback to the last checkpoint")
        self.shard, self.cause = -1, None
