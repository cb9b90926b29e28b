"""Prometheus metrics (design notes §7): one definition per name, shared by every role.

Names follow Prometheus conventions: counters end in `_total`, durations are `_seconds` histograms, sizes are
in bytes and rows. Every series carries `ecrec_job` (the job's name; `job` and `instance` are Prometheus's own
target labels), `role` (coordinator, server, worker, client) and `shard` (a server's shard id; empty for the
other roles), plus `method`, `kind`, `state`, `phase`, `result` or `rank` where they apply. On the coordinator's
per-shard series and on `ecrec_degraded_{reads,writes}_total`, `shard` is the shard the series is about (the
failed shard whose rows were decoded or written elsewhere).

Each process owns one `Metrics` bound to its own registry, so tests can run several roles in one interpreter
without clashes; `serve()` exposes it over HTTP (real Prometheus exposition). The coordinator's registry also
holds a `JobCollector` that reads the job's state at scrape time (step, loss, shard states, recovery progress)
and the RPC latency its workers report (`WorkerReports`): a Prometheus that scrapes only the coordinator sees
what an operator of the job watches (charts/ecrec/dashboards/ecrec.json is built from these names).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ecrec.core.cluster import ShardState

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PHASE_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
BASE_LABELS = ("ecrec_job", "role", "shard")

# The values of the one-hot state gauges: every value is exported (1 for the current one, 0 for the others),
# so a query for one state has a series whatever the state is.
JOB_PHASES = ("Pending", "Running", "Degraded", "Recovering", "Succeeded", "Failed")  # Coordinator.phase()
SHARD_STATES = tuple(s.value for s in ShardState)
# RecoveryRecord.state
RECOVERY_PHASES = ("detected", "waiting", "running", "completed", "failed", "interrupted")


class Metrics:
    """All ecrec_* metrics of one process. Unused ones simply stay at zero."""

    def __init__(self, job: str, role: str, shard: str = "", registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.labels = {"ecrec_job": job, "role": role, "shard": shard}
        self._children: dict[tuple, object] = {}
        r, base = self.registry, list(BASE_LABELS)
        self.samples = Counter("ecrec_samples_trained_total", "Training samples processed", base, registry=r)
        self.steps = Counter("ecrec_steps_total", "Training steps completed", base, registry=r)
        self.throughput = Gauge(
            "ecrec_training_throughput_samples_per_second",
            "Training throughput over the last 2 s (coordinator: all workers)",
            base,
            registry=r,
        )
        self.rpc_latency = Histogram(
            "ecrec_rpc_latency_seconds",
            "RPC latency by method (servers: served; workers: each call they made)",
            [*base, "method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rpc_errors = Counter(
            "ecrec_rpc_errors_total", "Failed RPCs by method and code", [*base, "method", "code"], registry=r
        )
        self.bytes_sent = Counter(
            "ecrec_bytes_sent_total",
            "Payload bytes sent by kind (pull, push, delta, recovery, dense)",
            [*base, "kind"],
            registry=r,
        )
        self.rows = Counter("ecrec_rows_total", "Rows served or updated by kind", [*base, "kind"], registry=r)
        self.epoch = Gauge("ecrec_cluster_epoch", "Cluster-map epoch", base, registry=r)
        self.servers = Gauge("ecrec_servers", "Servers by state", [*base, "state"], registry=r)
        self.failures = Counter("ecrec_failures_detected_total", "Server failures detected", base, registry=r)
        self.recoveries_started = Counter(
            "ecrec_recoveries_started_total", "Recoveries started", base, registry=r
        )
        self.recoveries_completed = Counter(
            "ecrec_recoveries_completed_total", "Recoveries completed", base, registry=r
        )
        self.time_to_continue = Histogram(
            "ecrec_time_to_continue_seconds",
            "Kill (or, if not known, failure detection) to the first training step completed after it",
            base,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.time_to_recover = Histogram(
            "ecrec_time_to_recover_seconds",
            "Kill (or, if not known, failure detection) to the replacement fully rebuilt",
            base,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.rows_recovered = Counter(
            "ecrec_rows_recovered_total", "Data rows rebuilt by recovery, by rebuilt shard", base, registry=r
        )
        self.degraded_reads = Counter(
            "ecrec_degraded_reads_total",
            "Rows of a failed shard read by decoding their stripe (shard: the failed shard)",
            base,
            registry=r,
        )
        self.degraded_writes = Counter(
            "ecrec_degraded_writes_total",
            "Rows of a failed shard updated at their acting home (shard: the failed shard)",
            base,
            registry=r,
        )
        self.parity_checks = Counter(
            "ecrec_parity_check_stripes_total",
            "Stripes checked by result (ok, mismatch)",
            [*base, "result"],
            registry=r,
        )
        self.parity_last_mismatches = Gauge(
            "ecrec_parity_check_last_mismatches",
            "Stripes that mismatched in the latest parity check",
            base,
            registry=r,
        )
        self.parity_last_time = Gauge(
            "ecrec_parity_check_last_timestamp_seconds",
            "Unix time of the latest parity check reported to the coordinator",
            base,
            registry=r,
        )

    def of(self, metric, **extra):
        """The child of `metric` with this process's labels: `m.of(m.rows, kind="pull").inc(n)`; `extra` may
        also override a base label (`shard=` on the coordinator's per-shard series). Children are kept:
        `labels()` costs ~10 us, several times per message on the hot paths (no series is ever removed)."""
        key = (id(metric), *extra.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**{**self.labels, **extra})
        return child

    @contextmanager
    def timed(self, method: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.of(self.rpc_latency, method=method).observe(time.perf_counter() - start)

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Expose /metrics over HTTP; returns the bound port (port 0 picks a free one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_address[1]


def latency_snapshot(metrics: Metrics) -> dict[str, dict]:
    """This process's `ecrec_rpc_latency_seconds` as {method: {"buckets": [cumulative count per bucket of
    LATENCY_BUCKETS, then +Inf], "sum": seconds}}: what a worker reports to the coordinator."""
    out: dict[str, dict] = {}
    for family in metrics.rpc_latency.collect():
        for s in family.samples:  # buckets come in ascending `le` order
            h = out.setdefault(s.labels["method"], {"buckets": [], "sum": 0.0})
            if s.name.endswith("_bucket"):
                h["buckets"].append(s.value)
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
    return out


class WorkerReports:
    """Counters each worker process reports with its progress (cumulative since the process started), turned
    into job-wide counters on the coordinator: degraded rows by failed shard, and RPC latency by method
    (exported by `JobCollector` as `ecrec_job_rpc_latency_seconds`). Only increases are added, so a
    replacement process that counts from zero again never makes a counter go down."""

    def __init__(self, metrics: Metrics, num_servers: int):
        self.metrics, self.num_servers = metrics, num_servers
        self.last: dict[int, tuple[str, dict, dict, dict]] = {}  # rank -> (instance, reads, writes, latency)
        self.latency: dict[str, list[float]] = {}  # method -> cumulative bucket counts, then the sum

    def check(self, reads: dict[int, int], writes: dict[int, int], latency: dict[str, dict]) -> None:
        """Raise ValueError (400) for a report that does not fit the job; called before anything changes."""
        for what, counts in (("degradedReads", reads), ("degradedWrites", writes)):
            for shard, n in counts.items():
                if not 0 <= shard < self.num_servers or n < 0:
                    raise ValueError(f"{what}: shard {shard} out of range or count {n} negative")
        for method, h in latency.items():
            buckets, total = h["buckets"], h["sum"]
            if not method or len(method) > 64:
                raise ValueError("rpcLatency: method names are 1 to 64 characters")
            if len(buckets) != len(LATENCY_BUCKETS) + 1 or not all(
                math.isfinite(b) and b >= 0 for b in (*buckets, total)
            ):
                raise ValueError(f"rpcLatency[{method}]: {len(LATENCY_BUCKETS) + 1} finite counts and a sum")

    def add(self, rank: int, instance: str, reads: dict, writes: dict, latency: dict) -> None:
        prev = self.last.get(rank)
        if prev is None or prev[0] != instance:  # a new process of the rank counts from zero
            prev = (instance, {}, {}, {})
        m = self.metrics
        for metric, now, before in ((m.degraded_reads, reads, prev[1]), (m.degraded_writes, writes, prev[2])):
            for shard, n in now.items():
                if n > before.get(shard, 0):
                    m.of(metric, shard=str(shard)).inc(n - before.get(shard, 0))
        for method, h in latency.items():
            old = prev[3].get(method, {"buckets": [0.0] * len(h["buckets"]), "sum": 0.0})
            new = [*h["buckets"], h["sum"]]
            total = self.latency.setdefault(method, [0.0] * len(new))
            for i, (a, b) in enumerate(zip(new, [*old["buckets"], old["sum"]], strict=True)):
                total[i] += max(0.0, a - b)
        self.last[rank] = (instance, dict(reads), dict(writes), dict(latency))


class JobCollector:
    """The coordinator's view of the job, read at scrape time from `state()` (Coordinator.metrics_state):

    step and its target, the latest loss of each worker, the job's phase, each shard's state and incarnation,
    each shard's latest recovery (phase, lock groups done of total, rows rebuilt), and the RPC latency the
    workers reported (`WorkerReports`)."""

    def __init__(
        self, labels: dict[str, str], state: Callable[[], dict] | None, reports: WorkerReports | None
    ):
        self.labels, self.state, self.reports = labels, state, reports

    def describe(self):
        return self._families({}, {})

    def collect(self):
        state = self.state() if self.state is not None else {}
        latency = self.reports.latency if self.reports is not None else {}
        return self._families(state, dict(latency))

    def _families(self, st: dict, latency: dict):
        names = list(BASE_LABELS)
        job, role = self.labels["ecrec_job"], self.labels["role"]

        def labels(shard: str = "", *rest: str) -> list[str]:
            return [job, role, shard, *rest]

        step = GaugeMetricFamily(
            "ecrec_training_step", "Steps every worker has completed (the slowest)", labels=names
        )
        target = GaugeMetricFamily("ecrec_training_target_steps", "Steps each worker trains", labels=names)
        loss = GaugeMetricFamily(
            "ecrec_training_loss", "Latest training loss each worker reported", labels=[*names, "rank"]
        )
        phase = GaugeMetricFamily(
            "ecrec_job_phase", "1 for the job's phase, 0 for the others", labels=[*names, "phase"]
        )
        if st:
            step.add_metric(labels(), st["step"])
            target.add_metric(labels(), st["target_steps"])
            for rank, value in sorted(st["losses"].items()):
                loss.add_metric(labels("", str(rank)), value)
            for p in JOB_PHASES:
                phase.add_metric(labels("", p), float(p == st["phase"]))
        yield from (step, target, loss, phase)

        shard_state = GaugeMetricFamily(
            "ecrec_shard_state", "1 for each shard's state, 0 for the others", labels=[*names, "state"]
        )
        incarnation = GaugeMetricFamily(
            "ecrec_shard_incarnation",
            "Process incarnation serving each shard (+1 per replacement)",
            labels=names,
        )
        for shard, state, inc in st.get("shards", ()):
            for s in SHARD_STATES:
                shard_state.add_metric(labels(str(shard), s), float(s == state))
            incarnation.add_metric(labels(str(shard)), inc)
        yield from (shard_state, incarnation)

        rec_phase = GaugeMetricFamily(
            "ecrec_recovery_phase",
            "1 for the phase of each shard's latest recovery, 0 for the others",
            labels=[*names, "phase"],
        )
        groups = GaugeMetricFamily(
            "ecrec_recovery_lock_groups",
            "Lock groups (data and parity) in the latest recovery's plan",
            labels=names,
        )
        done = GaugeMetricFamily(
            "ecrec_recovery_lock_groups_done", "Lock groups the latest recovery has rebuilt", labels=names
        )
        rows = GaugeMetricFamily(
            "ecrec_recovery_rows_rebuilt", "Data rows the latest recovery has rebuilt", labels=names
        )
        for shard, rec in sorted(st.get("recoveries", {}).items()):
            for p in RECOVERY_PHASES:
                rec_phase.add_metric(labels(str(shard), p), float(p == rec["phase"]))
            groups.add_metric(labels(str(shard)), rec["lock_groups"])
            done.add_metric(labels(str(shard)), rec["lock_groups_done"])
            rows.add_metric(labels(str(shard)), rec["rows"])
        yield from (rec_phase, groups, done, rows)

        # The checkpoint strategies (checkpoint, checknrun, cpr): what they cost and lost so far.
        ckpts = CounterMetricFamily(
            "ecrec_checkpoints_committed",
            "Checkpoints committed, by kind (full, increment, hot)",
            labels=[*names, "kind"],
        )
        written = CounterMetricFamily(
            "ecrec_checkpoint_written_bytes", "Bytes of committed checkpoints", labels=names
        )
        paused = CounterMetricFamily(
            "ecrec_checkpoint_paused_seconds", "Time training was held for checkpoints", labels=names
        )
        rollbacks = CounterMetricFamily(
            "ecrec_rollbacks", "Rollbacks to a checkpoint after a failure", labels=names
        )
        redone = CounterMetricFamily(
            "ecrec_steps_redone", "Steps trained again after rollbacks", labels=names
        )
        pls = GaugeMetricFamily(
            "ecrec_portion_of_lost_samples_ratio",
            "CPR's portion of lost samples (partial recovery)",
            labels=names,
        )
        if (ck := st.get("checkpointing")) is not None:
            for kind, n in sorted(ck["committed"].items()):
                ckpts.add_metric(labels("", kind), n)
            written.add_metric(labels(), ck["bytesWritten"])
            paused.add_metric(labels(), ck["pausedSeconds"])
            rollbacks.add_metric(labels(), ck["rollbacks"])
            redone.add_metric(labels(), ck["stepsRedone"])
            pls.add_metric(labels(), ck["portionOfLostSamples"])
        yield from (ckpts, written, paused, rollbacks, redone, pls)

        h = HistogramMetricFamily(
            "ecrec_job_rpc_latency_seconds",
            "Latency of the RPCs the job's workers made, by method (summed over workers by the coordinator)",
            labels=[*names, "method"],
        )
        bounds = [*(floatToGoString(b) for b in LATENCY_BUCKETS), "+Inf"]
        for method, counts in sorted(latency.items()):
            h.add_metric(labels("", method), list(zip(bounds, counts[:-1], strict=True)), counts[-1])
        yield h


class StoreCollector:
    """Exposes a server's store counters (rows queued behind a lock, degraded rows, rows rebuilt) at scrape time."""

    COUNTERS = (
        ("buffered", "ecrec_server_buffered_updates", "Requests that waited for busy or locked rows"),
        ("degraded_rows", "ecrec_server_degraded_rows", "Rows served or written for a failed shard"),
        ("rows_recovered", "ecrec_server_rows_rebuilt", "Rows this replacement rebuilt"),
        (
            "stripes_read_again",
            "ecrec_server_stripes_read_again",
            "Stripes a decode read again: their members and parity record were not a consistent cut",
        ),
        (
            "deltas_delivered",
            "ecrec_server_delta_batches",
            "commit: deltaLog: delta batches this parity server accepted (one per part and parity server)",
        ),
        (
            "deltas_held",
            "ecrec_server_delta_batches_held",
            "Of ecrec_server_delta_batches, those with rows that came ahead of a predecessor and were held for it",
        ),
        (
            "rows_realigned",
            "ecrec_server_rows_realigned",
            "r = 2: a failed shard's rows whose parity record took the other record's longer prefix of its updates",
        ),
        (
            "rows_caught_up",
            "ecrec_server_rows_caught_up",
            "r = 2: rows a parity record took from the failed shard's deltas it had refused, to match the other",
        ),
    )

    def __init__(self, store, labels: dict[str, str]):
        self.store, self.labels = store, labels

    def describe(self):
        return self._families(None)

    def collect(self):
        return self._families(self.store)

    def _families(self, store):
        names = list(self.labels)
        values = [self.labels[n] for n in names]
        for key, name, doc in self.COUNTERS:
            c = CounterMetricFamily(name, doc, labels=names)
            if store is not None:
                c.add_metric(values, store.stats[key])
            yield c
        c = CounterMetricFamily(
            "ecrec_server_parts_expired",
            "Parts whose worker never finished them, settled by this server (rowLocks: aborted; deltaLog: "
            "their deltas forwarded to the parity servers), by how its death was known: worker_gone (the "
            "coordinator said its process is gone) or timeout (txnTimeoutSeconds passed)",
            labels=[*names, "reason"],
        )
        if store is not None:
            for reason in ("worker_gone", "timeout"):
                c.add_metric([*values, reason], store.stats[f"expired_{reason}"])
        yield c
        g = GaugeMetricFamily("ecrec_server_staged", "Undecided 2PC state on this server", labels=names)
        if store is not None:
            g.add_metric(values, store.staged_count())
        yield g


def coordinator_metrics(
    job: str, state: Callable[[], dict], num_servers: int
) -> tuple[Metrics, WorkerReports]:
    """The coordinator's Metrics, with the job collector registered and the counters a dashboard rates over
    created at zero (a series that appears only with its first increment has no `rate` before it)."""
    m = Metrics(job, "coordinator")
    reports = WorkerReports(m, num_servers)
    m.registry.register(JobCollector(m.labels, state, reports))
    for metric in (m.samples, m.failures, m.recoveries_started, m.recoveries_completed):
        m.of(metric)
    for metric in (m.time_to_continue, m.time_to_recover):
        m.of(metric)
    for result in ("ok", "mismatch"):
        m.of(m.parity_checks, result=result)
    for shard in range(num_servers):
        m.of(m.degraded_reads, shard=str(shard))
        m.of(m.degraded_writes, shard=str(shard))
        m.of(m.rows_recovered, shard=str(shard))
    return m, reports


def exported_metrics() -> dict[str, str]:
    """Every metric family any ecrec process exports: {family name: type}, names as in the exposition (a
    counter's `_total` included). The dashboard's queries may name only these (tests/test_dashboard.py)."""
    m = Metrics("x", "coordinator")
    out: dict[str, str] = {}
    for collector in (m.registry, JobCollector(m.labels, None, None), StoreCollector(None, m.labels)):
        families = collector.collect() if collector is m.registry else collector.describe()
        for f in families:
            out[f.name + "_total" if f.type == "counter" else f.name] = f.type
    return out


def series_names(family: str, kind: str) -> set[str]:
    """The sample names a family of `kind` puts into the exposition (what PromQL can select)."""
    if kind == "histogram":
        return {f"{family}_bucket", f"{family}_sum", f"{family}_count"}
    if kind == "counter":
        return {family, family.removesuffix("_total") + "_created"}
    return {family}
