"""Checkpoints of strategy ecrec, for its coming checkpoint fallback (docs/protocol.md, "Checkpoint strategies"):
a shard's full copy holds its parity records and their versions besides its rows and dense chunks, and loading
one puts back the whole shard — data, versions, dense chunks, parity, pver — and resets every piece of
protocol state in flight to what a freshly started, fully rebuilt server has.

In-memory servers (tests/netsim.py), both commit modes: train, checkpoint every server, train on with work
left in flight and more than r servers lost and replaced, load the checkpoint everywhere, and train again
with the same step ids (a rollback replays its steps): every server ends bit-identical to a twin that went
on from the checkpointed state without the detour, with every parity record exact.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from ecrec.core.update import StepUpdate
from ecrec.ft.files import CheckpointError, ManifestStore, write_shard
from ecrec.jobctx import JobContext
from ecrec.store import ShardStore
from ecrec.wire import InvalidRequest
from tests.conftest import make_ctx
from tests.netsim import (
    WORKER,
    Net,
    Worker,
    assert_parity_ok,
    assert_same_model,
    commit_part,
    logical_model,
    stage_part,
    wire_copy,
)

N, K = 5, 4
A, B, C = 1, 2, 4  # A and D keep work in flight; B fails first, then a second server (C, or A): > r lost
D = 3
Update = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]
Tensors = dict[str, torch.Tensor]


def ecrec_ctx(commit: str) -> JobContext:
    return make_ctx(
        f"ckpt-{commit}",
        faultTolerance__strategy="ecrec",
        servers__replicas=N,
        faultTolerance__ecrec__k=K,
        faultTolerance__ecrec__commit=commit,
    )


def commit_mode(ctx: JobContext) -> str:
    return ctx.spec.fault_tolerance.ecrec.commit


@pytest.fixture(scope="module", params=["rowLocks", "deltaLog"])
def ctx(request) -> JobContext:
    return ecrec_ctx(request.param)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors (tests/conftest.py)


def make_updates(ctx: JobContext, steps: range, seed: int) -> list[Update]:
    """Worker 0's steps: hot rows touched by every step (versions climb) plus random cold rows."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in steps:
        hot = torch.randperm(120, generator=gen)[:60]
        rest = torch.randperm(ctx.placement.num_rows, generator=gen)[:200]
        g = torch.unique(torch.cat([hot, rest]))
        g = g[torch.randperm(g.numel(), generator=gen)]
        grads = torch.randn(g.numel(), ctx.dim, generator=gen)
        out.append((f"w0-{i}", g, grads, torch.randn(ctx.dense_numel, generator=gen)))
    return out


def logged_update(net: Net, step: str, g: torch.Tensor, grads: torch.Tensor, dense: torch.Tensor) -> None:
    """One step under commit: deltaLog, as the worker does it without failures in flight: apply every part
    at its data server (or a failed shard's rows at their acting homes), then deliver the deltas to the live
    parity servers and wait until they are applied."""
    ctx = net.ctx
    update = StepUpdate(
        step, ctx.placement, g, [ctx.dense_holders(c) for c in range(ctx.num_servers)], stable_txns=True
    )
    batches = []
    for part in update.plan(net.view()):
        chunks = {c: dense[slice(*ctx.dense_bounds[c])].clone() for c in part.dense}
        _n, out = net.call(
            WORKER,
            part.target,
            "apply_part",
            part.txn,
            g[part.pos],
            grads[part.pos].clone(),
            part.src,
            chunks,
        )
        batches += [wire_copy(b, b.parity_server) for b in out]
    for server in sorted({b.parity_server for b in batches} - net.failed):
        mine = [b for b in batches if b.parity_server == server]
        assert net.call(WORKER, server, "deliver", mine, True) == []


def train(net: Net, updates: list[Update]) -> None:
    for u in updates:
        if commit_mode(net.ctx) == "deltaLog":
            logged_update(net, *u)
        else:
            Worker(net).update(*u)


def shard_state(store: ShardStore) -> Tensors:
    """Everything a shard's checkpoint holds, copied."""
    out = {
        "rows": store.rows.records,
        "versions": store.rows.versions,
        "parity": store.parity.parity,
        "pver": store.parity.pver,
    }
    out |= {f"dense.{c}": recs for c, recs in store.dense.records.items()}
    return {key: t.clone() for key, t in out.items()}


def assert_same_tensors(got: Tensors, want: Tensors, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, t in want.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, f"{what}: {key}"
        assert torch.equal(got[key].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), (
            f"{what}: {key} differs"
        )


def assert_fresh(store: ShardStore) -> None:
    """Nothing in flight: the protocol state of a freshly started server that has rebuilt everything."""
    rows, parity, dense = store.rows, store.parity, store.dense
    assert not rows.staged and not rows.locks.holders() and bool((rows.locks.owner == -1).all())
    assert not parity.staged and not parity.staged_at and not parity.resolved
    assert not parity.pending and not parity.held and not bool(parity.held_marks().any())
    assert len(store.deltalog) == 0 and not store.held_from and not store.refused and not store.accepted
    assert not store.acting.staged and not store.acting.locks and not store.acting.cache
    assert not store.replacement and store.recovery_done() and parity._all_ready
    assert not bool(store.parity_rebuilding.any()) and not store.dense_copying_in
    assert not dense.staged and not dense.copying and not any(dense.log.values())
    assert not store.outcomes and store.staged_count() == 0


def in_flight(net: Net) -> dict[str, int]:
    """What the live servers have in flight, summed over them."""
    stores = list(net.stores.values())
    return {
        "staged parts": sum(len(s.rows.staged) for s in stores),
        "staged deltas": sum(len(s.parity.staged) for s in stores),
        "held deltas": sum(len(s.parity.held) for s in stores),
        "logged parts": sum(len(s.deltalog) for s in stores),
        "refused": sum(len(s.refused) for s in stores),
        "accepted": sum(len(s.accepted) for s in stores),
        "materialized": sum(len(s.acting.cache) for s in stores),
        "outcomes": sum(len(s.outcomes) for s in stores),
        "replacements": sum(s.replacement for s in stores),
    }


def rows_of(ctx: JobContext, s: int, local: list[int]) -> torch.Tensor:
    return ctx.placement.global_id(s, torch.tensor(local))


def leave_work_in_flight(net: Net, hand: list[Update]) -> None:
    """Updates of A's and D's rows left half done, then a second failure: more than r servers lost.

    rowLocks: a part committed at A whose decision never reached the parity servers (staged there), a later
    one of the same rows decided first (held there for its predecessor), a part staged at A and one at D
    (rows locked, deltas staged), then C dies. deltaLog: the same two at A (applied; the first never
    delivered, the second delivered and held) and at D, then A dies: its held deltas are dropped and
    remembered as refused, D's stay held."""
    ctx = net.ctx
    (s1, _, gr1, _), (s2, _, gr2, _), (s3, _, gr3, _), (s4, _, gr4, _) = hand
    rows_a = rows_of(ctx, A, [0, 1, 2, 3, 5, 6, 7])  # every stripe slot: deltas for every parity server
    rows_a2, rows_d = rows_of(ctx, A, [9, 10]), rows_of(ctx, D, [0, 1, 2, 3])
    n = rows_a.numel()
    if commit_mode(ctx) == "rowLocks":
        first = stage_part(net, A, f"{s1}/{A}.-1.0", rows_a, gr1[:n])
        assert commit_part(net, A, f"{s1}/{A}.-1.0") == "committed"  # its decision is never sent
        second = stage_part(net, A, f"{s2}/{A}.-1.0", rows_a, gr2[:n])
        assert commit_part(net, A, f"{s2}/{A}.-1.0", second) == "committed"  # decided ahead of `first`
        assert first.batches and second.batches
        stage_part(net, A, f"{s3}/{A}.-1.0", rows_a2, gr3[:2])
        stage_part(net, D, f"{s4}/{D}.-1.0", rows_d, gr4[:4])
        net.kill(C)  # the worker, stopped by the failure, never commits or decides these
        return
    _n, first = net.call(WORKER, A, "apply_part", f"{s1}/{A}.-1.0", rows_a, gr1[:n])
    _n, second = net.call(WORKER, A, "apply_part", f"{s2}/{A}.-1.0", rows_a, gr2[:n])
    for server in sorted({b.parity_server for b in second} - net.failed):
        mine = [wire_copy(b, server) for b in second if b.parity_server == server]
        assert net.call(WORKER, server, "deliver", mine, False) == []  # held: `first` never comes
    net.call(WORKER, D, "apply_part", f"{s3}/{D}.-1.0", rows_d, gr3[:4])
    _n, later = net.call(WORKER, D, "apply_part", f"{s4}/{D}.-1.0", rows_d, gr4[:4])
    for server in sorted({b.parity_server for b in later} - net.failed - {A}):
        mine = [wire_copy(b, server) for b in later if b.parity_server == server]
        assert net.call(WORKER, server, "deliver", mine, False) == []  # held, and stays held: D lives
    net.kill(A)
    for store in list(net.stores.values()):
        store.expire()  # settles A's held deltas: dropped, their rows remembered for their deliverer


def test_a_checkpoint_holds_parity_and_loading_it_rolls_every_server_back_to_one_consistent_cut(ctx):
    net, twin = Net(ctx), Net(ctx)
    before = make_updates(ctx, range(1, 3), seed=1)
    detour = make_updates(ctx, range(3, 11), seed=2)
    train(net, before)
    train(twin, before)
    ckpt = {s: net[s].checkpoint_tensors() for s in range(N)}
    for s in range(N):
        assert {"parity", "pver"} <= set(ckpt[s]) and ckpt[s]["pver"].dtype == torch.int64
        assert_same_tensors(ckpt[s], shard_state(net[s]), f"checkpoint of shard {s}")
    assert_parity_ok(net)

    # The detour: more steps, a failure with degraded writes at the acting homes, work left in flight, a
    # second failure (parity cannot rebuild two lost shards) and empty replacements for both.
    train(net, detour[:2])
    net.kill(B)
    train(net, detour[2:4])  # degraded writes of B's rows at their acting homes
    leave_work_in_flight(net, detour[4:])
    victim = C if commit_mode(ctx) == "rowLocks" else A
    assert net.is_failed(B) and net.is_failed(victim)
    net.replace(B)
    net.replace(victim)
    left = in_flight(net)
    if commit_mode(ctx) == "rowLocks":
        want = ["staged parts", "staged deltas", "held deltas"]
    else:
        want = ["logged parts", "held deltas", "refused", "accepted"]
    for what in [*want, "materialized", "outcomes", "replacements"]:
        assert left[what] > 0, f"nothing {what} before the load: {left}"

    for s in range(N):
        assert net[s].load_checkpoint(ckpt[s]) == ctx.placement.rows_on(s)
    for s in range(N):
        assert_same_tensors(shard_state(net[s]), ckpt[s], f"shard {s} after the load")
        assert_same_tensors(shard_state(net[s]), shard_state(twin[s]), f"shard {s} against the twin")
        assert_fresh(net[s])
    assert_parity_ok(net)

    # The workers replay the steps since the checkpoint, under the same step ids: each applies anew.
    train(net, detour)
    train(twin, detour)
    assert_parity_ok(net)
    assert_same_model(logical_model(net), logical_model(twin))
    for s in range(N):
        assert_same_tensors(shard_state(net[s]), shard_state(twin[s]), f"shard {s} after the replay")


def test_a_checkpoint_of_another_shape_is_refused_and_changes_nothing(ctx):
    net = Net(ctx)
    train(net, make_updates(ctx, range(1, 2), seed=3))
    good = net[A].checkpoint_tensors()
    rows_a = rows_of(ctx, A, [0, 1])
    if commit_mode(ctx) == "rowLocks":
        stage_part(net, A, "w0-9/1.-1.0", rows_a, torch.ones(2, ctx.dim))  # staged: stays staged
    else:
        net.call(WORKER, A, "apply_part", "w0-9/1.-1.0", rows_a, torch.ones(2, ctx.dim))  # logged: stays
    store = net[A]
    state, flight = shard_state(store), in_flight(net)
    n_par = store.parity.parity.shape[0]
    bad = [
        {**good, "parity": torch.zeros(n_par + 1, ctx.record_width)},
        {**good, "pver": torch.zeros(n_par, K + 1, dtype=torch.int64)},
        {k: v for k, v in good.items() if k != "pver"},  # a checkpoint without parity (another strategy's)
        {**good, "rows": good["rows"][:-1]},
    ]
    for tensors in bad:
        with pytest.raises(InvalidRequest, match="checkpoint of shard 1: (parity|pver|rows) is"):
            store.load_checkpoint(tensors)
        assert_same_tensors(shard_state(store), state, "a refused load")
        assert in_flight(net) == flight
    assert "w0-9/1.-1.0" in store.rows.staged or "w0-9/1.-1.0" in store.deltalog  # still in flight


def test_loading_no_checkpoint_gives_the_initial_state_with_its_parity(ctx):
    net, fresh = Net(ctx), Net(ctx)
    train(net, make_updates(ctx, range(1, 3), seed=5))
    net.kill(B)
    net.replace(B)  # a replacement too: it starts from the seed like the others
    for s in range(N):
        net[s].load_checkpoint(None)
    for s in range(N):
        assert_same_tensors(shard_state(net[s]), shard_state(fresh[s]), f"shard {s}")
        assert bool((net[s].parity.pver == 0).all()) and bool((net[s].rows.versions == 0).all())
        assert_fresh(net[s])
    assert_parity_ok(net)
    updates = make_updates(ctx, range(1, 3), seed=6)
    train(net, updates)
    train(fresh, updates)
    assert_parity_ok(net)
    for s in range(N):
        assert_same_tensors(shard_state(net[s]), shard_state(fresh[s]), f"shard {s} after training")


def test_a_replacement_that_loads_a_checkpoint_is_whole(ctx):
    net = Net(ctx)
    train(net, make_updates(ctx, range(1, 3), seed=7))
    ckpt = {s: net[s].checkpoint_tensors() for s in range(N)}
    net.kill(B)
    store = net.replace(B)
    assert store.replacement and not store.recovery_done() and not bool(store.row_ready.any())
    for s in range(N):
        net[s].load_checkpoint(ckpt[s])
    assert store.recovery_done() and not store.replacement
    assert_fresh(store)
    assert_same_tensors(shard_state(store), ckpt[B], "the replacement")
    assert_parity_ok(net)
    g = ctx.placement.global_id(B, torch.arange(8))
    assert torch.equal(Worker(net).pull(g), ckpt[B]["rows"][:8, : ctx.dim])  # served as loaded, no rebuild
    assert store.stats["rows_recovered"] == 0


@pytest.mark.parametrize("step", ["rebuild_rows", "rebuild_parity", "copy_dense"])
def test_a_rebuild_under_way_when_a_checkpoint_is_loaded_installs_nothing(step):
    ctx = ecrec_ctx("rowLocks")
    net = Net(ctx)
    ckpt = net[B].checkpoint_tensors()
    train(net, make_updates(ctx, range(1, 3), seed=8))  # the survivors move on: a rebuild reads newer state
    net.kill(B)
    store = net.replace(B)
    read = "serve_dense_copy" if step == "copy_dense" else "read_rows"
    net.on(read, lambda _call: store.load_checkpoint(ckpt), caller=B)  # while the step reads its peers
    args = () if step == "copy_dense" else (torch.arange(4),)
    assert net.call(WORKER, B, step, *args) == 0
    assert not net.hooks, "the step never read from a peer"
    assert_same_tensors(shard_state(store), ckpt, "the loaded shard")
    assert_fresh(store)


def test_checkpoint_files_carry_parity_and_their_checksums_cover_it(tmp_path):
    ctx = ecrec_ctx("deltaLog")
    net, twin = Net(ctx), Net(ctx)
    updates = make_updates(ctx, range(1, 3), seed=9)
    train(net, updates)
    train(twin, updates)
    files = [write_shard(tmp_path, 1, s, net[s].checkpoint_tensors(1)) for s in range(N)]
    manifests = ManifestStore(tmp_path, "h")
    manifests.commit(1, [{"rank": 0, "step": 2, "samples": 0}], files)
    train(net, make_updates(ctx, range(3, 5), seed=10))
    for s in range(N):
        net[s].load_checkpoint(manifests.read_shard(1, s))
    for s in range(N):
        assert_same_tensors(shard_state(net[s]), shard_state(twin[s]), f"shard {s} read back")
    assert_parity_ok(net)

    # A flipped byte inside the parity records is caught by the file's checksum.
    path = tmp_path / files[A]["file"]
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    start, _end = json.loads(data[8 : 8 + size])["parity"]["data_offsets"]
    data[8 + size + start] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        manifests.read_shard(1, A)


def test_only_ecrec_copies_parity_and_only_in_full_copies():
    plain = ShardStore(make_ctx("ckpt-plain", faultTolerance__strategy="checkpoint"), 0)
    assert sorted(plain.checkpoint_tensors()) == ["dense.0", "rows", "versions"]
    ecrec = Net(ecrec_ctx("rowLocks"))[0]
    assert {"parity", "pver"} <= set(ecrec.checkpoint_tensors())
    with pytest.raises(InvalidRequest, match="full one"):
        ecrec.snapshots.copy(
            ecrec.rows.records, ecrec.rows.versions, {}, base=1, parity={"parity": ecrec.parity.parity}
        )


def test_a_server_told_to_hold_its_forwards_sends_none_until_told_otherwise():
    """The fallback's rollback (heartbeats: rollingBack): a data server forwards no logged delta, so none from
    before the rollback can land on a parity server that has loaded the checkpoint; it says it holds them
    only once no forward pass is on its way."""
    ctx = ecrec_ctx("deltaLog")
    net = Net(ctx)
    (step, _g, grads, _dense), *_ = make_updates(ctx, range(1), seed=5)
    rows = rows_of(ctx, D, [0, 1, 2, 3])
    net.call(WORKER, D, "apply_part", f"{step}/{D}.-1.0", rows, grads[:4])  # applied, never delivered
    store = net.stores[D]
    assert len(store.deltalog) == 1 and not store.forwards_held()
    store.hold_forwards(True)
    assert store.forwards_held()
    net.clock.advance(net.txn_timeout + 1)  # due: its worker is silent past txnTimeout
    assert store.forward_due() == 0 and len(store.deltalog) == 1
    before = {s: shard_state(net.stores[s]) for s in net.stores if s != D}
    for s, state in before.items():
        assert_same_tensors(shard_state(net.stores[s]), state, f"server {s}")  # nothing reached a peer
    store._forwarding += 1  # a pass that began before the hold is still on its way
    assert not store.forwards_held()
    store._forwarding -= 1
    store.hold_forwards(False)
    assert store.forward_due() == 1 and len(store.deltalog) == 0
    assert_parity_ok(net)
