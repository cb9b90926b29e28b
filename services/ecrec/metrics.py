"""Prometheus metrics (design notes §7): one definition per name, shared by every role.

Counters end in `_total`, durations are `_seconds` histograms, labels are `job`, `shard`, `role` (+ `method`,
`kind` where they apply). Each process owns one `Metrics` bound to its own registry, so tests can run several
roles in one interpreter without clashes; `serve()` exposes it over HTTP (real Prometheus exposition).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PHASE_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """All ecrec_* metrics of one process. Unused ones simply stay at zero."""

    def __init__(self, job: str, role: str, shard: str = "", registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.labels = {"job": job, "role": role, "shard": shard}
        r, base = self.registry, ["job", "role", "shard"]
        self.samples = Counter("ecrec_samples_trained_total", "Training samples processed", base, registry=r)
        self.steps = Counter("ecrec_steps_total", "Training steps completed", base, registry=r)
        self.throughput = Gauge(
            "ecrec_training_throughput_samples_per_second", "Recent training throughput", base, registry=r
        )
        self.rpc_latency = Histogram(
            "ecrec_rpc_latency_seconds",
            "RPC latency by method",
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
            "Kill or failure to training continuing",
            base,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.full_recovery = Histogram(
            "ecrec_full_recovery_seconds",
            "Failure detected to recovery completed",
            base,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.rows_recovered = Counter(
            "ecrec_rows_recovered_total", "Row records rebuilt by recovery", base, registry=r
        )
        self.degraded_reads = Counter(
            "ecrec_degraded_reads_total", "Rows read by decoding their stripe", base, registry=r
        )
        self.buffered_updates = Counter(
            "ecrec_buffered_updates_total", "Updates buffered behind a lock group", base, registry=r
        )
        self.parity_checks = Counter(
            "ecrec_parity_check_stripes_total", "Stripes checked by result", [*base, "result"], registry=r
        )

    def of(self, metric, **extra):
        """The child of `metric` with this process's labels: `m.of(m.rows, kind="pull").inc(n)`."""
        return metric.labels(**self.labels, **extra)

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
