"""The operator's own Prometheus metrics (`ecrec_operator_*`), served by `ecrec-operator --metrics-port`."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

reconciles = Counter("ecrec_operator_reconciles_total", "Reconcile passes over ECRecJobs")
actions = Counter("ecrec_operator_actions_total", "Actions the reconciler decided, by kind", ["kind"])
pods_created = Counter(
    "ecrec_operator_pods_created_total",
    "Pods created, by role and whether they replace a lost one",
    ["role", "replacement"],
)
errors = Counter(
    "ecrec_operator_errors_total", "Actions that failed (retried on the next pass), by kind", ["kind"]
)
replacement_seconds = Histogram(
    "ecrec_operator_replacement_seconds",
    "From a server pod seen lost to its replacement's recovery started",
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
)
