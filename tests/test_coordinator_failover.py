"""Coordinator failover (docs/protocol.md): a coordinator that dies is replaced and rebuilds its state from
the launcher's seed and the processes' heartbeats and reports; nothing is lost and training goes on.

The pure rules are tested on `ClusterMap` and on a `Coordinator` object; then deterministic local jobs kill
the coordinator with SIGKILL before training, during training, at each step of a recovery and together with
a server, and must end bit-identical to the undisturbed run with parity exact (I1, I2).
"""

from __future__ import annotations

import json

import pytest

from ecrec.coordinator.contract import (
    FailureReport,
    Heartbeat,
    Progress,
    RegisterServer,
    RegisterWorker,
    WorkerFinished,
    WorkerLost,
)
from ecrec.coordinator.service import Coordinator
from ecrec.core.cluster import GENERATION_EPOCHS, ClusterMap, ProbeFirst, Refused, ShardState
from ecrec.local import run_local
from tests.conftest import make_ctx
from tests.test_ecrec import assert_consistent, det_ctx


# -- the pure rules -------------------------------------------------------------------------------------
def started_map() -> ClusterMap:
    m = ClusterMap(num_servers=3, failure_timeout=2.0, recoverable=True)
    for s in range(3):
        m.register(s, f"a{s}", 0.0, instance=f"s{s}-1")
    m.report_failure(1, 1.0)
    m.register(1, "b1", 1.5, instance="s1-2", replacement=True)  # recovering
    return m


def test_a_successor_map_outranks_every_epoch_of_its_predecessor_and_keeps_its_shards():
    old = started_map()
    new = ClusterMap(num_servers=3, failure_timeout=2.0, recoverable=True, generation=2)
    assert new.epoch == GENERATION_EPOCHS + 1 > old.epoch
    new.restore(old.seed(), now=10.0)
    assert [s.state for s in new.shards] == [ShardState.UP, ShardState.RECOVERING, ShardState.UP]
    assert new.shards[1].instance == "s1-2" and new.shards[1].superseded == {"s1-1": 1}
    # Listed processes carry on with ordinary heartbeats; a superseded one is still refused.
    assert new.heartbeat(1, "b1", 10.5, "s1-2")
    assert not new.heartbeat(1, "a1", 10.5, "s1-1")
    # Restored shards count as alive from the restore: silence past the timeout fails them as usual.
    assert [t.shard for t in new.tick(12.5)] == [0, 2]
    # A seed from the same or a later generation is refused: the successor would not be newer.
    same = ClusterMap(num_servers=3, failure_timeout=2.0, generation=2)
    with pytest.raises(Refused):
        same.restore(new.seed(), now=0.0)


def test_a_process_the_seed_missed_rejoins_only_if_newer_and_only_once_the_listed_one_is_gone():
    old = started_map()
    seed = old.seed()
    old.register(2, "c2", 2.0, instance="s2-2", replacement=True, confirmed_dead=True)  # after the seed
    new = ClusterMap(num_servers=3, failure_timeout=2.0, recoverable=True, generation=2)
    new.restore(seed, now=3.0)
    epoch = new.epoch
    with pytest.raises(ProbeFirst):  # s2-1 is listed as up: it must be probed first
        new.rejoin(2, "c2", 3.1, instance="s2-2", incarnation=2, recovered=False)
    (failed, rejoined) = new.rejoin(
        2, "c2", 3.2, instance="s2-2", incarnation=2, recovered=False, confirmed_dead=True
    )
    assert (failed.kind, rejoined.kind) == ("failure_detected", "rejoined")
    assert new.shards[2].state is ShardState.RECOVERING and new.epoch == epoch + 2
    assert new.shards[2].superseded == {"s2-1": 1}
    for instance, incarnation in (("s2-1", 3), ("s9-9", 2), ("s9-9", 1)):  # superseded, or not newer
        with pytest.raises(Refused):
            new.rejoin(
                2, "x", 3.3, instance=instance, incarnation=incarnation, recovered=False, confirmed_dead=True
            )
    # A rebuilt replacement rejoins as up (the listed process gone); a first process of a shard the seed has
    # pending, too.
    new.rejoin(2, "e2", 3.4, instance="s2-3", incarnation=3, recovered=True, confirmed_dead=True)
    fresh = ClusterMap(num_servers=3, failure_timeout=2.0, recoverable=True, generation=3)
    fresh.restore(
        {"epoch": 5, "shards": [{"shard": 0, "state": "failed", "incarnation": 1, "instance": "s0-1"}]}, 0.0
    )
    fresh.rejoin(1, "d1", 0.1, instance="s1-1", incarnation=1, recovered=False)
    assert [s.state for s in new.shards + fresh.shards][2:] == [
        ShardState.UP,
        ShardState.FAILED,
        ShardState.UP,
        ShardState.PENDING,
    ]
    # A replacement of a shard this map has failed is refused, rebuilt or not: acting homes may have taken
    # degraded writes of its rows since it rebuilt them (the recovered_dense flake); a new one rebuilds it.
    epoch = fresh.epoch
    for recovered in (False, True):
        with pytest.raises(Refused, match="failed in this map"):
            fresh.rejoin(
                0, "d0", 0.2, instance="s0-2", incarnation=2, recovered=recovered, confirmed_dead=True
            )
    assert fresh.shards[0].state is ShardState.FAILED and fresh.epoch == epoch
    fresh.register(0, "f0", 0.3, instance="s0-3", replacement=True)
    assert fresh.shards[0].state is ShardState.RECOVERING
    # Strategies that rebuild nothing (checkpoints) load their state themselves: their replacements rejoin.
    ckpt = ClusterMap(num_servers=1, failure_timeout=2.0, recoverable=False, generation=2)
    ckpt.restore(
        {"epoch": 5, "shards": [{"shard": 0, "state": "failed", "incarnation": 1, "instance": "s0-1"}]}, 0.0
    )
    ckpt.rejoin(0, "d0", 0.1, instance="s0-2", incarnation=2, recovered=False)
    assert ckpt.shards[0].state is ShardState.UP
    # A coordinator that never replaced another admits nobody this way.
    with pytest.raises(Refused):
        started_map().rejoin(0, "z", 5.0, instance="s0-9", incarnation=9, recovered=True, confirmed_dead=True)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def started_job():
    """A started ECRec job (3 servers, k=2, worker 0) on a test clock: its spec, the clock, the instances its
    coordinator's probe finds answering, and that coordinator (its successors reuse `old.probe`)."""
    job = make_ctx(
        "fo", servers__replicas=3, faultTolerance__strategy="ecrec", faultTolerance__ecrec__k=2
    ).job
    clock, alive = Clock(), set()
    old = Coordinator(job, clock=clock, probe=lambda addr, inst: inst in alive)
    for s in range(3):
        old.register_server(RegisterServer(shard=s, address=f"a{s}", instance=f"s{s}-1"))
        alive.add(f"s{s}-1")
    old.register_worker(RegisterWorker(rank=0, instance="w0-1"))
    return job, clock, alive, old


def test_a_successor_coordinator_takes_over_progress_and_recoveries_and_admits_rejoins():
    job, clock, alive, old = started_job()
    assert old.status()["phase"] == "Running"
    clock.t += 5
    old.report_progress(Progress(rank=0, instance="w0-1", step=40, samples=2560, lastStepAt=clock.t))
    alive.discard("s2-1")
    old.report_failure(FailureReport(shard=2))
    old.register_server(RegisterServer(shard=2, address="b2", instance="s2-2", replacement=True))
    seed = old.status()["resume"]
    assert seed["generation"] == 1 and seed["recoveries"][0]["shard"] == 2

    clock.t += 3
    new = Coordinator(job, clock=clock, probe=old.probe, generation=2, seed=seed)
    st = new.status()
    assert st["phase"] == "Recovering" and st["step"] == 40 and st["cluster"]["epoch"] > seed["epoch"]
    # The rebuild's driver died with the old coordinator: the record says so, and a new request resumes it.
    assert [r["state"] for r in st["recoveries"]] == ["interrupted"]
    assert st["events"][-1]["kind"] == "coordinator_restored"
    # Listed processes carry on as before; the worker's progress continues from its own count.
    assert new.heartbeat(Heartbeat(shard=0, address="a0", instance="s0-1", incarnation=1))["ok"]
    new.report_progress(Progress(rank=0, instance="w0-1", step=45, samples=2880))
    assert new.status()["step"] == 45
    # A worker the seed does not list (a replacement registered after it was written) is refused until it
    # says who it is; a rejoin that is not newer is refused.
    with pytest.raises(Refused):
        new.report_progress(Progress(rank=0, instance="w0-2", step=47, samples=3008))
    with pytest.raises(Refused):
        new.register_worker(RegisterWorker(rank=0, instance="w0-0", incarnation=1, rejoin=True))
    out = new.register_worker(
        RegisterWorker(rank=0, instance="w0-2", incarnation=2, rejoin=True, step=47, samples=3008)
    )
    assert out["resume"]["step"] == 47 and new.status()["workers"][0]["instance"] == "w0-2"
    # The first coordinator never admits a rejoin.
    with pytest.raises(Refused):
        old.register_worker(RegisterWorker(rank=0, instance="w0-3", incarnation=3, rejoin=True))


def test_a_successor_slow_to_serve_counts_failure_timeouts_from_when_it_serves():
    # Seen on a loaded machine: the successor's tick ran before its HTTP server was up, and every server it
    # restored (their heartbeats refused until then) was declared failed at once: "5 servers lost at once".
    job, clock, alive, old = started_job()
    seed = old.status()["resume"]
    timeout = job.spec.coordinator.failure_timeout_seconds

    def successor() -> Coordinator:
        clock.t += 1
        new = Coordinator(job, clock=clock, probe=old.probe, generation=2, seed=seed)
        clock.t += 2 * timeout  # imports, the app, uvicorn's start
        return new

    unserved = successor()
    unserved.tick()
    assert [s["state"] for s in unserved.status()["cluster"]["shards"]] == ["failed"] * 3  # the bug's shape

    new = successor()
    new.serving()
    new.tick()
    st = new.status()
    assert [s["state"] for s in st["cluster"]["shards"]] == ["up"] * 3 and not st["workers"][0][
        "unresponsive"
    ]
    clock.t += timeout - 0.5
    new.heartbeat(Heartbeat(shard=0, address="a0", instance="s0-1", incarnation=1))
    clock.t += 1.0  # from serving on, silence counts as usual
    new.tick()
    assert [s["state"] for s in new.status()["cluster"]["shards"]] == ["up", "failed", "failed"]


def test_a_replacement_of_a_shard_the_seed_has_failed_is_refused_and_a_new_one_rebuilds_it():
    # The replacement registered, and the rebuild started, after the last seed: the successor knows the shard
    # only as failed, publishes it so, and acting homes take degraded writes of its rows again. Whatever the
    # replacement rebuilt before (all of it, even) can be stale: it is refused, and exits; a new replacement
    # registers and the open record resumes with it.
    job, clock, alive, old = started_job()
    alive.discard("s2-1")
    old.report_failure(FailureReport(shard=2))
    seed = old.status()["resume"]
    assert [r["state"] for r in old.status()["recoveries"]] == ["detected"]
    old.register_server(RegisterServer(shard=2, address="b2", instance="s2-2", replacement=True))

    clock.t += 3
    new = Coordinator(job, clock=clock, probe=old.probe, generation=2, seed=seed)
    for recovered in (False, True):
        beat = Heartbeat(
            shard=2, address="b2", instance="s2-2", incarnation=2, recovered=recovered, rowsRecovered=860
        )
        assert not new.heartbeat(beat)["ok"]
    st = new.status()
    assert st["cluster"]["shards"][2]["state"] == "failed" and st["phase"] == "Degraded"
    assert [r["state"] for r in st["recoveries"]] == ["interrupted"]
    new.register_server(RegisterServer(shard=2, address="c2", instance="s2-3", replacement=True))
    st = new.status()
    assert [r["state"] for r in st["recoveries"]] == ["waiting"]
    assert st["events"][-1]["kind"] == "replacement_registered"
    assert (
        st["cluster"]["shards"][2]["state"] == "recovering" and st["cluster"]["shards"][2]["incarnation"] == 2
    )
    new._stop.set()


def test_a_replacement_rebuilt_after_the_last_seed_completes_its_record_when_it_rejoins():
    # The seed lists a replacement (s2-2) under recovery; it died, and a second one (s2-3) registered and was
    # rebuilt before the launcher saved another seed: the successor learns from the rejoin (once its probe
    # finds s2-2 gone) that the shard is whole again. The open record must complete (`ecrec local` waits for
    # every record to).
    job, clock, alive, old = started_job()
    alive.discard("s2-1")
    old.report_failure(FailureReport(shard=2))
    old.register_server(RegisterServer(shard=2, address="b2", instance="s2-2", replacement=True))
    seed = old.status()["resume"]
    assert seed["shards"][2]["state"] == "recovering"

    for recovered, state, phase in ((False, "interrupted", "Recovering"), (True, "completed", "Running")):
        clock.t += 3
        new = Coordinator(job, clock=clock, probe=old.probe, generation=2, seed=seed)
        labels = dict(new.metrics.labels)
        beat = Heartbeat(
            shard=2, address="c2", instance="s2-3", incarnation=3, recovered=recovered, rowsRecovered=860
        )
        assert new.heartbeat(beat)["ok"]
        st = new.status()
        assert [r["state"] for r in st["recoveries"]] == [state], st["recoveries"]
        assert st["phase"] == phase
        assert st["cluster"]["shards"][2]["state"] == ("up" if recovered else "recovering")
        if recovered:
            (rec,) = st["recoveries"]
            assert rec["rows_recovered"] == 860 and rec["completed_at"] is not None
            rows = new.metrics.registry.get_sample_value(
                "ecrec_rows_recovered_total", {**labels, "shard": "2"}
            )
            assert rows == 860  # the counter agrees with the record
            assert st["events"][-1]["kind"] == "recovery_completed"
        new._stop.set()


def test_a_worker_done_as_its_coordinator_died_is_finished_when_the_launcher_reports_its_exit():
    # The old coordinator acknowledged the last report and died before its state was saved; the worker exited
    # (0) before the launcher built the successor's seed. Only the launcher's report of the exit finishes it.
    job, clock, alive, old = started_job()
    steps, batch = job.spec.training.steps, job.spec.training.batch_size
    old.report_progress(Progress(rank=0, instance="w0-1", step=steps - 3, samples=(steps - 3) * batch))
    seed = old.status()["resume"]
    old.report_progress(Progress(rank=0, instance="w0-1", step=steps, samples=steps * batch, done=True))
    assert old.status()["phase"] == "Succeeded"
    new = Coordinator(job, clock=clock, probe=old.probe, generation=2, seed=seed)
    assert new.status()["phase"] == "Running"
    with pytest.raises(Refused):  # only the process the coordinator lists
        new.worker_finished(WorkerFinished(rank=0, instance="w0-0"))
    new.worker_finished(WorkerFinished(rank=0, instance="w0-1"))
    st = new.status()
    assert st["phase"] == "Succeeded" and st["step"] == steps and st["samples"] == steps * batch
    assert [e["kind"] for e in st["events"]][-2:] == ["worker_finished", "training_finished"]
    new.worker_finished(WorkerFinished(rank=0, instance="w0-1"))  # again (the next pass): nothing changes
    assert new.status()["samples"] == steps * batch and len(new.status()["events"]) == len(st["events"])


# -- live jobs --------------------------------------------------------------------------------------------
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> str:
    report = run_local(det_ctx("base"), tmp_path_factory.mktemp("base"), progress=False)
    assert_consistent(report)
    return report["params_sha256"]


def restored(report: dict) -> list[dict]:
    return [e for e in report["events"] if e["kind"] == "coordinator_restored"]


@slow
def test_coordinator_killed_during_training_is_replaced_and_nothing_changes(tmp_path, baseline):
    report = run_local(det_ctx("kill-coord"), tmp_path, progress=False, kills=[("coordinator", "step:60")])
    assert len(restored(report)) == 1, report["events"]
    assert_consistent(report)
    assert report["params_sha256"] == baseline


@slow
def test_coordinator_killed_before_training_started(tmp_path, baseline):
    # Killed having admitted its third server, before answering it: the successor knows no more than that
    # nothing started; servers and the worker rejoin, and training starts once they all have.
    report = run_local(
        det_ctx("kill-coord-early"),
        tmp_path,
        progress=False,
        fault="coordinator:coordinator:server_registered@3",
    )
    assert report["fault"]["fired"] and len(restored(report)) == 1
    assert_consistent(report)
    assert report["params_sha256"] == baseline


@slow
@pytest.mark.parametrize(
    "point",
    [
        "coordinator:coordinator:recovery_started",  # the plan made, nothing rebuilt yet
        "coordinator:coordinator:recovered_dense",  # dense copied, rows and parity under way
        "coordinator:coordinator:recovered_data@3",  # three lock groups of rows rebuilt
        "coordinator:coordinator:recovered_parity",  # a lock group of parity re-encoded
        "coordinator:coordinator:recovery_completed",  # completed, before anybody heard of it
    ],
)
def test_coordinator_killed_at_each_step_of_a_recovery_and_the_recovery_resumes(tmp_path, baseline, point):
    ctx = det_ctx("kill-coord-rec", faultTolerance__ecrec__lockGroupRows=64)
    report = run_local(ctx, tmp_path, progress=False, kills=[(2, "step:60")], fault=point)
    assert report["fault"]["fired"], "the fault point was never reached"
    assert len(restored(report)) == 1
    (rec,) = report["recoveries"]
    assert rec["shard"] == 2 and rec["rows_recovered"] > 0 and rec["completed_at"] is not None
    assert_consistent(report)
    assert report["params_sha256"] == baseline


@slow
def test_coordinator_killed_with_a_seed_older_than_the_replacement_rebuilds_the_shard_anew(
    tmp_path, baseline
):
    # The launcher's last seed has shard 2 failed: the replacement registered, and its dense state was copied,
    # after it (the window of a launcher's pass). The successor publishes shard 2 failed; acting homes take
    # degraded writes of its rows while the replacement holds what it rebuilt. Its rejoin is refused, it exits,
    # and a new replacement rebuilds the shard.
    # Heartbeats 2 s apart: the replacement rejoins up to 2 s after the successor starts, time for the worker
    # to write shard 2's rows degraded (without the refusal, runs ended with parity mismatches).
    ctx = det_ctx(
        "kill-coord-stale",
        faultTolerance__ecrec__lockGroupRows=64,
        coordinator__heartbeatIntervalSeconds=2.0,
        coordinator__failureTimeoutSeconds=6.0,
        # The workers report their steps with their 2 s heartbeats: the supervisor sees step 20 up to ~2.5 s
        # after it, so it is paced (one CI run's unpaced report of step 60 came after training had ended). At
        # 40 steps a second the kill lands by step ~120 of 200 on any machine.
        training__maxStepsPerSecond=40,
    )
    report = run_local(
        ctx,
        tmp_path,
        progress=False,
        kills=[(2, "step:20")],
        fault="coordinator:coordinator:recovered_dense",
        hold_seed=lambda seed: seed["shards"][2]["state"] == "failed",
    )
    assert report["fault"]["fired"] and len(restored(report)) == 1
    successor = json.loads((tmp_path / "coordinator-2.resume.json").read_text())
    assert successor["shards"][2]["state"] == "failed"
    # The killed server's replacement, the coordinator's, and the one that took over from the refused one.
    assert report["replacements"] == 3
    (rec,) = report["recoveries"]
    assert rec["shard"] == 2 and rec["completed_at"] is not None
    assert_consistent(report)
    assert report["params_sha256"] == baseline


@slow
def test_coordinator_and_a_server_killed_at_once(tmp_path, baseline):
    # The server's failure happens while nobody can declare it: workers keep retrying, the successor probes
    # and declares it, and the usual rebuild follows.
    report = run_local(
        det_ctx("kill-both"), tmp_path, progress=False, kills=[("coordinator", "step:60"), (3, "step:60")]
    )
    assert len(restored(report)) == 1
    assert [r["shard"] for r in report["recoveries"]] == [3]
    assert_consistent(report)
    assert report["params_sha256"] == baseline


def test_heartbeats_name_the_worker_processes_that_are_gone_and_a_successor_still_does():
    # Servers abort what a gone worker process left staged as soon as a heartbeat says it is gone
    # (ShardStore.expire): a lost process, and every incarnation before a rank's current one; never a worker
    # that is only silent (it may come back).
    job, clock, alive, old = started_job()

    def gone(coordinator) -> dict:
        return coordinator.heartbeat(Heartbeat(shard=0, address="a0", instance="s0-1", incarnation=1))[
            "workersGone"
        ]

    assert gone(old) == {}
    clock.t += 5  # the worker silent for longer than the failure timeout: unresponsive, not gone
    for s in range(3):
        old.heartbeat(Heartbeat(shard=s, address=f"a{s}", instance=f"s{s}-1", incarnation=1))
    old.tick()
    assert old.progress.workers[0].unresponsive and gone(old) == {}
    old.worker_lost(WorkerLost(rank=0, instance="w0-1", replacing=True))
    assert gone(old) == {"0": 1}
    old.register_worker(RegisterWorker(rank=0, instance="w0-2", incarnation=2, replacement=True))
    assert gone(old) == {"0": 1}
    # A successor started from the last seed knows as much.
    new = Coordinator(job, clock=clock, probe=old.probe, generation=2, seed=old.status()["resume"])
    assert gone(new) == {"0": 1}
