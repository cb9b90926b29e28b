"""Offline quality metrics of click predictions: ROC AUC and log-loss.

This module owns how the held-out split is scored; callers gather labels and scores (any device, any shape)
and get plain floats back.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _flat_pair(labels: Tensor, other: Tensor, name: str) -> tuple[Tensor, Tensor]:
    y = labels.detach().reshape(-1).to("cpu", torch.float64)
    s = other.detach().reshape(-1).to("cpu", torch.float64)
    if y.numel() != s.numel():
        raise ValueError(f"labels and {name} differ in size: {y.numel()} vs {s.numel()}")
    return y, s


def auc(labels: Tensor, scores: Tensor) -> float:
    """ROC AUC via the Mann–Whitney rank statistic; tied scores share their average rank.

    Labels > 0.5 count as positives. Returns 0.5 when either class is absent (AUC is undefined there).
    """
    y, s = _flat_pair(labels, scores, "scores")
    pos = y > 0.5
    n_pos = int(pos.sum())
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return 0.5
    # Ranks 1..n in sorted order; a group of c equal scores ending at rank e gets rank e - (c - 1) / 2.
    _, inverse, counts = torch.unique(s, sorted=True, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    avg_rank = ends - (counts.to(torch.float64) - 1) / 2
    rank_sum = avg_rank[inverse][pos].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def logloss(labels: Tensor, probs: Tensor, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities `probs` (clamped to [eps, 1 - eps]) against 0/1 labels."""
    y, p = _flat_pair(labels, probs, "probs")
    if y.numel() == 0:
        raise ValueError("logloss of an empty set of predictions")
    p = p.clamp(eps, 1 - eps)
    return float(-(y * torch.log(p) + (1 - y) * torch.log1p(-p)).mean())
