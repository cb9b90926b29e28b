"""DenseReplicas (ecrec.core.dense): a server's dense chunks and their 2PC state, without I/O."""

from __future__ import annotations

import torch

from ecrec.core.dense import LOG_STEPS, DenseReplicas
from ecrec.core.optim import make_optimizer

OPT = make_optimizer("adagrad", 0.1)


def replicas(ready: bool = True) -> DenseReplicas:
    records = {0: OPT.init_records(torch.arange(4.0).reshape(-1, 1)), 3: OPT.init_records(torch.ones(2, 1))}
    return DenseReplicas(OPT, records, {0: ready, 3: ready})


def test_a_staged_update_applies_on_commit_only_and_an_abort_leaves_nothing():
    d = replicas()
    before = d.records[0].clone()
    g = torch.full((4,), 0.5)
    d.stage("w0-1/2.-1.0", "w0-1", {0: g})
    g.fill_(9.0)  # the caller's buffer may be reused: the stage keeps its own copy
    assert torch.equal(d.records[0], before) and d.in_flight(0) and not d.in_flight(3)
    assert d.commit("w0-1/2.-1.0", "w0-1")
    assert torch.equal(d.records[0], OPT.apply(before, torch.full((4, 1), 0.5)))
    assert not d.in_flight(0) and list(d.log[0]) == ["w0-1"]
    assert not d.commit("w0-1/2.-1.0", "w0-1")  # nothing left to apply: a repeated commit changes nothing
    d.stage("w0-2/2.-1.0", "w0-2", {0: torch.ones(4)})
    d.abort("w0-2/2.-1.0")
    assert not d.in_flight(0) and not d.commit("w0-2/2.-1.0", "w0-2")
    assert list(d.log[0]) == ["w0-1"]


def test_a_copy_drains_stages_and_the_replacement_skips_steps_the_copy_holds():
    survivor, replacement = replicas(), replicas(ready=False)
    assert replacement.not_ready([0, 3]) == [0, 3] and not replacement.all_ready()
    survivor.stage("w0-1/2.-1.0", "w0-1", {0: torch.ones(4)})
    survivor.begin_copy(0, epoch=7)
    assert survivor.any_copying([0]) and not survivor.any_copying([3])  # new stages of chunk 0 wait
    assert survivor.stale(0, 6) and not survivor.stale(0, 7) and not survivor.stale(0, 0)
    assert survivor.in_flight(0)  # the copy waits for this one
    survivor.commit("w0-1/2.-1.0", "w0-1")
    recs, steps = survivor.copy_out(0)
    survivor.end_copy(0)
    assert not survivor.any_copying([0]) and steps == ["w0-1"]
    replacement.install(0, recs, steps)
    assert replacement.ready[0] and replacement.not_ready([0, 3]) == [3]
    # the worker retries step w0-1 at the replacement too: already in the copy, not applied twice
    replacement.stage("w0-1/1.-1.1", "w0-1", {0: torch.ones(4)})
    assert not replacement.in_flight(0) and torch.equal(replacement.records[0], survivor.records[0])


def test_the_log_of_applied_steps_is_bounded():
    d = replicas()
    for i in range(LOG_STEPS + 5):
        d.stage(f"t{i}", f"s{i}", {3: torch.zeros(2)})
        d.commit(f"t{i}", f"s{i}")
    assert len(d.log[3]) == LOG_STEPS and next(iter(d.log[3])) == "s5"
    assert d.length(0) == 4 and torch.equal(d.values(0), torch.arange(4.0)) and 0 in d and 1 not in d
