"""Two failures at each point of the paper's two-phase commit (commit: rowLocks) with r = 2 (issue #30), on
tests/netsim.py's stores: the fault table of tests/test_store_protocol.py with two servers dying together at
each step of an update — two data servers of its stripes, a data server and a parity server, or both parity
servers of its rows. The job goes on (degraded reads and writes), both are replaced and rebuilt side by side
with updates between their lock groups, and everything ends bit-identical to a twin that never failed, with P
and Q exact and no two-phase-commit state left. (The delta log's failure points with two losses:
tests/test_degraded_r2.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.netsim import WORKER, assert_parity_ok, assert_same_model, bits, logical_model
from tests.test_degraded_r2 import recover_together
from tests.test_store_protocol import Twins, make_updates, rows_of
from tests.test_store_r2 import N, ecrec_job

S, T = 2, 3  # the data server of the faulty part, and another data server of its stripes
P, Q = 0, 1  # P and Q of S's rows at stripe slot 0 (the part touches every slot: k parity server pairs)

# fault -> (the two victims, Net.on match): both die at that point of the first update after it is armed.
FAULTS = {
    "two-data-servers-before-the-stage-answer": ((S, T), dict(method="stage", server=S, phase="after")),
    "two-data-servers-after-the-deltas-staged": (
        (S, T),
        dict(method="stage_deltas", server=Q, phase="after"),
    ),
    "two-data-servers-before-commit": ((S, T), dict(method="commit", server=S, phase="before")),
    "two-data-servers-after-commit": ((S, T), dict(method="commit", server=S, phase="after")),
    "two-data-servers-before-the-decisions": ((S, T), dict(method="decide_many", server=Q, phase="before")),
    "data-and-parity-server-before-the-deltas": (
        (S, Q),
        dict(method="stage_deltas", server=Q, phase="before"),
    ),
    "data-and-parity-server-after-the-deltas": ((S, Q), dict(method="stage_deltas", server=Q, phase="after")),
    "data-and-parity-server-before-the-decisions": (
        (S, Q),
        dict(method="decide_many", server=Q, phase="before"),
    ),
    "both-parity-servers-after-the-deltas": ((P, Q), dict(method="stage_deltas", server=Q, phase="after")),
    "both-parity-servers-before-the-decisions": (
        (P, Q),
        dict(method="decide_many", server=Q, phase="before"),
    ),
}


@pytest.fixture(scope="module")
def ctx():
    return ecrec_job(commit="rowLocks")


@pytest.mark.parametrize("fault", FAULTS)
def test_two_failures_at_any_step_recover_bit_identical_to_no_failure(ctx, fault):
    victims, match = FAULTS[fault]
    both = Twins(ctx)
    net, twin = both.net, both.twin
    updates = make_updates(ctx, 10, seed=7)
    for u in updates[:2]:
        both.update(u)
    net.on(hook=lambda _call: [net.kill(v) for v in victims], caller=WORKER, **match)
    both.update(updates[2])
    assert all(net.is_failed(v) for v in victims), "the fault point was not reached"
    for u in updates[3:5]:  # degraded writes of the victims' rows at their acting homes
        both.update(u)
    for v in victims:  # degraded reads: every update exactly once
        lost = rows_of(ctx, v)
        got = both.worker.pull(lost)
        assert torch.equal(bits(got), bits(twin[v].rows.records[:, : ctx.dim])), f"shard {v}"
    for v in victims:
        net.replace(v)
    more = iter(updates[5:])

    def between() -> None:  # an update after each lock group while there are any left
        if (u := next(more, None)) is not None:
            both.update(u)

    recover_together(net, list(victims), lock_group_rows=200, between=between)
    assert next(more, None) is None, "fewer lock groups than updates: some ran after the rebuilds"
    assert all(net[s].recovery_done() for s in range(N))
    assert_same_model(logical_model(net), logical_model(twin))
    assert_parity_ok(net)
    assert net.staged_total() == 0 and twin.staged_total() == 0
