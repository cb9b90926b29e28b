"""The part of PSClient that ecrec.delivery.DeltaLogDriver uses (updater.Transport), over tests/netsim.py's
stores: the messages and answers of gRPC (protobufs, RpcErrors), no sockets, every call answered at once."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import grpc
import torch

from ecrec.core.txn import RowsBusy
from ecrec.core.update import MapView
from ecrec.metrics import Metrics
from ecrec.proto import ecrec_pb2 as pb
from ecrec.server import delta_batch, delta_message, refused_rows
from ecrec.store import Busy, NotOwner, PeerFailed
from ecrec.wire import InvalidRequest, bytes_to_floats, bytes_to_ids
from tests.netsim import WORKER, Net

_CODES = {
    NotOwner: grpc.StatusCode.FAILED_PRECONDITION,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Busy: grpc.StatusCode.ABORTED,
    RowsBusy: grpc.StatusCode.ABORTED,
}


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class NetTransport:
    """This worker's map is a copy that lags behind the Net's until it refreshes; `before_deliver[server]`
    runs before a DeliverDeltas reaches `server` and may raise an RpcError as its answer. `calls` counts the
    messages by method."""

    timeout = 5.0
    progress_timeout = 10.0

    def __init__(self, net: Net):
        self.net, self.ctx = net, net.ctx
        self.metrics = Metrics("t", "worker", "0")
        self.stubs: dict = {}
        self.before_deliver: dict = {}
        self.map = net.view()
        self.degraded_writes = 0
        self.interrupt = threading.Event()
        self.calls: dict[str, int] = {}

    @property
    def epoch(self) -> int:
        return self.map.epoch

    def refresh(self) -> None:
        self.map = self.net.view()

    def view(self) -> MapView:
        return self.map

    def failed(self, shard: int) -> bool:
        return self.map.failed(shard)

    def degraded(self) -> bool:
        return bool(self.map.failed_shards)

    def report_failure(self, shard: int) -> None:
        self.refresh()

    def recover_from(self, shard: int, err: grpc.RpcError) -> None:
        self.refresh()

    def note_degraded(self, kind: str, shard: int, rows: int) -> None:
        self.degraded_writes += rows

    def call(self, shard: int, method: str, request) -> Future:
        self.calls[method] = self.calls.get(method, 0) + 1
        fut: Future = Future()
        try:
            fut.set_result(getattr(self, method)(shard, request))
        except grpc.RpcError as e:
            fut.set_exception(e)
        except PeerFailed as e:  # a dead server: the connection fails
            fut.set_exception(Refusal(grpc.StatusCode.UNAVAILABLE, str(e)))
        except (NotOwner, InvalidRequest, Busy, RowsBusy) as e:  # as ecrec.server's rpc edge answers them
            fut.set_exception(Refusal(_CODES[type(e)], str(e)))
        return fut

    def _batches(self, shard: int, messages) -> list:
        return [delta_batch(b, shard, self.ctx.record_width) for b in messages]

    def Stage(self, shard: int, req) -> pb.StageResponse:
        store = self.net.stores.get(shard)
        if store is not None and req.epoch < store.epoch:  # ecrec.server checks it before anything else
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"stale epoch {req.epoch}")
        g = bytes_to_ids(req.ids)
        grads = bytes_to_floats(req.grads, g.numel(), self.ctx.dim, "grads").clone()
        dense = {
            c: torch.frombuffer(bytearray(buf), dtype=torch.float32)
            for c, buf in zip(req.dense_chunks, req.dense_grads, strict=True)
        }
        refused, held = [], []
        if req.carried or req.ask:  # as ecrec.server's Stage: the riding deliveries first
            asked = [(r.txn, r.src) for r in req.ask]
            refused, held = self.net.call(
                WORKER, shard, "deliver_early", self._batches(shard, req.carried), asked
            )
        versions = bytes_to_ids(req.versions) if req.HasField("versions") else None
        n, batches = self.net.call(
            WORKER,
            shard,
            "apply_part",
            req.txn,
            g,
            grads,
            req.src,
            dense,
            req.epoch,
            list(req.delivered),
            versions,
        )
        return pb.StageResponse(
            staged=n,
            deltas=[delta_message(b) for b in batches],
            refused=refused_rows(refused),
            held=[pb.PartRef(txn=t, src=s) for t, s in held],
        )

    def DeliverDeltas(self, shard: int, req) -> pb.DeliverResponse:
        hook = self.before_deliver.pop(shard, None)
        if hook is not None:
            hook()
        store = self.net.stores.get(shard)  # (a dead one: the call below fails as a connection would)
        if store is not None and req.epoch < store.epoch:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"stale epoch {req.epoch}")
        batches = self._batches(shard, req.batches)
        if req.early:
            asked = [(r.txn, r.src) for r in req.ask]
            refused, held = self.net.call(WORKER, shard, "deliver_early", batches, asked, list(req.delivered))
        else:
            refused, held = self.net.call(WORKER, shard, "deliver", batches, True, list(req.delivered)), []
        return pb.DeliverResponse(
            refused=refused_rows(refused), held=[pb.PartRef(txn=t, src=s) for t, s in held]
        )


def rows_and_grads(ctx, seed: int, shard: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """12 rows of `shard` over every stripe slot (so over k parity servers), and their gradients."""
    g = ctx.placement.global_id(shard, torch.arange(12) * 3)
    return g, torch.randn(g.numel(), ctx.dim, generator=torch.Generator().manual_seed(seed))


def dense_grad(ctx) -> torch.Tensor:
    return torch.full((ctx.dense_bounds[-1][1],), 0.01)


def apply(driver, step: str, seed: int) -> None:
    """One worker step through a DeltaLogDriver: `rows_and_grads(seed)` and the dense gradient."""
    g, grads = rows_and_grads(driver.ctx, seed)
    driver.apply(step, g, grads, dense_grad(driver.ctx))
