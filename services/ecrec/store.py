"""The state of one parameter server and the protocol steps on it, with the network injected.

`ShardStore` holds the server's tensors — its data row records and their versions, the parity records it
keeps for other servers' stripes, its dense chunks — and runs every protocol step of docs/protocol.md on
them. Each role's state is its own object without I/O (core/txn.py: `DataParticipant` for the rows,
`ParityParticipant` for the parity records; core/dense.py: `DenseReplicas`; core/acting.py: `ActingHome`
for degraded writes of failed shards' rows; core/stripes.py: what a decode or a re-encode reads and what it
gives); the store owns them, the lock, the waits and the calls to peers. Anything that needs another server
goes through `Peers`, so the same code runs over gRPC in a server process and over direct calls in
deterministic in-process tests (`LocalPeers`). One mutex guards the state; it is released while waiting for
peers, and a condition variable wakes requests waiting for busy rows.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch

from ecrec.core.acting import ActingHome
from ecrec.core.codes import make_code
from ecrec.core.dense import DenseReplicas
from ecrec.core.snapshots import ShardSnapshots
from ecrec.core.stripes import Read, ReadResult, SecondFailure, StripeDecode, StripeEncode
from ecrec.core.txn import DataParticipant, DeltaBatch, ParityParticipant, RowLocks
from ecrec.core.update import WorkerFence, step_of, txn_age
from ecrec.core.vec import all_unique, in_range
from ecrec.faults import fault_point
from ecrec.jobctx import JobContext
from ecrec.model import init_dense, init_embedding_rows
from ecrec.rebuild_error import Tap
from ecrec.wire import InvalidRequest, check_finite

INIT_BLOCK_ROWS = 1 << 18  # initialize tables in blocks to bound the temporaries of the hash init
CONSISTENT_READ_TRIES = 200
# How long a stage waits for rows another worker's part holds before answering Busy. Waits follow wait-die
# (ShardStore._wait_rows), so they form no cycle; the bound is for a holder whose worker died (its part
# expires after txnTimeout). Rows locked by a recovery lock group are waited for up to wait_timeout (the
# group finishes on its own).
ROW_LOCK_WAIT = 0.05
REBUILD_TXN = "recovery:"
# How long a part waits for an older part's rows before it answers Busy (wait-die, ShardStore._wait_rows).
# The older part usually commits within a few round trips. Measured on examples/local-small.yaml, k=4, 2
# workers, alternating runs: 0 (die at once) 23.8 RPCs per worker step; 10 ms 22.8; 20 ms 21.0-21.2 and the
# best throughput; 40 ms the same RPCs but slower (a real wait cycle stalls its two workers that long).
YOUNGER_WAIT = 0.02
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


@dataclass
class Staged:
    """A stage's answer: rows staged and, for the server's own rows, the deltas the worker must deliver to
    their parity servers before it commits."""

    rows: int
    batches: list[DeltaBatch]


class PeerFailed(Exception):
    def __init__(self, server: int, detail: str = ""):
        super().__init__(f"server {server} failed: {detail}")
        self.server = server


class Busy(Exception):
    """Rows stayed busy past the wait limit (the worker retries the part)."""


class NotOwner(Exception):
    """The request was routed with an outdated cluster map (the worker refreshes it and retries)."""


class Peers(Protocol):
    """What a server needs from the others. Calls raise PeerFailed if the peer is unreachable."""

    def deltas(
        self, batches: list[DeltaBatch], immediate: bool, epoch: int
    ) -> dict[int, Exception | None]: ...

    def decide(
        self, servers: list[int], txn: str, src: int, commit: bool, epoch: int
    ) -> dict[int, Exception | None]: ...

    def read_rows(
        self, requests: list[tuple[int, str, torch.Tensor, int]], epoch: int
    ) -> list[ReadResult]: ...

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


class ShardStore:
    """One server's tables and protocol state. Thread-safe."""

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
        self.code = make_code(ctx.spec.fault_tolerance.ecrec.code)
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
        n_par = p.parity_rows_on(shard) if p.r else 0
        parity = torch.zeros(n_par, ctx.record_width)
        if n_par and not replacement:
            parity = self._encode_initial_parity(n_par, seed)
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
        self.outcomes: OrderedDict[str, str] = OrderedDict()
        self.stats = {
            "degraded_rows": 0,
            "buffered": 0,
            "rows_recovered": 0,
            "expired_worker_gone": 0,
            "expired_timeout": 0,
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
        out = torch.empty(g.numel(), self.ctx.record_width, dtype=torch.float32)
        for lo in range(0, g.numel(), INIT_BLOCK_ROWS):
            hi = min(g.numel(), lo + INIT_BLOCK_ROWS)
            out[lo:hi] = self.opt.init_records(init_embedding_rows(g[lo:hi], self.dim, seed))
        return out

    def _encode_initial_parity(self, n_par: int, seed: int) -> torch.Tensor:
        """Parity of the initial records, computed locally: initial rows are a pure function of global id."""
        p, out = self.placement, torch.empty(n_par, self.ctx.record_width)
        for lo in range(0, n_par, INIT_BLOCK_ROWS):
            index = torch.arange(lo, min(n_par, lo + INIT_BLOCK_ROWS))
            shards, locals_, present = p.stripe_members(self.shard, index)
            g = p.global_id(shards.reshape(-1), locals_.reshape(-1))
            recs = torch.zeros(g.numel(), self.ctx.record_width)
            mask = present.reshape(-1)
            recs[mask] = self._init_records(g[mask], seed)
            out[lo : lo + index.numel()] = self.code.encode(recs.view(index.numel(), p.k, -1).transpose(0, 1))
        return out

    # ---------------------------------------------------------------------------------------------------
    # validation and waiting
    def local_rows(self, g: torch.Tensor, src: int | None = None) -> torch.Tensor:
        p, src = self.placement, self.shard if src is None else src
        if g.numel() == 0:
            return g
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

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        """Wait (holding self.lock on return) until ready(); Busy after `timeout` (default wait_timeout).

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
                self.cond.wait(timeout=min(left, 0.1))
        finally:
            self.waiting -= 1
        self.stats["buffered"] += 1

    def _chunk(self, chunk: int) -> torch.Tensor:
        if chunk not in self.dense:
            raise InvalidRequest(f"chunk: dense chunk {chunk} is not held by shard {self.shard}")
        return self.dense.records[chunk]

    def _wait_rows(
        self, locks: RowLocks, rows: torch.Tensor, txn: str, what: str, lone: bool = False
    ) -> None:
        """Wait for rows held by others: longer for a recovery lock group; for another worker's part, under
        wait-die (docs/protocol.md, "Hot rows"): past a short grace (YOUNGER_WAIT), a part waits only for
        younger holders (txn_age), or when it is `lone` — its worker holds no other part anywhere, so nothing
        can be waiting for it. Otherwise it answers Busy and its worker retries it once its other parts are
        decided. Past the grace, waits only go from older to younger parts or from parts nobody waits for:
        no cycle, so two workers staging the same hot rows on two servers in opposite orders stall each
        other for the grace at most, not until ROW_LOCK_WAIT runs out."""
        if not locks.busy(rows, txn):
            return  # the usual case: nothing to wait for, and no need to learn who holds what
        self._wait(lambda: not any(h.startswith(REBUILD_TXN) for h in locks.holders_of(rows)), what)
        if lone:
            self._wait(lambda: not locks.busy(rows, txn), what, timeout=ROW_LOCK_WAIT)
            return
        try:  # most holders commit soon; one that is waiting for this worker's rows elsewhere does not
            self._wait(lambda: not locks.busy(rows, txn), what, timeout=YOUNGER_WAIT)
            return
        except Busy:
            pass
        age = txn_age(txn)

        def free() -> bool:
            holders = locks.holders_of(rows) - {txn}
            if any(txn_age(h) <= age for h in holders):
                raise Busy(
                    f"{what}: held by an older part (wait-die: retried once this worker's others are decided)"
                )
            return not holders

        self._wait(free, what, timeout=ROW_LOCK_WAIT)

    def _remember(self, txn: str, outcome: str) -> None:
        self.outcomes[txn] = outcome
        while len(self.outcomes) > 65536:
            self.outcomes.popitem(last=False)

    # ---------------------------------------------------------------------------------------------------
    # reads
    def pull(self, g: torch.Tensor) -> torch.Tensor:
        local = self.local_rows(g)
        self.ensure_rows(local)
        with self.lock:
            self.snapshots.read(local)
            return self.rows.records[:, : self.dim].index_select(0, local)

    def pull_dense(self, chunk: int) -> torch.Tensor:
        self._chunk(chunk)
        with self.lock:
            self._wait(lambda: self.dense.ready[chunk], f"dense chunk {chunk} not copied yet")
            return self.dense.values(chunk)

    def chunk_len(self, chunk: int) -> int:
        return self._chunk(chunk).shape[0]

    def read(self, kind: str, start: int, count: int, chunk: int = 0) -> torch.Tensor:
        table = {
            "data": lambda: self.rows.records,
            "parity": lambda: self.parity.parity,
            "dense": lambda: self._chunk(chunk),
        }[kind]()
        n = table.shape[0]
        if start > n:
            raise InvalidRequest(f"start: {start} is past the end ({n} records)")
        end = n if count == 0 else min(n, start + count)
        with self.lock:
            return table[start:end].clone()

    def read_rows(self, kind: str, index: torch.Tensor, src: int = -1) -> ReadResult:
        """Records with versions. PARITY reads for rebuilding shard `src` wait for its undecided deltas; DATA
        reads with `src >= 0` (re-encoding parity) wait until none of the rows is staged."""
        if kind == "data":
            if not in_range(index, self.num_rows):
                raise InvalidRequest("index: local rows out of range")
            with self.lock:
                if src >= 0:  # re-encoding parity: no staged update may slip between this read and its commit
                    self._wait(lambda: not self.rows.locks.busy(index), "rows staged by a txn")
                if not bool(self.row_ready[index].all()):
                    raise NotOwner(f"rows of shard {self.shard} not rebuilt yet")
                return ReadResult(self.rows.records[index].clone(), self.rows.versions[index].clone())
        n_par = self.parity.parity.shape[0]
        if not in_range(index, n_par):
            raise InvalidRequest("index: parity indices out of range")
        with self.lock:
            if src >= 0:
                self._wait(lambda: not self._undecided_from(src, index), f"deltas of shard {src}")
            return ReadResult(
                self.parity.parity[index].clone(),
                self.parity.pver[index].clone(),
                self.parity.ready[index].clone(),
            )

    def _undecided_from(self, src: int, index: torch.Tensor) -> bool:
        """Any update of shard `src`'s rows in flight on these parity indices? (A staged delta of src, or a
        degraded write this server is running for src, possibly still decoding.)"""
        for _txn, idx, _slot in self.parity.staged_members(src) + self.parity.held_members(src):
            if bool(torch.isin(idx, index).any()):
                return True
        if self.acting.writing(src):
            shards, locs, present = self.placement.stripe_members(self.shard, index)
            rows = locs[(shards == src) & present]
            if rows.numel() and self.acting.busy(src, rows):
                return True
        return False

    # ---------------------------------------------------------------------------------------------------
    # decoding (degraded reads, acting-home writes, recovery)
    def decode_rows(self, src: int, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Records and versions of shard src's rows, decoded from their stripes (consistent cut). The
        parity records and the other members are read in one round (ecrec.core.stripes); stripes a commit
        was crossing are read again."""
        out = torch.empty(local.numel(), self.ctx.record_width)
        vers = torch.empty(local.numel(), dtype=torch.int64)
        todo = torch.arange(local.numel())
        # Only the replacement rebuilding its own rows must wait for src's in-flight updates to settle; a
        # degraded read or write at the acting home reads committed state (and holds the row lock itself).
        plan = StripeDecode(self.placement, src, local, wait_src=src if src == self.shard else -1)
        for _attempt in range(CONSISTENT_READ_TRIES):
            try:
                decoded, versions, consistent = plan.decode(
                    self.code, self.ctx.record_width, self._read_many(plan.reads)
                )
            except SecondFailure as e:
                raise PeerFailed(-1, str(e)) from e
            if not self.code.exact:  # rounding may leave state outside its domain (docs/protocol.md)
                decoded = self.opt.project(decoded, self.dim)
            out[todo[consistent]] = decoded[consistent]
            vers[todo[consistent]] = versions[consistent]
            todo = todo[~consistent]
            if todo.numel() == 0:
                if self.tap is not None:
                    self.tap.decoded(src, local, vers, out)
                return out, vers
            plan = plan.rest(consistent)
            time.sleep(0.002)  # a commit is between a member and its parity server: read again
        raise Busy(f"could not read a consistent cut of {todo.numel()} stripes")

    def _read_many(self, reads: list[Read]) -> list[ReadResult]:
        """Reads from peers, all at once; reads addressed to this server are served locally."""
        out: list[ReadResult | None] = [None] * len(reads)
        remote = [(i, r) for i, r in enumerate(reads) if r.server != self.shard]
        for i, r in enumerate(reads):
            if r.server == self.shard:
                out[i] = self.read_rows(r.kind, r.index, r.src)
        if remote:
            requests = [(r.server, r.kind, r.index, r.src) for _i, r in remote]
            for (i, _r), res in zip(remote, self.peers.read_rows(requests, self.epoch), strict=True):
                out[i] = res
        return out  # type: ignore[return-value]

    def degraded_pull(self, src: int, g: torch.Tensor) -> torch.Tensor:
        local = self.local_rows(g, src)
        self._check_acting(src, local)
        recs, _v = self.lost_rows(src, local)
        self.stats["degraded_rows"] += local.numel()
        return recs[:, : self.dim]

    def lost_rows(self, src: int, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed records and versions of failed shard src's rows: materialized ones from the acting
        home's cache, the rest decoded (and materialized)."""

        def reflected() -> torch.Tensor:  # the versions the parity records reflect for these rows
            _, pindex = self.placement.parity_of(src, local)
            return self.parity.pver[pindex, self.placement.stripe_of(src, local)[1]]

        if local.numel() == 0:
            return torch.empty(0, self.ctx.record_width), torch.empty(0, dtype=torch.int64)
        with self.lock:
            seen = self.acting.lookup(src, local, reflected)
            if seen.cache is not None and bool(seen.hit.all()):
                return seen.cache.records[local].clone(), seen.cache.versions[local].clone()
        miss = (~seen.hit).nonzero().squeeze(1)
        recs = torch.empty(local.numel(), self.ctx.record_width)
        vers = torch.empty(local.numel(), dtype=torch.int64)
        recs[miss], vers[miss] = self.decode_rows(src, local[miss])
        with self.lock:
            self.acting.materialize(src, local, seen, recs, vers)
        return recs, vers

    def _check_acting(self, src: int, local: torch.Tensor) -> None:
        if src == self.shard or not self.peers.is_failed(src):
            with self.lock:
                self.acting.forget(src)
            raise NotOwner(f"shard {src} is not failed in this server's cluster map (epoch {self.epoch})")
        pserver, _ = self.placement.parity_of(src, local)
        if bool((pserver != self.shard).any()):
            raise InvalidRequest(
                f"ids: this server is not the parity server of all these rows of shard {src}"
            )
        key = getattr(self.peers, "failure_key", None)
        key = key(src) if key is not None else None
        with self.lock:
            self.acting.begin(src, key)

    # ---------------------------------------------------------------------------------------------------
    # recovery of a replacement
    def ensure_rows(self, local: torch.Tensor) -> None:
        """Rebuild on demand any of these rows that recovery has not reached yet."""
        if not self.replacement or bool(self.row_ready[local].all()):
            return
        self.rebuild_rows(local)

    def rebuild_rows(self, local: torch.Tensor) -> int:
        """Rebuild one lock group: lock, gather + decode, install, unlock (queued requests then run)."""
        group = f"{REBUILD_TXN}{id(local)}:{time.monotonic_ns()}"
        with self.lock:
            # Only rows not rebuilt yet: they can be locked by another group, never staged (a stage rebuilds
            # its rows first). Rows already rebuilt may be staged by a worker's part, and a pull that also
            # needs some rows rebuilt must not wait for that part's commit.
            self._wait(lambda: not self.rows.locks.busy(local[~self.row_ready[local]]), "rows being rebuilt")
            todo = local[~self.row_ready[local]]
            if todo.numel() == 0:
                return 0
            self.rows.locks.lock(group, todo)
        try:
            recs, vers = self.decode_rows(self.shard, todo)
            fault_point("recover:mid_group")
            with self.lock:
                self.rows.records[todo] = recs
                self.rows.versions[todo] = vers
                self.row_ready[todo] = True
                self.stats["rows_recovered"] += todo.numel()
        finally:
            with self.lock:
                self.rows.locks.unlock(group)
                self.cond.notify_all()
        fault_point("recover:after_group")
        return todo.numel()

    def rebuild_parity(self, index: torch.Tensor) -> int:
        """Re-encode parity records from their members' current records (versions make the cut exact)."""
        with self.lock:
            self._wait(lambda: not bool(self.parity_rebuilding[index].any()), "parity records being rebuilt")
            index = index[~self.parity.ready[index]]
            if index.numel() == 0:
                return 0
            self.parity_rebuilding[index] = True
        try:
            plan = StripeEncode(
                self.placement, self.shard, index
            )  # its reads wait for staged rows: read_rows
            records, vers = plan.encode(self.code, self.ctx.record_width, self._read_many(plan.reads))
            with self.lock:
                self.parity.install(index, records, vers)
        finally:
            with self.lock:
                self.parity_rebuilding[index] = False
                self.cond.notify_all()
        return index.numel()

    def copy_dense(self) -> int:
        """Copy the replicated chunks from the surviving replica; skip txns the copy already contains."""
        n = 0
        for c in list(self.dense.records):
            with self.lock:
                self._wait(lambda c=c: c not in self.dense_copying_in, f"dense chunk {c} being copied")
                if self.dense.ready[c]:
                    continue
                self.dense_copying_in.add(c)
            try:
                other = [h for h in self.ctx.dense_holders(c) if h != self.shard][0]
                recs, txns = self.peers.dense_copy(other, c, self.epoch)
                with self.lock:
                    self.dense.install(c, recs, txns)
            finally:
                with self.lock:
                    self.dense_copying_in.discard(c)
                    self.cond.notify_all()
            n += recs.shape[0]
        return n

    def serve_dense_copy(self, chunk: int, epoch: int) -> tuple[torch.Tensor, list[str]]:
        """The surviving replica's side of copy_dense: from now on reject dense stages older than `epoch`."""
        self._chunk(chunk)
        with self.lock:
            # New stages of the chunk wait from here, so the ones in flight can drain.
            self.dense.begin_copy(chunk, epoch)
            try:
                self._wait(lambda: not self.dense.in_flight(chunk), "dense txns in flight")
                return self.dense.copy_out(chunk)
            finally:
                self.dense.end_copy(chunk)
                self.cond.notify_all()

    def staged_count(self) -> int:
        """Undecided 2PC state on this server (parts, acting parts, parity deltas, dense stages)."""
        with self.lock:
            return len(self.rows.staged) + len(self.acting) + len(self.parity.staged) + len(self.dense.staged)

    def recovery_done(self) -> bool:
        return bool(self.row_ready.all()) and bool(self.parity.ready.all()) and self.dense.all_ready()

    # ---------------------------------------------------------------------------------------------------
    # checkpoints (strategies checkpoint, checknrun, cpr: docs/protocol.md, "Checkpoint strategies")
    def checkpoint_tensors(self, checkpoint: int = 0, base: int | None = None) -> dict[str, torch.Tensor]:
        """A copy of this shard's state (ecrec.core.snapshots): workers are paused for a checkpoint, so
        nothing is in flight and the copy is a consistent cut."""
        with self.lock:
            return self.snapshots.copy(
                self.rows.records, self.rows.versions, self.dense.records, checkpoint, base
            )

    def hot_tensors(self) -> dict[str, torch.Tensor]:
        """cpr: a copy of the hot rows and every dense chunk, taken while training goes on."""
        with self.lock:
            return self.snapshots.hot_copy(self.rows.records, self.rows.versions, self.dense.records)

    def _initial_tensors(self) -> dict[str, torch.Tensor]:
        """The state the job starts from (a pure function of the seed), for a restore with no checkpoint yet."""
        seed = self.ctx.spec.training.seed
        out = {
            "rows": self._init_records(
                self.placement.global_id(self.shard, torch.arange(self.num_rows)), seed
            ),
            "versions": torch.zeros(self.num_rows, dtype=torch.int64),
        }
        flat = init_dense(*_model_args(self.ctx), seed=seed)
        for c in self.dense.records:
            lo, hi = self.ctx.dense_bounds[c]
            out[f"dense.{c}"] = self.opt.init_records(flat[lo:hi].reshape(-1, 1).clone())
        return out

    def load_checkpoint(
        self,
        tensors: dict[str, torch.Tensor] | None,
        *increments: dict[str, torch.Tensor],
        base: int | None = None,
    ) -> int:
        """Replace this shard's whole state with a checkpoint's (None: the initial state), then apply the rows
        (and dense chunks) of `increments` in order: checknrun's increment, cpr's hot-row saves. Returns the
        data rows loaded. A checkpoint of another shape is refused and changes nothing."""
        expect = {"rows": (self.num_rows, self.ctx.record_width), "versions": (self.num_rows,)}
        expect |= {f"dense.{c}": tuple(recs.shape) for c, recs in self.dense.records.items()}
        t = self.snapshots.merge(self._initial_tensors() if tensors is None else tensors, increments, expect)
        with self.lock:
            self.rows.records.copy_(t["rows"])
            self.rows.versions.copy_(t["versions"])
            for c in self.dense.records:
                self.dense.install(c, t[f"dense.{c}"].clone())
            self.row_ready.fill_(True)
            self.snapshots.loaded(base, t["modified"])
            self.replacement = False
            self.outcomes.clear()
            self.cond.notify_all()
        return self.num_rows

    # ---------------------------------------------------------------------------------------------------
    # updates without 2PC (strategy none, or twoPhaseCommit: false)
    def push(self, g: torch.Tensor, grads: torch.Tensor, txn: str = "") -> int:
        local = self.local_rows(g)
        self._check_grads(grads, local.numel())
        self.ensure_rows(local)
        txn = txn or f"push:{time.monotonic_ns()}"
        with self.lock:
            self._wait(lambda: not self.rows.locks.busy(local), "rows staged by another txn")
            part = self.rows.stage(txn, local, grads, self.clock())
            self.rows.commit(txn)  # applied at once; rows stay locked until the parity has the delta
            self.rows.locks.lock(txn, local)
            self.snapshots.written(local)
        try:
            self._send_deltas(part.batches, immediate=True)
        finally:
            with self.lock:
                self.rows.locks.unlock(txn)
                self.cond.notify_all()
        return local.numel()

    def push_dense(self, chunk: int, grads: torch.Tensor) -> None:
        recs = self._chunk(chunk)
        if grads.shape != (recs.shape[0], 1):
            grads = grads.reshape(-1, 1)
        check_finite(grads, "grads")
        with self.lock:
            self._wait(lambda: self.dense.ready[chunk], "dense chunk not copied yet")
            self.dense.apply_now(chunk, grads)

    def _send_deltas(self, batches: list[DeltaBatch], immediate: bool) -> None:
        """Deliver deltas; a parity server that fails is confirmed with the coordinator, then skipped."""
        pending = [b for b in batches if not self.peers.is_failed(b.parity_server)]
        for _attempt in range(10):
            if not pending:
                return
            errors = self.peers.deltas(pending, immediate, self.epoch)
            retry = []
            for b in pending:
                if errors.get(b.parity_server) is None:
                    continue
                if not self.peers.confirm_failed(b.parity_server):
                    retry.append(b)  # alive after all (a transient error): send again
            pending = retry
        raise PeerFailed(pending[0].parity_server, "deltas not delivered")

    # ---------------------------------------------------------------------------------------------------
    # two-phase commit
    def stage(
        self,
        txn: str,
        g: torch.Tensor,
        grads: torch.Tensor,
        src: int = -1,
        dense: dict[int, torch.Tensor] | None = None,
        epoch: int = 0,
        decisions: list[tuple[str, int, bool]] = (),
        lone: bool = False,
    ) -> Staged:
        """Phase 1 of a part (docs/protocol.md): stage the new records; the answer carries the deltas for the
        worker to deliver to the parity servers (nothing is sent from here). The worker's decisions about
        earlier parts, for which this server is a parity server, ride along: they are applied first, before
        this stage can wait for anything that might be waiting for them. `lone`: the worker stages nothing
        else while this waits (see _wait_rows)."""
        src = self.shard if src < 0 else src
        local = self.local_rows(g, src)
        self._check_grads(grads, local.numel())
        dense = dense or {}
        for c, dg in dense.items():
            if dg.shape != (self.chunk_len(c),):
                raise InvalidRequest(f"dense_grads: chunk {c} expects {self.chunk_len(c)} values")
            check_finite(dg, "dense_grads")
        if decisions:  # checked above; applied before this stage can wait for anything
            self.decide_many(list(decisions))
        if src != self.shard:
            return Staged(self._stage_acting(txn, src, local, grads, lone), [])
        self.ensure_rows(local)
        with self.lock:
            if txn in self.outcomes:
                raise Busy(f"txn {txn} was already {self.outcomes[txn]}")
            for c in dense:
                if self.dense.stale(c, epoch):
                    raise NotOwner(f"dense chunk {c} has a new replica: refresh the cluster map")
            if missing := self.dense.not_ready(dense):
                # A replacement whose copy of the chunk is not here yet: refused at once, never waited for.
                # The copy waits for the surviving replica's dense stages to drain, and the worker commits
                # its stage there only once every part of the pass has answered: waiting here would close
                # a cycle that only a txnTimeout breaks (a 10 s stall at every recovery's start). The worker
                # retries the part on its next pass, when the copy (which holds this step's dense update
                # once the surviving replica committed it) is done.
                raise Busy(f"dense chunk {missing} not copied yet")
            self._wait(lambda: not self.dense.any_copying(dense), "dense chunk being copied")
            if txn not in self.rows.staged:
                self._wait_rows(self.rows.locks, local, txn, "rows staged by another txn", lone)
            part = self.rows.stage(txn, local, grads, self.clock())  # a retried stage gets the same part
            self.dense.stage(txn, step_of(txn), dense)
        fault_point("stage:after_local")
        return Staged(local.numel(), list(part.batches))

    def _stage_acting(
        self, txn: str, src: int, local: torch.Tensor, grads: torch.Tensor, lone: bool = False
    ) -> int:
        """Phase 1 of a degraded write: this parity server stands in for failed shard src's rows. Rows
        another worker's degraded write holds are waited for under wait-die, like a data server's
        (_wait_rows): two workers' degraded writes of hot rows at two acting homes would otherwise each wait
        for the other until ROW_LOCK_WAIT ran out."""
        with self.lock:
            if txn in self.acting:  # a retried stage gets the same answer, staged once
                return local.numel()
            if txn in self.outcomes:
                raise Busy(f"txn {txn} was already {self.outcomes[txn]}")
        self._check_acting(src, local)
        p = self.placement
        with self.lock:
            while True:
                # the dead server's own undecided deltas: decided by their workers (or on expiry), soon
                self._wait(
                    lambda: not self._staged_from_rows(src, local),
                    "rows of a failed shard with an undecided update of its own",
                    timeout=ROW_LOCK_WAIT,
                )
                if (locks := self.acting.locks.get(src)) is not None:
                    self._wait_rows(locks, local, txn, "rows of a failed shard staged by another txn", lone)
                if not self._staged_from_rows(src, local):  # none came back while this waited
                    break
            # Checked again under the lock (the wait released it): a replacement's rebuild may have read
            # these rows' parity since, and must not miss a write that starts after its read.
            if not self.peers.is_failed(src):
                raise NotOwner(f"shard {src} has a replacement now (epoch {self.epoch}): refresh the map")
            self.acting.lock(txn, src, local)
        try:
            old, vers = self.lost_rows(src, local)
        except Exception:
            with self.lock:
                self.acting.unlock(txn, src)
                self.cond.notify_all()
            raise
        new = self.opt.apply(old, grads)
        _, index = p.parity_of(src, local)
        slot = p.stripe_of(src, local)[1]
        batch = DeltaBatch(self.shard, txn, src, index, slot, self.code.delta(old, new), vers + 1)
        with self.lock:
            self.parity.stage(batch)
            self.acting.stage(txn, src, local, new, vers + 1, self.clock())
            self.stats["degraded_rows"] += local.numel()
        fault_point("acting:after_stage")
        return local.numel()

    def _staged_from_rows(self, src: int, local: torch.Tensor) -> bool:
        """Does failed shard src still have an undecided delta (staged before it died) on these rows, or a
        committed one held until its predecessor is applied?"""
        k = self.placement.k
        for txn, idx, slot in self.parity.staged_members(src) + self.parity.held_members(src):
            if txn in self.acting:
                continue
            if bool(torch.isin(idx * k + slot, local).any()):
                return True
        return False

    def commit(self, txn: str) -> str:
        """Phase 2 at the data server, the part's decision point: apply the staged records (and dense
        chunks) and release the rows. The worker then tells the parity servers; a parity server that never
        hears asks here (outcome)."""
        with self.lock:
            if txn in self.outcomes:
                return self.outcomes[txn]
            write = self.acting.commit(txn)
            if write is not None:
                self.parity.commit(txn, write.src)
                self._remember(txn, "committed")
                self.cond.notify_all()
                return "committed"
            part = self.rows.staged.get(txn)
            if part is None and txn not in self.dense.staged:
                return "unknown"
            if part is not None:
                self.rows.commit(txn)
            self.dense.commit(txn, step_of(txn))
            self._remember(txn, "committed")
            self.cond.notify_all()
        fault_point("commit:after_apply")
        return "committed"

    def outcome(self, txn: str) -> str:
        """What this data server decided about a part: committed, aborted, staged (undecided) or unknown."""
        with self.lock:
            if txn in self.outcomes:
                return self.outcomes[txn]
            if txn in self.rows.staged or txn in self.dense.staged or txn in self.acting:
                return "staged"
            return "unknown"

    def abort(self, txn: str) -> str:
        """Undo a staged part. A txn this server never staged answers "unknown" and leaves no trace: a
        stray abort must not decide the fate of a part that has not arrived yet."""
        with self.lock:
            if txn in self.outcomes:
                return self.outcomes[txn]
            if txn not in self.acting and txn not in self.rows.staged and txn not in self.dense.staged:
                return "unknown"
            write = self.acting.abort(txn)
            if write is not None:
                self.parity.abort(txn, write.src)
            part = self.rows.abort(txn)
            self.dense.abort(txn)
            self._remember(txn, "aborted")
            self.cond.notify_all()
        if part is not None:
            self._decide(list(part.parity_servers), txn, commit=False)
        return "aborted"

    def _decide(self, servers: list[int], txn: str, commit: bool) -> None:
        live = [s for s in servers if not self.peers.is_failed(s)]
        for _attempt in range(10):
            if not live:
                return
            errors = self.peers.decide(live, txn, self.shard, commit, self.epoch)
            live = [s for s in live if errors.get(s) is not None and not self.peers.confirm_failed(s)]

    def decide_deltas(self, txn: str, src: int, commit: bool) -> str:
        """A parity server's side of a decision about (txn, src)'s staged deltas."""
        with self.lock:
            if src in self.acting.cache and commit and (txn, src) in self.parity.staged:
                # A dead server's own update committed on its behalf changes its lost rows: forget them.
                k = self.placement.k
                self.acting.invalidate(
                    src, torch.cat([b.index * k + b.slot for b in self.parity.staged[(txn, src)]])
                )
            out = self.parity.commit(txn, src) if commit else self.parity.abort(txn, src)
            self.cond.notify_all()
        fault_point("decide:after_apply")
        return out

    def receive_deltas(self, batch: DeltaBatch, immediate: bool) -> None:
        """Deltas of another server's rows (from the worker, or from the data server without 2PC)."""
        self.stage_deltas([batch], immediate)

    def check_deltas(self, b: DeltaBatch) -> None:
        """A delta batch must come from a data shard whose parity this server holds, for the parity indices
        and stripe slots that placement gives that shard's rows here."""
        p, n = self.placement, self.ctx.num_servers
        if b.parity_server != self.shard or b.src == self.shard or not 0 <= b.src < n:
            raise InvalidRequest(
                f"deltas: batch for server {b.parity_server} from {b.src} sent to {self.shard}"
            )
        if b.index.numel() == 0:
            return
        lo, hi = b.index.aminmax()
        if int(lo) < 0 or int(hi) >= self.parity.parity.shape[0]:
            raise InvalidRequest("index: parity indices out of range")
        if int(b.version.min()) < 1:
            raise InvalidRequest("version: a delta takes its row to version 1 or later")
        # The closed form of placement.stripe_members for one source (a hot path: every delta message):
        # every stripe whose parity this server holds has its member of shard src at the same slot, and that
        # member is a real row (not padding) up to some parity index.
        slot = (b.src - (self.shard - p.k) % n) % n
        if bool((b.slot != slot).any()):
            lo, hi = b.slot.aminmax()
            if int(lo) < 0 or int(hi) >= p.k:
                raise InvalidRequest(f"slot: stripe slots are in [0, {p.k})")
            raise InvalidRequest(f"index: not parity records of shard {b.src}'s rows on server {self.shard}")
        if slot >= p.k or int(hi) * p.k + slot >= p.rows_on(b.src):
            raise InvalidRequest(f"index: not parity records of shard {b.src}'s rows on server {self.shard}")

    def stage_deltas(self, batches: list[DeltaBatch], immediate: bool = False) -> None:
        """Stage (or, without 2PC, apply) deltas of other servers' rows."""
        for b in batches:  # all checked before any is staged
            self.check_deltas(b)
        with self.lock:
            if not immediate:
                # Deltas of a part its data server staged before it died, delivered only after this server
                # learned of the failure: a degraded write of the same rows may be staged here already,
                # built on the version these deltas also build on, and only one of two such updates can
                # reach the record (the other would be skipped as a duplicate, while the acting home's
                # materialized rows hold it). Refused; the worker aborts the part and retries it as a
                # degraded write. Deltas that arrived before the failure are staged, and degraded writes
                # of their rows wait for their decision (_staged_from_rows).
                gone = sorted({b.src for b in batches if self.peers.is_failed(b.src)})
                if gone:
                    raise NotOwner(
                        f"deltas: shard {gone[0]} is failed in this server's cluster map (epoch {self.epoch}):"
                        " retry the part as a degraded write"
                    )
            now = self.clock()
            for b in batches:
                if immediate:
                    self.parity.apply_now(b)
                else:
                    self.parity.stage(b, now)
            self.cond.notify_all()
        fault_point("delta:after_stage")

    def decide_many(self, decisions: list[tuple[str, int, bool]]) -> list[str]:
        """Decisions about staged deltas, (txn, src, commit) each, in one message from the worker. Commits
        are applied together (ParityParticipant.commit_many) unless an abort is among them or this server
        stands in for one of their data servers (its materialized rows must see each one)."""
        with self.lock:
            if all(commit and src not in self.acting.cache for _t, src, commit in decisions):
                out = self.parity.commit_many([(txn, src) for txn, src, _c in decisions])
                self.cond.notify_all()
            else:
                out = None
        if out is None:
            return [self.decide_deltas(txn, src, commit) for txn, src, commit in decisions]
        fault_point("decide:after_apply")
        return out

    def fence_workers(self, gone: dict) -> bool:
        """The coordinator's word on which worker processes are gone (rank -> newest incarnation gone); True
        if it names one not known before: then `expire` has work to do now."""
        with self.lock:
            return self.fence.update(gone)

    def expire(self) -> list[str]:
        """Resolve what a dead worker left undecided (I4): abort its parts staged here, and settle deltas
        staged here by asking their data server what it decided. A worker is known dead when its part has
        waited `txn_timeout` for a decision, or at once when the coordinator says its process is gone (the
        fence): its staged rows would otherwise hold up every worker that needs them until the timeout."""
        with self.lock:
            now = self.clock()
            gone = self.fence.fenced
            stale = list(self.rows.expired(now, self.txn_timeout, gone))
            # degraded writes whose worker died expire too, or the failed shard's rows would stay locked
            stale += self.acting.expired(now, self.txn_timeout, gone)
            undecided = [
                (key, now - self.parity.staged_at[key])
                for key in self.parity.expired(now, self.txn_timeout, gone)
                if key[0] not in self.acting  # this server's own degraded writes: aborted above
            ]
            reasons = {txn: "expired_worker_gone" if gone(txn) else "expired_timeout" for txn in stale}
        for txn in stale:
            if self.abort(txn) == "aborted":
                with self.lock:
                    self.stats[reasons[txn]] += 1
        for (txn, src), age in undecided:
            self._settle(txn, src, age)
        if self.ctx.spec.fault_tolerance.ecrec.two_phase_commit:  # without 2PC deltas are never staged here
            with self.lock:
                if self.parity.drop_orphans():
                    self.cond.notify_all()
        return stale

    def _settle(self, txn: str, src: int, age: float) -> None:
        """A delta no worker decided: its data server's outcome decides. If that server is gone, the worker
        that staged the part decides on its behalf; if nobody has after three timeouts, nobody will (the
        worker died too) and dropping the delta is consistent, as the data server's records are gone."""
        answer = "unknown"
        if not self.peers.is_failed(src):
            try:
                answer = self.peers.outcome(src, txn)
            except PeerFailed:
                answer = "unknown"
        if answer == "unknown":
            with self.lock:  # a later delta of one of its rows from src proves src committed it
                if self.parity.proves_commit(txn, src, exclude=self.acting.staged):
                    answer = "committed"
        if answer == "committed":
            self.decide_deltas(txn, src, True)
        elif answer == "aborted" or (answer == "unknown" and age > 3 * self.txn_timeout):
            self.decide_deltas(txn, src, False)


def _model_args(ctx: JobContext) -> tuple:
    m = ctx.model
    return (m.num_dense, m.num_tables, m.dim, list(m.bottom_mlp), list(m.top_mlp))
