"""What a parameter server needs from the other servers (`Peers`), and the stand-in without redundancy.

The store never opens a socket: a server process injects `ecrec.server.GrpcPeers`, deterministic in-process
tests inject direct calls (tests/netsim.py). No part of the store calls a peer while it holds its lock.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ecrec.core.stripes import Read, ReadResult
from ecrec.core.txn import DeltaBatch


class PeerFailed(Exception):
    def __init__(self, server: int, detail: str = ""):
        super().__init__(f"server {server} failed: {detail}")
        self.server = server


class Peers(Protocol):
    """What a server needs from the others. Calls raise PeerFailed if the peer is unreachable."""

    def deltas(
        self, batches: list[DeltaBatch], immediate: bool, epoch: int
    ) -> dict[int, Exception | None]: ...

    def decide(
        self, servers: list[int], txn: str, src: int, commit: bool, epoch: int
    ) -> dict[int, Exception | None]: ...

    def read_rows(self, requests: list[Read], epoch: int) -> list[ReadResult]: ...

    def dense_copy(self, server: int, chunk: int, epoch: int) -> tuple[torch.Tensor, list[str]]: ...

    def outcome(self, server: int, txn: str) -> str: ...

    def confirm_failed(self, server: int) -> bool: ...

    def is_failed(self, server: int) -> bool: ...


class NoPeers:
    """For a server without redundancy (strategy none): nothing to talk to."""

    def deltas(self, batches, immediate, epoch):
        return {b.parity_server: None for b in batches}

    def decide(self, servers, txn, src, commit, epoch):
        return dict.fromkeys(servers)

    def read_rows(self, requests, epoch):
        raise PeerFailed(-1, "no peers")

    def dense_copy(self, server, chunk, epoch):
        raise PeerFailed(server, "no peers")

    def outcome(self, server, txn):
        raise PeerFailed(server, "no peers")

    def confirm_failed(self, server):
        return True

    def is_failed(self, server):
        return False
