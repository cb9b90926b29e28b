"""An in-memory network of `ShardStore`s for deterministic protocol tests: no processes, no sockets, no threads.

`Net` holds one store per shard id and wires them with `LocalPeers`, which implements ecrec.store's `Peers` by
direct method calls on the other stores. A dead shard is one whose store (its memory) was dropped: calls to
it fail with `PeerFailed` as they would over gRPC, and so does anything a dead store still tries to send, so
`kill` acts like a SIGKILL between two protocol steps. Every call between processes (worker -> server and
server -> server) passes through `Net.call`, where hooks (`Net.kill_at`, `Net.on`) can kill a process or
lose a message or its answer at an exact point of the protocol.

`Worker` drives the same update bookkeeping and the same four phases as UpdateDriver.apply
(ecrec.core.update.StepUpdate; docs/protocol.md): stage every part, deliver the deltas to the parity servers,
commit, tell the parity servers. Rows of a failed shard go to their acting home with `src = shard`; a data
server that is gone after its stage was answered has its deltas committed on its behalf. One difference:
it sends each pass's decisions at once (DecideMany) where PSClient lets them ride on its next stage in
normal operation; the store's side of that is tested on its own, and the client's by the real-process runs.
`stage_part` and `commit_part` run those phases for one part by hand.

`logical_model` and `parity_check` are the test oracles: the whole model in placement-independent order, and
invariant I1 (every parity record == encode(members), bit-exact for xor), as PSClient.parity_check.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ecrec.core.codes import make_code
from ecrec.core.recovery import plan_recovery
from ecrec.core.stripes import Read
from ecrec.core.txn import DeltaBatch, RowsBusy
from ecrec.core.update import MapView, Part, StepUpdate
from ecrec.jobctx import JobContext
from ecrec.store import Busy, NotOwner, PeerFailed, ReadResult, ShardStore, Staged
from ecrec.wire import InvalidRequest

WORKER = -1  # caller id of the worker in `Call`s
LOST = object()  # Worker._try: no answer
# What a server's RPC layer turns into a gRPC status: the peer sees an RpcError, i.e. PeerFailed.
REMOTE_ERRORS = (InvalidRequest, NotOwner, Busy, RowsBusy, PeerFailed)


@dataclass
class FakeClock:
    """The stores' wall clock (txnTimeout expiry); moves only when a test says so."""

    t: float = 1_000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass(frozen=True)
class Call:
    """One message: `caller` (a shard id or WORKER) invokes store method `method` on shard `server`.
    Hooks see it twice: phase "before" (raise PeerFailed: the message is lost) and "after" (the server has
    acted; raise PeerFailed: the answer is lost)."""

    method: str
    caller: int
    server: int
    phase: str


Hook = Callable[[Call], None]


def wire_copy(b: DeltaBatch, server: int) -> DeltaBatch:
    """A delta batch as the receiving server sees it: its own tensors, addressed to it."""
    return DeltaBatch(
        server,
        b.txn,
        b.src,
        b.index.clone(),
        b.slot.clone(),
        b.delta.clone(),
        b.version.clone(),
        b.incarnation,
        b.via,
        None if b.base is None else b.base.clone(),
    )


class LocalPeers:
    """`Peers` of server `me` over direct calls through the Net. Remote errors become PeerFailed, as the
    gRPC adapter (server.GrpcPeers) reports every RpcError."""

    def __init__(self, net: Net, me: int):
        self.net, self.me = net, me

    def _call(self, server: int, method: str, *args):
        try:
            return self.net.call(self.me, server, method, *args)
        except REMOTE_ERRORS as e:
            if isinstance(e, PeerFailed) and e.server == server:
                raise
            raise PeerFailed(server, f"{type(e).__name__}: {e}") from e

    def deltas(self, batches: list[DeltaBatch], immediate: bool, epoch: int) -> dict[int, Exception | None]:
        out: dict[int, Exception | None] = {}
        for b in batches:
            try:
                self._call(b.parity_server, "receive_deltas", wire_copy(b, b.parity_server), immediate)
                out.setdefault(b.parity_server, None)
            except PeerFailed as e:
                out[b.parity_server] = e
        return out

    def decide(
        self, servers: list[int], txn: str, src: int, commit: bool, epoch: int
    ) -> dict[int, Exception | None]:
        out: dict[int, Exception | None] = {}
        for s in servers:
            try:
                self._call(s, "decide_deltas", txn, src, commit)
                out[s] = None
            except PeerFailed as e:
                out[s] = e
        return out

    def read_rows(self, requests: list[Read], epoch: int) -> list[ReadResult]:
        return [self._call(r.server, "read_rows", r.kind, r.index.clone(), r.src, r.as_of) for r in requests]

    def dense_copy(self, server: int, chunk: int, epoch: int) -> tuple[torch.Tensor, list[str]]:
        recs, txns = self._call(server, "serve_dense_copy", chunk, epoch)
        return recs.clone(), list(txns)

    def outcome(self, server: int, txn: str) -> str:
        return self._call(server, "outcome", txn)

    def confirm_failed(self, server: int) -> bool:
        return self.net.is_failed(server)  # the coordinator's probe finds the process gone, or not

    def is_failed(self, server: int) -> bool:
        return self.net.is_failed(server)

    def failure_key(self, server: int) -> int:
        return self.net.incarnation[server]

    def is_recovering(self, server: int) -> bool:
        store = self.net.stores.get(server)
        return store is not None and store.replacement and not store.recovery_done()


class Net:
    """One ShardStore per shard id, a cluster map (failed shards, incarnations, epoch) and the wires."""

    def __init__(self, ctx: JobContext, *, wait_timeout: float = 2.0, txn_timeout: float = 5.0):
        self.ctx = ctx
        self.clock = FakeClock()
        self.wait_timeout, self.txn_timeout = wait_timeout, txn_timeout
        self.epoch = 1
        self.incarnation = [1] * ctx.num_servers
        self.failed: set[int] = set()
        self.hooks: list[Hook] = []
        self.stores: dict[int, ShardStore] = {s: self._new_store(s, False) for s in range(ctx.num_servers)}

    def _new_store(self, s: int, replacement: bool) -> ShardStore:
        store = ShardStore(
            self.ctx,
            s,
            LocalPeers(self, s),
            replacement=replacement,
            txn_timeout=self.txn_timeout,
            wait_timeout=self.wait_timeout,
            clock=self.clock,
        )
        store.epoch = self.epoch
        return store

    # -- the cluster map ----------------------------------------------------------------------------------
    def __getitem__(self, s: int) -> ShardStore:
        if s not in self.stores:
            raise KeyError(f"shard {s} is dead")
        return self.stores[s]

    def is_failed(self, s: int) -> bool:
        return s in self.failed

    def view(self) -> MapView:
        return MapView(self.epoch, frozenset(self.failed), dict(enumerate(self.incarnation)))

    def live(self) -> list[int]:
        return sorted(self.stores)

    def _bump_epoch(self) -> None:
        self.epoch += 1
        for store in self.stores.values():
            store.epoch = self.epoch

    def kill(self, s: int) -> None:
        """SIGKILL shard s: its memory is gone; the coordinator marks it failed (epoch + 1)."""
        self.stores.pop(s, None)
        self.failed.add(s)
        self._bump_epoch()

    def replace(self, s: int) -> ShardStore:
        """A replacement registers under shard id s, empty; the map routes s's rows to it again (recovering)."""
        if s in self.stores:
            self.kill(s)
        self.incarnation[s] += 1
        self.failed.discard(s)
        self.stores[s] = self._new_store(s, True)
        self._bump_epoch()
        return self.stores[s]

    def recover(self, s: int, lock_group_rows: int, between: Callable[[int], None] | None = None) -> int:
        """Walk the coordinator's recovery plan on replacement s (dense, data lock groups, parity groups);
        `between(i)` runs after step i, e.g. to apply updates while the rebuild is under way. Returns the
        number of steps."""
        store = self[s]
        steps = plan_recovery(store.num_rows, store.parity.parity.shape[0], lock_group_rows)
        for i, step in enumerate(steps):
            if step.kind == "dense":
                self.call(WORKER, s, "copy_dense")
            elif step.kind == "data":
                self.call(WORKER, s, "rebuild_rows", torch.arange(step.start, step.start + step.count))
            else:
                self.call(WORKER, s, "rebuild_parity", torch.arange(step.start, step.start + step.count))
            if between is not None:
                between(i)
        return len(steps)

    # -- the wires ----------------------------------------------------------------------------------------
    def call(self, caller: int, server: int, method: str, *args, **kwargs):
        """Deliver one message and its answer; PeerFailed if either end is dead or a hook loses it."""
        self._run_hooks(Call(method, caller, server, "before"))
        if caller != WORKER and caller not in self.stores:
            raise PeerFailed(server, f"sender {caller} is dead")  # a killed process sends nothing more
        store = self.stores.get(server)
        if store is None:
            raise PeerFailed(server, "connection refused")
        try:
            out = getattr(store, method)(*args, **kwargs)
        except Exception:
            if self.stores.get(server) is not store:  # it died on the way: the caller sees only that
                raise PeerFailed(server, "died before answering") from None
            raise
        self._run_hooks(Call(method, caller, server, "after"))
        if self.stores.get(server) is not store:
            raise PeerFailed(server, "died before answering")
        return out

    def _run_hooks(self, call: Call) -> None:
        for hook in list(self.hooks):
            hook(call)

    def on(
        self,
        method: str,
        hook: Hook,
        *,
        caller: int | None = None,
        server: int | None = None,
        phase: str = "before",
        nth: int = 1,
    ) -> None:
        """Run `hook` once, at the nth matching call."""
        seen = 0

        def matcher(call: Call) -> None:
            nonlocal seen
            if call.method != method or call.phase != phase:
                return
            if (caller is not None and call.caller != caller) or (
                server is not None and call.server != server
            ):
                return
            seen += 1
            if seen == nth:
                self.hooks.remove(matcher)
                hook(call)

        self.hooks.append(matcher)

    def kill_at(self, method: str, victim: int, **match) -> None:
        """Kill `victim` at the matching call (a fault point), e.g. after its deltas reached a parity server:
        kill_at("receive_deltas", victim=s, caller=s, phase="after")."""
        self.on(method, lambda _call: self.kill(victim), **match)

    def lose_at(self, method: str, **match) -> None:
        """Lose the matching message (phase "before") or its answer (phase "after")."""

        def lose(call: Call) -> None:
            raise PeerFailed(call.server, f"{call.method} lost ({call.phase})")

        self.on(method, lose, **match)

    def staged_total(self) -> int:
        return sum(st.staged_count() for st in self.stores.values())


# ---------------------------------------------------------------------------------------------------------
# the worker
class Worker:
    """Drives the worker-coordinated 2PC of docs/protocol.md over a Net, as UpdateDriver.apply does (the
    same StepUpdate bookkeeping and the same four phases, one message at a time)."""

    def __init__(self, net: Net):
        self.net = net
        self.ctx = net.ctx
        self.p = net.ctx.placement

    def stage(
        self, part: Part, g: torch.Tensor, grads: torch.Tensor, dense_grad: torch.Tensor | None
    ) -> Staged:
        dense = {}
        if part.dense:
            assert dense_grad is not None
            dense = {c: dense_grad[slice(*self.ctx.dense_bounds[c])].clone() for c in part.dense}
        return self.net.call(
            WORKER, part.target, "stage", part.txn, g[part.pos], grads[part.pos].clone(), part.src, dense
        )

    def _try(self, server: int, method: str, *args, tries: int = 2):
        """Call a live server, asking again if the message or its answer was lost; LOST if it never
        answered (dead, or every try was lost)."""
        for _i in range(tries):
            try:
                return self.net.call(WORKER, server, method, *args)
            except PeerFailed:
                if self.net.is_failed(server):
                    break
        return LOST

    def update(
        self,
        step: str,
        g: torch.Tensor,
        grads: torch.Tensor,
        dense_grad: torch.Tensor | None = None,
        attempts: int = 5,
    ) -> None:
        """Apply one step's update exactly once, whatever single failure the Net's hooks inject."""
        holders = (
            [self.ctx.dense_holders(c) for c in range(self.ctx.num_servers)] if dense_grad is not None else []
        )
        update = StepUpdate(step, self.p, g, holders)
        net = self.net
        for _attempt in range(attempts):
            parts = update.plan(net.view())
            if not parts:
                return
            # (1) stage
            staged: list[tuple[Part, list[DeltaBatch]]] = []
            for part in parts:
                try:
                    staged.append((part, self.stage(part, g, grads, dense_grad).batches))
                except PeerFailed:
                    if not net.is_failed(part.target):
                        self._try(part.target, "abort", part.txn)  # it may have staged
                except (Busy, NotOwner, RowsBusy):
                    pass  # busy rows or a stale map: retry the part on the next pass
            # (2) deltas, one message per parity server
            by_server: dict[int, list[DeltaBatch]] = {}
            for _part, batches in staged:
                for b in batches:
                    by_server.setdefault(b.parity_server, []).append(b)
            undelivered = set()
            for server, batches in sorted(by_server.items()):
                if net.is_failed(server):
                    continue
                try:
                    ok = self._try(server, "stage_deltas", [wire_copy(b, server) for b in batches])
                except NotOwner:
                    ok = LOST
                if ok is LOST and not net.is_failed(server):
                    undelivered.add(server)
            # (3) commit
            decisions: dict[int, list[tuple[str, int, bool]]] = {}
            for part, batches in staged:
                if undelivered & {b.parity_server for b in batches}:
                    if self._try(part.target, "abort", part.txn) is LOST:  # it cannot tell them: we do
                        for b in batches:
                            decisions.setdefault(b.parity_server, []).append((part.txn, part.target, False))
                    continue
                outcome = self._try(part.target, "commit", part.txn)
                if outcome is LOST:
                    outcome = "gone" if net.is_failed(part.target) else "aborted"
                if outcome == "unknown":
                    outcome = "gone"
                if outcome == "committed":
                    update.committed(part)
                elif outcome == "gone":
                    update.committed_by_dead_target(part)  # its deltas are committed on its behalf below
                else:
                    continue
                for b in batches:
                    decisions.setdefault(b.parity_server, []).append((part.txn, part.target, True))
            # (4) decisions, one message per parity server (one that misses it asks the data server later)
            for server, ds in sorted(decisions.items()):
                if not net.is_failed(server):
                    self._try(server, "decide_many", ds)
        raise RuntimeError(f"update {step}: not applied after {attempts} attempts")

    def pull(self, g: torch.Tensor) -> torch.Tensor:
        """Embedding rows of unique ids g; rows of a failed shard are degraded reads at their parity servers."""
        out = torch.empty(g.numel(), self.ctx.dim)
        for s, pos, local in self.p.group_by_shard(g):
            if self.net.is_failed(s):
                pservers, _ = self.p.acting_parity(s, local, self.net.failed)
                for ps in pservers.unique().tolist():
                    sub = pos[pservers == ps]
                    out[sub] = self.net.call(WORKER, ps, "degraded_pull", s, g[sub])
            else:
                out[pos] = self.net.call(WORKER, s, "pull", g[pos])
        return out


def stage_part(
    net: Net,
    server: int,
    txn: str,
    g: torch.Tensor,
    grads: torch.Tensor,
    src: int = -1,
    dense: dict | None = None,
    epoch: int = 0,
    lone: bool = False,
) -> Staged:
    """Phases 1 and 2 of one part by hand: stage at `server`, deliver its deltas to the parity servers."""
    staged = net.call(WORKER, server, "stage", txn, g, grads, src, dense or {}, epoch, (), lone)
    for b in staged.batches:
        if not net.is_failed(b.parity_server):
            net.call(WORKER, b.parity_server, "stage_deltas", [wire_copy(b, b.parity_server)])
    return staged


def decide_part(net: Net, txn: str, src: int, staged: Staged, commit: bool) -> list[str]:
    """The worker's decision about a part's deltas at its live parity servers (e.g. on behalf of a dead
    data server)."""
    return [
        net.call(WORKER, b.parity_server, "decide_many", [(txn, src, commit)])[0]
        for b in staged.batches
        if not net.is_failed(b.parity_server)
    ]


def commit_part(net: Net, server: int, txn: str, staged: Staged | None = None) -> str:
    """Phases 3 and 4 of one part by hand: commit at `server`, then tell its parity servers."""
    out = net.call(WORKER, server, "commit", txn)
    if out == "committed" and staged is not None:
        decide_part(net, txn, server, staged, commit=True)
    return out


# ---------------------------------------------------------------------------------------------------------
# oracles
@dataclass
class Model:
    """The logical model: row records and versions in global row order, dense records in parameter order."""

    rows: torch.Tensor  # [G, W]
    versions: torch.Tensor  # [G]
    dense: torch.Tensor  # [D, Wd]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_model(got: Model, want: Model) -> None:
    bad_rows = (bits(got.rows) != bits(want.rows)).any(dim=1).nonzero().squeeze(1)
    assert bad_rows.numel() == 0, (
        f"{bad_rows.numel()} row records differ, first global ids {bad_rows[:8].tolist()}"
    )
    bad_vers = (got.versions != want.versions).nonzero().squeeze(1)
    assert bad_vers.numel() == 0, f"{bad_vers.numel()} row versions differ, first {bad_vers[:8].tolist()}"
    assert same_bits(got.dense, want.dense), "dense records differ"


def logical_model(net: Net) -> Model:
    """Every row record in global order (from its data server) and each dense chunk from its first live
    holder. Needs every shard live with its rows and dense chunks rebuilt."""
    ctx, p = net.ctx, net.ctx.placement
    g = torch.arange(p.num_rows)
    rows = torch.empty(p.num_rows, ctx.record_width)
    versions = torch.empty(p.num_rows, dtype=torch.int64)
    for s, pos, local in p.group_by_shard(g):
        store = net[s]
        assert bool(store.row_ready[local].all()), f"shard {s} has rows not rebuilt yet"
        rows[pos] = store.rows.records[local]
        versions[pos] = store.rows.versions[local]
    dense = []
    for c in range(ctx.num_servers):
        holder = next(h for h in ctx.dense_holders(c) if not net.is_failed(h))
        assert net[holder].dense.ready[c], f"dense chunk {c} not copied yet on {holder}"
        dense.append(net[holder].dense.records[c])
    return Model(rows, versions, torch.cat(dense))


def parity_check(net: Net, lost: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict:
    """Invariant I1 on every parity record: == encode(its members), bit-exact for xor (close for sum).
    `in_flight` counts stripes whose member versions differ from those the parity reflects. `lost`: the
    (records, versions) of failed shards' rows, as a reference says they must be (their parity records died
    with them and are not checked)."""
    ctx, p = net.ctx, net.ctx.placement
    code = make_code(ctx.spec.fault_tolerance.ecrec.code, p.r, p.k)
    stripes = mismatches = in_flight = 0
    bad: list[tuple[int, int]] = []
    lost = lost or {}
    rows_of = {s: (net[s].rows.records, net[s].rows.versions) for s in net.stores} | lost
    for server, j in itertools.product(range(ctx.num_servers), range(p.r)):
        if server in lost:
            continue
        store = net[server]
        assert bool(store.parity.ready.all()), f"server {server} has parity records not rebuilt yet"
        block = torch.arange(store.parity.parity.shape[0] // p.r)
        index = p.parity_index(j, block)  # parity j's records (P, then Q when r = 2)
        shards, locs, present = p.stripe_members(server, block, j)
        members = torch.zeros(p.k, index.numel(), ctx.record_width)
        mvers = torch.zeros(index.numel(), p.k, dtype=torch.int64)
        for s in shards[present].unique().tolist():
            sel = present & (shards == s)
            ri, sj = sel.nonzero(as_tuple=True)
            assert s in lost or bool(net[s].row_ready[locs[ri, sj]].all()), (
                f"shard {s} has rows not rebuilt yet"
            )
            members[sj, ri] = rows_of[s][0][locs[ri, sj]]
            mvers[ri, sj] = rows_of[s][1][locs[ri, sj]]
        expected = code.encode(members, j) if p.r == 2 else code.encode(members)
        got = store.parity.parity[index]
        if code.name in ("xor", "pq"):
            ok = (bits(expected) == bits(got)).all(dim=1)
        else:
            ok = torch.isclose(expected, got, rtol=1e-4, atol=1e-5).all(dim=1)
        settled = (mvers == store.parity.pver[index]).all(dim=1)
        stripes += int(settled.sum())
        in_flight += int((~settled).sum())
        wrong = (settled & ~ok).nonzero().squeeze(1)
        mismatches += wrong.numel()
        bad += [(server, i) for i in index[wrong[:4]].tolist()]
    return {"stripes": stripes, "mismatches": mismatches, "in_flight": in_flight, "bad": bad}


def assert_parity_ok(net: Net, lost: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
    pc = parity_check(net, lost)
    assert pc["stripes"] > 0 and pc["mismatches"] == 0 and pc["in_flight"] == 0, pc


def dense_replica_mismatches(net: Net) -> int:
    """Dense chunks whose live replicas differ in any bit."""
    bad = 0
    for c in range(net.ctx.num_servers):
        first, *rest = [
            net[h].dense.records[c] for h in net.ctx.dense_holders(c) if not net.is_failed(h)
        ] or [None]
        bad += int(not all(same_bits(first, other) for other in rest))
    return bad
