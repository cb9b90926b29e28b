"""A parameter server's side of the checkpoint strategies (checkpoint, checknrun, cpr: docs/protocol.md,
"Checkpoint strategies"): what the `Checkpoint` and `Restore` RPCs do with this shard's state and files.

`ParameterServicer` (ecrec.server) keeps the gRPC methods — the generated base class routes by their names,
and its `rpc` wrapper checks epochs, maps errors to status codes and records metrics — and delegates to
`CheckpointHandlers`. A request that does not fit the job's strategy or the server's state raises
`CheckpointRefused` (FAILED_PRECONDITION, as the servicer's own WrongState).

Threads: checknrun writes its files in the background, one at a time, on `_writer` (one thread);
`_writes_lock` guards `_writes` (checkpoint id -> the write's future) and is never held while waiting for a
write. The store's lock is taken only inside the store's methods (ecrec.store.checkpoints).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

from ecrec import faults
from ecrec.proto import ecrec_pb2 as pb
from ecrec.store import ShardStore
from ecrec.wire import InvalidRequest


class CheckpointRefused(Exception):
    """The checkpoint request does not fit this job's strategy or this server's state."""


class CheckpointHandlers:
    """The Checkpoint and Restore handlers of one server's ParameterServicer."""

    def __init__(self, store: ShardStore):
        self.store = store
        # checknrun: checkpoint files written in the background, one at a time, by checkpoint id
        self._writer = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._writes: dict[int, futures.Future] = {}
        self._writes_lock = threading.Lock()

    def _checkpoints(self):
        from ecrec.ft.files import ManifestStore

        ctx = self.store.ctx
        if ctx.spec.fault_tolerance.checkpoints() is None:
            raise CheckpointRefused(
                f"faultTolerance.strategy {ctx.spec.fault_tolerance.strategy} takes no checkpoints"
                + (" (no faultTolerance.ecrec.fallback)" if ctx.ecrec else "")
            )
        return ManifestStore.for_job(ctx.job)

    def checkpoint(self, request) -> pb.CheckpointResponse:
        """Write this shard's part of checkpoint `checkpoint` under the job's checkpoint directory. checknrun
        decouples it: the first call copies the state (a baseline, or the rows changed since the last one)
        and answers; the file is quantized and written on a thread; a call with await_written answers once
        it is there."""
        from ecrec.ft.files import encode_records, write_shard

        start = time.perf_counter()
        store = self._checkpoints()
        if request.checkpoint < 1:
            raise InvalidRequest("checkpoint: ids start at 1")
        ctx = self.store.ctx
        if request.hot:  # cpr: the hot rows, exact, while training goes on
            if self.store.snapshots.hot is None:
                raise CheckpointRefused(
                    "hot-row saves need faultTolerance.strategy cpr with cpr.hotRows mfu or ssu"
                )
            t = self.store.hot_tensors()
            entry = write_shard(store.root, request.checkpoint, self.store.shard, t)
            return _checkpoint_answer(entry, int(t["index"].numel()), start)
        if ctx.spec.fault_tolerance.strategy != "checknrun":
            faults.fault_point("checkpoint:before_write")
            entry = write_shard(
                store.root, request.checkpoint, self.store.shard, self.store.checkpoint_tensors()
            )
            faults.fault_point("checkpoint:after_write")
            return _checkpoint_answer(entry, self.store.num_rows, start)
        if request.await_written:
            with self._writes_lock:
                fut = self._writes.get(request.checkpoint)
            if fut is None:
                raise CheckpointRefused(f"checkpoint {request.checkpoint} was never begun on this server")
            entry, rows = fut.result()
            return _checkpoint_answer(entry, rows, start)
        base = None if request.baseline else int(request.base)
        t = self.store.checkpoint_tensors(request.checkpoint, base=base)
        bits = ctx.spec.fault_tolerance.checknrun.quantize_bits
        rows = int(t["rows"].shape[0])

        def write() -> tuple[dict, int]:
            encoded = {k: v for k, v in t.items() if k != "rows"} | encode_records(t["rows"], ctx.dim, bits)
            faults.fault_point("checkpoint:before_write")
            entry = write_shard(store.root, request.checkpoint, self.store.shard, encoded)
            faults.fault_point("checkpoint:after_write")
            return entry, rows

        with self._writes_lock:
            self._writes = {c: f for c, f in self._writes.items() if c >= request.checkpoint - 1}
            self._writes[request.checkpoint] = self._writer.submit(write)
        return pb.CheckpointResponse(rows=rows, seconds=time.perf_counter() - start)

    def restore(self, request) -> pb.RestoreResponse:
        """Load this shard's part of a committed checkpoint (0: the initial state), replacing all its state;
        for a checknrun increment, its baseline and then the increment's rows."""
        from ecrec.ft.files import CheckpointError, decode_records

        start = time.perf_counter()
        store = self._checkpoints()
        ctx = self.store.ctx
        try:
            if not request.checkpoint:
                rows = self.store.load_checkpoint(None)
            elif ctx.spec.fault_tolerance.strategy == "checknrun":
                base_id = store.manifest(request.checkpoint).get("base") or request.checkpoint
                base, inc = store.read_chain(request.checkpoint, self.store.shard)
                bits = ctx.spec.fault_tolerance.checknrun.quantize_bits
                for t in (base, inc):
                    if t is not None:
                        t["rows"] = decode_records(t, ctx.dim, bits)
                rows = self.store.load_checkpoint(
                    base, *([inc] if inc is not None else []), base=int(base_id)
                )
            else:  # checkpoint, or cpr: its full checkpoint, then the hot-row saves since, oldest first
                full, *hots = store.hot_chain(request.checkpoint)
                shard = self.store.shard
                rows = self.store.load_checkpoint(
                    store.read_shard(full, shard), *(store.read_shard(h, shard) for h in hots)
                )
        except CheckpointError as e:
            raise CheckpointRefused(str(e)) from e
        return pb.RestoreResponse(rows=rows, seconds=time.perf_counter() - start)


def _checkpoint_answer(entry: dict, rows: int, start: float):
    return pb.CheckpointResponse(
        file=entry["file"],
        sha256=entry["sha256"],
        bytes=entry["bytes"],
        rows=rows,
        seconds=time.perf_counter() - start,
    )
