"""A worker's read-ahead while a shard is rebuilt (ecrec.worker.ReadAhead, PSClient.warm, the warm Pull): the
next steps' rows announced to the replacement once per half window, each batch made once and the same as
without it; a warm pull rebuilds exactly the rows not reached yet and answers none."""

from __future__ import annotations

import torch

from ecrec.data import Batch
from ecrec.worker import ReadAhead
from tests.netsim import Net, Worker, assert_same_model, logical_model
from tests.test_store_protocol import ecrec_ctx, make_updates

S = 2


def batch_of(step: int) -> Batch:
    ids = torch.tensor([[step, 100 + step], [step, 7]])
    return Batch(torch.zeros(2, 1), ids, torch.zeros(2))


class Recorder:
    def __init__(self):
        self.made: list[int] = []
        self.warmed: list[torch.Tensor] = []
        self.recovering = False

    def make(self, step: int) -> Batch:
        self.made.append(step)
        return batch_of(step)


def ahead(rec: Recorder, last: int = 1000, steps: int = 8) -> ReadAhead:
    offsets = torch.tensor([0, 1000])
    return ReadAhead(rec.make, last, offsets, rec.warmed.append, lambda: rec.recovering, steps)


def test_without_a_recovery_each_batch_is_made_at_its_step_and_nothing_is_announced():
    rec = Recorder()
    ra = ahead(rec)
    for step in range(5):
        assert torch.equal(ra.batch(step).ids, batch_of(step).ids)
    assert rec.made == [0, 1, 2, 3, 4] and rec.warmed == []


def test_while_a_shard_is_rebuilt_the_next_steps_rows_go_ahead_once_per_half_window():
    rec = Recorder()
    ra = ahead(rec, steps=8)
    ra.batch(0)
    rec.recovering = True
    got = [ra.batch(step) for step in range(1, 14)]
    assert [torch.equal(b.ids, batch_of(s).ids) for s, b in zip(range(1, 14), got, strict=True)] == [
        True
    ] * 13
    assert sorted(rec.made) == list(range(0, 21)) and len(set(rec.made)) == len(rec.made)  # each made once
    # at step 1: steps 1-8; at step 5 (8 is within half a window): 9-12; at step 9: 13-16; at step 13: 17-20
    want = [range(1, 9), range(9, 13), range(13, 17), range(17, 21)]
    assert len(rec.warmed) == len(want)
    for warmed, steps in zip(rec.warmed, want, strict=True):
        ids = torch.cat([(batch_of(s).ids + torch.tensor([0, 1000])).reshape(-1) for s in steps])
        assert torch.equal(warmed, torch.unique(ids))


def test_the_window_ends_with_the_job_and_a_rollback_drops_nothing_it_needs():
    rec = Recorder()
    rec.recovering = True
    ra = ahead(rec, last=6, steps=8)
    ra.batch(0)
    assert sorted(rec.made) == list(range(6))  # not past the last step
    ra.batch(3)  # a jump ahead (a rollback to a later checkpoint) drops the batches before it
    assert sorted(ra._made) == [4, 5]
    assert torch.equal(ra.batch(1).ids, batch_of(1).ids)  # a step back is made again


def test_a_warm_pull_rebuilds_the_rows_a_replacement_has_not_reached_and_changes_nothing_else():
    ctx = ecrec_ctx("readahead")
    net, twin = Net(ctx), Net(ctx)
    for u in make_updates(ctx, 3, seed=4):
        Worker(net).update(*u)
        Worker(twin).update(*u)
    rep = net.replace(S)
    local = torch.tensor([0, 3, 17, 40])
    g = ctx.placement.global_id(S, local)
    net.call(0, S, "warm", g)
    assert torch.equal(rep.row_ready.nonzero().squeeze(1), local)
    assert torch.equal(rep.rows.records[local], twin[S].rows.records[local])
    net.call(0, S, "warm", g)  # again: nothing left to rebuild
    assert int(rep.stats["rows_recovered"]) == 4
    net.recover(S, lock_group_rows=500)
    assert_same_model(logical_model(net), logical_model(twin))
