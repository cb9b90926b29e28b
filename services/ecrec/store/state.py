"""A parameter server's state, its one lock, and how a request waits for busy state: the base of every part
of `ShardStore` (ecrec.store).

`StoreState` builds the server's tensors at start-up — its data row records and their versions
(core/txn.py `DataParticipant`), the parity records it keeps for other servers' stripes
(`ParityParticipant`), its dense chunks (core/dense.py `DenseReplicas`), the acting home of failed shards'
rows (core/acting.py `ActingHome`), the checkpoint trackers (core/snapshots.py) — from the seed, or empty for
a replacement; a checkpoint's load (ecrec.store.checkpoints) replaces them and resets the protocol state in
flight. The parts (records, participant, deltas, recovery, checkpoints) are mixins over this one state:
the protocol's steps cross roles under one lock (a stage touches rows, dense chunks, the acting home and the
outcomes at once), so the state is not split, only the steps.

Lock discipline (every part follows it):
- `lock`, one mutex, guards all mutable state: `rows`, `row_ready`, `parity`, `parity_rebuilding`,
  `acting`, `dense`, `dense_copying_in`, `outcomes`, `stats`, `fence`, `waiting`, `snapshots`, `replacement`,
  `loads`, and deltaLog's `deltalog`, `held_from`, `refused`, `accepted`.
  It is not reentrant: public methods take it themselves and must not be called with it held.
- `cond` is a condition on `lock`. Whoever changes state a waiter may be waiting for (rows unlocked, a part
  decided, parity or a chunk installed) calls `cond.notify_all()` before releasing the lock; a change on the
  parity side (records, held deltas, refusals) calls `_parity_changed()`, which also wakes `held_cond`, where
  deliveries wait for their rows' predecessors (a delivery wakes `held_cond` only if it released held rows).
- `_wait(ready, ...)` is called with `lock` held, releases it while it sleeps and returns with it held; at
  most MAX_WAITING requests wait at once, and a wait ends with the caller's deadline (`CALLER`).
- Peers are never called with `lock` held; neither is decoding (it calls peers). Tensors handed out are
  copied (`clone`/`index_select`) before the lock is released.
- `epoch` is written by the adapter (ParameterServicer) without the lock: one int, read as a whole.
- `local_rows`, `_check_grads` and `_chunk` only read geometry: no lock. `_remember` needs `lock` held.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch

from ecrec.core.acting import ActingHome
from ecrec.core.codes import make_code
from ecrec.core.cuts import Cuts
from ecrec.core.deltalog import DeltaLog
from ecrec.core.dense import DenseReplicas
from ecrec.core.snapshots import ShardSnapshots
from ecrec.core.txn import DataParticipant, ParityParticipant
from ecrec.core.update import WorkerFence
from ecrec.core.vec import all_unique, in_range
from ecrec.jobctx import JobContext
from ecrec.model import init_dense, init_embedding_rows
from ecrec.rebuild_tap import Tap
from ecrec.store.peers import NoPeers, Peers
from ecrec.wire import InvalidRequest, check_finite

INIT_BLOCK_ROWS = 1 << 18  # initialize tables in blocks to bound the temporaries of the hash init
REBUILD_TXN = "recovery:"  # the holder name of a recovery lock group's rows (Recovery.rebuild_rows)
# Requests allowed to wait at once (for busy rows, undecided deltas, a dense copy). Past that a request that
# would wait answers Busy at once, so that waiting requests, however many arrive, hold a bounded share of the
# server's threads and the rest keep answering.
MAX_WAITING = 16


@dataclass(frozen=True)
class Caller:
    """The request being served on this thread: how long its caller still waits, and whether it still does
    (set by the gRPC adapter). A wait for busy state never outlives its caller."""

    deadline: float | None  # time.monotonic() by which the caller gives up; None = no deadline
    active: Callable[[], bool] = lambda: True


CALLER: ContextVar[Caller | None] = ContextVar("ecrec_caller", default=None)


class Cancelled(Exception):
    """The caller gave up (deadline passed or cancelled) while the request waited."""


class Busy(Exception):
    """Rows stayed busy past the wait limit (the worker retries the part)."""


class NotOwner(Exception):
    """The request was routed with an outdated cluster map (the worker refreshes it and retries)."""


class StoreState:
    """One server's tables and protocol state, built at start-up; the parts of ShardStore add the steps."""

    def __init__(
        self,
        ctx: JobContext,
        shard: int,
        peers: Peers | None = None,
        *,
        replacement: bool = False,
        txn_timeout: float = 5.0,
        wait_timeout: float = 30.0,
        clock: Callable[[], float] = time.time,
    ):
        self.ctx, self.shard, self.peers = ctx, shard, peers or NoPeers()
        self.clock, self.txn_timeout, self.wait_timeout = clock, txn_timeout, wait_timeout
        p = self.placement = ctx.placement
        self.num_rows = p.rows_on(shard)
        self.dim = ctx.dim
        self.opt = ctx.optimizer
        self.epoch = 0
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        # Deliveries waiting for their rows' predecessors wake only when held rows may have been released
        # (_parity_changed, or a delivery that applied some: LoggedUpdates.deliver), not on every stage or
        # delivery as `cond` does: under hot rows many wait at once.
        self.held_cond = threading.Condition(self.lock)
        # r = 2: the P + Q code (xor family); r = 0 (no parity) and r = 1: the code named
        self.code = make_code(ctx.spec.fault_tolerance.ecrec.code, 2 if p.r == 2 else 1, p.k)
        seed = ctx.spec.training.seed
        self.replacement = replacement
        # -- data rows ----------------------------------------------------------------------------------
        if replacement:
            data = torch.zeros(self.num_rows, ctx.record_width)
        else:
            data = self._init_records(p.global_id(shard, torch.arange(self.num_rows)), seed)
        self.rows = DataParticipant(
            shard, p, self.code, self.opt, data, torch.zeros(self.num_rows, dtype=torch.int64)
        )
        self.tap = Tap.from_env(shard, self.rows)  # None unless `ecrec local --rebuild-error` asked for it
        self.row_ready = torch.full((self.num_rows,), not replacement, dtype=torch.bool)
        # checkpoint strategies: checknrun's rows updated since each baseline, cpr's hot rows
        cpr = ctx.spec.fault_tolerance.cpr
        self.snapshots = ShardSnapshots(
            shard,
            self.num_rows,
            hot_rows=cpr.hot_rows if ctx.spec.fault_tolerance.strategy == "cpr" else "none",
            hot_fraction=cpr.hot_row_fraction,
            ssu_period=cpr.ssu_period,
        )
        # -- parity records -----------------------------------------------------------------------------
        n_par = p.r * p.parity_rows_on(shard)  # parity index j·B + block (Placement.parity_index)
        if n_par and not replacement:
            parity = self._encode_initial_parity(n_par, seed)
        else:
            parity = torch.zeros(n_par, ctx.record_width)
        self.parity = ParityParticipant(
            shard,
            p,
            self.code,
            parity,
            torch.zeros(n_par, max(p.k, 1), dtype=torch.int64),
            ready=torch.full((n_par,), not replacement, dtype=torch.bool),
        )
        # -- degraded writes of failed shards' rows, for which this server is the acting home -----------
        self.acting = ActingHome(p.rows_on, ctx.record_width)
        self.cuts = Cuts(p.rows_on)  # r = 2: a failed shard's rows in both parity records (store.twoparity)
        # -- dense chunks -------------------------------------------------------------------------------
        flat = init_dense(*_model_args(ctx), seed=seed)
        records, ready = {}, {}
        for c in ctx.dense_chunks_of(shard):
            lo, hi = ctx.dense_bounds[c]
            records[c] = self.opt.init_records(flat[lo:hi].reshape(-1, 1).clone())
            # A lone replica has nothing to copy from: ready at once, unless a checkpoint restores it.
            ready[c] = not replacement or (len(ctx.dense_holders(c)) == 1 and not ctx.checkpointing)
        self.dense = DenseReplicas(self.opt, records, ready)
        # A replacement's parity records and dense chunks being rebuilt now. A Recover step can run twice at
        # once (a coordinator died with it in flight and its successor sent it again): the second waits for
        # the first and then finds it done. Installing a second, older cut after updates had been applied
        # on top of the first would silently drop them.
        self.parity_rebuilding = torch.zeros(n_par, dtype=torch.bool)
        self.dense_copying_in: set[int] = set()
        # Checkpoints loaded (ecrec.store.checkpoints): a rebuild or copy that began before a load installs
        # nothing after it.
        self.loads = 0
        self.outcomes: OrderedDict[str, str] = OrderedDict()
        # commit: deltaLog (ecrec.store.logged): parts applied here whose deltas the worker has not said it
        # delivered; per data server, the incarnation whose held deltas this parity server keeps; rows of
        # delivered batches dropped unapplied, by (txn, src), until their deliverer asks; the (txn, src,
        # incarnation) of batches accepted here lately (a re-delivery after their data server failed is not
        # refused).
        ec = ctx.spec.fault_tolerance
        self.logged = ec.strategy == "ecrec" and ec.ecrec.two_phase_commit and ec.ecrec.commit == "deltaLog"
        self.deltalog = DeltaLog()
        self.held_from: dict[int, int] = {}
        self.refused: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()
        self.accepted: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        # The checkpoint fallback's rollback: forwards held (hold_forwards), forward passes on their way.
        self._forwards_held = False
        self._forwarding = 0
        self._said_committing: set[str] = set()  # expired degraded writes whose commit failed, logged once
        self.stats = {
            "degraded_rows": 0,
            "buffered": 0,
            "rows_recovered": 0,
            "expired_worker_gone": 0,
            "expired_timeout": 0,
            "stripes_read_again": 0,
            "deltas_delivered": 0,  # deltaLog: delta batches accepted as a parity server (first deliveries)
            "deltas_held": 0,  # ... of them with rows that came ahead of a predecessor and were held
            "rows_realigned": 0,  # r = 2: a failed shard's rows whose other parity record took the acting home's cut
            "rows_caught_up": 0,  # r = 2: rows a parity record took from the deltas it had refused (core/cuts.py)
        }
        # Worker processes the coordinator says are gone: what they staged here is settled at once (expire).
        self.fence = WorkerFence()
        self.waiting = 0  # requests in _wait now (bounded by MAX_WAITING)

    @property
    def data(self) -> torch.Tensor:
        """This shard's data row records [rows, record width]."""
        return self.rows.records

    # ---------------------------------------------------------------------------------------------------
    # initialization
    def _init_records(self, g: torch.Tensor, seed: int) -> torch.Tensor:
        """The initial records of rows `g`: `opt.init_records` of their initial rows (optimizer state 0), written
        in place block by block (a whole table's temporaries cost more than the rows' hash)."""
        out = torch.zeros(g.numel(), self.ctx.record_width, dtype=torch.float32)
        for lo in range(0, g.numel(), INIT_BLOCK_ROWS):
            hi = min(g.numel(), lo + INIT_BLOCK_ROWS)
            out[lo:hi, : self.dim] = init_embedding_rows(g[lo:hi], self.dim, seed)
        return out

    def _encode_initial_parity(self, n_par: int, seed: int) -> torch.Tensor:
        """Parity of the initial records, computed locally: initial rows are a pure function of global id."""
        p, out, W = self.placement, torch.empty(n_par, self.ctx.record_width), self.ctx.record_width
        blocks = p.parity_rows_on(self.shard)
        # One buffer of members for every block: fresh ones per block cost more in page faults than the xor.
        buf = torch.empty(min(blocks, INIT_BLOCK_ROWS) * p.k, W)
        for j, lo in itertools.product(range(p.r), range(0, blocks, INIT_BLOCK_ROWS)):
            block = torch.arange(lo, min(blocks, lo + INIT_BLOCK_ROWS))
            shards, locals_, present = p.stripe_members(self.shard, block, j)
            g = p.global_id(shards.reshape(-1), locals_.reshape(-1))
            mask = present.reshape(-1)
            recs = buf[: g.numel()].zero_()
            # optimizer state 0 (opt.init_records); absent members 0
            recs[:, : self.dim][mask] = init_embedding_rows(g[mask], self.dim, seed)
            members = recs.view(block.numel(), p.k, -1).transpose(0, 1)
            out[p.parity_index(j, block)] = (
                self.code.encode(members, j) if p.r == 2 else self.code.encode(members)
            )
        return out

    # ---------------------------------------------------------------------------------------------------
    # validation and waiting
    def local_rows(self, g: torch.Tensor, src: int | None = None) -> torch.Tensor:
        p, src = self.placement, self.shard if src is None else src
        if g.numel() == 0:
            return g
        if g.device.type == "cpu" and g.dtype == torch.int64:
            return _local_rows_np(g.numpy(), p.num_servers, src, p.num_rows)
        if not in_range(g, p.num_rows):
            raise InvalidRequest(f"ids: global row ids must be in [0, {p.num_rows})")
        if bool((p.data_shard(g) != src).any()):
            raise InvalidRequest(f"ids: some rows are not owned by shard {src}")
        local = p.local_row(g)
        if not all_unique(local):
            raise InvalidRequest("ids: row ids in one request must be unique (sum duplicate gradients first)")
        return local

    def _check_grads(self, grads: torch.Tensor, n: int) -> None:
        if grads.shape != (n, self.dim):
            raise InvalidRequest(f"grads: expected shape ({n}, {self.dim}), got {tuple(grads.shape)}")
        check_finite(grads, "grads")

    def _check_part(
        self, g: torch.Tensor, grads: torch.Tensor, src: int, dense: dict[int, torch.Tensor] | None
    ) -> tuple[int, torch.Tensor, dict[int, torch.Tensor]]:
        """Validate a part's rows, gradients and dense gradients (a stage, under either commit) before
        anything happens; returns (src, local rows, dense)."""
        src = self.shard if src < 0 else src
        local = self.local_rows(g, src)
        self._check_grads(grads, local.numel())
        dense = dense or {}
        for c, dg in dense.items():
            if dg.shape != (self.chunk_len(c),):
                raise InvalidRequest(f"dense_grads: chunk {c} expects {self.chunk_len(c)} values")
            check_finite(dg, "dense_grads")
        return src, local, dense

    def _admit(self, dense: dict[int, torch.Tensor], epoch: int) -> None:
        """May a stage planned under `epoch` apply here now (its rows, and these dense chunks)? Needs `lock`
        (and may wait for a copy being taken).

        The epoch is checked again here, under the lock, though the servicer checked it on arrival: a
        replacement's rebuild read makes this server adopt a newer epoch and then reads under the lock, and a
        stage planned before it (the worker's map still has the replacement's shard failed, so the worker
        skips that parity server) that took the lock after the read would apply an update whose delta the
        rebuilt parity never gets: every later update of the row was then held there for it, forever."""
        if epoch and epoch < self.epoch:
            raise NotOwner(
                f"stale epoch {epoch}: this server is at epoch {self.epoch}, refresh the cluster map"
            )
        for c in dense:
            if self.dense.stale(c, epoch):
                raise NotOwner(f"dense chunk {c} has a new replica: refresh the cluster map")
        if missing := self.dense.not_ready(dense):
            # A replacement whose copy of the chunk is not here yet: refused at once, never waited for. The
            # copy waits for the surviving replica's dense stages to drain, and the worker commits its stage
            # there only once every part of the pass has answered: waiting here would close a cycle that
            # only a txnTimeout breaks (a 10 s stall at every recovery's start). The worker retries the part
            # on its next pass, when the copy (which holds this step's dense update once the surviving
            # replica committed it) is done.
            raise Busy(f"dense chunk {missing} not copied yet")
        self._wait(lambda: not self.dense.any_copying(dense), "dense chunk being copied")

    def _parity_changed(self) -> None:
        """Parity records, held deltas or refusals changed: wake every waiter. (Needs `lock`.)"""
        self.cond.notify_all()
        self.held_cond.notify_all()

    def _wait(
        self,
        ready: Callable[[], bool],
        what: str,
        timeout: float | None = None,
        cond: threading.Condition | None = None,
    ) -> None:
        """Wait (holding self.lock on return) until ready(); Busy after `timeout` (default wait_timeout).
        `cond`: what wakes it (default `cond`; a wake-up missed costs at most the 0.1 s poll).

        Bounded harm: the wait ends when the caller stops waiting for the answer (its deadline, a
        cancellation), and at most MAX_WAITING requests wait at once."""
        if ready():
            return
        if self.waiting >= MAX_WAITING:
            raise Busy(f"{what}: {self.waiting} requests are waiting already")
        timeout = self.wait_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        caller = CALLER.get()
        if caller is not None and caller.deadline is not None:
            deadline = min(deadline, caller.deadline)
        self.waiting += 1
        try:
            while not ready():
                if caller is not None and not caller.active():
                    raise Cancelled(f"{what}: the caller stopped waiting")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Busy(f"{what}: still busy after {timeout:.2f}s")
                (cond or self.cond).wait(timeout=min(left, 0.1))
        finally:
            self.waiting -= 1
        self.stats["buffered"] += 1

    def _chunk(self, chunk: int) -> torch.Tensor:
        if chunk not in self.dense:
            raise InvalidRequest(f"chunk: dense chunk {chunk} is not held by shard {self.shard}")
        return self.dense.records[chunk]

    def _remember(self, txn: str, outcome: str) -> None:
        self.outcomes[txn] = outcome
        while len(self.outcomes) > 65536:
            self.outcomes.popitem(last=False)


def _local_rows_np(g: np.ndarray, n: int, src: int, num_rows: int) -> torch.Tensor:
    """`local_rows` in numpy: a few µs where the same checks as torch ops cost ~80 µs per request (every
    pull, push and stage; docs/benchmarks.md, "Cheaper row work"). Same checks, same order, same errors."""
    s = np.sort(g)
    if s[0] < 0 or s[-1] >= num_rows:
        raise InvalidRequest(f"ids: global row ids must be in [0, {num_rows})")
    if (g % n != src).any():
        raise InvalidRequest(f"ids: some rows are not owned by shard {src}")
    if (s[1:] == s[:-1]).any():  # one shard: local rows repeat exactly where global ids do
        raise InvalidRequest("ids: row ids in one request must be unique (sum duplicate gradients first)")
    return torch.from_numpy(g // n)


def _model_args(ctx: JobContext) -> tuple:
    m = ctx.model
    return (m.num_dense, m.num_tables, m.dim, list(m.bottom_mlp), list(m.top_mlp))
