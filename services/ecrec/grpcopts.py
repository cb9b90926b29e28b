"""gRPC settings the data path shares: every parameter server's gRPC server and every channel to one
(clients, servers' peer channels, benchmarks, the fuzzer). A module of its own so that a client need not
import the server for them."""

from __future__ import annotations

# Records travel as raw bytes, a whole shard's at once for recovery reads: far past gRPC's 4 MiB default.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 512 * 1024 * 1024),
    ("grpc.max_receive_message_length", 512 * 1024 * 1024),
]
