"""The Prometheus expositions of a real job: `promtool check metrics` (Debian's prometheus package, fetched by
hack/fetch-prometheus) passes on the coordinator's, a server's and a worker's /metrics, and the names, types
and labels follow Prometheus conventions (parsed with prometheus_client.parser). Also the coordinator's
bookkeeping of what workers report (degraded rows, RPC latency), on the real REST app."""

from __future__ import annotations

import math

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ecrec.coordinator.app import create_app
from ecrec.coordinator.service import Coordinator
from ecrec.metrics import JOB_PHASES, LATENCY_BUCKETS, SHARD_STATES, exported_metrics
from tests.conftest import make_ctx, processes_mentioning
from tests.prom import local_job, promtool_check_metrics

ROLES = {"coordinator", "server", "worker"}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(fams: dict, name: str, **labels) -> list:
    """Samples of family `name` (a counter's name without _total) whose labels include `labels`."""
    fam = fams.get(name)
    return [] if fam is None else [s for s in fam.samples if labels.items() <= s.labels.items()]


def value(fams: dict, sample: str, **labels) -> float:
    """The one sample named `sample` (e.g. ecrec_x_total, ecrec_y_count) with `labels`."""
    base = sample
    for suffix in ("_total", "_bucket", "_count", "_sum"):
        if sample.endswith(suffix) and base not in fams:
            base = sample.removesuffix(suffix)
    found = [s for s in samples(fams, base, **labels) if s.name == sample]
    assert len(found) == 1, f"{sample}{labels}: {found}"
    return found[0].value


def check_conventions(text: str, job: str, role: str) -> dict:
    """promtool's lint and our own conventions; returns the parsed families."""
    code, said = promtool_check_metrics(text)
    # No exceptions: any lint finding (or a parse error) fails.
    assert code == 0 and said == "", f"promtool check metrics ({role}): exit {code}\n{said}"
    fams = families(text)
    exported = exported_metrics()
    for name, fam in fams.items():
        if name.endswith("_created"):
            continue  # prometheus_client's creation-time gauges for counters and histograms
        assert name.startswith("ecrec_"), name
        key = name + "_total" if fam.type == "counter" else name
        assert exported.get(key) == fam.type, f"{key} ({fam.type}) is not what ecrec.metrics declares"
        if fam.type != "counter":
            assert not name.endswith("_total"), f"{name}: only counters end in _total"
        if fam.type == "histogram":
            assert name.endswith("_seconds"), f"{name}: our histograms are durations, in seconds"
        for s in fam.samples:
            if fam.type == "counter":
                assert s.name in (name + "_total", name + "_created"), s.name
            # Prometheus's own target labels: ours would be renamed exported_job / exported_instance.
            assert not {"job", "instance", "exported_job"} & set(s.labels), (s.name, s.labels)
            assert s.labels["ecrec_job"] == job and s.labels["role"] == role, (s.name, s.labels)
            assert "shard" in s.labels, s.name
            assert math.isfinite(s.value), (s.name, s.value)
    return fams


@pytest.mark.slow
@pytest.mark.timeout(900)  # a replacement server starts slowly on a busy machine
def test_expositions_of_a_job_with_a_kill_pass_promtool_and_follow_conventions(tmp_path):
    with local_job(tmp_path / "job", kill="2@2") as job:  # (its replacement 3 s later: tests/prom.py)
        # Bounded waits: a broken job fails the test with its logs instead of hanging it.
        job.wait("the recovery of shard 2", job.recovered, 300)
        workers = lambda: job.status()["workers"]  # noqa: E731
        job.wait(
            "both workers reporting a loss",
            lambda: [w["loss"] is not None for w in workers()] == [True] * 2,
            60,
        )

        # Workers report their degraded reads and writes with their progress, which may come after the
        # recovery: wait for the reports (bounded), then scrape.
        def degraded_reported() -> bool:
            fams = families(httpx.get(f"{job.coordinator}/metrics", timeout=10).text)
            # the series appear with the first report that has them: none yet is "not yet", not a failure
            return all(
                sum(
                    x.value
                    for x in samples(fams, f"ecrec_degraded_{kind}", shard="2")
                    if x.name.endswith("_total")
                )
                > 0
                for kind in ("reads", "writes")
            )

        job.wait("the workers' reports of degraded reads and writes", degraded_reported, 60)
        coord_text = httpx.get(f"{job.coordinator}/metrics", timeout=10).text
        cluster = httpx.get(f"{job.coordinator}/v1/cluster", timeout=10).json()
        server_text = httpx.get(cluster["shards"][2]["metricsUrl"], timeout=10).text  # the rebuilt one
        worker_texts = [httpx.get(job.worker_metrics_url(rank), timeout=10).text for rank in range(2)]
        code = job.stop()
    assert code == 130, job.logs()  # stopped by Ctrl-C, not failed
    assert processes_mentioning(str(tmp_path)) == []

    c = check_conventions(coord_text, job.name, "coordinator")
    s = check_conventions(server_text, job.name, "server")
    ws = [check_conventions(text, job.name, "worker") for text in worker_texts]

    # The coordinator covers the job: step, loss of each worker, phase, one state per shard, the recovery.
    assert value(c, "ecrec_training_step") > 0
    assert value(c, "ecrec_training_target_steps") == 100000
    assert {x.labels["rank"] for x in samples(c, "ecrec_training_loss")} == {"0", "1"}
    assert sum(x.value for x in samples(c, "ecrec_job_phase")) == 1
    assert {x.labels["phase"] for x in samples(c, "ecrec_job_phase")} == set(JOB_PHASES)
    for shard in range(5):
        states = {x.labels["state"]: x.value for x in samples(c, "ecrec_shard_state", shard=str(shard))}
        assert set(states) == set(SHARD_STATES) and states["up"] == 1 and sum(states.values()) == 1, states
    assert value(c, "ecrec_shard_incarnation", shard="2") == 2
    assert value(c, "ecrec_recovery_phase", shard="2", phase="completed") == 1
    groups = value(c, "ecrec_recovery_lock_groups", shard="2")
    assert groups > 0 and value(c, "ecrec_recovery_lock_groups_done", shard="2") == groups
    rebuilt = value(c, "ecrec_recovery_rows_rebuilt", shard="2")
    assert rebuilt > 0 and value(c, "ecrec_rows_recovered_total", shard="2") == rebuilt
    assert value(c, "ecrec_failures_detected_total") >= 1
    assert value(c, "ecrec_recoveries_completed_total") >= 1
    assert value(c, "ecrec_time_to_continue_seconds_count") >= 1
    assert value(c, "ecrec_time_to_recover_seconds_count") >= 1
    # Workers read and wrote rows of the failed shard 2 elsewhere, and said so with their progress.
    assert value(c, "ecrec_degraded_reads_total", shard="2") > 0
    assert value(c, "ecrec_degraded_writes_total", shard="2") > 0
    assert value(c, "ecrec_degraded_reads_total", shard="0") == 0
    methods = {x.labels["method"] for x in samples(c, "ecrec_job_rpc_latency_seconds")}
    assert {"Pull", "Stage", "DeliverDeltas", "DegradedPull"} <= methods, methods
    assert value(c, "ecrec_job_rpc_latency_seconds_count", method="Stage") > 0
    # One Recover call per lock group and one for the dense replicas (more if a step had to be retried).
    assert value(c, "ecrec_rpc_latency_seconds_count", method="Recover") >= groups + 1
    assert value(c, "ecrec_samples_trained_total") > 0

    # Each worker: its own RPCs by method; its share of the degraded rows (one of them may have read none of
    # shard 2's rows in the second or so it was failed: seen on a loaded CI machine, for worker 0).
    for w in ws:
        assert value(w, "ecrec_rpc_latency_seconds_count", method="Pull") > 0
        assert value(w, "ecrec_steps_total") > 0
    shares = [
        sum(x.value for x in samples(w, "ecrec_degraded_reads", shard="2") if x.name.endswith("_total"))
        for w in ws
    ]
    assert sum(shares) > 0, shares
    # The rebuilt server: served RPCs, its store's counters, the Recover steps it ran.
    assert value(s, "ecrec_rpc_latency_seconds_count", method="Recover") >= groups + 1
    assert value(s, "ecrec_server_rows_rebuilt_total") == rebuilt
    assert samples(s, "ecrec_server_staged")


def _coordinator(workers: int = 1):
    ctx = make_ctx(servers__replicas=5, workers__replicas=workers, faultTolerance__strategy="ecrec")
    coord = Coordinator(ctx.job, probe=lambda addr, inst: True)
    api = TestClient(create_app(coord))
    for s in range(5):
        api.post("/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    return coord, api


def _latency(count: int, seconds: float) -> dict:
    """A histogram whose `count` observations all fell in the 0.005 s bucket."""
    i = LATENCY_BUCKETS.index(0.005)
    return {"buckets": [0] * i + [count] * (len(LATENCY_BUCKETS) + 1 - i), "sum": seconds}


def test_worker_counters_are_summed_and_never_go_down_when_a_replacement_counts_from_zero():
    coord, api = _coordinator()
    api.post("/v1/workers/register", json={"rank": 0, "instance": "w0"})

    def report(instance: str, step: int, reads: int, pulls: int) -> httpx.Response:
        body = {"rank": 0, "instance": instance, "step": step, "samples": step * 64}
        body |= {"degradedReads": {"2": reads}, "rpcLatency": {"Pull": _latency(pulls, pulls * 0.004)}}
        return api.post("/v1/workers/progress", json=body)

    assert report("w0", 1, 10, 3).status_code == 200
    assert report("w0", 2, 25, 5).status_code == 200
    api.post("/v1/workers/lost", json={"rank": 0, "instance": "w0", "replacing": True})
    api.post(
        "/v1/workers/register", json={"rank": 0, "instance": "w0b", "incarnation": 2, "replacement": True}
    )
    assert report("w0b", 3, 4, 1).status_code == 200  # the replacement counts from zero again
    fams = families(api.get("/metrics").text)
    assert value(fams, "ecrec_degraded_reads_total", shard="2") == 25 + 4
    assert value(fams, "ecrec_job_rpc_latency_seconds_count", method="Pull") == 5 + 1
    assert value(fams, "ecrec_job_rpc_latency_seconds_bucket", method="Pull", le="0.001") == 0
    assert value(fams, "ecrec_job_rpc_latency_seconds_sum", method="Pull") == pytest.approx(0.024)


@pytest.mark.parametrize(
    "extra",
    [
        {"degradedReads": {"7": 1}},  # no shard 7
        {"degradedWrites": {"1": -5}},
        {"rpcLatency": {"Pull": {"buckets": [1, 2], "sum": 0.1}}},  # not this histogram's buckets
        {"rpcLatency": {"": _latency(1, 0.1)}},
    ],
)
def test_a_report_with_counters_that_do_not_fit_is_refused_and_changes_nothing(extra):
    coord, api = _coordinator()
    api.post("/v1/workers/register", json={"rank": 0, "instance": "w0"})
    before = api.get("/v1/status").json()
    body = {"rank": 0, "instance": "w0", "step": 4, "samples": 256, **extra}
    assert api.post("/v1/workers/progress", json=body).status_code in (400, 422)
    after = api.get("/v1/status").json()
    assert after["workers"] == before["workers"] and after["samples"] == before["samples"] == 0
    fams = families(api.get("/metrics").text)
    degraded = [x.value for x in samples(fams, "ecrec_degraded_reads") if x.name.endswith("_total")]
    assert degraded == [0] * 5 and not samples(fams, "ecrec_job_rpc_latency_seconds")


def test_parity_check_results_are_counted_and_bad_ones_refused():
    coord, api = _coordinator()
    assert api.post("/v1/parity-checks", json={"stripes": 100, "mismatches": 2}).json() == {"ok": False}
    assert api.post("/v1/parity-checks", json={"stripes": 50, "mismatches": 0}).json() == {"ok": True}
    assert api.post("/v1/parity-checks", json={"stripes": 5, "mismatches": 6}).status_code == 400
    fams = families(api.get("/metrics").text)
    assert value(fams, "ecrec_parity_check_stripes_total", result="ok") == 148
    assert value(fams, "ecrec_parity_check_stripes_total", result="mismatch") == 2
    assert value(fams, "ecrec_parity_check_last_mismatches") == 0


def test_every_declared_metric_follows_the_naming_conventions():
    for name, kind in exported_metrics().items():
        assert name.startswith("ecrec_") and name == name.lower(), name
        assert name.endswith("_total") == (kind == "counter"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name


def test_checkpoint_strategies_export_what_they_cost_and_lost():
    ctx = make_ctx(servers__replicas=2, faultTolerance__strategy="cpr")
    coord = Coordinator(ctx.job, probe=lambda addr, inst: True)
    api = TestClient(create_app(coord))
    fams = check_conventions(api.get("/metrics").text, ctx.name, "coordinator")
    assert value(fams, "ecrec_checkpoints_committed_total", kind="full") == 0
    # What the driver counts as it commits, restores and loses (its own tests drive the real thing).
    d = coord.ckpt
    d.committed["full"], d.committed["hot"], d.bytes_written, d.paused_seconds = 2, 5, 4096, 1.25
    d.cycle.pls, d.cycle.rollbacks, d.cycle.steps_redone = 0.03, 0, 0
    fams = check_conventions(api.get("/metrics").text, ctx.name, "coordinator")
    assert value(fams, "ecrec_checkpoints_committed_total", kind="hot") == 5
    assert value(fams, "ecrec_checkpoint_written_bytes_total") == 4096
    assert value(fams, "ecrec_checkpoint_paused_seconds_total") == 1.25
    assert value(fams, "ecrec_portion_of_lost_samples_ratio") == 0.03
    assert value(fams, "ecrec_rollbacks_total") == 0
