"""The worker registry (ecrec.core.workers) as a state machine: no coordinator, no threads, times passed in."""

from __future__ import annotations

import math

import pytest

from ecrec.core.cluster import Refused
from ecrec.core.workers import WorkerRegistry, step_times


def kinds(reg: WorkerRegistry) -> list[str]:
    return [e["kind"] for e in reg.progress.events]


def started(num_workers: int = 2, at: float = 10.0) -> WorkerRegistry:
    reg = WorkerRegistry(num_workers)
    for rank in range(num_workers):
        reg.register(rank, f"w{rank}-1", 1, False, now=at)
    assert reg.all_registered
    reg.progress.started(at)
    return reg


def test_a_registration_outside_the_ranks_is_malformed_and_one_without_a_name_refused():
    reg = WorkerRegistry(2)
    with pytest.raises(ValueError, match="out of range") as e:
        reg.register(2, "w", 1, False, now=1.0)
    assert not isinstance(e.value, Refused)
    with pytest.raises(Refused, match="must name itself"):
        reg.register(0, "", 1, False, now=1.0)
    assert reg.progress.workers == {} and reg.progress.events == []


def test_a_second_process_for_a_rank_is_admitted_only_as_a_newer_replacement_of_a_lost_one():
    reg = started()
    with pytest.raises(Refused, match="admitted only after that process was reported lost"):
        reg.register(0, "w0-2", 2, True, now=11.0)
    assert reg.lost(0, "w0-1", replacing=True, reason="", now=12.0)
    with pytest.raises(Refused, match="is not after"):
        reg.register(0, "w0-2", 1, True, now=13.0)
    with pytest.raises(Refused, match="admitted only after"):  # not saying it is a replacement
        reg.register(0, "w0-2", 2, False, now=13.0)
    w = reg.register(0, "w0-2", 2, True, now=14.0)
    assert (w.instance, w.incarnation, w.lost, w.heard_at) == ("w0-2", 2, False, 14.0)
    assert kinds(reg)[-2:] == ["worker_lost", "worker_replaced"]
    assert reg.progress.workers_gone() == {"0": 1}


def test_a_first_process_is_not_a_replacement():
    with pytest.raises(Refused, match="never registered"):
        WorkerRegistry(1).register(0, "w0-2", 2, True, now=1.0)


def test_a_rejoin_needs_a_restored_coordinator_and_never_takes_a_rank_back():
    reg = WorkerRegistry(1)
    with pytest.raises(Refused, match="only a coordinator that replaced another"):
        reg.rejoin(0, "w0-1", 1, 5, 320, restored=False, now=1.0)
    reg.restore([{"rank": 0, "instance": "w0-1", "incarnation": 1, "step": 8, "samples": 512}], now=2.0)
    w = reg.rejoin(0, "w0-1", 1, 5, 320, restored=True, now=3.0)
    assert (w.step, w.samples) == (8, 512) and reg.last_step_at is None  # behind the seed: the seed stands
    w = reg.rejoin(0, "w0-1", 1, 12, 768, restored=True, now=4.0)
    assert (w.step, w.samples) == (12, 768) and reg.last_step_at == 4.0
    with pytest.raises(Refused, match="is not newer"):
        reg.rejoin(0, "w0-0", 1, 12, 768, restored=True, now=5.0)
    assert kinds(reg) == ["worker_rejoined", "worker_rejoined"]


def test_a_seed_round_trips_and_one_listing_a_rank_outside_the_job_is_refused():
    reg = started()
    reg.lost(1, "w1-1", replacing=False, reason="exited with code 139", now=11.0)
    again = WorkerRegistry(2)
    again.restore(reg.seed(), now=20.0)
    assert again.seed() == reg.seed()
    assert again.progress.workers[1].done and again.progress.workers[0].heard_at == 20.0
    with pytest.raises(Refused, match="outside"):
        WorkerRegistry(1).restore(reg.seed(), now=20.0)


def test_reports_come_from_the_registered_process_and_never_go_back():
    reg = started()
    with pytest.raises(Refused, match="registered as instance"):
        reg.worker(0, "w0-0")
    with pytest.raises(ValueError, match=r"out of range \[0, 2\)"):
        reg.worker(2, "w2")
    w = reg.worker(0, "w0-1")
    reg.check_report(w, 3, 192, 0.5)
    assert reg.report(w, 3, 192, 0.5, False, None, [10.2, 10.4, 10.6], 10.6, now=11.0) == 192
    assert (w.step, w.samples, w.loss, w.heard_at) == (3, 192, 0.5, 11.0) and reg.last_step_at == 11.0
    with pytest.raises(Refused, match="behind its last report"):
        reg.check_report(w, 2, 192, None)
    with pytest.raises(ValueError, match="finite"):
        reg.check_report(w, 4, 256, math.nan)


def test_a_silent_worker_is_unresponsive_until_it_reports_again():
    reg = started(at=10.0)
    assert reg.check_silent(now=14.0, timeout=5.0) == []
    (w0, w1) = reg.check_silent(now=15.5, timeout=5.0)
    assert w0.unresponsive and w1.unresponsive and reg.check_silent(now=30.0, timeout=5.0) == []
    reg.report(w0, 1, 64, None, False, None, [], None, now=16.0)
    assert not w0.unresponsive and kinds(reg).count("worker_responsive") == 1


def test_a_lost_process_reports_nothing_and_a_finished_one_counts_as_done():
    reg = started()
    assert reg.lost(0, "w0-1", replacing=False, reason="", now=11.0)
    assert not reg.lost(0, "w0-1", replacing=False, reason="", now=12.0)  # reported already
    w0 = reg.progress.workers[0]
    assert reg.report(w0, 5, 320, None, False, None, [], None, now=12.0) is None and w0.step == 0
    assert reg.finished(1, "w1-1", steps=10, samples=640, now=13.0) == 640
    assert reg.finished(1, "w1-1", steps=10, samples=640, now=14.0) is None
    assert reg.all_done and kinds(reg)[-1] == "worker_finished"


def test_a_rollback_takes_every_rank_back_and_restarts_the_stall_clock():
    reg = started()
    for rank in range(2):
        w = reg.worker(rank, f"w{rank}-1")
        reg.report(w, 10, 640, None, True, None, [], None, now=12.0)
    reg.progress.finish(13.0)
    reg.rolled_back({0: (4, 256), 1: (4, 256)}, now=14.0)
    assert [(w.step, w.samples, w.done) for w in reg.progress.workers.values()] == [(4, 256, False)] * 2
    assert reg.progress.finished_at is None and reg.last_step_at == 14.0
    assert reg.progress.events[-1]["steps"] == {"0": 4, "1": 4}


def test_step_times_are_sorted_finite_and_end_with_the_latest():
    assert step_times([3.0, math.inf, 1.0], 4.0) == [1.0, 3.0, 4.0]
    assert step_times([], math.nan) == []
