"""Unary calls as messages on long-lived gRPC streams (the `Calls` method; docs/architecture.md, "Streams").

A unary call in Python gRPC sets up a call object, an HTTP/2 stream and a handler dispatch every time; a
message on a stream that is already open costs far less (measured in docs/benchmarks.md). So a client keeps a
few `Calls` streams open to each server and sends each call as one `Call` message on an idle one; the server
runs the same servicer method it would run for the unary call and sends the answer back as the next message.
Everything above this module sees unary semantics:

- one call at a time per stream: no ids, no reordering, no head-of-line blocking between callers;
- the caller's timeout holds per message: the server's handler gets it as its deadline (a wait ends when the
  caller stops waiting), and the client's watchdog cancels a stream whose answer is late, so a paused server
  fails the call with DEADLINE_EXCEEDED as a unary call would;
- a failed call comes back as its status code and details and is raised as a `grpc.RpcError` (`CallError`)
  with the same `code()` and `details()`; a stream that breaks (the server died) fails the call in flight
  with the stream's own status and is dropped;
- a server keeps at most `MAX_STREAMS` open (each holds one of its handler threads) and refuses more with
  RESOURCE_EXHAUSTED; a client that meets the refusal, or a server without the method, uses unary calls to it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from ecrec.proto import ecrec_pb2 as pb

log = logging.getLogger("ecrec.streams")

MAX_STREAMS = 32  # per server: each open stream holds one handler thread (the server has 64 + this many)
STREAMS_PER_SERVER = 4  # per client and server: the training thread's and the update thread's calls at once
WATCHDOG_PERIOD = 0.02  # seconds: how late a timed-out call on a stream may fail
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_FALLBACK = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED)


def _unary_methods() -> dict[str, tuple[type, type]]:
    """Method name -> (request class, response class) for every unary method of ParameterServer."""
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    return {
        m.name: (getattr(pb, m.input_type.name), getattr(pb, m.output_type.name))
        for m in service.methods
        if not m.client_streaming and not m.server_streaming
    }


METHODS = _unary_methods()


class CallError(grpc.RpcError):
    """A call on a stream that failed: the same code() and details() its unary call would have had."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


# -- server side ------------------------------------------------------------------------------------------
class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class MessageContext:
    """What a servicer method sees of one call on a stream: the caller's deadline for this message, the
    stream's liveness, and abort() as the answer's status."""

    def __init__(self, stream: grpc.ServicerContext, timeout: float):
        self._stream = stream
        self._deadline = time.monotonic() + timeout if timeout > 0 else None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        return self._stream.is_active() and (self._deadline is None or time.monotonic() < self._deadline)

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)


class StreamEndpoint:
    """The server's side of `Calls`: runs each message through the servicer's own method."""

    def __init__(self, servicer, max_streams: int = MAX_STREAMS):
        self.handlers = {name: (getattr(servicer, name), req) for name, (req, _resp) in METHODS.items()}
        self.max_streams = max_streams
        self.open = 0
        self._lock = threading.Lock()

    def serve(self, requests: Iterator[pb.Call], context: grpc.ServicerContext) -> Iterator[pb.Call]:
        with self._lock:
            full = self.open >= self.max_streams
            if not full:
                self.open += 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_streams} streams open: call unary")
        try:
            for call in requests:
                yield self.one(call, context)
        finally:
            with self._lock:
                self.open -= 1

    def one(self, call: pb.Call, context: grpc.ServicerContext) -> pb.Call:
        entry = self.handlers.get(call.method)
        if entry is None:
            return _failed(grpc.StatusCode.UNIMPLEMENTED, f"method: no unary method {call.method!r}")
        handler, request_cls = entry
        try:
            request = request_cls.FromString(call.body)
        except Exception as e:  # noqa: BLE001 - a malformed body is the caller's error; the stream goes on
            return _failed(grpc.StatusCode.INVALID_ARGUMENT, f"body: not a {request_cls.__name__} ({e})")
        try:
            response = handler(request, MessageContext(context, call.timeout))
        except _Aborted as a:
            return _failed(a.code, a.details)
        except Exception as e:  # noqa: BLE001 - the servicer's methods map their errors; this keeps the stream
            log.exception("%s on a stream: unexpected error", call.method)
            return _failed(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        return pb.Call(body=response.SerializeToString())


def _failed(code: grpc.StatusCode, details: str) -> pb.Call:
    return pb.Call(code=code.value[0], details=details)


# -- client side ------------------------------------------------------------------------------------------
class _Watchdog:
    """One thread per process: cancels streams whose call is past its deadline."""

    def __init__(self):
        self.busy: set[_Stream] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, stream: _Stream) -> None:
        with self._lock:
            self.busy.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream-watchdog", daemon=True)
                self._thread.start()

    def unwatch(self, stream: _Stream) -> bool:
        """Stop watching; True if the stream expired meanwhile."""
        with self._lock:
            self.busy.discard(stream)
            return stream.expired

    def _run(self) -> None:
        while True:
            time.sleep(WATCHDOG_PERIOD)
            now = time.monotonic()
            with self._lock:  # decided under the lock: a stream whose answer came meanwhile is not busy
                late = [s for s in self.busy if s.deadline < now]
                self.busy.difference_update(late)
                for s in late:
                    s.expired = True
            for s in late:
                s.cancel()


WATCHDOG = _Watchdog()


class _Broken(Exception):
    """The stream failed (not the call on it): `error` is what the caller sees."""

    def __init__(self, error: grpc.RpcError, answered: bool):
        super().__init__(str(error))
        self.error, self.answered = error, answered


class _Stream:
    def __init__(self, open_calls: Callable):
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._answers = open_calls(iter(self._out.get, None))
        self.deadline = 0.0
        self.expired = False  # set by the watchdog: the stream is being cancelled, never to be reused
        self.answered = False  # has this stream answered anything (was it accepted)?

    def call(self, method: str, request, response_cls: type, timeout: float):
        self.deadline = time.monotonic() + timeout
        self._out.put(pb.Call(method=method, body=request.SerializeToString(), timeout=timeout))
        WATCHDOG.watch(self)
        try:
            answer = next(self._answers)
        except grpc.RpcError as e:
            error = e
            if WATCHDOG.unwatch(self):
                error = CallError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: no answer within {timeout:.1f}s"
                )
            raise _Broken(error, self.answered) from None
        except StopIteration:
            WATCHDOG.unwatch(self)
            raise _Broken(CallError(grpc.StatusCode.UNAVAILABLE, "the stream ended"), self.answered) from None
        WATCHDOG.unwatch(self)  # expired just now? The answer still counts; the pool drops the stream
        self.answered = True
        if answer.code:
            raise CallError(_CODES.get(answer.code, grpc.StatusCode.UNKNOWN), answer.details)
        return response_cls.FromString(answer.body)

    def cancel(self) -> None:
        self._answers.cancel()

    def close(self) -> None:
        self._out.put(None)
        self._answers.cancel()


class StreamPool:
    """A client's streams to one server: up to `size` open, each lent to one call at a time. With none idle
    and `size` open, or once the server refused streams, calls go unary."""

    def __init__(self, stub, size: int = STREAMS_PER_SERVER):
        self.stub, self.size = stub, size
        self._idle: list[_Stream] = []
        self._open = 0
        self.opened = 0  # streams ever opened (the channel's owner must not close it under them)
        self._lock = threading.Lock()
        self.unary_only = size <= 0
        self.closed = False

    def call(self, method: str, request, timeout: float):
        stream = self._take()
        if stream is None:
            return getattr(self.stub, method)(request, timeout=timeout)
        try:
            response = stream.call(method, request, METHODS[method][1], timeout)
        except _Broken as b:
            self._drop(stream)
            if not b.answered and b.error.code() in _FALLBACK:
                log.info("server refused call streams (%s): unary calls from now on", b.error.code().name)
                self.unary_only = True
                return getattr(self.stub, method)(request, timeout=timeout)
            raise b.error from None
        except CallError:
            self._give(stream)
            raise
        self._give(stream)
        return response

    def _take(self) -> _Stream | None:
        with self._lock:
            if self.unary_only or self.closed:
                return None
            if self._idle:
                return self._idle.pop()
            if self._open >= self.size:
                return None
            self._open += 1
            self.opened += 1
        return _Stream(self.stub.Calls)

    def _give(self, stream: _Stream) -> None:
        if stream.expired:  # answered as the watchdog cancelled it
            self._drop(stream)
            return
        with self._lock:
            if not self.closed:
                self._idle.append(stream)
                return
        stream.close()

    def _drop(self, stream: _Stream) -> None:
        with self._lock:
            self._open -= 1
        stream.close()

    def close(self) -> None:
        with self._lock:
            self.closed, idle, self._idle = True, self._idle, []
        for s in idle:
            s.close()
