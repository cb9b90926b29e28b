"""What one gRPC stream of raw bytes moves on this machine: the limit a rebuild's transfer rate is measured
against (`ecrec bench scale`).

A server process answers every call with the same payload of raw bytes (a generic handler: no protobuf, no
tensors), and one channel calls it back to back for a while, one call at a time, as a rebuild's lock group
reads its answers. Both ends are Python gRPC, as in the job, on loopback.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from concurrent import futures

import grpc

from ecrec.grpcopts import GRPC_OPTIONS

METHOD = "/ecrec.TransportProbe/Get"


def _serve(conn, size: int) -> None:
    payload = b"\x5a" * size
    handler = grpc.method_handlers_generic_handler(
        "ecrec.TransportProbe", {"Get": grpc.unary_unary_rpc_method_handler(lambda _req, _ctx: payload)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(port)
    conn.recv()  # until the client is done
    server.stop(1.0).wait()  # (a grace: the client's channel closes without a GOAWAY in the log)


def grpc_stream_rate(seconds: float = 1.0, size: int = 8 << 20) -> float:
    """Bytes per second one channel receives, calling for `size`-byte answers for `seconds` (one call at a
    time) from a server in another process."""
    ctx = mp.get_context("spawn")  # no fork of a process that holds torch's and gRPC's threads
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(there, size), daemon=True)
    proc.start()
    try:
        port = here.recv()
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
            get = channel.unary_unary(METHOD)  # bytes in, bytes out: no (de)serializers
            get(b"", timeout=30)  # connect and warm up
            moved, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds:
                moved += len(get(b"", timeout=30))
        return moved / elapsed
    finally:
        here.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
