"""Reference models for the accuracy comparisons: logistic regression and a factorization machine.

Both are trained in-process on CPU with plain torch, on the same `DataSource` as the job (its training batches
`batch(0, B)`, `batch(1, B)`, ...) and scored on the same held-out split (`eval_batches`) with the same metrics
(ecrec.evaluation), so a DLRM's AUC and log-loss in `ecrec local`'s report have a bar to be read against.

- lr: logit = b + sum_t w_t[id_t] + u . dense, i.e. logistic regression over one-hot categorical ids and the
  dense features;
- fm: lr plus the factorization machine's pairwise term sum_{i<j} <v_i, v_j> x_i x_j over the same features
  (a k-dimensional vector per categorical id and per dense feature; x = 1 for an id, the value for a dense
  feature), computed with Rendle's O(nk) identity.

Deterministic: the initialization is seeded, the batches are the data source's, and CPU training is
single-process; the same seed gives the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ecrec.data import DataSource
from ecrec.evaluation import auc, logloss

# The reference budget and settings: fixed, so that the bar does not move with the job's own settings; chosen
# by a small sweep on MovieLens-100k's time split (Adam learning rate, epochs, L2) for the best held-out AUC.
BATCH_SIZE = 512
EPOCHS = 3.0
LEARNING_RATE = {"lr": 0.01, "fm": 0.003}
FM_DIM = 8
L2 = 1e-2  # on the weights (and FM vectors) of the ids a batch reads, per sample


class FactorizationMachine(nn.Module):
    """Logistic regression over one-hot ids + dense features; with `k` > 0 also the FM pairwise term."""

    def __init__(self, table_sizes: Sequence[int], num_dense: int, k: int, generator: torch.Generator):
        super().__init__()
        sizes = torch.tensor(list(table_sizes), dtype=torch.int64)
        self.register_buffer("offsets", torch.cumsum(sizes, 0) - sizes)
        total = int(sizes.sum())
        self.bias = nn.Parameter(torch.zeros(1))
        self.w = nn.Parameter(torch.zeros(total))
        self.w_dense = nn.Parameter(torch.zeros(num_dense))
        self.k = k
        if k:
            self.v = nn.Parameter(torch.randn(total, k, generator=generator) * 0.01)
            self.v_dense = nn.Parameter(torch.randn(num_dense, k, generator=generator) * 0.01)

    def forward(self, dense: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(logits [B], the L2 penalty of the rows read)."""
        g = ids + self.offsets
        w = self.w[g]
        logits = self.bias + w.sum(1) + dense @ self.w_dense
        penalty = (w * w).sum()
        if self.k:
            rows = self.v[g]  # [B, T, k]
            vecs = torch.cat([rows, dense.unsqueeze(2) * self.v_dense], dim=1)  # x_i v_i, [B, T + D, k]
            s = vecs.sum(1)
            logits = logits + 0.5 * (s * s - (vecs * vecs).sum(1)).sum(1)
            penalty = penalty + (rows * rows).sum()
        return logits, penalty


def train_and_evaluate(
    data: DataSource,
    table_sizes: Sequence[int],
    num_dense: int,
    k: int,
    steps: int,
    *,
    batch_size: int = BATCH_SIZE,
    lr: float = LEARNING_RATE["lr"],
    l2: float = L2,
    seed: int = 0,
    eval_batch_size: int = 4096,
) -> dict[str, float]:
    """Train one model (k = 0: logistic regression) on `data.batch(i, batch_size)` for i < steps with Adam;
    return its {"auc", "logloss"} on `data.eval_batches`."""
    model = FactorizationMachine(table_sizes, num_dense, k, torch.Generator().manual_seed(seed))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for i in range(steps):
        b = data.batch(i, batch_size)
        logits, penalty = model(b.dense, b.ids)
        loss = F.binary_cross_entropy_with_logits(logits, b.labels) + l2 * penalty / len(b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    labels, probs = [], []
    with torch.no_grad():
        for b in data.eval_batches(eval_batch_size):
            labels.append(b.labels)
            probs.append(torch.sigmoid(model(b.dense, b.ids)[0]))
    y, p = torch.cat(labels), torch.cat(probs)
    return {"auc": round(auc(y, p), 6), "logloss": round(logloss(y, p), 6)}  # as ecrec.client.evaluate


def reference_models(
    data: DataSource,
    table_sizes: Sequence[int],
    num_dense: int,
    train_samples: int,
    *,
    epochs: float = EPOCHS,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """{"lr": {"auc", "logloss"}, "fm": {...}}: both models trained for `epochs` passes over the
    `train_samples` training samples of `data` (in its own batch order) and scored on its held-out split."""
    steps = max(1, math.ceil(epochs * train_samples / BATCH_SIZE))
    # Single-threaded: small enough that threads cost more than they give, and the numbers stay the same.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {
            name: train_and_evaluate(
                data, table_sizes, num_dense, k, steps, lr=LEARNING_RATE[name], seed=seed
            )
            for name, k in (("lr", 0), ("fm", FM_DIM))
        }
    finally:
        torch.set_num_threads(threads)


def reference_for_job(spec, data: DataSource) -> dict[str, dict[str, float]] | None:
    """The reference models' scores beside a job's own evaluation, where its data are real (data.source
    movielens100k, whose `data` knows its training split); None for the other sources. `ecrec local`'s report
    and the operator's final checks (status.eval.reference) both take them from here."""
    if spec.data.source != "movielens100k":
        return None
    m = spec.model_config_resolved()
    return reference_models(data, m.table_sizes, m.num_dense, data.n_train, seed=spec.training.seed)
