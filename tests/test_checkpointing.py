"""The checkpoint strategies' coordinator state machine (ecrec.core.checkpointing): inputs in, acts out."""

from __future__ import annotations

import pytest

from ecrec.core.checkpointing import (
    Act,
    CheckpointCycle,
    Phase,
    cpr_interval,
    expected_pls,
    full_recovery_interval,
)


def cycle(strategy="checkpoint", workers=2, servers=3, **kw) -> CheckpointCycle:
    kw = kw or {"interval_seconds": 10.0}
    c = CheckpointCycle(strategy, workers, servers, **kw)
    c.started(0.0)
    return c


def report(c, rank, step, done=False, paused=None, stopped=0):
    return c.report(rank, step, step * 10, done, paused, stopped)


def test_a_checkpoint_pauses_every_worker_then_writes_commits_and_resumes():
    c = cycle()
    report(c, 0, 5)
    report(c, 1, 4)
    assert c.tick(9.9) == [] and c.control()["pause"] is None
    assert c.tick(10.0) == [] and c.control()["pause"] == 1 and c.phase is Phase.PAUSING
    assert report(c, 0, 6, paused=1) == []  # one worker paused: the other may still push
    assert report(c, 1, 7, paused=1) == [Act("write", 1, (0, 1, 2))]
    assert c.control()["pause"] == 1  # still paused while the servers write
    assert c.written(1, True, now=12.0) == [Act("commit", 1, progress=((0, 6, 60), (1, 7, 70)))]
    assert c.control()["pause"] is None and c.phase is Phase.TRAINING
    assert c.tick(21.9) == [] and c.tick(22.0) == [] and c.control()["pause"] == 2  # interval from the end


def test_a_failure_rolls_every_rank_back_to_the_last_checkpoint_once_all_stopped_and_the_shard_is_back():
    c = cycle()
    report(c, 0, 5)
    report(c, 1, 5)
    c.tick(10.0)
    report(c, 0, 6, paused=1)
    report(c, 1, 6, paused=1)
    c.written(1, True, now=11.0)
    report(c, 0, 20)
    report(c, 1, 18)
    assert c.failure(2) == [] and c.phase is Phase.STOPPING and c.control()["rollback"] == 1
    assert report(c, 0, 21, stopped=1) == [] and report(c, 1, 18, stopped=1) == []  # shard 2 not back yet
    assert c.registered(2) == [Act("restore", 1, (0, 1, 2))]
    assert c.phase is Phase.RESTORING and c.control()["resume"] is None
    c.restored((0, 1, 2), True, now=15.0)
    ctl = c.control()
    assert ctl["resume"] == {"0": [6, 60], "1": [6, 60]} and ctl["rollback"] == 1 and ctl["pause"] is None
    assert c.steps_redone == (21 - 6) + (18 - 6) and c.rollbacks == 1


def test_a_failure_while_writing_abandons_that_checkpoint_and_falls_back_to_the_one_before():
    c = cycle()
    for r in (0, 1):
        report(c, r, 3)
    c.tick(10.0)
    for r in (0, 1):
        report(c, r, 3, paused=1)
    c.written(1, True, now=10.5)
    c.tick(21.0)
    for r in (0, 1):
        report(c, r, 9, paused=2)
    assert c.phase is Phase.WRITING
    c.failure(0)
    assert c.written(2, True, now=22.0) == []  # too late: never committed
    for r in (0, 1):
        report(c, r, 9, stopped=1)
    assert c.registered(0) == [Act("restore", 1, (0, 1, 2))]


def test_without_a_checkpoint_yet_a_rollback_restores_the_initial_state():
    c = cycle()
    for r in (0, 1):
        report(c, r, 4)
    c.failure(1)
    for r in (0, 1):
        report(c, r, 4, stopped=1)
    assert c.registered(1) == [Act("restore", None, (0, 1, 2))]
    c.restored((0, 1, 2), True, now=3.0)
    assert c.control()["resume"] == {"0": [0, 0], "1": [0, 0]}


def test_a_lost_worker_holds_up_neither_a_checkpoint_nor_a_rollback():
    c = cycle()
    report(c, 0, 5)
    report(c, 1, 5)
    c.worker_lost(1)
    c.tick(10.0)
    assert report(c, 0, 5, paused=1) == [Act("write", 1, (0, 1, 2))]
    c.written(1, True, now=10.0)
    c.failure(0)
    assert report(c, 0, 7, stopped=1) == []
    assert c.registered(0) == [Act("restore", 1, (0, 1, 2))]


def test_cpr_restores_only_the_lost_shard_and_nobody_stops_or_rolls_back():
    c = cycle("cpr")
    for r in (0, 1):
        report(c, r, 5)
    c.tick(10.0)
    for r in (0, 1):
        report(c, r, 5, paused=1)
    c.written(1, True, now=10.0)
    for r in (0, 1):
        report(c, r, 30)
    assert c.failure(2) == [] and c.phase is Phase.TRAINING and c.control()["rollback"] == 0
    assert not c.shard_ready(2)
    assert c.tick(100.0) == [] and c.control()["pause"] is None  # no checkpoint without shard 2
    assert c.registered(2) == [Act("restore", 1, (2,))]
    c.restored((2,), True, now=101.0)
    assert c.shard_ready(2) and c.control()["resume"] is None and c.steps_redone == 0


def test_a_final_checkpoint_ends_training_and_a_later_failure_redoes_nothing():
    c = cycle(workers=1)
    report(c, 0, 50, done=True)
    assert not c.finished
    c.tick(1.0)  # done before the interval: the final checkpoint is due at once
    assert c.phase is Phase.WRITING and c.pending_final
    assert c.written(1, True, now=2.0) == [Act("commit", 1, progress=((0, 50, 500),), final=True)]
    assert c.finished and c.control()["finished"]
    assert c.tick(1000.0) == [] and c.phase is Phase.TRAINING  # no checkpoint after the final one
    c.failure(1)
    assert not c.finished
    report(c, 0, 50, done=True, stopped=1)
    c.registered(1)
    c.restored((0, 1, 2), True, now=3.0)
    assert c.control()["resume"] == {"0": [50, 500]} and c.steps_redone == 0
    report(c, 0, 50, done=True, stopped=1)  # it resumed at its last step: done at once
    assert c.finished


def test_an_interval_in_steps_is_published_ahead_so_every_rank_pauses_after_the_same_step():
    c = cycle(interval_steps=20)
    ctl = c.control()
    assert ctl["pause"] == 1 and ctl["pauseAtStep"] == 20  # armed from the start
    assert report(c, 0, 20, paused=1) == []  # the fast rank waits at step 20 for the slow one
    assert c.holding
    assert report(c, 1, 13) == [] and c.tick(100.0) == []  # no time-based checkpoint meanwhile
    assert report(c, 1, 20, paused=1) == [Act("write", 1, (0, 1, 2))]
    assert c.written(1, True, now=2.0) == [Act("commit", 1, progress=((0, 20, 200), (1, 20, 200)))]
    ctl = c.control()
    assert ctl["pause"] == 2 and ctl["pauseAtStep"] == 40 and not c.holding
    # Every rank done before the next multiple: that checkpoint becomes the final one, at once.
    report(c, 0, 30, done=True)
    report(c, 1, 30, done=True)
    c.tick(3.0)
    assert c.phase is Phase.WRITING and c.pending == 2 and c.pending_final


def test_settings_are_checked():
    with pytest.raises(ValueError):
        CheckpointCycle("ecrec", 1, 1, interval_seconds=1.0)
    with pytest.raises(ValueError):
        CheckpointCycle("checkpoint", 1, 1)


def test_checknrun_resumes_training_once_the_state_is_copied_and_commits_after_the_write():
    c = cycle("checknrun")
    report(c, 0, 5)
    report(c, 1, 5)
    c.tick(10.0)
    report(c, 0, 5, paused=1)
    assert report(c, 1, 5, paused=1) == [Act("write", 1, (0, 1, 2))]  # the first one is a baseline
    assert c.snapshotted(1, True, now=10.1) == [] and c.control()["pause"] is None  # training goes on
    report(c, 0, 9)
    assert c.tick(100.0) == [] and c.phase is Phase.TRAINING  # no second checkpoint while one is written
    # The cut was taken at step 5: that is what the manifest records, not the step at the end of the write.
    assert c.written(1, True, now=11.0) == [Act("commit", 1, progress=((0, 5, 50), (1, 5, 50)))]
    c.tick(21.0)
    report(c, 0, 20, paused=2)
    [write] = report(c, 1, 20, paused=2)
    assert not write.baseline  # an increment over baseline 1
    c.snapshotted(2, True, now=21.0)
    [commit] = c.written(2, True, now=22.0, fraction=0.3)
    assert (commit.baseline, commit.base) == (False, 1) and c.last.base == 1 and c.sizes == [0.3]


def test_checknrun_takes_a_new_baseline_when_the_increments_outgrow_it_and_a_failure_drops_a_write():
    c = cycle("checknrun", workers=1)
    kinds = []
    for n, fraction in enumerate([1.0, 0.4, 0.5, 0.6, 0.7, 0.2], start=1):
        c.tick(10.0 * n + 0.5)
        [write] = report(c, 0, n, paused=n)
        kinds.append(write.baseline)
        c.snapshotted(n, True, now=10.0 * n)
        c.written(n, True, now=10.0 * n, fraction=fraction)
    # baseline; 1.4 > .8; 1.9 > 1.5; 2.5 > 2.4; 3.2 <= 3.5 -> baseline; then increments again
    assert kinds == [True, False, False, False, False, True]
    c.tick(100.0)
    [write] = report(c, 0, 9, paused=7)
    c.snapshotted(7, True, now=100.0)
    c.failure(0)  # a server dies while the servers write checkpoint 7: it is never committed
    assert c.written(7, True, now=101.0) == [] and c.last.checkpoint == 6


def test_cpr_tracks_the_portion_of_lost_samples_and_picks_its_interval_from_the_target():
    c = cycle("cpr", workers=1, servers=4, interval_seconds=10.0, total_samples=1000)
    c.report(0, 10, 100, False, None, 0)
    c.tick(10.0)
    c.report(0, 10, 100, False, 1, 0)
    c.written(1, True, now=10.0)
    c.report(0, 20, 200, False, None, 0)
    c.failure(2)
    # The worker trained on to step 30 before the failure stopped it; its report of that comes after the
    # failure was declared. Lost: 200 samples since the checkpoint, of 1000, on one of 4 servers — counted
    # when the shard is restored, from what the workers said by then.
    c.report(0, 30, 300, False, None, 0)
    assert c.pls == 0.0
    [restore] = c.registered(2)
    assert restore.kind == "restore" and restore.shards == (2,)
    c.restored((2,), True, now=12.0)
    assert c.pls == pytest.approx(200 / (1000 * 4))
    c.restored((2,), True, now=12.5)  # a repeated answer counts nothing twice
    assert c.pls == pytest.approx(200 / (1000 * 4))
    # Eq. 4 and its inverse; full recovery's optimum for comparison (Eq. 1).
    t = cpr_interval(0.1, num_servers=4, mtbf=3600.0)
    assert t == pytest.approx(2 * 0.1 * 4 * 3600.0) and expected_pls(t, 4, 3600.0) == pytest.approx(0.1)
    assert full_recovery_interval(save_seconds=30.0, mtbf=3600.0) == pytest.approx((2 * 30 * 3600) ** 0.5)


def test_a_manifest_that_could_not_be_written_leaves_the_checkpoint_before_it_the_latest():
    c = cycle(workers=1)
    for n in (1, 2):
        c.tick(10.0 * n + 1)
        report(c, 0, 10 * n, paused=n)
        c.written(n, True, now=10.0 * n + 1)
    assert c.last.checkpoint == 2
    c.commit_failed(2)
    assert c.last.checkpoint == 1 and c.last.progress == {0: (10, 100)}
    c.failure(0)
    report(c, 0, 25, stopped=1)
    assert c.registered(0) == [Act("restore", 1, (0, 1, 2))]


def test_cpr_saves_hot_rows_between_full_checkpoints_without_pausing_and_restores_from_the_latest():
    c = cycle("cpr", workers=1, interval_seconds=10.0, hot_interval=2.5)
    report(c, 0, 5)
    assert c.tick(5.0) == []  # no hot-row save before a full checkpoint exists
    c.tick(10.0)
    report(c, 0, 6, paused=1)
    c.written(1, True, now=10.0)
    assert c.tick(12.0) == []
    [write] = c.tick(12.5)
    assert write == Act("write", 2, (0, 1, 2), hot=True, base=1) and c.control()["pause"] is None
    assert c.tick(100.0) == []  # nothing else while it is written
    [commit] = c.written(2, True, now=13.0)
    assert commit.hot and commit.base == 1 and c.last.checkpoint == 1 and c.last_hot == 2
    [write] = c.tick(15.5)
    c.failure(0)  # a failure while hot save 3 is written: it never counts
    assert c.written(3, True, now=16.0) == []
    assert c.registered(0) == [Act("restore", 2, (0,))]  # full checkpoint 1, then hot save 2
    c.restored((0,), True, now=17.0)
    # The next full checkpoint starts the hot saves over.
    c.tick(30.0)
    report(c, 0, 40, paused=c.pending)
    c.written(c.pending, True, now=30.0)
    assert c.last_hot is None and c.tick(31.0) == []


def test_a_successor_coordinator_rolls_back_to_the_stores_newest_checkpoint_with_ids_above_the_old_ones():
    from ecrec.core.checkpointing import Committed

    # The dead coordinator (generation 1) had checkpoint 3 committed and was writing 4, rollback 2 done.
    c = cycle()
    last = Committed(3, {0: (30, 300), 1: (29, 290)})
    assert c.taken_over(last, None, generation=2, now=50.0) == []
    ctl = c.control()
    assert c.phase is Phase.STOPPING and ctl["rollback"] == (1 << 20) + 1 > 2 and ctl["pause"] is None
    # Workers heard of rollback 2 at most: their reports do not count as stopped for this one.
    report(c, 0, 41, stopped=2)
    assert report(c, 1, 40, stopped=2) == []
    report(c, 0, 41, stopped=ctl["rollback"])
    assert report(c, 1, 40, stopped=ctl["rollback"]) == [Act("restore", 3, (0, 1, 2))]
    c.restored((0, 1, 2), True, now=52.0)
    assert c.control()["resume"] == {"0": [30, 300], "1": [29, 290]} and c.rollbacks == 1
    # The next checkpoint's id is above any the dead one could have used (its files may linger).
    c.tick(62.0)
    assert c.control()["pause"] == (1 << 20) + 1


def test_a_successor_under_cpr_trains_on_and_restores_a_replacement_that_was_waiting():
    from ecrec.core.checkpointing import Committed

    c = cycle("cpr", servers=3)
    last = Committed(2, {0: (20, 200), 1: (20, 200)})
    acts = c.taken_over(last, 5, generation=3, now=10.0, failed=(0, 1), registered=(1,))
    assert acts == [Act("restore", 5, (1,))]  # the newest hot-row save over checkpoint 2
    assert c.phase is Phase.TRAINING and c.control()["rollback"] == 0  # nobody stops
    assert not c.shard_ready(0) and not c.shard_ready(1)
    assert c.registered(0) == [Act("restore", 5, (0,))]  # shard 0's replacement comes later


# -- strategy ecrec's checkpoint fallback --------------------------------------------------------------------
def fallback(workers=2, servers=5, **kw) -> CheckpointCycle:
    return cycle("checkpoint", workers, servers, fallback=True, **(kw or {"interval_seconds": 10.0}))


def checkpointed(c: CheckpointCycle, step: int, now: float) -> int:
    """Every rank at `step` pauses for the checkpoint due at `now`, which is written and committed."""
    c.tick(now)
    ckpt = c.control()["pause"]
    for rank in range(c.num_workers):
        report(c, rank, step, paused=ckpt)
    c.written(ckpt, True, now=now + 1)
    return ckpt


def test_fallback_a_lost_shard_holds_checkpoints_off_until_ecrec_rebuilt_it_nobody_stops():
    c = fallback()
    report(c, 0, 5)
    report(c, 1, 5)
    assert checkpointed(c, 5, 10.0) == 1
    report(c, 0, 9)
    report(c, 1, 9)
    assert c.failure(3) == [] and c.phase is Phase.TRAINING and c.control()["rollback"] == 0
    assert c.registered(3) == []  # its replacement: ECRec rebuilds it, nothing is restored
    assert c.tick(30.0) == [] and c.control()["pause"] is None  # due, but held off while shard 3 is down
    assert c.rebuilt(3) == []
    assert c.tick(30.0) == [] and c.control()["pause"] == 2
    assert c.rollbacks == 0 and c.steps_redone == 0


def test_fallback_a_failure_while_paused_abandons_that_checkpoint_and_lets_the_workers_go():
    c = fallback()
    c.tick(10.0)
    report(c, 0, 5, paused=1)
    assert c.control()["pause"] == 1
    assert c.failure(0) == [] and c.control()["pause"] is None and c.phase is Phase.TRAINING
    report(c, 1, 5, paused=1)  # the other worker's late pause changes nothing
    assert c.phase is Phase.TRAINING


def test_fallback_more_than_r_lost_rolls_every_rank_back_to_the_last_checkpoint():
    c = fallback()
    report(c, 0, 5)
    report(c, 1, 5)
    checkpointed(c, 5, 10.0)
    report(c, 0, 12)
    report(c, 1, 11)
    c.failure(1)
    c.registered(1)  # a replacement registered: ECRec started rebuilding it
    c.failure(4)  # a second shard lost while the first is rebuilt: stripes parity cannot rebuild
    assert c.beyond_parity((1, 4), registered=(1,)) == [] and c.phase is Phase.STOPPING
    assert c.control()["rollback"] == 1 and c.control()["resume"] is None
    assert c.beyond_parity((1, 4), registered=(1,)) == [] and c.control()["rollback"] == 1  # once
    assert c.failure(3) == [] and c.control()["rollback"] == 1  # a third: one more for the same rollback
    assert c.registered(3) == []
    assert c.rebuilt(1) == []  # a rebuild finishing now is the restore's business
    assert report(c, 0, 12, stopped=1) == [] and report(c, 1, 11, stopped=1) == []  # shard 4 not back
    assert c.registered(4) == [Act("restore", 1, (0, 1, 2, 3, 4))] and c.phase is Phase.RESTORING
    c.restored((0, 1, 2, 3, 4), True, now=20.0)
    assert c.control()["resume"] == {"0": [5, 50], "1": [5, 50]} and c.phase is Phase.TRAINING
    assert c.rollbacks == 1 and c.steps_redone == (12 - 5) + (11 - 5) and not c.failed
    assert c.tick(31.0) == [] and c.control()["pause"] == 2  # checkpoints go on


def test_reports_while_the_restore_loads_never_lower_where_a_rank_stopped():
    # On a cluster the restore takes seconds, and a stopped worker's heartbeats meanwhile carry the coordinator's
    # count of its last report before the stop (below the checkpoint's step): taken as they came, they read as
    # nothing to redo (stepsRedone 0 after a node loss mid-training, in k8s e2e runs).
    c = fallback()
    report(c, 0, 5)
    report(c, 1, 5)
    checkpointed(c, 5, 10.0)
    report(c, 0, 4)  # (a count from before the checkpoint, late: training goes on and takes it)
    report(c, 0, 9)
    report(c, 1, 8)
    c.failure(1)
    c.failure(2)
    c.beyond_parity((1, 2))
    report(c, 0, 9, stopped=1)
    report(c, 1, 8, stopped=1)
    c.registered(1)
    assert c.registered(2) == [Act("restore", 1, (0, 1, 2, 3, 4))]
    report(c, 0, 4, stopped=1)  # while the restore loads
    report(c, 1, 3, stopped=1)
    c.restored((0, 1, 2, 3, 4), True, now=20.0)
    assert c.steps_redone == (9 - 5) + (8 - 5)
    report(c, 0, 5, stopped=1)  # after it: the resume point, as the coordinator counts it again
    assert c.workers[0].step == 5


def test_fallback_without_a_checkpoint_yet_rolls_back_to_the_initial_state():
    c = fallback()
    report(c, 0, 3, stopped=0)
    report(c, 1, 3)
    c.beyond_parity((0, 2))
    report(c, 0, 3, stopped=1)
    report(c, 1, 3, stopped=1)
    c.registered(0)
    assert c.registered(2) == [Act("restore", None, (0, 1, 2, 3, 4))]


def test_fallback_writes_no_final_checkpoint_and_is_finished_when_every_worker_is_done():
    c = fallback()
    report(c, 0, 100, done=True)
    assert not c.finished
    report(c, 1, 100, done=True)
    assert c.tick(50.0) == [] and c.control()["pause"] is None and c.phase is Phase.TRAINING
    assert c.finished and c.control()["finished"]


def test_fallback_successor_rolls_back_only_if_its_predecessor_was_and_above_its_generations():
    c = CheckpointCycle("checkpoint", 2, 5, interval_seconds=10.0, fallback=True)
    assert c.taken_over(None, None, generation=2, now=0.0, failed=(3,), registered=(3,)) == []
    assert c.phase is Phase.TRAINING and c.failed == {3} and c.control()["rollback"] == 0  # ECRec rebuilds 3
    c.rebuilt(3)
    c.beyond_parity((0, 1))
    assert c.control()["rollback"] == (1 << 20) + 1  # above any generation the predecessor published
    s = CheckpointCycle("checkpoint", 2, 5, interval_seconds=10.0, fallback=True)
    s.taken_over(None, None, generation=3, now=0.0, rolling_back=True)
    assert s.phase is Phase.STOPPING and s.control()["rollback"] == (2 << 20) + 1


def test_fallback_is_a_full_checkpoint_of_strategy_checkpoint_and_only_it_goes_beyond_parity():
    with pytest.raises(ValueError, match="full checkpoints"):
        CheckpointCycle("checknrun", 2, 5, interval_seconds=10.0, fallback=True)
    with pytest.raises(ValueError, match="fallback"):
        cycle().beyond_parity((0, 1))
