"""The cluster map (pure) and the coordinator's REST API (FastAPI test client, no network)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ecrec import auth
from ecrec.coordinator.app import create_app
from ecrec.coordinator.probe import SingleFlight, probe_server
from ecrec.coordinator.service import Coordinator
from ecrec.core.checkpointing import Phase
from ecrec.core.cluster import ClusterMap, ProbeFirst, ShardState
from tests.conftest import make_ctx


def test_silent_server_is_failed_and_epoch_bumps():
    cm = ClusterMap(num_servers=2, failure_timeout=1.0, recoverable=True)
    cm.register(0, "a:1", now=0.0, instance="a")
    cm.register(1, "b:1", now=0.0, instance="b")
    assert cm.ready and cm.epoch == 1
    cm.heartbeat(0, "a:1", now=0.9, instance="a")
    assert cm.tick(now=1.5)[0].kind == "failure_detected"
    assert cm.shards[1].state is ShardState.FAILED and cm.shards[0].state is ShardState.UP
    assert cm.epoch == 2
    assert cm.tick(now=1.6) == []  # reported once


def test_replacement_registers_as_recovering_with_new_epoch():
    cm = ClusterMap(num_servers=2, failure_timeout=1.0, recoverable=True)
    cm.register(0, "a:1", 0.0, instance="a")
    cm.register(1, "b:1", 0.0, instance="b")
    cm.report_failure(1, 0.5)
    kinds = [t.kind for t in cm.register(1, "b:2", 0.7, instance="b2", replacement=True)]
    assert kinds == ["replacement_registered"]
    assert cm.shards[1].state is ShardState.RECOVERING and cm.shards[1].incarnation == 2
    assert not cm.heartbeat(1, "b:1", 0.8, instance="b")  # the old process is disowned
    assert cm.heartbeat(1, "b:2", 0.8, instance="b2")
    assert cm.recovered(1, 1.0)[0].epoch == cm.epoch == 4


def test_fast_restart_under_same_shard_counts_as_failure():
    cm = ClusterMap(num_servers=1, failure_timeout=10.0, recoverable=True)
    cm.register(0, "a:1", 0.0, instance="a")
    with pytest.raises(ProbeFirst):  # the registered process may still serve: the caller must probe it
        cm.register(0, "a:2", 1.0, instance="a2", replacement=True)
    assert cm.shards[0].state is ShardState.UP and cm.epoch == 1  # nothing changed
    kinds = [t.kind for t in cm.register(0, "a:2", 1.0, instance="a2", replacement=True, confirmed_dead=True)]
    assert kinds == ["failure_detected", "replacement_registered"]


def test_rest_flow_registration_progress_and_metrics():
    ctx = make_ctx(servers__replicas=2, workers__replicas=2)
    coord = Coordinator(ctx.job, probe=lambda addr, inst: False)
    api = TestClient(create_app(coord))
    assert api.get("/healthz").json() == {"ok": True}
    for s in range(2):
        assert (
            api.post(
                "/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"}
            ).status_code
            == 200
        )
    assert api.get("/v1/cluster").json()["ready"]
    assert (
        api.post("/v1/servers/register", json={"shard": 9, "address": "x", "instance": "x"}).status_code
        == 400
    )
    assert not api.post("/v1/workers/register", json={"rank": 0, "instance": "w0"}).json()["started"]
    assert api.post("/v1/workers/register", json={"rank": 1, "instance": "w1"}).json()["started"]
    api.post("/v1/workers/progress", json={"rank": 0, "instance": "w0", "step": 3, "samples": 192})
    api.post("/v1/workers/progress", json={"rank": 1, "instance": "w1", "step": 2, "samples": 128})
    status = api.get("/v1/status").json()
    assert status["phase"] == "Running" and status["samples"] == 320 and status["step"] == 2
    # A failure report is confirmed with a probe before the shard is marked failed.
    api.post("/v1/failures", json={"shard": 1})
    status = api.get("/v1/status").json()
    assert status["phase"] == "Failed" and "strategy 'none'" in status["reason"]
    assert [e["kind"] for e in status["events"]][-1] == "failure_detected"
    text = api.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {s.name: s.value for s in families["ecrec_samples_trained"].samples}
    assert samples["ecrec_samples_trained_total"] == 320
    failures = [s for s in families["ecrec_failures_detected"].samples if s.name.endswith("_total")]
    assert failures[0].value == 1 and failures[0].labels["role"] == "coordinator"


def test_failure_report_for_a_live_server_is_ignored():
    ctx = make_ctx(servers__replicas=2)
    coord = Coordinator(ctx.job, probe=lambda addr, inst: True)
    api = TestClient(create_app(coord))
    for s in range(2):
        api.post("/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    epoch = api.post("/v1/failures", json={"shard": 0}).json()["epoch"]
    assert epoch == 1 and api.get("/v1/cluster").json()["shards"][0]["state"] == "up"


def one_worker_training():
    """A job of two servers and one worker, registered: training has started. Returns the coordinator's clock
    (a one-element list the test moves), the coordinator and its API."""
    ctx = make_ctx(workers__replicas=1)
    now = [100.0]
    coord = Coordinator(ctx.job, clock=lambda: now[0], probe=lambda a, i: True)
    api = TestClient(create_app(coord))
    for s in range(2):
        api.post("/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    api.post("/v1/workers/register", json={"rank": 0, "instance": "w0"})
    return now, coord, api


def test_throughput_series_from_progress():
    now, coord, api = one_worker_training()
    for i in range(1, 6):
        now[0] = 100.0 + 0.5 * i
        api.post("/v1/workers/progress", json={"rank": 0, "instance": "w0", "step": i, "samples": 500 * i})
        coord.tick()
    series = api.get("/v1/status").json()["throughputSeries"]
    assert series and all(abs(rate - 1000.0) < 1e-6 for _, rate in series)
    assert series[-1][0] == 2.5


def test_samples_series_puts_samples_where_their_steps_completed():
    now, coord, api = one_worker_training()  # training started at 100.0
    # Two steps of 250 samples completed at 100.12 and 100.37, reported at 100.5; none in the next report;
    # then one at 101.43, reported at 101.5 without its time (an old worker): counted at the report.
    reports = [(0.5, 2, 500, [100.12, 100.37]), (1.0, 2, 500, []), (1.5, 3, 750, [])]
    for t, step, samples, times in reports:
        now[0] = 100.0 + t
        body = {"rank": 0, "instance": "w0", "step": step, "samples": samples, "stepTimes": times}
        api.post("/v1/workers/progress", json=body)
        coord.tick()
    series = api.get("/v1/status").json()["samplesSeries"]
    assert series[0] == [0.0, 0] and series[-1][1] == 750
    points = dict((round(t, 3), n) for t, n in series)
    # the steps' 0.05 s bins, not the report's arrival: 250 by 0.15 s, 500 by 0.4 s, nothing more until 1.5 s
    assert points[0.1] == 0 and points[0.15] == 250 and points[0.35] == 250 and points[0.4] == 500
    assert points[1.5] == 500 and points[1.55] == 750


def test_a_rollback_shows_as_no_progress_not_a_negative_throughput():
    # A checkpoint strategy's rollback takes the samples count back; the status schema (samplesPerSecond >= 0)
    # refused the negative rate, and the operator's reconcile failed until the window had passed it.
    now, coord, api = one_worker_training()
    steps = [1, 2, 3, None, 2, 3]  # None: the job rolls back to step 1 (as the checkpoint cycle does)
    for i, step in enumerate(steps, start=1):
        now[0] = 100.0 + 0.5 * i
        if step is None:
            with coord.lock:
                coord.rolled_back({0: (1, 500)})
        else:
            r = api.post(
                "/v1/workers/progress",
                json={"rank": 0, "instance": "w0", "step": step, "samples": 500 * step},
            )
            assert r.status_code == 200, r.text
        coord.tick()
        status = api.get("/v1/status").json()
        assert status["samplesPerSecond"] >= 0, status["throughputSeries"]
    rates = [rate for _, rate in api.get("/v1/status").json()["throughputSeries"]]
    assert min(rates) == 0.0 and max(rates) == 1000.0, rates


def test_bad_shard_in_a_heartbeat_is_a_400_and_the_coordinator_keeps_serving():
    ctx = make_ctx(servers__replicas=2)
    api = TestClient(create_app(Coordinator(ctx.job, probe=lambda a, i: True)))
    r = api.post("/v1/servers/heartbeat", json={"shard": 5, "address": "x", "instance": "x"})
    assert r.status_code == 400 and "out of range" in r.json()["detail"]
    assert api.get("/healthz").json() == {"ok": True}


def test_a_silent_worker_is_declared_unresponsive_and_a_report_clears_it():
    ctx = make_ctx(workers__replicas=2, coordinator__failureTimeoutSeconds=3.0)
    now = [100.0]
    coord = Coordinator(ctx.job, clock=lambda: now[0], probe=lambda a, i: True)
    api = TestClient(create_app(coord))

    def beat():  # servers keep heartbeating: only the workers are under test
        for s in range(2):
            api.post("/v1/servers/heartbeat", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})

    for s in range(2):
        api.post("/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    api.post("/v1/workers/register", json={"rank": 0, "instance": "w0"})
    now[0] = 110.0  # rank 0 waited 10 s for rank 1: waiting for the start is not silence
    api.post("/v1/workers/register", json={"rank": 1, "instance": "w1"})
    beat()
    coord.tick()
    assert not any(w["unresponsive"] for w in api.get("/v1/status").json()["workers"])
    for t in range(1, 9):  # rank 0 reports every 0.5 s; rank 1 goes quiet (paused)
        now[0] = 110.0 + 0.5 * t
        api.post("/v1/workers/progress", json={"rank": 0, "instance": "w0", "step": t, "samples": 64 * t})
        beat()
        coord.tick()
    workers = {w["rank"]: w for w in api.get("/v1/status").json()["workers"]}
    assert workers[1]["unresponsive"] and not workers[0]["unresponsive"]
    events = [e for e in api.get("/v1/status").json()["events"] if e["kind"] == "worker_unresponsive"]
    assert [e["worker"] for e in events] == [1]
    coord.tick()  # declared once
    assert sum(e["kind"] == "worker_unresponsive" for e in api.get("/v1/status").json()["events"]) == 1
    # It comes back before anyone deleted it: no longer unresponsive.
    api.post("/v1/workers/progress", json={"rank": 1, "instance": "w1", "step": 1, "samples": 64})
    assert not {w["rank"]: w for w in api.get("/v1/status").json()["workers"]}[1]["unresponsive"]


def checkpoint_job(tmp_path):
    """A started coordinator under the checkpoint strategy: 2 servers, worker 0, and `report(step, **holds)`,
    that worker's progress report (its HTTP status)."""
    ctx = make_ctx(
        servers__replicas=2,
        workers__replicas=1,
        faultTolerance__strategy="checkpoint",
        faultTolerance__checkpoint__path=str(tmp_path),
    )
    coord = Coordinator(ctx.job, probe=lambda addr, inst: True)
    api = TestClient(create_app(coord))
    for s in range(2):
        api.post("/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    assert api.post("/v1/workers/register", json={"rank": 0, "instance": "w0"}).json()["started"]

    def report(step: int, **holds) -> int:
        body = {"rank": 0, "instance": "w0", "step": step, "samples": step * 64, **holds}
        return api.post("/v1/workers/progress", json=body).status_code

    return coord, api, report


def test_a_report_from_before_a_rollback_resume_does_not_count_once_the_restore_is_done(tmp_path):
    # A worker stopped for a rollback keeps reporting its pre-rollback step until it takes up the resume
    # point; such a report, arriving after the restore, must not undo the rollback's counters (it did, and
    # the worker's next, honest report was then refused as going backwards).
    coord, api, report = checkpoint_job(tmp_path)
    assert report(175) == 200
    cycle = coord.ckpt.cycle
    with coord.lock:  # what the driver does on a failure and a restore, without servers to call
        cycle.failure(1)
    assert report(175, stopped=1) == 200
    with coord.lock:
        cycle.registered(1)  # its replacement
        cycle.restored((0, 1), True, now=coord.clock())
        coord.rolled_back(cycle.resume)
    assert report(175, stopped=1) == 200  # late, from before the resume: its step is not taken
    assert api.get("/v1/status").json()["step"] == 0
    assert report(3, stopped=1, resumed=1) == 200
    assert api.get("/v1/status").json()["step"] == 3


def test_the_steps_a_worker_trained_since_its_last_report_count_as_redone_when_it_stops_for_a_rollback(
    tmp_path,
):
    # A kill soon after a checkpoint: the worker's last periodic report was at the checkpoint's step, it
    # trained on, and the failure was declared before its next report. Its stop report says where it stopped;
    # those steps are redone too (they read as none, and stepsRedone was 0 in a CI run).
    coord, api, report = checkpoint_job(tmp_path)
    assert report(100) == 200
    cycle = coord.ckpt.cycle
    with coord.lock:
        cycle.failure(1)
    assert report(100) == 200  # sent before it saw the rollback: nothing new
    assert report(130, stopped=1) == 200  # it stopped 30 steps on
    with coord.lock:
        cycle.registered(1)
    assert cycle.phase is Phase.RESTORING
    assert report(130, stopped=1) == 200  # its heartbeat while the restore loads (seconds, on a cluster)
    with coord.lock:
        cycle.restored((0, 1), True, now=coord.clock())
        coord.rolled_back(cycle.resume)
    assert cycle.steps_redone == 130  # no checkpoint yet: all of them
    assert report(140, stopped=1) == 200  # late, after the restore: not taken, nor counted again
    assert cycle.steps_redone == 130 and api.get("/v1/status").json()["step"] == 0


def test_a_late_recovery_request_under_a_checkpoint_strategy_opens_no_record(tmp_path):
    """The launcher asks for a shard's recovery from a status read before its restore completed; under a
    checkpoint strategy that request only reports, and must not open a record nothing completes (the launcher
    waits for every record to complete: a bench job hung there until its timeout)."""
    import time

    ctx = make_ctx(
        servers__replicas=3,
        faultTolerance__strategy="checkpoint",
        faultTolerance__checkpoint__path=str(tmp_path / "ckpt"),
    )
    alive = {f"h:{s}" for s in range(3)}
    coord = Coordinator(ctx.job, probe=lambda addr, inst: addr in alive)
    api = TestClient(create_app(coord))
    for s in range(3):
        r = api.post("/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
        assert r.status_code == 200
    assert api.post("/v1/recoveries", json={"shard": 1}).status_code == 409  # it has not failed
    assert api.get("/v1/recoveries").json() == []
    alive.discard("h:1")
    api.post("/v1/failures", json={"shard": 1})
    r = api.post(
        "/v1/servers/register", json={"shard": 1, "address": "h:9", "instance": "r1", "replacement": True}
    )
    assert r.status_code == 200
    with coord.lock:
        coord.complete_restore(1, 0, time.time())
    assert api.post("/v1/recoveries", json={"shard": 1}).status_code == 200  # late: answers the record
    assert [r["state"] for r in api.get("/v1/recoveries").json()] == ["completed"]


def test_time_to_continue_is_the_first_step_after_the_detection_not_the_reports_latest():
    # Workers report every 0.5 s; the report's latest step can be up to that much later than the first step
    # trained after a failure was detected, which is what "time to continue" measures.
    ctx = make_ctx(
        workers__replicas=1, servers__replicas=3, faultTolerance__strategy="ecrec", faultTolerance__ecrec__k=2
    )
    now = [100.0]
    coord = Coordinator(ctx.job, clock=lambda: now[0], probe=lambda a, i: False)  # probes find it dead
    api = TestClient(create_app(coord))
    for s in range(3):
        api.post("/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    api.post("/v1/workers/register", json={"rank": 0, "instance": "w0"})

    def report(step: int, times: list[float]) -> None:
        body = {"rank": 0, "instance": "w0", "step": step, "samples": 64 * step}
        r = api.post("/v1/workers/progress", json=body | {"stepTimes": times, "lastStepAt": times[-1]})
        assert r.status_code == 200, r.text

    now[0] = 100.5
    report(2, [100.2, 100.4])
    now[0] = 101.0
    api.post("/v1/failures", json={"shard": 1})
    now[0] = 101.5
    report(6, [100.6, 100.9, 101.1, 101.45])
    (rec,) = coord.recoveries
    assert rec.detected_at == 101.0 and rec.continued_at == 101.1
    events = api.get("/v1/status").json()["events"]
    assert [e["t"] for e in events if e["kind"] == "training_continued"] == [1.1]
    now[0] = 102.0
    report(9, [101.6, 101.8, 101.9])  # the first stays
    assert rec.continued_at == 101.1
    body = {"rank": 0, "instance": "w0", "step": 9, "samples": 576, "stepTimes": [1.0] * 257}
    assert api.post("/v1/workers/progress", json=body).status_code == 422  # more than a report carries


def test_a_spare_waiting_in_its_heartbeat_hears_of_its_shard_the_moment_it_is_assigned():
    # The heartbeat is a long poll: the spare learns of a failed shard at once, not at its next heartbeat
    # (each poll interval of waiting was degraded training before the takeover).
    import threading

    from ecrec.coordinator.contract import SpareIn

    ctx = make_ctx(servers__replicas=3, coordinator__failureTimeoutSeconds=60.0)
    alive = {f"h:{s}" for s in range(3)}
    coord = Coordinator(ctx.job, probe=lambda addr, inst: addr in alive)
    api = TestClient(create_app(coord))
    for s in range(3):
        api.post("/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    assert api.post("/v1/spares/register", json={"instance": "sp"}).json()["assigned"] is None
    # Nothing to take over: the wait ends with its timeout, and the spare is still there, unassigned.
    assert coord.spare_heartbeat(SpareIn(instance="sp", wait=0.2)) == {
        "registered": True,
        "assigned": None,
        "finished": False,
    }
    answers: list[dict] = []
    waiting = threading.Thread(
        target=lambda: answers.append(coord.spare_heartbeat(SpareIn(instance="sp", wait=30))), daemon=True
    )
    waiting.start()
    alive.discard("h:1")
    assert api.post("/v1/failures", json={"shard": 1}).status_code == 200
    waiting.join(timeout=10)  # (30 s if only the timeout ended it)
    assert not waiting.is_alive() and answers == [{"registered": True, "assigned": 1, "finished": False}]
    # A stray wait is refused by the schema, not slept through.
    r = api.post("/v1/spares/heartbeat", json={"instance": "sp", "wait": 3600})
    assert r.status_code == 422


def test_a_registered_replacement_has_its_rebuild_started_without_being_asked():
    # The launcher's request came at its next look at the status (0.2 s and more after the registration),
    # all of it degraded training for nothing; the coordinator starts the rebuild itself now, and the
    # launcher's request finds it running.
    import threading

    ctx = make_ctx(servers__replicas=3, faultTolerance__strategy="ecrec", faultTolerance__ecrec__k=2)
    alive = {f"h:{s}" for s in range(3)}
    coord = Coordinator(ctx.job, probe=lambda addr, inst: addr in alive)
    driven, release = [], threading.Event()
    # no servers to call
    coord.recovery._drive_recovery = lambda rec: (driven.append(rec.shard), release.wait(10))
    api = TestClient(create_app(coord))
    for s in range(3):
        api.post("/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    alive.discard("h:1")
    api.post("/v1/failures", json={"shard": 1})
    assert driven == [] and [r["state"] for r in api.get("/v1/recoveries").json()] == ["detected"]
    r = api.post(
        "/v1/servers/register", json={"shard": 1, "address": "h:9", "instance": "r1", "replacement": True}
    )
    assert r.status_code == 200
    assert driven == [1] and [r["state"] for r in api.get("/v1/recoveries").json()] == ["waiting"]
    assert api.post("/v1/recoveries", json={"shard": 1}).json()["state"] == "waiting"  # the same, running
    assert driven == [1]
    release.set()


def test_reports_of_one_failure_made_at_once_probe_the_server_once():
    calls, release = [], threading.Event()

    def slow_probe(address: str, instance: str) -> bool:
        calls.append((address, instance))
        release.wait(5)
        return False

    probe = SingleFlight(slow_probe)
    answers: list[bool] = []
    reporters = [threading.Thread(target=lambda: answers.append(probe("a:1", "i"))) for _ in range(4)]
    for t in reporters:
        t.start()
    deadline = time.monotonic() + 5
    while not probe.running and time.monotonic() < deadline:  # until the first report is probing
        time.sleep(0.001)
    time.sleep(0.05)  # the others are waiting for its answer, not probing
    assert calls == [("a:1", "i")]
    release.set()
    for t in reporters:
        t.join(5)
    assert answers == [False] * 4 and calls == [("a:1", "i")]
    assert probe("a:1", "i") is False and len(calls) == 2  # a later report probes anew
    assert probe("b:1", "i") is False and len(calls) == 3  # another server is another probe


def test_a_probe_that_raises_raises_in_every_report_waiting_for_it():
    entered, release = threading.Event(), threading.Event()

    def broken(address: str, instance: str) -> bool:
        entered.set()
        release.wait(5)
        raise RuntimeError("probe broke")

    probe = SingleFlight(broken)
    errors: list[str] = []

    def report() -> None:
        try:
            probe("a:1", "i")
        except RuntimeError as e:
            errors.append(str(e))

    first = threading.Thread(target=report)
    first.start()
    entered.wait(5)
    second = threading.Thread(target=report)
    second.start()
    time.sleep(0.05)
    release.set()
    first.join(5)
    second.join(5)
    assert errors == ["probe broke"] * 2 and not probe.running


def test_a_server_address_that_refuses_connections_is_dead_without_a_grpc_channel(monkeypatch):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens on the port now

    def no_channel(*_a, **_k):
        raise AssertionError("a refused connection needs no gRPC channel")

    monkeypatch.setattr(auth, "channel", no_channel)
    assert probe_server(f"127.0.0.1:{port}") is False
    with socket.socket() as listener:  # something listens: gRPC decides (here: it is no parameter server)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with pytest.raises(AssertionError, match="gRPC channel"):
            probe_server(f"127.0.0.1:{listener.getsockname()[1]}")
