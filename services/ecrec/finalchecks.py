"""The checks after training, one implementation for `ecrec local`'s report and the operator's job status:
evaluation on the held-out split, the parity check (invariant I1, posted to the coordinator for its
/metrics when the caller gives one), and — for the launcher's report — the model's digest, what is still
staged and the dense replicas' agreement; then the reference models on the same split (`reference`).

The caller opens and closes the `PSClient` (the cluster map it reads from is the caller's) and decides what
of the result it reports and when; nothing here retries. No threads of its own: the operator runs `check`
on a thread of its own (ecrec_operator.handlers.FinalChecks), the launcher on its main thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ecrec.client import PSClient, evaluate
from ecrec.coordinator.client import CoordinatorClient
from ecrec.coordinator.contract import ParityCheck
from ecrec.data import DataSource
from ecrec.modelread import (
    data_tables,
    dense_replica_mismatches,
    params_sha256,
    parity_check,
    staged_counts,
)
from ecrec.worker import data_source

EVAL_BATCH = 4096


@dataclass
class Found:
    """What the checks found. The launcher-only fields are None unless `check(..., report=True)`; the parity
    fields are None for a job without ECRec."""

    eval: dict  # auc, logloss, samples on the held-out split
    data: DataSource  # the job's data: `reference` trains on its training split
    parity_check: dict | None = None  # stripes, mismatches, in_flight
    params_sha256: str | None = None
    staged_after: int | None = None
    dense_replica_mismatches: int | None = None


def check(client: PSClient, *, coordinator: CoordinatorClient | None = None, report: bool = False) -> Found:
    """Run the checks on the model `client` reads. `report`: the launcher's full set (wait for staged parts to
    settle first, the digest, staged counts, dense replicas); `coordinator`: where the parity result goes."""
    ctx = client.ctx
    if report and ctx.ecrec:
        wait_settled(client, ctx.spec.fault_tolerance.ecrec.txn_timeout_seconds)
    data = data_source(ctx)
    found = Found(evaluate(client, data.eval_batches(EVAL_BATCH)), data)
    # The digest and the parity check's first round read the same data records: read them once.
    tables = data_tables(client) if ctx.ecrec and report else None
    if report:
        found.params_sha256 = params_sha256(client, None if tables is None else [t[0] for t in tables])
    if ctx.ecrec:
        found.parity_check = parity_check(client, data=tables)
        if coordinator is not None:  # for the coordinator's /metrics
            coordinator.record_parity_check(ParityCheck(**found.parity_check))
        if report:
            found.staged_after = sum(staged_counts(client))
            found.dense_replica_mismatches = dense_replica_mismatches(client)
    return found


def reference(spec, data: DataSource) -> dict | None:
    """Logistic regression and a factorization machine on the same split: a bar for the DLRM's numbers
    (real data only; None for synthetic)."""
    from ecrec.reference import reference_for_job

    return reference_for_job(spec, data)


def wait_settled(client: PSClient, txn_timeout: float) -> None:
    """A worker that died mid-update leaves parts staged; the servers settle them within a few txnTimeouts
    (ShardStore.expire). The report's checks describe the state with nothing in flight, so give them that
    time — and no more: what is still staged afterwards is reported (staged_after) as the bug it is."""
    deadline = time.monotonic() + 3 * txn_timeout + 5.0
    while sum(staged_counts(client)) and time.monotonic() < deadline:
        time.sleep(0.2)
