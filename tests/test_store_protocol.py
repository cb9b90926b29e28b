"""The ECRec protocol on in-memory servers (tests/netsim.py): 2PC updates, failures at every protocol step,
degraded reads and writes, recovery lock group by lock group, and txnTimeout expiry (docs/protocol.md).

Every scenario runs next to a twin Net that applies the same updates without failures; xor parity makes the
outcome a pure function of the updates, so "a server failed and was rebuilt" must end bit-identical to the
twin (I2), with every parity record equal to the encoding of its stripe (I1) and no 2PC state left (I4).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ecrec.core.update import WorkerFence, txn_age, txn_worker
from ecrec.jobctx import JobContext
from ecrec.store import Busy, NotOwner, PeerFailed
from ecrec.store import participant as store_mod
from tests.conftest import make_ctx
from tests.netsim import (
    WORKER,
    Model,
    Net,
    Part,
    Worker,
    assert_parity_ok,
    assert_same_model,
    bits,
    commit_part,
    decide_part,
    dense_replica_mismatches,
    logical_model,
    parity_check,
    same_bits,
    stage_part,
    wire_copy,
)

N, K = 5, 4
Update = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]


def ecrec_ctx(name: str = "netsim", **extra) -> JobContext:
    # netsim's Worker drives the two-phase commit (rowLocks); deltaLog's steps are tests/test_delta_log.py's
    extra.setdefault("faultTolerance__ecrec__commit", "rowLocks")
    return make_ctx(
        name, faultTolerance__strategy="ecrec", servers__replicas=N, faultTolerance__ecrec__k=K, **extra
    )


@pytest.fixture(scope="module")
def ctx() -> JobContext:
    return ecrec_ctx()


# These tensors are tiny: torch's intra-op thread pool costs ~10x more than it saves on them here.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_updates(ctx: JobContext, n: int, seed: int, cold: int = 200) -> list[Update]:
    """Worker steps: a hot set of rows touched by every step (versions climb, I3) plus random cold rows."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        hot = torch.randperm(120, generator=gen)[:60]
        rest = torch.randperm(ctx.placement.num_rows, generator=gen)[:cold]
        g = torch.unique(torch.cat([hot, rest]))
        g = g[torch.randperm(g.numel(), generator=gen)]
        grads = torch.randn(g.numel(), ctx.dim, generator=gen)
        dense = torch.randn(ctx.dense_numel, generator=gen)
        out.append((f"s{seed}.{i}", g, grads, dense))
    return out


class Twins:
    """A Net and its failure-free twin, a worker on each: every update goes to both."""

    def __init__(self, ctx: JobContext):
        self.net, self.twin = Net(ctx), Net(ctx)
        self.worker, self._twin_worker = Worker(self.net), Worker(self.twin)

    def update(self, u: Update) -> None:
        self.worker.update(*u)
        self._twin_worker.update(*u)


def reference(ctx: JobContext, start: Model, updates: list[Update]) -> Model:
    """The updates applied with the optimizer directly on the logical model, no servers involved."""
    opt = ctx.optimizer
    rows, versions, dense = start.rows.clone(), start.versions.clone(), start.dense.clone()
    for _step, g, grads, dense_grad in updates:
        rows[g] = opt.apply(rows[g], grads)
        versions[g] += 1
        for lo, hi in ctx.dense_bounds:  # per chunk, as its replicas do
            dense[lo:hi] = opt.apply(dense[lo:hi], dense_grad[lo:hi].reshape(-1, 1))
    return Model(rows, versions, dense)


def rows_of(ctx: JobContext, s: int, n: int | None = None) -> torch.Tensor:
    """Global ids of shard s's first n local rows."""
    n = ctx.placement.rows_on(s) if n is None else n
    return ctx.placement.global_id(s, torch.arange(n))


def lost_rows_at_acting_homes(net: Net, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Records and versions of failed shard s's rows as its acting homes see them (degraded reads)."""
    p = net.ctx.placement
    local = torch.arange(p.rows_on(s))
    recs = torch.empty(local.numel(), net.ctx.record_width)
    vers = torch.empty(local.numel(), dtype=torch.int64)
    for ps, pos, _idx in p.group_by_parity(s, local):
        recs[pos], vers[pos] = net[ps].lost_rows(s, local[pos])
    return recs, vers


def assert_matches_twin(net: Net, twin: Net) -> None:
    """What every live server holds (rebuilt rows, ready parity records, copied dense chunks) and what the
    acting homes decode for a failed shard equals the failure-free twin, bit for bit."""
    for s in range(N):
        t = twin[s]
        if net.is_failed(s):
            recs, vers = lost_rows_at_acting_homes(net, s)
            assert torch.equal(bits(recs), bits(t.rows.records)), f"decoded rows of failed shard {s} differ"
            assert torch.equal(vers, t.rows.versions), f"decoded versions of failed shard {s} differ"
            continue
        st = net[s]
        ready = st.row_ready
        assert torch.equal(bits(st.rows.records[ready]), bits(t.rows.records[ready])), f"rows of {s} differ"
        assert torch.equal(st.rows.versions[ready], t.rows.versions[ready]), f"versions of {s} differ"
        pr = st.parity.ready
        assert torch.equal(bits(st.parity.parity[pr]), bits(t.parity.parity[pr])), f"parity of {s} differs"
        assert torch.equal(st.parity.pver[pr], t.parity.pver[pr]), f"pver of {s} differs"
        for c, recs in st.dense.records.items():
            if st.dense.ready[c]:
                assert same_bits(recs, t.dense.records[c]), f"dense chunk {c} on {s} differs"


def assert_fully_recovered(net: Net, twin: Net) -> None:
    assert all(net[s].recovery_done() for s in range(N))
    assert_same_model(logical_model(net), logical_model(twin))
    assert_parity_ok(net)
    assert net.staged_total() == 0 and twin.staged_total() == 0
    assert dense_replica_mismatches(net) == 0


def part_at(ctx: JobContext, s: int, n: int, step: str = "x", seed: int = 5):
    """A part of n rows of shard s, its ids and gradients."""
    g = rows_of(ctx, s, n)
    grads = torch.randn(n, ctx.dim, generator=torch.Generator().manual_seed(seed))
    return Part(s, -1, torch.arange(n), txn=f"{step}/{s}.-1.0"), g, grads


# -- the update path without failures ------------------------------------------------------------------------
def test_initial_parity_encodes_the_initial_rows(ctx):
    net = Net(ctx)
    pc = parity_check(net)
    assert pc["mismatches"] == 0 and pc["in_flight"] == 0
    assert pc["stripes"] == sum(ctx.placement.parity_rows_on(s) for s in range(N))


def test_two_phase_updates_keep_parity_and_equal_the_optimizer_applied_directly(ctx):
    net = Net(ctx)
    start = logical_model(net)
    updates = make_updates(ctx, 6, seed=1)
    w = Worker(net)
    for u in updates:
        w.update(*u)
    assert_same_model(logical_model(net), reference(ctx, start, updates))
    assert int(logical_model(net).versions.max()) == len(updates)  # the hot rows were updated every step
    assert_parity_ok(net)
    assert net.staged_total() == 0 and dense_replica_mismatches(net) == 0


def test_updates_without_two_phase_commit_keep_parity_and_equal_the_optimizer(ctx):
    net = Net(ctx)
    start = logical_model(net)
    updates = make_updates(ctx, 4, seed=2)
    for step, g, grads, dense_grad in updates:
        for s, pos, _local in ctx.placement.group_by_shard(g):
            net.call(WORKER, s, "push", g[pos], grads[pos], f"{step}/{s}")
        for c, (lo, hi) in enumerate(ctx.dense_bounds):
            for h in ctx.dense_holders(c):
                net.call(WORKER, h, "push_dense", c, dense_grad[lo:hi])
    assert_same_model(logical_model(net), reference(ctx, start, updates))
    assert_parity_ok(net)
    assert net.staged_total() == 0 and dense_replica_mismatches(net) == 0


def test_staged_part_is_invisible_to_reads_and_parity_until_commit(ctx):
    net = Net(ctx)
    s = 2
    part, g, grads = part_at(ctx, s, 40)
    chunk = ctx.dense_chunks_of(s)[0]
    lo, hi = ctx.dense_bounds[chunk]
    dense_grad = torch.randn(hi - lo, generator=torch.Generator().manual_seed(9))
    before = logical_model(net)
    parity_before = {q: net[q].parity.parity.clone() for q in range(N)}
    pulled_before = Worker(net).pull(g)

    staged = stage_part(net, s, part.txn, g, grads, -1, {chunk: dense_grad})
    assert staged.rows == 40
    pservers = sorted(set(ctx.placement.parity_of(s, part.pos)[0].tolist()))
    assert sorted(b.parity_server for b in staged.batches) == pservers
    assert len(pservers) == K  # 40 consecutive local rows have all K parity servers
    for q in pservers:
        assert (part.txn, s) in net[q].parity.staged
    assert torch.equal(bits(Worker(net).pull(g)), bits(pulled_before))
    assert same_bits(net[s].pull_dense(chunk), before.dense[lo:hi, 0])
    assert_same_model(logical_model(net), before)
    for q in range(N):
        assert same_bits(net[q].parity.parity, parity_before[q])
    assert_parity_ok(net)

    # Committed at the data server (the decision point); the parity servers hear it from the worker next.
    assert net.call(WORKER, s, "commit", part.txn) == "committed"
    assert net[s].outcome(part.txn) == "committed"
    assert all((part.txn, s) in net[q].parity.staged for q in pservers)
    assert parity_check(net)["in_flight"] > 0 and parity_check(net)["mismatches"] == 0
    for q in pservers:
        assert net.call(WORKER, q, "decide_many", [(part.txn, s, True)]) == ["committed"]
    want = reference(ctx, before, [])
    want.rows[g] = ctx.optimizer.apply(before.rows[g], grads)
    want.versions[g] += 1
    want.dense[lo:hi] = ctx.optimizer.apply(before.dense[lo:hi], dense_grad.reshape(-1, 1))
    got = logical_model(net)
    assert torch.equal(bits(got.rows), bits(want.rows)) and torch.equal(got.versions, want.versions)
    assert same_bits(net[s].dense.records[chunk], want.dense[lo:hi])  # the other replica is staged separately
    assert torch.equal(bits(Worker(net).pull(g)), bits(want.rows[g, : ctx.dim]))
    assert_parity_ok(net)
    assert net.staged_total() == 0


def test_hot_row_is_staged_by_one_txn_at_a_time_and_the_next_builds_on_the_commit(ctx):
    net = Net(ctx, wait_timeout=0.2)
    s = 1
    start = logical_model(net)
    g1, g2 = rows_of(ctx, s, 8), rows_of(ctx, s, 12)[4:]  # 4 rows in common
    gen = torch.Generator().manual_seed(3)
    grads1, grads2 = torch.randn(8, ctx.dim, generator=gen), torch.randn(8, ctx.dim, generator=gen)
    a = stage_part(net, s, "a/1", g1, grads1)
    with pytest.raises(Busy):
        net.call(WORKER, s, "stage", "b/1", g2, grads2)
    assert "b/1" not in net[s].rows.staged
    commit_part(net, s, "a/1", a)
    commit_part(net, s, "b/1", stage_part(net, s, "b/1", g2, grads2))

    opt, want = ctx.optimizer, start.rows.clone()
    want[g1] = opt.apply(want[g1], grads1)
    want[g2] = opt.apply(want[g2], grads2)  # the second update built on the first's committed records
    got = logical_model(net)
    assert torch.equal(bits(got.rows), bits(want))
    assert got.versions[g1[4:]].tolist() == [2] * 4
    assert_parity_ok(net)


# -- failures during a part ----------------------------------------------------------------------------------
S, Q = 2, 4  # the data server of the faulty part, and one of its parity servers

# fault -> (victim, Net.kill_at match): the victim dies at that point of the first update after it is armed.
# The worker sends every message (docs/protocol.md): stage, deltas, commit, decisions.
FAULTS = {
    # data server S dies before answering its stage: nothing left S; the worker writes degraded
    "data-before-stage-answer": (S, dict(method="stage", caller=WORKER, server=S, phase="after")),
    # S dies with its deltas staged at the parity servers: the worker commits them on S's behalf
    "data-after-its-deltas-staged": (S, dict(method="stage_deltas", caller=WORKER, server=Q, phase="after")),
    "data-before-commit": (S, dict(method="commit", caller=WORKER, server=S, phase="before")),
    "data-after-commit-applied": (S, dict(method="commit", caller=WORKER, server=S, phase="after")),
    # S committed and died before the parity servers heard: the worker tells them anyway
    "data-before-decisions": (S, dict(method="decide_many", caller=WORKER, server=Q, phase="before")),
    # parity server Q dies: its deltas are dropped; Q's parity is re-encoded when Q is rebuilt
    "parity-before-deltas": (Q, dict(method="stage_deltas", caller=WORKER, server=Q, phase="before")),
    "parity-after-deltas": (Q, dict(method="stage_deltas", caller=WORKER, server=Q, phase="after")),
    "parity-before-decisions": (Q, dict(method="decide_many", caller=WORKER, server=Q, phase="before")),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_single_failure_at_any_step_recovers_bit_identical_to_no_failure(ctx, fault):
    victim, match = FAULTS[fault]
    both = Twins(ctx)
    net, twin = both.net, both.twin
    updates = make_updates(ctx, 12, seed=4)
    for u in updates[:2]:
        both.update(u)
    net.kill_at(victim=victim, **match)
    both.update(updates[2])
    assert net.is_failed(victim), "the fault point was not reached"
    assert_matches_twin(net, twin)  # degraded reads see the update exactly once

    for u in updates[3:5]:  # degraded writes of the victim's rows at their acting homes
        both.update(u)
    lost = rows_of(ctx, victim)
    assert torch.equal(bits(both.worker.pull(lost)), bits(twin[victim].rows.records[:, : ctx.dim]))
    assert_matches_twin(net, twin)

    net.replace(victim)
    more = iter(updates[5:])

    def between(i: int) -> None:  # updates while the rebuild is under way, lock group by lock group
        u = next(more, None)
        if u is not None:
            both.update(u)
            assert_matches_twin(net, twin)

    assert net.recover(victim, lock_group_rows=200, between=between) == 1 + 5 + 2
    assert next(more, None) is None
    assert_fully_recovered(net, twin)


@pytest.mark.parametrize(
    "method, caller, server, phase",
    [
        ("stage", WORKER, S, "after"),  # the stage answer is lost: the worker aborts the part and retries
        ("commit", WORKER, S, "after"),  # the commit answer is lost: asked again, idempotent
        ("commit", WORKER, S, "before"),
        ("stage_deltas", WORKER, Q, "before"),  # the deltas are lost on the way: sent again
        ("stage_deltas", WORKER, Q, "after"),  # their answer is lost: sent again, replacing (not adding)
        ("decide_many", WORKER, Q, "before"),
        ("decide_many", WORKER, Q, "after"),  # a decision's answer is lost: sent again, idempotent
    ],
)
def test_lost_messages_between_live_servers_change_nothing(ctx, method, caller, server, phase):
    net, twin = Net(ctx), Net(ctx)
    updates = make_updates(ctx, 3, seed=6)
    for i, u in enumerate(updates):
        if i == 1:
            net.lose_at(method, caller=caller, server=server, phase=phase)
        Worker(net).update(*u)
        Worker(twin).update(*u)
    assert not net.hooks, "the message was never sent"
    assert_fully_recovered(net, twin)


def test_delta_redelivered_after_a_lost_ack_is_applied_once(ctx):
    net, twin = Net(ctx), Net(ctx)
    part, g, grads = part_at(ctx, S, 40)
    for n in (net, twin):
        staged = stage_part(n, S, part.txn, g, grads)
        if n is net:  # Q staged the deltas but the answer was lost: the worker sends them again
            b = next(b for b in staged.batches if b.parity_server == Q)
            n.call(WORKER, Q, "stage_deltas", [wire_copy(b, Q)])
        commit_part(n, S, part.txn, staged)
    assert_fully_recovered(net, twin)


def test_retried_stage_of_the_same_txn_is_applied_once(ctx):
    net, twin = Net(ctx), Net(ctx)
    part, g, grads = part_at(ctx, S, 40)
    for n in (net, twin):
        staged = stage_part(n, S, part.txn, g, grads)
        if n is net:  # the worker's retry of an unanswered stage: the same answer, staged once
            again = stage_part(n, S, part.txn, g, grads)
            assert all(
                same_bits(a.delta, b.delta) for a, b in zip(again.batches, staged.batches, strict=True)
            )
        commit_part(n, S, part.txn, staged)
    assert_fully_recovered(net, twin)


def test_a_data_server_dying_before_its_stage_answer_leaves_no_trace_at_the_parity_servers(ctx):
    net = Net(ctx)
    part, g, grads = part_at(ctx, S, 40)
    parity_before = {q: net[q].parity.parity.clone() for q in range(N)}
    net.kill_at("stage", victim=S, caller=WORKER, server=S, phase="after")
    with pytest.raises(PeerFailed):
        Worker(net).stage(part, g, grads, None)
    for q in net.live():  # its deltas were in the answer that never came
        assert net[q].staged_count() == 0 and same_bits(net[q].parity.parity, parity_before[q])


def test_a_part_aborted_at_its_data_server_is_dropped_by_the_parity_servers_that_got_its_deltas(ctx):
    net = Net(ctx)
    part, g, grads = part_at(ctx, S, 40)
    before = logical_model(net)
    parity_before = {q: net[q].parity.parity.clone() for q in range(N)}
    staged = stage_part(net, S, part.txn, g, grads)
    assert net.call(WORKER, S, "abort", part.txn) == "aborted"  # e.g. another parity server missed its deltas
    for b in staged.batches:
        q = b.parity_server
        assert net[q].parity.resolved[(part.txn, S)] == "aborted" and net[q].staged_count() == 0
        assert same_bits(net[q].parity.parity, parity_before[q])
    assert net.call(WORKER, S, "commit", part.txn) == "aborted"  # the decision stands
    assert_same_model(logical_model(net), before)


def test_txn_age_orders_worker_steps_by_step_then_rank_and_ignores_the_attempt():
    assert txn_age("w1-7/0.-1.0") < txn_age("w0-8/3.-1.0") < txn_age("w1-8/0.-1.0")
    assert txn_age("w0-8/3.-1.0") == txn_age("w0-8/3.-1.5")  # a retried part keeps its age
    assert txn_age("w0i2-8/1.-1.0") != txn_age("w0-8/1.-1.0")  # another incarnation: a distinct txn
    assert txn_age("w0-8r3/1.-1.0") < txn_age("w0-9/1.-1.0")  # after a rollback (r<checkpoint>)
    assert txn_age("w9-99999/0.-1.0") < txn_age("push:1") and txn_age("a/1") < txn_age("b/1")


def test_the_worker_fence_names_the_processes_the_coordinator_says_are_gone():
    assert txn_worker("w3-7/0.-1.0") == (3, 1) and txn_worker("w3i12-7r2/0.-1.0") == (3, 12)
    assert txn_worker("push:1") is None and txn_worker("x/1.-1.0") is None
    fence = WorkerFence()
    assert not fence.fenced("w0-1/0.-1.0") and not fence.fenced("push:1")
    assert fence.update({"0": 1, "2": 2}) and not fence.update({0: 1, 2: 1})  # it only grows
    assert fence.fenced("w0-1/0.-1.0") and not fence.fenced("w0i2-1/0.-1.0")
    assert (
        fence.fenced("w2i2-5/0.-1.0")
        and not fence.fenced("w2i3-5/0.-1.0")
        and not fence.fenced("w1-5/0.-1.0")
    )


def _until_waiting(store, n: int = 1) -> None:
    deadline = time.monotonic() + 5
    while store.waiting < n:
        assert time.monotonic() < deadline, "the stage never started waiting"
        time.sleep(0.001)


def test_hot_rows_wait_die_older_waits_younger_answers_busy_unless_lone(ctx, monkeypatch):
    """Two workers staging the same hot rows on two servers in opposite orders must not wait for each other
    (each holding one server's rows): the younger part answers Busy after a short grace, the older waits for
    the younger's commit; a lone part (its worker holds nothing else) may wait for an older one."""
    monkeypatch.setattr(store_mod, "ROW_LOCK_WAIT", 5.0)  # waits here end by commits, not by the bound
    net = Net(ctx, wait_timeout=5.0)
    s = 1
    g = rows_of(ctx, s, 6)
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(6, ctx.dim, generator=gen) for _ in range(3)]
    # the younger part (step 9) holds the rows; the older one (step 3) waits until it commits
    young = stage_part(net, s, "w1-9/1.-1.0", g, grads[0])
    done = threading.Event()

    def older() -> None:
        commit_part(net, s, "w0-3/1.-1.0", stage_part(net, s, "w0-3/1.-1.0", g, grads[1]))
        done.set()

    t = threading.Thread(target=older)
    t.start()
    _until_waiting(net[s])  # waiting, not refused
    assert not done.is_set()
    commit_part(net, s, "w1-9/1.-1.0", young)
    t.join(5)
    assert done.is_set()
    # now the older part holds the rows: a younger one is refused after the grace, with why
    old = stage_part(net, s, "w0-4/1.-1.0", g, grads[2])
    started = time.monotonic()
    with pytest.raises(Busy, match="older part"):
        net.call(WORKER, s, "stage", "w1-10/1.-1.0", g, grads[0])
    assert time.monotonic() - started < 1.0  # after YOUNGER_WAIT, not after the (here 5 s) wait bound
    assert "w1-10/1.-1.0" not in net[s].rows.staged
    # ... but the same part sent lone waits for the older one's commit
    box = {}
    t = threading.Thread(
        target=lambda: box.setdefault("staged", stage_part(net, s, "w1-10/1.-1.1", g, grads[0], lone=True))
    )
    t.start()
    _until_waiting(net[s])
    commit_part(net, s, "w0-4/1.-1.0", old)
    t.join(5)
    commit_part(net, s, "w1-10/1.-1.1", box["staged"])
    assert_parity_ok(net)
    assert net.staged_total() == 0


def test_degraded_writes_wait_die_at_the_acting_home_as_data_servers_do(ctx, monkeypatch):
    """Two workers' degraded writes of a failed shard's hot rows, at two acting homes in opposite orders,
    would each wait for the other until the bound: the younger answers Busy after the grace, the older
    waits for the younger's commit, and a lone one may wait for an older one (found in the recovery
    benchmark: "rows of a failed shard staged by another txn: still busy after 0.05s" through a failure)."""
    monkeypatch.setattr(store_mod, "ROW_LOCK_WAIT", 5.0)  # waits here end by commits, not by the bound
    net, twin = Net(ctx, wait_timeout=5.0), Net(ctx)
    net.kill(S)
    g = rows_of(ctx, S)
    ps = int(ctx.placement.parity_of(S, torch.arange(g.numel()))[0][0])
    g = g[ctx.placement.parity_of(S, torch.arange(g.numel()))[0] == ps][:6]  # rows whose acting home is ps
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(6, ctx.dim, generator=gen) for _ in range(4)]

    def write(txn: str, i: int, lone: bool = False) -> None:
        net.call(WORKER, ps, "stage", txn, g, grads[i], S, {}, 0, (), lone)

    def done(txn: str, i: int) -> None:
        assert net.call(WORKER, ps, "commit", txn) == "committed"
        commit_part(twin, S, txn, stage_part(twin, S, txn, g, grads[i]))

    young = f"w1-9/{ps}.{S}.0"
    write(young, 0)
    box = {}
    older = threading.Thread(target=lambda: box.setdefault("old", write(f"w0-3/{ps}.{S}.0", 1) or True))
    older.start()
    _until_waiting(net[ps])  # the older one waits, it is not refused
    assert "old" not in box
    done(young, 0)
    older.join(5)
    assert box["old"]
    done(f"w0-3/{ps}.{S}.0", 1)
    # an older write holds the rows: a younger one is refused after the grace, with why
    write(f"w0-4/{ps}.{S}.0", 2)
    started = time.monotonic()
    with pytest.raises(Busy, match="older part"):
        write(f"w1-10/{ps}.{S}.0", 3)
    assert time.monotonic() - started < 1.0  # after YOUNGER_WAIT, not after the (here 5 s) bound
    # ... but sent lone, it waits for the older one's commit
    t = threading.Thread(
        target=lambda: box.setdefault("lone", write(f"w1-10/{ps}.{S}.1", 3, lone=True) or True)
    )
    t.start()
    _until_waiting(net[ps])
    done(f"w0-4/{ps}.{S}.0", 2)
    t.join(5)
    done(f"w1-10/{ps}.{S}.1", 3)
    assert net.staged_total() == 0
    recs, vers = lost_rows_at_acting_homes(net, S)
    local = ctx.placement.local_row(g)
    assert torch.equal(bits(recs[local]), bits(twin[S].rows.records[local]))
    assert torch.equal(vers[local], twin[S].rows.versions[local])


def test_degraded_write_waits_for_the_dead_servers_undecided_delta(ctx):
    net, twin = Net(ctx, wait_timeout=0.2), Net(ctx)
    part, g, grads = part_at(ctx, S, 40)
    commit_part(twin, S, part.txn, stage_part(twin, S, part.txn, g, grads))
    staged = stage_part(net, S, part.txn, g, grads)  # its deltas are at the parity servers
    net.kill(S)
    # Before the worker commits on S's behalf, the acting home must not build on the undecided delta.
    gen = torch.Generator().manual_seed(8)
    more = torch.randn(40, ctx.dim, generator=gen)
    ps = int(ctx.placement.parity_of(S, part.pos)[0][0])
    sub = g[ctx.placement.parity_of(S, part.pos)[0] == ps]
    with pytest.raises(Busy):
        net.call(WORKER, ps, "stage", "y/1", sub, more[: sub.numel()], S)
    assert decide_part(net, part.txn, S, staged, commit=True) == ["committed"] * K
    net.call(WORKER, ps, "stage", "y/1", sub, more[: sub.numel()], S)
    net.call(WORKER, ps, "commit", "y/1")
    commit_part(twin, S, "y/1", stage_part(twin, S, "y/1", sub, more[: sub.numel()]))
    assert_matches_twin(net, twin)


def test_a_rebuilds_read_that_waits_in_vain_logs_the_undecided_update_it_waited_for(ctx, caplog):
    # A parity read for rebuilding shard S waits for S's undecided deltas; when the wait runs out, the log
    # names them (the same line over and over is an update lost for good: the rebuild would never finish).
    net = Net(ctx, wait_timeout=0.2)
    part, g, grads = part_at(ctx, S, 40)
    staged = stage_part(net, S, part.txn, g, grads)
    b = staged.batches[0]
    with caplog.at_level("WARNING", logger="ecrec.server"), pytest.raises(Busy):
        net[b.parity_server].read_rows("parity", b.index, src=S)
    [line] = [r.getMessage() for r in caplog.records if "waited in vain" in r.getMessage()]
    assert f"shard {S} (" in line and f"staged txns ['{part.txn}']" in line, line
    assert decide_part(net, part.txn, S, staged, commit=True) == ["committed"] * K
    assert net[b.parity_server].read_rows("parity", b.index, src=S).records.shape[0] == b.index.numel()


def test_degraded_read_of_a_failed_shard_equals_its_rows(ctx):
    net, twin = Net(ctx), Net(ctx)
    for u in make_updates(ctx, 3, seed=7):
        Worker(net).update(*u)
        Worker(twin).update(*u)
    net.kill(S)
    g = rows_of(ctx, S)
    g = g[torch.randperm(g.numel(), generator=torch.Generator().manual_seed(1))]
    want = twin[S].rows.records[ctx.placement.local_row(g), : ctx.dim]
    assert torch.equal(bits(Worker(net).pull(g)), bits(want))
    assert torch.equal(bits(Worker(net).pull(g)), bits(want))  # again, from the materialized rows
    recs, vers = lost_rows_at_acting_homes(net, S)
    assert torch.equal(bits(recs), bits(twin[S].rows.records)) and torch.equal(vers, twin[S].rows.versions)
    assert net.call(WORKER, Q, "degraded_pull", S, torch.empty(0, dtype=torch.int64)).shape == (0, ctx.dim)


def test_staged_degraded_write_is_invisible_until_commit(ctx):
    net, twin = Net(ctx), Net(ctx)
    net.kill(S)
    p = ctx.placement
    local = torch.arange(40)
    ps = p.parity_of(S, local)[0]
    sub = p.global_id(S, local[ps == Q])
    grads = torch.randn(sub.numel(), ctx.dim, generator=torch.Generator().manual_seed(2))
    before = net.call(WORKER, Q, "degraded_pull", S, sub)
    parity_before = net[Q].parity.parity.clone()
    staged = net.call(WORKER, Q, "stage", "d/1", sub, grads, S)
    assert staged.rows == sub.numel() and staged.batches == []  # the acting home stages its own parity
    assert torch.equal(bits(net.call(WORKER, Q, "degraded_pull", S, sub)), bits(before))
    assert same_bits(net[Q].parity.parity, parity_before)
    assert net.call(WORKER, Q, "commit", "d/1") == "committed"
    commit_part(twin, S, "d/1", stage_part(twin, S, "d/1", sub, grads))
    want = twin[S].rows.records[p.local_row(sub), : ctx.dim]
    assert torch.equal(bits(net.call(WORKER, Q, "degraded_pull", S, sub)), bits(want))
    assert_matches_twin(net, twin)


def test_acting_home_rereads_rows_when_a_dead_servers_delta_is_committed_on_its_behalf(ctx):
    net, twin = Net(ctx), Net(ctx)
    part, g, grads = part_at(ctx, S, 40)
    staged = stage_part(net, S, part.txn, g, grads)  # then S dies before the commit
    net.kill(S)
    old = Worker(net).pull(g)  # decoded from committed state and materialized at the acting homes
    assert torch.equal(bits(old), bits(twin[S].rows.records[:40, : ctx.dim]))
    decide_part(net, part.txn, S, staged, commit=True)  # the worker commits on S's behalf
    commit_part(twin, S, part.txn, stage_part(twin, S, part.txn, g, grads))
    assert torch.equal(bits(Worker(net).pull(g)), bits(twin[S].rows.records[:40, : ctx.dim]))
    assert_matches_twin(net, twin)


def test_second_failure_of_a_shard_does_not_reuse_rows_materialized_in_the_first(ctx):
    net, twin = Net(ctx), Net(ctx)
    w, tw = Worker(net), Worker(twin)
    updates = make_updates(ctx, 4, seed=8)
    net.kill(S)
    w.update(*updates[0])
    tw.update(*updates[0])
    w.pull(rows_of(ctx, S))  # every lost row materialized at its acting home
    net.replace(S)
    net.recover(S, lock_group_rows=400)
    w.update(*updates[1])
    tw.update(*updates[1])
    # Updates without 2PC reach the acting homes only as immediate deltas (no decide_deltas to invalidate
    # materialized rows): only the new failure's fresh cache keeps them from serving stale rows.
    for n in (net, twin):
        step, g, grads, _dense = updates[2]
        for s, pos, _local in ctx.placement.group_by_shard(g):
            n.call(WORKER, s, "push", g[pos], grads[pos], f"{step}/{s}")
    net.kill(S)
    assert torch.equal(bits(w.pull(rows_of(ctx, S))), bits(twin[S].rows.records[:, : ctx.dim]))
    w.update(*updates[3])
    tw.update(*updates[3])
    assert_matches_twin(net, twin)


def test_degraded_write_is_refused_once_the_shard_has_a_replacement(ctx):
    net = Net(ctx)
    net.kill(S)
    sub = ctx.placement.global_id(S, torch.tensor([0]))
    ps = int(ctx.placement.parity_of(S, torch.tensor([0]))[0][0])
    net.call(WORKER, ps, "degraded_pull", S, sub)
    assert S in net[ps].acting.cache
    net.replace(S)
    with pytest.raises(NotOwner):
        net.call(WORKER, ps, "stage", "z/1", sub, torch.ones(1, ctx.dim), S)
    with pytest.raises(NotOwner):
        net.call(WORKER, ps, "degraded_pull", S, sub)
    assert S not in net[ps].acting.cache
    assert net[ps].staged_count() == 0


# -- recovery ------------------------------------------------------------------------------------------------
def replacement_with_rows(ctx: JobContext):
    """A Net whose server Q was replaced and has its dense chunks and rows back (its parity records not yet),
    a failure-free twin, and the replacement's store."""
    net, twin = Net(ctx), Net(ctx)
    net.kill(Q)
    rep = net.replace(Q)
    net.call(WORKER, Q, "copy_dense")
    net.call(WORKER, Q, "rebuild_rows", torch.arange(rep.num_rows))
    return net, twin, rep


def test_parity_rebuilt_while_a_commit_is_in_flight_replays_the_deltas_its_members_do_not_reflect(ctx):
    net, twin, rep = replacement_with_rows(ctx)
    a, ga, grads_a = part_at(ctx, S, 40, step="a", seed=1)
    b, gb, grads_b = part_at(ctx, 1, 40, step="b", seed=2)
    seen = {}

    threads = []

    def rebuild_parity(_call) -> None:
        # S committed part a and Q has just been told (the delta is kept until Q's record is rebuilt); part b
        # is staged at server 1 and at Q. The rebuild runs concurrently, as in a server: its reads of server
        # 1's rows wait for b's commit, and neither kept delta may be applied on top of the rebuilt record.
        seen["pending"] = len(rep.parity.pending)
        seen["staged"] = len(rep.parity.staged)
        t = threading.Thread(
            target=net.call, args=(WORKER, Q, "rebuild_parity", torch.arange(rep.parity.parity.shape[0]))
        )
        t.start()
        threads.append(t)

    for n in (net, twin):
        sb = stage_part(n, 1, b.txn, gb, grads_b)  # staged at Q before its records are rebuilt...
        sa = stage_part(n, S, a.txn, ga, grads_a)
        if n is net:
            n.on("decide_many", rebuild_parity, caller=WORKER, server=Q, phase="after")
        commit_part(n, S, a.txn, sa)
        commit_part(n, 1, b.txn, sb)  # ...committed after (the rebuild waits for both parts)
        for t in threads:
            t.join()
    assert seen == {"pending": 1, "staged": 1}
    assert rep.parity.pending == []
    assert_fully_recovered(net, twin)


class Background(threading.Thread):
    """A call on its own thread, as a second RPC handler runs it; its answer or error kept for the test."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.result, self.error = fn, args, None, None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            self.error = e


def test_a_parity_rebuild_sent_twice_at_once_runs_once_and_loses_no_update(ctx):
    # A coordinator killed with a parity Recover in flight: its successor sends the same step while the first
    # is still running. The second must not install its own cut after a commit was applied on the first's:
    # the record would go back to a version its member has left, and every later delta would be held forever.
    net, twin, rep = replacement_with_rows(ctx)
    every = torch.arange(rep.parity.parity.shape[0])
    part, g, grads = part_at(ctx, S, 40)
    second: list[Background] = []

    def resend_then_commit(_call) -> None:
        # The first rebuild has read S's rows; the second arrives, then a part of S commits.
        b = Background(net.call, WORKER, Q, "rebuild_parity", every)
        b.start()
        b.join(0.5)
        second.append(b)
        commit_part(net, S, part.txn, stage_part(net, S, part.txn, g, grads))

    net.on("read_rows", resend_then_commit, caller=Q, server=S, phase="after")
    first = net.call(WORKER, Q, "rebuild_parity", every)
    (b,) = second
    b.join()
    assert b.error is None and first == every.numel() and b.result == 0
    commit_part(twin, S, part.txn, stage_part(twin, S, part.txn, g, grads))
    assert_fully_recovered(net, twin)
    later, g2, grads2 = part_at(ctx, S, 40, step="y", seed=6)  # and the record goes on taking updates
    for n in (net, twin):
        commit_part(n, S, later.txn, stage_part(n, S, later.txn, g2, grads2))
    assert_fully_recovered(net, twin)


def test_a_dense_copy_sent_twice_at_once_copies_each_chunk_once(ctx):
    # As above for the dense step: a second install of an older copy would drop the steps committed on the
    # first (one replica behind the other for the rest of the job).
    net = Net(ctx)
    net.kill(Q)
    net.replace(Q)
    copies = []
    net.hooks.append(
        lambda c: copies.append(c) if (c.method, c.phase) == ("serve_dense_copy", "before") else 0
    )
    second: list[Background] = []

    def resend(_call) -> None:  # the first copy has its chunk from the survivor, not installed yet
        b = Background(net.call, WORKER, Q, "copy_dense")
        b.start()
        b.join(0.5)
        second.append(b)

    net.on("serve_dense_copy", resend, caller=Q, phase="after")
    first = net.call(WORKER, Q, "copy_dense")
    (b,) = second
    b.join()
    assert b.error is None
    chunks = ctx.dense_chunks_of(Q)
    assert len(copies) == len(chunks) and first + b.result == sum(net[Q].dense.length(c) for c in chunks)
    assert net[Q].dense.all_ready() and dense_replica_mismatches(net) == 0


def test_parity_rebuilt_between_a_stage_and_its_commit_still_gets_the_update(ctx):
    net, twin = Net(ctx), Net(ctx)
    part, g, grads = part_at(ctx, S, 40)
    staged = {n: stage_part(n, S, part.txn, g, grads) for n in (net, twin)}  # the delta is staged at Q
    net.kill(Q)  # Q dies with the staged delta; its replacement is rebuilt while the worker has not committed
    net.replace(Q)
    rebuild = threading.Thread(target=net.recover, args=(Q,), kwargs={"lock_group_rows": 1000})
    rebuild.start()
    time.sleep(0.3)  # re-encoding the parity of S's staged rows waits for the commit
    assert rebuild.is_alive()
    for n in (net, twin):
        assert commit_part(n, S, part.txn, staged[n]) == "committed"
    rebuild.join()
    assert_fully_recovered(net, twin)


def test_rebuild_waits_for_a_degraded_write_staged_before_the_replacement(ctx):
    net, twin = Net(ctx, wait_timeout=0.2), Net(ctx)
    net.kill(S)
    local = torch.tensor([1, 5, 9])  # all with parity on the same server
    ps = int(ctx.placement.parity_of(S, local)[0][0])
    g = ctx.placement.global_id(S, local)
    grads = torch.randn(3, ctx.dim, generator=torch.Generator().manual_seed(3))
    net.call(WORKER, ps, "stage", "d/1", g, grads, S)
    rep = net.replace(S)
    with pytest.raises(PeerFailed):  # the acting home holds the rows: the rebuild must not read around it
        net.call(WORKER, S, "rebuild_rows", local)
    assert not bool(rep.row_ready[local].any()) and not rep.rows.locks.busy(local)
    assert net.call(WORKER, ps, "commit", "d/1") == "committed"
    assert net.call(WORKER, S, "rebuild_rows", local) == 3
    commit_part(twin, S, "d/1", stage_part(twin, S, "d/1", g, grads))
    assert_matches_twin(net, twin)
    net.recover(S, lock_group_rows=500)
    assert_fully_recovered(net, twin)


def test_replacement_dying_mid_recovery_loses_nothing(ctx):
    net, twin = Net(ctx), Net(ctx)
    w, tw = Worker(net), Worker(twin)
    updates = iter(make_updates(ctx, 9, seed=13))

    def step() -> None:
        u = next(updates)
        w.update(*u)
        tw.update(*u)

    step()
    net.kill(S)
    step()
    rep = net.replace(S)
    rep.copy_dense()
    net.call(WORKER, S, "rebuild_rows", torch.arange(300))
    step()  # updates the rebuilt rows normally and rebuilds others on demand
    assert 300 < int(rep.row_ready.sum()) < rep.num_rows
    net.kill(S)  # the replacement dies with part of its rows rebuilt and none of its parity
    assert_matches_twin(net, twin)
    step()
    net.replace(S)
    net.recover(S, lock_group_rows=250, between=lambda i: step() if i in (1, 3, 5) else None)
    step()
    assert_fully_recovered(net, twin)


def test_recovery_by_lock_groups_rebuilds_rows_on_demand_between_groups(ctx):
    net, twin = Net(ctx), Net(ctx)
    w, tw = Worker(net), Worker(twin)
    updates = make_updates(ctx, 9, seed=9)
    for u in updates[:2]:
        w.update(*u)
        tw.update(*u)
    net.kill(S)
    for u in updates[2:4]:
        w.update(*u)
        tw.update(*u)
    rep = net.replace(S)
    assert not bool(rep.row_ready.any()) and not bool(rep.parity.ready.any())
    on_demand = []
    more = iter(updates[4:])

    def between(i: int) -> None:
        u = next(more, None)
        if u is None:
            return
        ready = rep.row_ready.clone()
        w.update(*u)
        tw.update(*u)
        on_demand.append(int((rep.row_ready & ~ready).sum()))
        assert_matches_twin(net, twin)

    # Groups of 300 rows: rows touched by an update are rebuilt before their group is reached.
    assert net.recover(S, lock_group_rows=300, between=between) == 1 + 3 + 1
    assert on_demand[0] > 0  # the first update after the dense copy needed rows not rebuilt yet
    assert rep.stats["rows_recovered"] == ctx.placement.rows_on(S)  # every row rebuilt exactly once
    assert_fully_recovered(net, twin)


def test_pull_at_a_replacement_rebuilds_the_rows_it_needs(ctx):
    net, twin = Net(ctx), Net(ctx)
    for u in make_updates(ctx, 2, seed=10):
        Worker(net).update(*u)
        Worker(twin).update(*u)
    net.kill(S)
    rep = net.replace(S)
    g = rows_of(ctx, S, 30)[::3]
    assert torch.equal(bits(Worker(net).pull(g)), bits(twin[S].rows.records[:30:3, : ctx.dim]))
    assert int(rep.row_ready.sum()) == 10
    net.recover(S, lock_group_rows=1000)
    assert_fully_recovered(net, twin)


def test_a_pull_needing_rows_rebuilt_does_not_wait_for_parts_staged_on_rebuilt_rows(ctx):
    # Found in the recovery benchmark's traces: a pull at a replacement that needed some rows rebuilt waited
    # for every lock on its rows, including another worker's part staged on rows rebuilt already, so pulls
    # during a recovery waited out other workers' commits.
    net, twin = Net(ctx, wait_timeout=5.0), Net(ctx)
    for u in make_updates(ctx, 2, seed=11):
        Worker(net).update(*u)
        Worker(twin).update(*u)
    net.kill(S)
    rep = net.replace(S)
    part, g, grads = part_at(ctx, S, 10)
    staged = stage_part(net, S, part.txn, g, grads)  # rebuilds its 10 rows on demand, then holds them
    assert int(rep.row_ready.sum()) == 10
    wanted = rows_of(ctx, S, 20)  # 10 rows staged by the part above, 10 not rebuilt yet
    started = time.monotonic()
    pulled = Worker(net).pull(wanted)
    assert time.monotonic() - started < 2.0  # not the 5 s wait bound: the part was never waited for
    assert torch.equal(bits(pulled), bits(twin[S].rows.records[:20, : ctx.dim]))
    commit_part(net, S, part.txn, staged)
    commit_part(twin, S, part.txn, stage_part(twin, S, part.txn, g, grads))
    net.recover(S, lock_group_rows=1000)
    assert_fully_recovered(net, twin)


def test_replacement_skips_dense_steps_its_copy_already_contains(ctx):
    net, twin = Net(ctx), Net(ctx)
    chunk = ctx.dense_chunks_of(S)[0]
    other = next(h for h in ctx.dense_holders(chunk) if h != S)
    lo, hi = ctx.dense_bounds[chunk]
    grad = torch.randn(hi - lo, generator=torch.Generator().manual_seed(4))
    none = torch.empty(0, dtype=torch.int64), torch.empty(0, ctx.dim)
    net.kill(S)
    # Step "7" reached the surviving replica; then S's replacement copies the chunk.
    net.call(WORKER, other, "stage", f"7/{other}.-1.0", *none, -1, {chunk: grad})
    net.call(WORKER, other, "commit", f"7/{other}.-1.0")
    epoch_before = net.epoch
    rep = net.replace(S)  # a new map: the copy is made under it
    assert rep.epoch > epoch_before
    net.call(WORKER, S, "copy_dense")
    assert same_bits(rep.dense.records[chunk], net[other].dense.records[chunk])
    # A stage of the same step that reaches the replacement late is not applied twice...
    net.call(WORKER, S, "stage", f"7/{S}.-1.1", *none, -1, {chunk: grad})
    assert net.call(WORKER, S, "commit", f"7/{S}.-1.1") == "committed"
    assert same_bits(rep.dense.records[chunk], net[other].dense.records[chunk])
    # ...the survivor refuses stages of the chunk built on the map before the replacement...
    with pytest.raises(NotOwner):
        net.call(WORKER, other, "stage", f"8/{other}.-1.0", *none, -1, {chunk: grad}, epoch_before)
    # ...and later steps apply on both replicas alike.
    for h in (S, other):
        net.call(WORKER, h, "stage", f"8/{h}.-1.0", *none, -1, {chunk: grad}, rep.epoch)
        net.call(WORKER, h, "commit", f"8/{h}.-1.0")
    for step in ("7", "8"):
        for h in ctx.dense_holders(chunk):
            twin.call(WORKER, h, "stage", f"{step}/{h}.-1.0", *none, -1, {chunk: grad})
            twin.call(WORKER, h, "commit", f"{step}/{h}.-1.0")
    assert same_bits(rep.dense.records[chunk], twin[S].dense.records[chunk])
    assert same_bits(net[other].dense.records[chunk], twin[other].dense.records[chunk])


def test_replacement_that_copied_a_dense_chunk_mid_step_still_receives_the_step(ctx):
    """The step's part at the surviving replica fails once (busy rows) and meanwhile the dead replica's
    replacement registers and copies the chunk, which does not hold the step yet: the retry must send the
    step to the replacement too, or the two replicas diverge (found by a real-process run in CI)."""
    net, twin = Net(ctx), Net(ctx)
    chunk = ctx.dense_chunks_of(S)[0]
    other = next(h for h in ctx.dense_holders(chunk) if h != S)
    step, g, grads, dense_grad = make_updates(ctx, 1, seed=11)[0]
    net.kill(S)

    def replace_and_copy(_call) -> None:
        net.replace(S)
        net.call(WORKER, S, "copy_dense")
        raise Busy("rows staged by another txn")

    net.on("stage", replace_and_copy, caller=WORKER, server=other)
    Worker(net).update(step, g, grads, dense_grad)
    Worker(twin).update(step, g, grads, dense_grad)
    assert not any(net.hooks)  # the hook fired
    net.recover(S, lock_group_rows=1000)
    assert same_bits(net[S].dense.records[chunk], net[other].dense.records[chunk])
    assert_fully_recovered(net, twin)


@pytest.mark.parametrize("order", ["piggybacked", "reversed"])
def test_decisions_for_one_row_may_ride_late_or_arrive_out_of_order(ctx, order):
    """The worker's decision about part a rides on its next stage at the parity server (applied before the
    stage), ahead of the deltas of a later part b that updates the same rows; or it reaches the parity
    server only after b's decision (b is held until a's arrives)."""
    net, twin = Net(ctx), Net(ctx)
    g = rows_of(ctx, S, 40)
    gen = torch.Generator().manual_seed(21)
    grads_a, grads_b = torch.randn(40, ctx.dim, generator=gen), torch.randn(40, ctx.dim, generator=gen)
    for n in (net, twin):  # the twin decides each part at once
        if n is twin:
            commit_part(n, S, "a/1", stage_part(n, S, "a/1", g, grads_a))
            commit_part(n, S, "b/1", stage_part(n, S, "b/1", g, grads_b))
            continue
        a = stage_part(n, S, "a/1", g, grads_a)
        assert n.call(WORKER, S, "commit", "a/1") == "committed"  # a's decision not delivered yet
        b = n.call(WORKER, S, "stage", "b/1", g, grads_b)  # built on a's committed records
        for batch in b.batches:
            q = batch.parity_server
            if (
                order == "piggybacked"
            ):  # the worker's next stage at q (here an empty part) carries a's decision
                carrier = f"carrier/{q}"
                nothing = torch.empty(0, dtype=torch.int64), torch.empty(0, ctx.dim)
                n.call(WORKER, q, "stage", carrier, *nothing, -1, {}, 0, [("a/1", S, True)])
                assert n[q].parity.resolved[("a/1", S)] == "committed"
                n.call(WORKER, q, "commit", carrier)
            n.call(WORKER, q, "stage_deltas", [wire_copy(batch, q)])
        assert n.call(WORKER, S, "commit", "b/1") == "committed"
        decide_part(n, "b/1", S, b, commit=True)
        if order == "reversed":
            assert parity_check(n)["in_flight"] > 0 and parity_check(n)["mismatches"] == 0
            assert any(n[q].parity.held for q in range(N))
            decide_part(n, "a/1", S, a, commit=True)
        assert not any(n[q].parity.held for q in range(N))
    assert_fully_recovered(net, twin)


# -- txnTimeout ----------------------------------------------------------------------------------------------
def test_expired_stage_is_aborted_and_its_rows_and_deltas_released(ctx):
    net = Net(ctx, txn_timeout=5.0)
    part, g, grads = part_at(ctx, S, 40)
    before = logical_model(net)
    stage_part(net, S, part.txn, g, grads)  # then the worker dies: no commit
    pservers = sorted(set(ctx.placement.parity_of(S, part.pos)[0].tolist()))
    net.clock.advance(4.0)
    assert net[S].expire() == []  # not yet
    assert net[S].rows.locks.busy(part.pos)
    net.clock.advance(2.0)
    assert net[S].expire() == [part.txn]
    assert not net[S].rows.locks.busy(part.pos) and net[S].rows.staged == {}
    for q in pservers:
        assert (part.txn, S) not in net[q].parity.staged
        assert net[q].parity.resolved[(part.txn, S)] == "aborted"
    assert net.staged_total() == 0
    # A late commit from the worker is refused; the model is untouched; the rows take new stages at once.
    assert net.call(WORKER, S, "commit", part.txn) == "aborted"
    assert_same_model(logical_model(net), before)
    assert_parity_ok(net)
    commit_part(net, S, "again/1", stage_part(net, S, "again/1", g, grads))
    assert logical_model(net).versions[g].tolist() == [1] * 40
    assert_parity_ok(net)


def test_a_part_of_a_worker_process_known_gone_is_aborted_at_once_and_no_other_part(ctx):
    # The coordinator says rank 1's first process is gone (lost, or replaced by incarnation 2): its staged
    # part is aborted at the next expire, long before txnTimeout; rank 1's new process and rank 0 are not.
    net = Net(ctx, txn_timeout=60.0)
    dead, g, grads = part_at(ctx, S, 40, step="w1-7")
    live, g2, grads2 = part_at(ctx, S, 40, step="w1i2-8", seed=6)
    other, g3, grads3 = part_at(ctx, S, 40, step="w0-8", seed=7)
    g2, g3 = g2 + N * 40, g3 + N * 80  # other rows of S
    before = logical_model(net)
    staged = {
        p.txn: stage_part(net, S, p.txn, *a)
        for p, *a in ((dead, g, grads), (live, g2, grads2), (other, g3, grads3))
    }
    assert net[S].expire() == []
    assert net[S].fence_workers({"1": 1}) and not net[S].fence_workers({"1": 1, "0": 0})
    assert net[S].expire() == [dead.txn]
    assert net[S].stats["expired_worker_gone"] == 1 and net[S].stats["expired_timeout"] == 0
    assert not net[S].rows.locks.busy(dead.pos) and set(net[S].rows.staged) == {live.txn, other.txn}
    for b in staged[dead.txn].batches:  # the aborted part's parity servers were told at once
        assert net[b.parity_server].parity.resolved[(dead.txn, S)] == "aborted"
    # the dead process's late commit is refused; the live parts commit as usual
    assert net.call(WORKER, S, "commit", dead.txn) == "aborted"
    for p in (live, other):
        assert commit_part(net, S, p.txn, staged[p.txn]) == "committed"
    versions = logical_model(net).versions
    assert versions[g].tolist() == before.versions[g].tolist() and versions[g2].tolist() == [1] * 40
    assert net.staged_total() == 0
    assert_parity_ok(net)


def test_parity_servers_settle_deltas_of_a_worker_process_known_gone_at_once(ctx):
    # Committed at the data server, then the worker died before its decisions reached the parity servers:
    # once the coordinator says so they ask the data server at once instead of after txnTimeout.
    net, twin = Net(ctx, txn_timeout=60.0), Net(ctx)
    part, g, grads = part_at(ctx, S, 40, step="w0-3")
    staged = stage_part(net, S, part.txn, g, grads)
    assert net.call(WORKER, S, "commit", part.txn) == "committed"
    for b in staged.batches:
        q = b.parity_server
        net[q].expire()
        assert (part.txn, S) in net[q].parity.staged  # nobody knows the worker died
        net[q].fence_workers({"0": 1})
        net[q].expire()  # asks S: committed
        assert net[q].parity.resolved[(part.txn, S)] == "committed"
    commit_part(twin, S, part.txn, stage_part(twin, S, part.txn, g, grads))
    assert_fully_recovered(net, twin)


def test_parity_servers_settle_deltas_of_a_committed_part_whose_worker_died_by_asking_the_data_server(ctx):
    net, twin = Net(ctx, txn_timeout=5.0), Net(ctx)
    part, g, grads = part_at(ctx, S, 40)
    staged = stage_part(net, S, part.txn, g, grads)
    assert net.call(WORKER, S, "commit", part.txn) == "committed"  # then the worker dies: nobody tells Q
    pservers = [b.parity_server for b in staged.batches]
    net.clock.advance(4.0)
    for q in pservers:
        net[q].expire()
        assert (part.txn, S) in net[q].parity.staged  # not yet: the worker may still be on its way
    net.clock.advance(2.0)
    for q in pservers:
        net[q].expire()  # asks S: committed
        assert net[q].parity.resolved[(part.txn, S)] == "committed"
    commit_part(twin, S, part.txn, stage_part(twin, S, part.txn, g, grads))
    assert_fully_recovered(net, twin)


def test_parity_servers_wait_while_the_data_server_has_not_decided_and_drop_what_it_aborted(ctx):
    net = Net(ctx, txn_timeout=5.0)
    part, g, grads = part_at(ctx, S, 40)
    before = logical_model(net)
    staged = stage_part(net, S, part.txn, g, grads)
    q = staged.batches[0].parity_server
    net[q].parity.staged_at[(part.txn, S)] -= 10.0  # Q's copy is older than S's part (clocks differ)
    net[q].expire()
    assert net[S].outcome(part.txn) == "staged" and (part.txn, S) in net[q].parity.staged
    net.clock.advance(6.0)
    net[S].expire()  # S aborts the abandoned part and tells its parity servers
    assert net[q].parity.resolved[(part.txn, S)] == "aborted"
    assert net.staged_total() == 0
    assert_same_model(logical_model(net), before)
    assert_parity_ok(net)


def test_deltas_of_a_dead_data_server_and_a_dead_worker_are_dropped_after_three_timeouts(ctx):
    net = Net(ctx, txn_timeout=5.0)
    part, g, grads = part_at(ctx, S, 40)
    staged = stage_part(net, S, part.txn, g, grads)
    net.kill(S)  # and the worker dies too: nobody can decide for S
    q = staged.batches[0].parity_server
    net.clock.advance(10.0)
    net[q].expire()
    assert (part.txn, S) in net[q].parity.staged  # a live worker would commit on S's behalf by now
    net.clock.advance(6.0)
    net[q].expire()
    assert net[q].parity.resolved[(part.txn, S)] == "aborted"


def _two_commits_on_the_same_rows(net: Net, ctx: JobContext, deliver_t1: bool = True):
    """S commits part t1 and then t2 on the same three rows (their parity on one server, returned); the
    parity server hears t2's decision but not t1's (t1's worker died, or its decision is late)."""
    local = torch.tensor([0, 4, 8])
    ps = ctx.placement.parity_of(S, local)[0]
    assert bool((ps == ps[0]).all())
    g = ctx.placement.global_id(S, local)
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(3, ctx.dim, generator=gen) for _ in range(2)]
    s1 = stage_part(net, S, "t1/2.-1.0", g, grads[0])
    assert net.call(WORKER, S, "commit", "t1/2.-1.0") == "committed"
    s2 = stage_part(net, S, "t2/2.-1.0", g, grads[1])
    assert net.call(WORKER, S, "commit", "t2/2.-1.0") == "committed"
    if deliver_t1:
        decide_part(net, "t1/2.-1.0", S, s1, commit=True)
    decide_part(net, "t2/2.-1.0", S, s2, commit=True)
    return int(ps[0]), g


def test_a_dead_servers_undecided_delta_under_a_later_committed_one_is_committed_not_dropped(ctx):
    # t2's delta (version 2) is held at the parity server until t1's (version 1) is applied. S dies and nobody
    # decides t1; the three-timeouts rule would drop it, and the next degraded write (version 1 again) would
    # let t2 apply on top of it: the record then mixes two lineages, and S's rebuilt rows are garbage
    # (values like 3e3 from xor-ed bit patterns: the NaN a CI run of the paused-server e2e died of). A later
    # version from S is proof that S committed t1: it is committed.
    net, twin = Net(ctx, wait_timeout=0.2, txn_timeout=5.0), Net(ctx)
    ps, g = _two_commits_on_the_same_rows(net, ctx, deliver_t1=False)
    _two_commits_on_the_same_rows(twin, ctx)
    assert len(net[ps].parity.held) == 1 and ("t1/2.-1.0", S) in net[ps].parity.staged
    net.kill(S)
    with pytest.raises(Busy):  # nothing builds on the record while it lacks t1 and t2
        net.call(WORKER, ps, "stage", "t3/4.2.0", g, torch.ones(3, ctx.dim), S)
    net.clock.advance(20.0)
    net[ps].expire()
    assert net[ps].parity.resolved[("t1/2.-1.0", S)] == "committed" and net[ps].parity.held == []
    grads = torch.randn(3, ctx.dim, generator=torch.Generator().manual_seed(12))
    net.call(WORKER, ps, "stage", "t3/4.2.0", g, grads, S)  # a degraded write, then the rebuild
    net.call(WORKER, ps, "commit", "t3/4.2.0")
    commit_part(twin, S, "t3/4.2.0", stage_part(twin, S, "t3/4.2.0", g, grads))
    assert_matches_twin(net, twin)
    net.replace(S)
    net.recover(S, lock_group_rows=1000)
    assert_fully_recovered(net, twin)


def test_a_dead_servers_deltas_delivered_after_its_failure_are_refused_and_the_part_becomes_a_degraded_write(
    ctx,
):
    # Worker A's part is staged at S and S dies; before A delivers the deltas (A is slow), S is declared
    # failed and worker B stages a degraded write of the same rows at their parity server. Had A's deltas been
    # staged and committed on S's behalf before B's commit, both would build on the same version: the record
    # takes A's and skips B's as a duplicate while the acting home's materialized rows hold B's, and the next
    # degraded write xors onto the wrong base. The parity server refuses them instead: A aborts the part on
    # S's behalf and retries it as a degraded write, after B's.
    net, twin = Net(ctx, wait_timeout=0.2), Net(ctx)
    local = torch.tensor([0, 4, 8])
    ps = int(ctx.placement.parity_of(S, local)[0][0])
    g = ctx.placement.global_id(S, local)
    gen = torch.Generator().manual_seed(13)
    a, b = torch.randn(3, ctx.dim, generator=gen), torch.randn(3, ctx.dim, generator=gen)
    late = net.call(WORKER, S, "stage", "a/2.-1.0", g, a)
    assert {x.parity_server for x in late.batches} == {ps}
    net.kill(S)
    Worker(net).pull(g)  # the rows are materialized at the acting home
    net.call(WORKER, ps, "stage", "b/4.2.0", g, b, S)
    with pytest.raises(NotOwner):
        net.call(WORKER, ps, "stage_deltas", [wire_copy(x, ps) for x in late.batches])
    assert net.call(WORKER, ps, "commit", "b/4.2.0") == "committed"
    assert net.call(WORKER, ps, "decide_many", [("a/2.-1.0", S, False)]) == ["unknown"]  # A, on S's behalf
    Worker(net).update("a", g, a)  # A's retry: a degraded write now
    for txn, grads in (("b/4.2.0", b), ("a/2.-1.0", a)):
        commit_part(twin, S, txn, stage_part(twin, S, txn, g, grads))
    assert_matches_twin(net, twin)
    net.replace(S)
    net.recover(S, lock_group_rows=1000)
    assert_fully_recovered(net, twin)


def test_expired_degraded_write_releases_the_failed_shards_rows(ctx):
    net = Net(ctx, wait_timeout=0.2, txn_timeout=5.0)
    net.kill(S)
    sub = ctx.placement.global_id(S, torch.tensor([0, 4, 8]))
    ps = int(ctx.placement.parity_of(S, torch.tensor([0]))[0][0])
    net.call(WORKER, ps, "stage", "w/1", sub, torch.ones(3, ctx.dim), S)  # then the worker dies
    net.clock.advance(60.0)
    assert net[ps].expire() == ["w/1"]
    assert net[ps].staged_count() == 0
    net.call(WORKER, ps, "stage", "w2/1", sub, torch.ones(3, ctx.dim), S)  # another worker's write


def test_sum_code_keeps_parity_within_rounding_and_decodes_close_rows():
    ctx = ecrec_ctx("netsim-sum", faultTolerance__ecrec__code="sum")
    net, twin = Net(ctx), Net(ctx)
    for u in make_updates(ctx, 3, seed=12):
        Worker(net).update(*u)
        Worker(twin).update(*u)
    pc = parity_check(net)
    assert pc["stripes"] > 0 and pc["mismatches"] == 0 and pc["in_flight"] == 0
    net.kill(S)
    got = Worker(net).pull(rows_of(ctx, S))
    want = twin[S].rows.records[:, : ctx.dim]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_dense_stage_at_a_replacement_whose_copy_is_not_done_is_refused_at_once(ctx):
    # The cycle this breaks: the replacement's dense copy waits for the surviving replica's dense stages to
    # drain, and the worker commits its stage there only once every part of its pass has answered — so a
    # stage that waited at the replacement for the copy stalled training until a timeout (10 s at every
    # recovery's start). Refused at once instead, the worker commits the survivor's part, the copy (holding
    # that step's dense update) completes, and the retried part does not apply the update a second time.
    net = Net(ctx, wait_timeout=2.0)
    chunk = 1
    survivor, lost = ctx.dense_holders(chunk)
    lo, hi = ctx.dense_bounds[chunk]
    dense_grad = torch.randn(hi - lo, generator=torch.Generator().manual_seed(3))
    at_survivor, g1, grads1 = part_at(ctx, survivor, 8, step="s7")
    net.replace(lost)
    stage_part(net, survivor, at_survivor.txn, g1, grads1, -1, {chunk: dense_grad}, epoch=net.epoch)
    at_lost, g2, grads2 = part_at(ctx, lost, 8, step="s7", seed=6)
    t0 = time.monotonic()
    with pytest.raises(Busy, match="not copied yet"):
        net.call(WORKER, lost, "stage", at_lost.txn, g2, grads2, -1, {chunk: dense_grad}, net.epoch)
    assert time.monotonic() - t0 < 1.0  # not the 2 s wait
    assert at_lost.txn not in net[lost].rows.staged and at_lost.txn not in net[lost].dense.staged
    assert net.call(WORKER, survivor, "commit", at_survivor.txn) == "committed"
    assert net[lost].copy_dense() >= hi - lo  # no longer waits: the survivor's stage drained
    stage_part(net, lost, at_lost.txn, g2, grads2, -1, {chunk: dense_grad}, epoch=net.epoch)
    assert net.call(WORKER, lost, "commit", at_lost.txn) == "committed"
    # Both replicas applied step s7's dense update exactly once.
    want = ctx.optimizer.apply(Net(ctx)[survivor].dense.records[chunk], dense_grad.reshape(-1, 1))
    assert same_bits(net[survivor].dense.records[chunk], want) and same_bits(
        net[lost].dense.records[chunk], want
    )
