"""Is a parameter server process still there? `probe_server` asks it (TCP, then gRPC `Info`); `SingleFlight`
makes the many reports of one failure share one probe. The coordinator probes only outside its lock.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
from collections.abc import Callable

import grpc

from ecrec import auth


class SingleFlight:
    """Calls of `fn(address, instance)` made while one with the same arguments runs wait for its answer
    instead of running again: when a server dies, every worker and server that used it reports it at once,
    and each report probing it anew cost the coordinator CPU in the moment the whole job waits on it."""

    def __init__(self, fn: Callable[[str, str], bool]):
        self.fn = fn
        self.lock = threading.Lock()
        self.running: dict[tuple[str, str], concurrent.futures.Future] = {}

    def __call__(self, address: str, instance: str = "") -> bool:
        key = (address, instance)
        with self.lock:
            fut = self.running.get(key)
            first = fut is None
            if first:
                fut = self.running[key] = concurrent.futures.Future()
        if not first:
            return fut.result()
        try:
            answer = self.fn(address, instance)
            fut.set_result(answer)
            return answer
        except BaseException as e:
            fut.set_exception(e)
            raise
        finally:
            with self.lock:
                del self.running[key]


def _tcp_answers(address: str, timeout: float) -> bool | None:
    """Does anything accept a TCP connection at `address` within `timeout`? False when it is refused or
    nothing answers in time (the kernel accepts for a live process however busy it is); None when the network
    cannot tell (no route, a name that does not resolve): gRPC's probe decides then."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (ConnectionRefusedError, TimeoutError):
        return False
    except (OSError, ValueError):
        return None


def probe_server(address: str, instance: str = "", timeout: float = 1.0, token: str | None = None) -> bool:
    """True if the parameter server process `instance` answers Info at `address` within `timeout`. Another
    process answering at that address (a replacement that took it over) means `instance` is gone."""
    from ecrec.proto import ecrec_pb2, ecrec_pb2_grpc

    if not address:
        return False
    # A refused connection answers at once (a killed local process); a gRPC channel takes tens of ms to
    # say the same on a loaded machine, while every worker waits for the verdict.
    if _tcp_answers(address, timeout) is False:
        return False
    with auth.channel(address, token) as ch:
        try:
            info = ecrec_pb2_grpc.ParameterServerStub(ch).Info(ecrec_pb2.InfoRequest(), timeout=timeout)
        except grpc.RpcError as e:
            # A process that refuses our token is still there: never declare a live process dead.
            return e.code() == grpc.StatusCode.UNAUTHENTICATED
    return not instance or info.instance == instance
