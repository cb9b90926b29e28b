"""The pure parts of degraded mode with r = 2 (issue #30): ecrec.core.cuts (rows aligned per failure and their
cuts, rows a former acting home wrote), ParityParticipant.realign, the acting home by Placement, and the
versions a worker recovers from a part's delta batches (core/update.part_versions)."""

from __future__ import annotations

import pytest
import torch

from ecrec.core.codes import make_code
from ecrec.core.cuts import VIA_KEPT, Cuts
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
