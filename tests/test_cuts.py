"""The pure parts of degraded mode with r = 2 (issue #30): ecrec.core.cuts (rows aligned per failure and their
cuts, rows a former acting home wrote, refused deltas kept for a catch-up), ParityParticipant.realign, the acting home by Placement, and the
versions a worker recovers from a part's delta batches (core/update.part_versions)."""

from __future__ import annotations

import pytest
import torch

from ecrec.core.codes import make_code
from ecrec.core.cuts import REFUSED_KEPT, VIA_KEPT, Cuts
from ecrec.core.placement import Placement
from ecrec.core.raid6 import PQCode
from ecrec.core.txn import DeltaBatch, ParityParticipant
from ecrec.core.update import part_versions
from ecrec.proto import ecrec_pb2 as pb
from ecrec.server import delta_batch, delta_message, stage_versions
from ecrec.wire import InvalidRequest, ids_to_bytes

P = Placement(num_servers=6, k=4, num_rows=6 * 4 * 5, r=2)


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_rows_are_aligned_per_failure_and_skip_only_updates_within_their_cut():
    cuts = Cuts(P.rows_on)
    assert cuts.unaligned(1, "inc2", t(0, 1, 2)).all()
    cuts.align(1, "inc2", t(0, 1), t(5, 0))
    assert cuts.unaligned(1, "inc2", t(0, 1, 2)).tolist() == [False, False, True]
    # an update that took version 5 (or earlier) is in both records; 6 is not; 0 never reached the dead server
    assert cuts.within(1, "inc2", t(0, 0, 0, 2), t(5, 4, 6, 1)).tolist() == [True, True, False, False]
    assert cuts.within(1, "inc2", t(1), t(0)).tolist() == [False]
    # a later failure of the same shard (another incarnation) starts with nothing aligned
    assert cuts.unaligned(1, "inc3", t(0, 1)).all() and not cuts.within(1, "inc3", t(0), t(1)).any()
    # without a failure key nothing is known aligned, nothing skipped
    assert cuts.unaligned(1, None, t(0)).all() and not cuts.within(1, None, t(0), t(1)).any()
    cuts.align(2, "k", t(3), t(7))
    cuts.unalign(2, t(3))
    assert cuts.unaligned(2, "k", t(3)).all()


def test_rows_a_former_acting_home_wrote_are_known_by_worker_step_and_bounded():
    cuts = Cuts(P.rows_on)
    cuts.applied_via("w0-7", 1, t(4, 8))
    cuts.applied_via("w0-7", 1, t(12))
    assert cuts.came_via("w0-7", 1, t(4, 5, 12)).tolist() == [True, False, True]
    assert not cuts.came_via("w0-7", 2, t(4)).any() and not cuts.came_via("w1-7", 1, t(4)).any()
    for i in range(VIA_KEPT):
        cuts.applied_via(f"w1-{i}", 1, t(0))
    assert not cuts.came_via("w0-7", 1, t(4)).any()  # the oldest forgotten first
    cuts.reset()
    assert not cuts.via and not cuts.by_src


def _participant(code) -> ParityParticipant:
    n, w = 2 * P.parity_rows_on(0), 3
    return ParityParticipant(0, P, code, torch.zeros(n, w), torch.zeros(n, P.k, dtype=torch.int64))


def test_realign_moves_a_member_to_another_prefix_only_where_the_record_is_at_the_base():
    code = make_code("xor", 2, P.k)
    assert isinstance(code, PQCode)
    part = _participant(code)
    part.pver[[0, 1], 2] = t(3, 4)
    d = torch.randn(2, 3)
    b = DeltaBatch(0, "x:align", 5, t(0, 1), t(2, 2), d, t(6, 6), via=3, base=t(3, 3))
    off = part.realign(b)
    assert off.tolist() == [False, True]  # record 1 reflects version 4, not the base 3: left alone
    assert part.pver[0, 2] == 6 and part.pver[1, 2] == 4
    assert torch.equal(part.parity[0].view(torch.int32), d[0].view(torch.int32))
    assert torch.equal(part.parity[1], torch.zeros(3))


def test_the_acting_home_is_the_first_live_parity_server_or_p_when_none_is():
    local = torch.arange(P.rows_on(2))
    (ps, _), (qs, _) = (P.parity_of(2, local, j) for j in range(2))
    server, j = P.acting_parity(2, local, {2, int(ps[0]), int(qs[0])})
    both = (ps == ps[0]) & (qs == qs[0])
    assert torch.equal(server[both], ps[both])  # no live parity server: P's, where any call fails
    assert not bool(j[both].any())


def test_a_parts_versions_come_from_its_p_and_q_batches():
    local = t(0, 3, 5, 6, 9)
    blocks = P.parity_rows_on(0)
    # P's batch names rows 5 and 9 (slot 1, blocks 1 and 2); Q's names row 6 (slot 2, block 1) at B + block
    batches = [(t(1, 2), t(1, 1), t(7, 8)), (t(blocks + 1), t(2), t(4))]
    assert part_versions(P, local, batches).tolist() == [0, 0, 7, 4, 8]
    assert part_versions(P, t(), batches).numel() == 0


def test_an_acting_homes_batch_crosses_the_wire_with_via_and_base_and_a_bad_base_is_refused():
    d = torch.randn(2, 3)
    b = DeltaBatch(4, "w0-1/3.1.0:align", 1, t(0, 1), t(2, 2), d, t(6, 0), via=3, base=t(3, 0))
    got = delta_batch(delta_message(b), 4, 3)
    assert (got.via, got.base.tolist(), got.version.tolist()) == (3, [3, 0], [6, 0])
    plain = delta_batch(delta_message(DeltaBatch(4, "w0-1/1.-1.0", 1, t(0), t(2), d[:1], t(1))), 4, 3)
    assert plain.via == -1 and plain.base is None
    msg = delta_message(b)
    msg.base = ids_to_bytes(t(3))  # one base for two rows
    with pytest.raises(InvalidRequest, match="base"):
        delta_batch(msg, 4, 3)
    msg = delta_message(b)
    msg.ClearField("via")  # a base from no acting home
    with pytest.raises(InvalidRequest, match="base"):
        delta_batch(msg, 4, 3)


def test_a_stage_names_one_version_per_row():
    assert stage_versions(pb.StageRequest(src=1), 2) is None
    ok = pb.StageRequest(src=1, versions=ids_to_bytes(t(4, 0)))
    assert stage_versions(ok, 2).tolist() == [4, 0]
    assert stage_versions(pb.StageRequest(src=-1, versions=ids_to_bytes(t(4, 0))), 2).tolist() == [4, 0]
    with pytest.raises(InvalidRequest, match="versions"):
        stage_versions(ok, 3)


def test_a_batch_from_an_acting_home_names_its_write_of_the_failed_shards_rows():
    from ecrec.server import check_acting_txn

    check_acting_txn("w0-7/3.1.0", 3, 1)  # acting home 3 writing shard 1's rows
    check_acting_txn("rebuild/1.1.0", 1, 1)  # shard 1's replacement aligning the rows it rebuilds
    for txn in ("w0-7/1.-1.0", "w0-7/4.1.0", "w0-7/3.2.0", "not a txn"):
        with pytest.raises(InvalidRequest):
            check_acting_txn(txn, 3, 1)


def _refused(src: int, rows: torch.Tensor, version: torch.Tensor, incarnation: int = 2, seed: int = 0):
    """A delta batch of shard src's local `rows` for their P records on server 0, and the rows."""
    server, block = P.parity_of(src, rows)
    assert bool((server == 0).all())
    slot = P.stripe_of(src, rows)[1]
    d = torch.randn(rows.numel(), 3, generator=torch.Generator().manual_seed(seed))
    return DeltaBatch(0, f"w0-{seed}/{src}.-1.0", src, block, slot, d, version, incarnation), rows


def _rows_with_p_on_0(src: int, n: int) -> torch.Tensor:
    local = torch.arange(P.rows_on(src))
    return local[P.parity_of(src, local)[0] == 0][:n]


def test_a_record_behind_catches_up_with_the_deltas_it_refused_in_version_order_and_no_further():
    src = 2
    rows = _rows_with_p_on_0(src, 2)
    code = make_code("xor", 2, P.k)
    part = _participant(code)
    cuts = Cuts(P.rows_on)
    b2, _ = _refused(src, rows, t(2, 1), seed=2)  # row 0's second update, row 1's first
    b1, _ = _refused(src, rows[:1], t(1), seed=1)  # row 0's first: refused after its successor
    b3, _ = _refused(src, rows[:1], t(3), seed=3)
    for b in (b2, b1, b3):
        cuts.keep(b, P.parity_slot(b.index)[1] * P.k + b.slot)
    slot = int(b1.slot[0])
    target = torch.zeros(2, P.k, dtype=torch.int64)
    target[:, slot] = t(2, 0)  # the other record reflects row 0's first two updates, not row 1's
    blocks = torch.cat([b1.index, b2.index[1:]])
    # a failure being decoded of another incarnation of src (or none): nothing applies
    assert cuts.catch_up(part, blocks, target, {src: 3}.get) == 0
    assert cuts.catch_up(part, blocks, target, {}.get) == 0
    assert cuts.catch_up(part, blocks, target, {src: 2}.get) == 2  # row 0's versions 1 and 2
    want = (b1.delta[0].view(torch.int32) ^ b2.delta[0].view(torch.int32)).view(torch.float32)
    assert torch.equal(part.parity[b1.index[0]].view(torch.int32), want.view(torch.int32))
    assert part.pver[b1.index[0], slot] == 2 and part.pver[b2.index[1], slot] == 0
    assert cuts.catch_up(part, blocks, target, {src: 2}.get) == 0  # there already: nothing twice
    # row 1's record asked alone: its first update applies, and row 0's third (kept, next in line, but its
    # record not among those asked) does not
    only = torch.zeros(1, P.k, dtype=torch.int64)
    only[0, slot] = 1
    assert cuts.catch_up(part, b2.index[1:], only, {src: 2}.get) == 1
    assert part.pver[b2.index[1], slot] == 1 and part.pver[b1.index[0], slot] == 2


def test_rows_aligned_keep_nothing_and_an_incarnation_without_a_name_or_an_older_one_is_not_kept():
    src = 2
    rows = _rows_with_p_on_0(src, 2)
    cuts = Cuts(P.rows_on)
    cuts.align(src, 2, rows[:1], t(0))  # row 0's cut is fixed in the failure of incarnation 2
    b, local = _refused(src, rows, t(1, 1))
    cuts.keep(b, local)
    assert [k.rows.tolist() for k in cuts.kept] == [rows[1:].tolist()]
    cuts.align(src, 2, rows[1:], t(0))  # aligning drops what was kept for the row
    assert not cuts.kept
    unnamed, local = _refused(src, rows, t(1, 1), incarnation=0)
    cuts.keep(unnamed, local)
    stale, local = _refused(src, rows, t(1, 1), incarnation=1)  # before the failure whose cuts are known
    cuts.keep(stale, local)
    assert not cuts.kept
    later, local = _refused(src, rows, t(1, 1), incarnation=3)
    cuts.keep(later, local)  # a newer failure: nothing of it is aligned yet
    assert len(cuts.kept) == 1
    for i in range(REFUSED_KEPT + 5):
        cuts.keep(*_refused(src, rows, t(1, 1), incarnation=4, seed=i))
    assert len(cuts.kept) == REFUSED_KEPT and all(k.batch.incarnation == 4 for k in cuts.kept)
    cuts.reset()
    assert not cuts.kept
