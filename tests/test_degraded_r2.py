"""Degraded mode with two parity records per stripe (r = 2, issue #30), in the servers' stores: reads of a
failed shard's rows at their acting home (the first live parity server: P's, or Q's where P's is failed too),
degraded writes that change the acting home's parity record and send the other one its delta, and the
realignment of the two records where a failure split a delivery between them. Over tests/netsim.py's stores
and the worker's real DeltaLogDriver (tests/nettransport.py); every result is compared, bit for bit, with the
same updates applied to a job that never failed."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ecrec.core.stripes import other_member_lost
from ecrec.delivery import DeltaLogDriver
from ecrec.store import Busy, PeerFailed
from tests.netsim import (
    WORKER,
    Net,
    Worker,
    assert_parity_ok,
    assert_same_model,
    bits,
    dense_replica_mismatches,
    logical_model,
)
from tests.nettransport import NetTransport, apply, dense_grad, rows_and_grads
from tests.test_store_r2 import N, ecrec_job


def reference(deliveries: str, steps: int) -> Net:
    """The same single worker's `steps` steps on a job that never fails."""
    net = Net(ecrec_job(deliveries))
    driver = DeltaLogDriver(NetTransport(net))
    for i in range(1, steps + 1):
        apply(driver, f"w0-{i}", i)
    driver.flush_decisions()
    return net


def lost_rows(net: Net, ref: Net, shards) -> dict:
    """What the failed shards' rows must be: the reference's records and versions."""
    return {s: (ref[s].rows.records, ref[s].rows.versions) for s in shards}


def assert_dense_like(net: Net, ref: Net) -> None:
    """Every dense chunk has r + 1 = 3 replicas; the live ones are bit-identical to the reference's."""
    for c in range(net.ctx.num_servers):
        holders = net.ctx.dense_holders(c)
        assert len(holders) == 3
        for h in holders:
            if not net.is_failed(h):
                assert torch.equal(bits(net[h].dense.records[c]), bits(ref[holders[0]].dense.records[c])), (
                    c,
                    h,
                )
    assert dense_replica_mismatches(net) == 0


def degraded_pull_all(net: Net, s: int) -> torch.Tensor:
    """Every row of shard s read through its acting homes (DegradedPull), in local row order."""
    p = net.ctx.placement
    return Worker(net).pull(p.global_id(s, torch.arange(p.rows_on(s))))


def run_steps(deliveries: str, victim: int, steps: int, before=None) -> tuple[Net, NetTransport]:
    """A single worker's steps writing `victim`'s rows (rows_and_grads); `before(i, net)` runs before step i."""
    net = Net(ecrec_job(deliveries))
    transport = NetTransport(net)
    driver = DeltaLogDriver(transport)
    for i in range(1, steps + 1):
        if before is not None:
            before(i, net)
        g, grads = rows_and_grads(net.ctx, i, shard=victim)
        driver.apply(f"w0-{i}", g, grads, dense_grad(net.ctx))
    driver.flush_decisions()
    return net, transport


def test_the_acting_home_is_the_first_live_parity_server():
    p = ecrec_job().placement
    local = torch.arange(p.rows_on(1))
    (ps, _), (qs, _) = (p.parity_of(1, local, j) for j in range(2))
    server, j = p.acting_parity(1, local, {1})
    assert torch.equal(server, ps) and not bool(j.any())
    down = int(ps[0])  # P of some rows (those at one stripe slot) is failed too: Q's server acts for them
    server, j = p.acting_parity(1, local, {1, down})
    assert torch.equal(server, torch.where(ps == down, qs, ps))
    assert torch.equal(j, (ps == down).to(torch.int64))


@pytest.mark.parametrize("victims", [(s,) for s in range(N)] + [(1, 0), (1, 5), (2, 4), (0, 3)])
def test_degraded_reads_of_one_or_two_lost_shards_are_exact(victims):
    steps = 3
    ref = reference("ride", steps)
    net = reference("ride", steps)  # the same job, then the victims fail
    for s in victims:
        net.kill(s)
    for s in victims:
        want = ref[s].rows.records[:, : net.ctx.dim]
        assert torch.equal(bits(degraded_pull_all(net, s)), bits(want)), f"shard {s} of {victims}"


@pytest.mark.parametrize("deliveries", ["ride", "own"])
@pytest.mark.parametrize("victim", [1, 3])
def test_degraded_writes_keep_p_and_q_exact(deliveries, victim):
    """Shard `victim` fails after two steps; three more steps write its rows at their acting homes (rows of
    every stripe slot: four acting homes, each sending the other parity server its delta)."""
    steps = 5
    net = Net(ecrec_job(deliveries))
    transport = NetTransport(net)
    driver = DeltaLogDriver(transport)
    for i in range(1, steps + 1):
        if i == 3:
            net.kill(victim)
        g, grads = rows_and_grads(net.ctx, i, shard=victim)
        driver.apply(f"w0-{i}", g, grads, dense_grad(net.ctx))
    driver.flush_decisions()
    assert transport.degraded_writes > 0
    ref2, _ = run_steps(deliveries, victim, steps)
    # both parity records of every stripe equal encode(the reference's rows), the lost shard's included
    assert_parity_ok(net, lost_rows(net, ref2, [victim]))
    assert torch.equal(
        bits(degraded_pull_all(net, victim)), bits(ref2[victim].rows.records[:, : net.ctx.dim])
    )


@pytest.mark.parametrize("deliveries", ["ride", "own"])
@pytest.mark.parametrize("cut_at", [0, 2, 3, 4, 5])
def test_a_failure_that_splits_a_delivery_between_p_and_q_loses_and_repeats_nothing(deliveries, cut_at):
    """Shard 1 dies while its step's deltas are being delivered: the parity servers before `cut_at` (in the
    order the worker reaches them) applied them, the others refuse them. Rows at stripe slots whose P took the
    delta and Q did not (and the other way round) exist for most cuts; either way every update is applied once
    — the first live parity server's record holds, the other is realigned to it — and the lost rows, and P
    and Q of every stripe, come out bit-identical to a job that never failed."""
    victim, steps = 1, 5
    net = Net(ecrec_job(deliveries))
    transport = NetTransport(net)
    driver = DeltaLogDriver(transport)
    method = "deliver_early" if deliveries == "ride" else "deliver"
    killed, reached = [], []  # reached: parity servers that took the deltas before the failure

    def cut(call) -> None:
        if killed or call.caller == victim:
            return
        if call.server >= cut_at:
            killed.append(call.server)
            net.kill(victim)
        else:
            reached.append(call.server)

    for i in range(1, steps + 1):
        if i == 3:  # the deltas of step 2 (riding on step 3's stages) or of step 3 (in a round of their own)
            net.hooks.append(
                lambda call: cut(call) if call.method == method and call.phase == "before" else None
            )
        g, grads = rows_and_grads(net.ctx, i, shard=victim)
        driver.apply(f"w0-{i}", g, grads, dense_grad(net.ctx))
    driver.flush_decisions()
    assert killed, "the failure was never injected"
    ref, _ = run_steps(deliveries, victim, steps)
    assert torch.equal(bits(degraded_pull_all(net, victim)), bits(ref[victim].rows.records[:, : net.ctx.dim]))
    assert_parity_ok(net, lost_rows(net, ref, [victim]))
    for s in net.stores:  # the other shards' rows, untouched by the failure
        assert torch.equal(bits(net[s].rows.records), bits(ref[s].rows.records))
    # Rows of the slots whose P took the deltas and Q did not (or the other way round) were realigned, and no
    # others: three rows per slot (rows_and_grads).
    p = net.ctx.placement
    slots = torch.arange(p.k)  # the victim's rows at slot i have local row i: P on (1 - i + k) mod N, Q next
    took = [
        torch.isin(p.parity_of(victim, slots, j)[0], torch.tensor(reached, dtype=torch.int64))
        for j in range(2)
    ]
    split = int((took[0] != took[1]).sum())
    assert sum(net[s].stats["rows_realigned"] for s in net.stores) == 3 * split


@pytest.mark.parametrize("deliveries", ["ride", "own"])
@pytest.mark.parametrize("nth", [1, 2], ids=["after-its-align", "after-its-forward"])
def test_an_acting_home_that_dies_mid_write_hands_its_rows_to_the_other_parity_server(deliveries, nth):
    """Two failures at once: shard 1 fails, then the acting home of some of its rows (P's server) dies in the
    middle of its first degraded write — once the other parity server took the rows' alignment, or also the
    write's delta. The worker writes the rows again at the other parity server (Q's, now their acting home),
    which applies what it has not got and skips what it has: nothing lost, nothing applied twice."""
    victim, steps = 1, 5
    p = ecrec_job().placement
    home = int(p.parity_of(victim, torch.tensor([0]), 0)[0][0])  # P's server of the victim's slot-0 rows
    other = int(p.parity_of(victim, torch.tensor([0]), 1)[0][0])

    def before(i: int, net: Net) -> None:
        if i == 3:
            net.kill(victim)
            net.on("receive_deltas", lambda _c: net.kill(home), caller=home, phase="after", nth=nth)

    net, transport = run_steps(deliveries, victim, steps, before)
    assert net.is_failed(home) and transport.degraded_writes > 0
    ref, _ = run_steps(deliveries, victim, steps)
    assert torch.equal(bits(degraded_pull_all(net, victim)), bits(ref[victim].rows.records[:, : net.ctx.dim]))
    assert_parity_ok(net, lost_rows(net, ref, [victim, home]))
    assert_dense_like(net, ref)
    # the write's delta had reached Q (nth == 2): Q remembers it came from the acting home, and the retry skipped it
    assert bool(net[other].cuts.via) == (nth == 2)


@pytest.mark.parametrize("deliveries", ["ride", "own"])
@pytest.mark.parametrize("nth", [1, 2], ids=["at-its-align", "at-its-forward"])
def test_the_other_parity_server_dying_mid_write_leaves_the_acting_home_exact(deliveries, nth):
    """Two failures at once, the other way round: shard 1 fails, then the other parity server (Q's) of some
    of its rows dies as their acting home aligns them or sends it a write's delta. The acting home goes on
    alone (Q's records are re-encoded when it is rebuilt); its record keeps every update exactly once."""
    victim, steps = 1, 5
    p = ecrec_job().placement
    home = int(p.parity_of(victim, torch.tensor([0]), 0)[0][0])
    other = int(p.parity_of(victim, torch.tensor([0]), 1)[0][0])

    def before(i: int, net: Net) -> None:
        if i == 3:
            net.kill(victim)
            net.on("receive_deltas", lambda _c: net.kill(other), caller=home, server=other, nth=nth)

    net, _ = run_steps(deliveries, victim, steps, before)
    assert net.is_failed(other)
    ref, _ = run_steps(deliveries, victim, steps)
    assert torch.equal(bits(degraded_pull_all(net, victim)), bits(ref[victim].rows.records[:, : net.ctx.dim]))
    assert_parity_ok(net, lost_rows(net, ref, [victim, other]))
    assert_dense_like(net, ref)


@pytest.mark.parametrize("victim", [1, 4])
def test_under_row_locks_p_and_q_stay_exact_through_a_failure(victim):
    """commit: rowLocks (the paper's two-phase commit) with r = 2: a part stages P's and Q's deltas — two
    batches at a server that is P of some of its rows and Q of others — and commits them; after the failure
    degraded writes go to the acting homes, which send the other parity server its delta at commit."""

    def run(kill: bool) -> Net:
        net = Net(ecrec_job(commit="rowLocks"))
        worker = Worker(net)
        for i in range(1, 6):
            if kill and i == 3:
                net.kill(victim)
            g, grads = rows_and_grads(net.ctx, i, shard=victim)
            worker.update(f"w0-{i}", g, grads, dense_grad(net.ctx))
        return net

    net, ref = run(True), run(False)
    assert_parity_ok(ref)
    assert torch.equal(bits(degraded_pull_all(net, victim)), bits(ref[victim].rows.records[:, : net.ctx.dim]))
    assert_parity_ok(net, lost_rows(net, ref, [victim]))


@pytest.mark.parametrize("deliveries", ["ride", "own"])
@pytest.mark.parametrize("cut_at", [0, 3, 5])
@pytest.mark.parametrize("at_once", [True, False], ids=["replaced-at-once", "replaced-later"])
def test_a_replacement_rebuilds_the_union_of_both_records_and_skips_what_it_found(
    deliveries, cut_at, at_once
):
    """Shard 1 dies while its step's deltas are delivered (the split of the tests above), and a replacement
    registers — at once, so that the refused rows are written again at the replacement, which rebuilds them
    on demand; or after two steps of degraded writes. The replacement rebuilds its rows from both parity
    records (the longer prefix of the dead incarnation's updates: each record is realigned to it) and skips
    a rewrite of an update it found. The model and P and Q of every stripe end bit-identical to a job that
    never failed."""
    victim, steps = 1, 5
    done = []

    def before(i: int, net: Net) -> None:
        method = "deliver_early" if deliveries == "ride" else "deliver"

        def cut(call) -> None:
            if not done and call.caller != victim and call.method == method and call.phase == "before":
                if call.server >= cut_at:
                    done.append(call.server)
                    if not at_once:
                        net.kill(victim)
                        return
                    net.replace(victim)
                    net.call(WORKER, victim, "copy_dense")  # (the coordinator's first recovery step)

        if i == 3:
            net.hooks.append(cut)
        if i == 5 and not at_once:
            net.replace(victim)
        if i == 5 or (i == 4 and at_once):
            net.recover(victim, lock_group_rows=64)

    net, _ = run_steps(deliveries, victim, steps, before)
    assert done
    ref, _ = run_steps(deliveries, victim, steps)
    assert net[victim].recovery_done()
    assert_same_model(logical_model(net), logical_model(ref))
    assert_parity_ok(net)


def recover_together(
    net: Net, shards: list[int], lock_group_rows: int = 64, between: Callable[[], None] | None = None
) -> None:
    """The coordinator's recovery plans of several replacements side by side: dense chunks, then every data
    lock group, then every parity group (a parity re-encode reads members another replacement rebuilds).
    `between()` runs after each lock group, e.g. to apply updates while the rebuilds are under way."""
    for s in shards:
        net.call(WORKER, s, "copy_dense")
    for kind in ("rebuild_rows", "rebuild_parity"):
        for s in shards:
            n = net[s].num_rows if kind == "rebuild_rows" else net[s].parity.parity.shape[0]
            for lo in range(0, n, lock_group_rows):
                net.call(WORKER, s, kind, torch.arange(lo, min(n, lo + lock_group_rows)))
                if between is not None:
                    between()


def run_pair(deliveries: str, pair: tuple[int, int], steps: int, fail=None) -> tuple[Net, NetTransport]:
    """A single worker's steps writing the rows of both shards of `pair`. `fail(net)` (None: a job that never
    fails) runs before step 3; before step 5 both shards are replaced and rebuilt side by side."""
    a, b = pair
    net = Net(ecrec_job(deliveries))
    transport = NetTransport(net)
    driver = DeltaLogDriver(transport)
    for i in range(1, steps + 1):
        if fail is not None and i == 3:
            fail(net)
        if fail is not None and i == 5:
            net.replace(a)
            net.replace(b)
            recover_together(net, [a, b])
        ga, grads_a = rows_and_grads(net.ctx, i, shard=a)
        gb, grads_b = rows_and_grads(net.ctx, 100 + i, shard=b)
        driver.apply(f"w0-{i}", torch.cat([ga, gb]), torch.cat([grads_a, grads_b]), dense_grad(net.ctx))
    driver.flush_decisions()
    return net, transport


@pytest.mark.parametrize("deliveries", ["ride", "own"])
@pytest.mark.parametrize("pair", [(1, 2), (1, 5), (0, 3)])
def test_two_shards_lost_at_the_same_step_are_written_degraded_then_rebuilt_together(deliveries, pair):
    """Two servers killed at the same step: their rows are read and written at their acting homes (P's, or
    Q's where P's server is one of the two; a stripe with both lost members decodes from P and Q together),
    then two replacements register and are rebuilt side by side. Every row the worker writes belongs to the
    two lost shards; the model and P and Q of every stripe end bit-identical to a job that never failed."""

    def kill(net: Net) -> None:
        for s in pair:
            net.kill(s)

    net, transport = run_pair(deliveries, pair, 6, kill)
    ref, _ = run_pair(deliveries, pair, 6)
    assert transport.degraded_writes > 0
    assert all(net[s].recovery_done() for s in pair)
    assert_same_model(logical_model(net), logical_model(ref))
    assert_parity_ok(net)
    assert_dense_like(net, ref)


@pytest.mark.parametrize("deliveries", ["ride", "own"])
@pytest.mark.parametrize("pair", [(1, 2), (0, 3), (1, 5)])
@pytest.mark.parametrize("cut_at", [1, 2, 3, 4, 5])
def test_two_shards_dying_while_their_deltas_are_delivered_lose_nothing(deliveries, pair, cut_at):
    """Two servers killed at once while their step's deltas are being delivered: parity servers before
    `cut_at` (in the order the worker reaches them) took the deltas, the others refuse them. A stripe that
    lost both members decodes only from P and Q together, which must reflect the same updates; where one
    record took a lost member's delta and the other refused it, the one behind takes the delta it kept when it
    refused it (and no other). Degraded writes, then two replacements rebuilt side by side: the model and P
    and Q of every stripe end bit-identical to a job that never failed."""
    method = "deliver_early" if deliveries == "ride" else "deliver"
    killed, reached = [], []  # reached: parity servers that took the deltas before the failure

    def cut_when_delivered(net: Net) -> None:
        def cut(call) -> None:
            if killed or call.caller in pair or call.method != method or call.phase != "before":
                return
            if call.server >= cut_at:
                killed.append(call.server)
                for s in pair:
                    net.kill(s)
            else:
                reached.append(call.server)

        net.hooks.append(cut)

    net, _ = run_pair(deliveries, pair, 6, cut_when_delivered)
    assert killed, "the failure was never injected"
    ref, _ = run_pair(deliveries, pair, 6)
    assert all(net[s].recovery_done() for s in pair)
    assert_same_model(logical_model(net), logical_model(ref))
    assert_parity_ok(net)
    # Each row whose P took its delta and Q did not (or the other way round) was brought up once, by the
    # record behind, and no other: caught up where its stripe lost both members, realigned by its acting home
    # where it lost one. Three rows per stripe slot of each lost shard (rows_and_grads).
    p = net.ctx.placement
    slots = torch.arange(p.k)  # a shard's rows at slot i have local row i
    caught = realigned = 0
    for s in pair:
        servers = [p.parity_of(s, slots, j)[0] for j in range(2)]
        took = [torch.isin(t, torch.tensor(reached, dtype=torch.int64)) for t in servers]
        live = ~torch.isin(servers[0], torch.tensor(pair)) & ~torch.isin(servers[1], torch.tensor(pair))
        split = (took[0] != took[1]) & live
        lonely = other_member_lost(p, s, slots, pair)
        caught += 3 * int((split & lonely).sum())
        realigned += 3 * int((split & ~lonely).sum())
    assert sum(net[s].stats["rows_caught_up"] for s in net.stores) == caught
    assert sum(net[s].stats["rows_realigned"] for s in net.stores) == realigned


@pytest.mark.parametrize("deliveries", ["ride", "own"])
def test_a_write_forwarded_to_a_replacement_not_rebuilt_waits_there_for_its_rebuild(deliveries):
    """Two servers killed at once, one of them (server 0) the Q server of some of shard 1's rows; 0's
    replacement registers at once and is not rebuilt for two steps, while shard 1's rows are written at their
    acting homes. A write's delta for a Q record the replacement has not rebuilt is kept for its rebuild
    (found live: the acting home was refused such a forward forever, and the rebuilds waited for it). Then
    1 is replaced too and both are rebuilt: bit-identical to a job that never failed."""
    a, b = 1, 0
    steps = 6

    def run(fail: bool) -> Net:
        net = Net(ecrec_job(deliveries))
        driver = DeltaLogDriver(NetTransport(net))
        for i in range(1, steps + 1):
            if fail and i == 3:
                net.kill(a)
                net.kill(b)
                net.replace(b)
                net.call(WORKER, b, "copy_dense")  # (the coordinator's first recovery step)
            if fail and i == 5:
                net.replace(a)
                recover_together(net, [a, b])
            g, grads = rows_and_grads(net.ctx, i, shard=a)
            driver.apply(f"w0-{i}", g, grads, dense_grad(net.ctx))
        driver.flush_decisions()
        return net

    p = ecrec_job().placement
    assert int(p.parity_of(a, torch.tensor([0]), 1)[0][0]) == b  # b holds Q of a's slot-0 rows
    net, ref = run(True), run(False)
    assert all(net[s].recovery_done() for s in (a, b))
    assert_same_model(logical_model(net), logical_model(ref))
    assert_parity_ok(net)


def test_a_parity_server_that_heard_of_the_failure_first_still_gets_every_delta_of_the_step():
    """As when two server pods are deleted together: both data servers answer the worker's stage (a pod
    serves through its grace period) and die while their deltas are delivered; parity server 4 heard of the
    failure first and turns away the worker's messages as of a stale map (its stage, carrying the last step's
    deltas, and the delivery of this step's), while the others took this step's deltas. Before the worker
    finishes the last step — whose rows server 4 now refuses, written again and decoded from stripes that
    lost both shards — it asks again for this step's: server 4 refuses them too, keeps them, and catches up
    with them where the other record took them. (Found live: the worker finished the last step first, and its
    degraded write waited for a consistent cut forever.) Bit-identical to a job that never failed."""
    pair, x = (1, 2), 4
    answered, delivered, turned_away = set(), set(), []

    def arm(net: Net) -> None:
        def hook(call) -> None:
            if call.caller != WORKER:
                return
            if call.method == "apply_part" and call.phase == "after" and call.server in pair:
                answered.add(call.server)
                if answered == set(pair):  # both answered: server 4 hears of the failure before the worker
                    net[x].epoch = net.epoch + 1
                    transport.before_deliver[x] = lambda: turned_away.append(x)
            elif call.method == "deliver" and call.phase == "after" and answered == set(pair):
                delivered.add(call.server)
                if delivered == set(net.stores) - {x}:  # every other parity server took the step's deltas
                    net.hooks.remove(hook)
                    for s in pair:
                        net.kill(s)

        net.hooks.append(hook)

    net = Net(ecrec_job("ride"))
    transport = NetTransport(net)
    driver = DeltaLogDriver(transport)
    for i in range(1, 7):
        if i == 3:
            arm(net)
        if i == 5:
            for s in pair:
                net.replace(s)
            recover_together(net, list(pair))
        ga, grads_a = rows_and_grads(net.ctx, i, shard=pair[0])
        gb, grads_b = rows_and_grads(net.ctx, 100 + i, shard=pair[1])
        driver.apply(f"w0-{i}", torch.cat([ga, gb]), torch.cat([grads_a, grads_b]), dense_grad(net.ctx))
    driver.flush_decisions()
    assert turned_away and all(net.is_failed(s) is False for s in pair), "the failure was never injected"
    ref, _ = run_pair("ride", pair, 6)
    assert all(net[s].recovery_done() for s in pair)
    assert_same_model(logical_model(net), logical_model(ref))
    assert_parity_ok(net)
    assert net[x].stats["rows_caught_up"] > 0


@pytest.mark.parametrize("committer", ["expiry", "worker"])
def test_an_expired_degraded_write_whose_delta_is_refused_commits_on_a_later_pass_and_says_so_once(
    caplog, committer
):
    """A degraded write's delta, once sent to the other parity server, makes the write committed, never
    aborted (the other record may hold it). Refused there, the write stays until an expiry pass (or its
    worker's retried commit) commits it; a refusal that lasts is said once in the log (its rows are kept from
    a rebuild until it commits), and forgotten once it commits."""
    net = Net(ecrec_job(), txn_timeout=5.0)
    p, victim = net.ctx.placement, 1
    home = int(p.parity_of(victim, torch.tensor([0]), 0)[0][0])
    other = int(p.parity_of(victim, torch.tensor([0]), 1)[0][0])
    net.kill(victim)

    sends = []

    def refuse(call) -> None:  # after the alignment: the write's own send, then two expiry passes
        if (call.method, call.phase, call.caller, call.server) == ("receive_deltas", "before", home, other):
            sends.append(call)
            if 2 <= len(sends) <= 4:
                raise PeerFailed(other, "not now")

    net.hooks.append(refuse)
    g = p.global_id(victim, torch.tensor([0]))
    grads = torch.randn(1, net.ctx.dim, generator=torch.Generator().manual_seed(3))
    with pytest.raises(Busy, match="did not take it"):
        net.call(WORKER, home, "apply_part", "w0-1", g, grads, victim)
    net.clock.advance(6.0)
    with caplog.at_level("WARNING", logger="ecrec.server"):
        for _ in range(2):
            net[home].expire()
            assert net[home].staged_count() > 0
    said = [r.getMessage() for r in caplog.records if "could not commit yet" in r.getMessage()]
    assert len(said) == 1 and "w0-1" in said[0] and f"parity server {other}" in said[0], said
    if committer == "expiry":
        net[home].expire()  # taken now
    else:
        assert net.call(WORKER, home, "commit", "w0-1") == "committed"
    assert len(sends) == 5 and net[home].staged_count() == 0 and net[home].outcomes["w0-1"] == "committed"
    assert "w0-1" not in net[home]._said_committing
