"""AUC and log-loss against their textbook definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ecrec.evaluation import auc, logloss


def brute_force_auc(labels: torch.Tensor, scores: torch.Tensor) -> float:
    """P(score of a random positive > score of a random negative), ties counting one half."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return ((diff > 0).double().sum() + 0.5 * (diff == 0).double().sum()).item() / (pos.numel() * neg.numel())


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_pairwise_count_with_ties(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = 500
    labels = (torch.rand(n, generator=g) < 0.3).float()
    # Few distinct values, shifted by the label: many ties across and within classes, AUC well above 0.5.
    scores = torch.randint(0, 8, (n,), generator=g).float() + 2 * labels
    assert auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores), abs=1e-12)


def test_auc_of_perfect_inverted_and_constant_scores() -> None:
    labels = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    scores = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.7, 0.3])
    assert auc(labels, scores) == 1.0
    assert auc(labels, -scores) == 0.0
    assert auc(labels, torch.zeros(6)) == 0.5


def test_auc_is_half_when_a_class_is_absent() -> None:
    assert auc(torch.ones(4), torch.rand(4)) == 0.5
    assert auc(torch.zeros(4), torch.rand(4)) == 0.5


def test_auc_accepts_any_shape_and_rejects_mismatched_sizes() -> None:
    labels = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    scores = torch.tensor([[0.2, 0.6], [0.4, 0.5]])
    assert auc(labels, scores) == 0.75  # (0.6>0.2)+(0.6>0.5)+(0.4>0.2)+(0.4<0.5) = 3 of 4
    with pytest.raises(ValueError, match="differ in size"):
        auc(torch.zeros(3), torch.zeros(4))


def test_logloss_matches_binary_cross_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(1000, generator=g, dtype=torch.float64) * 0.98 + 0.01
    labels = (torch.rand(1000, generator=g, dtype=torch.float64) < probs).double()
    expected = F.binary_cross_entropy(probs, labels).item()
    assert logloss(labels, probs.float()) == pytest.approx(expected, rel=1e-6)


def test_logloss_clamps_certain_wrong_predictions() -> None:
    labels = torch.tensor([1.0, 0.0])
    probs = torch.tensor([0.0, 1.0])
    eps = 1e-7
    expected = F.binary_cross_entropy(
        torch.full((2,), eps, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    )
    assert logloss(labels, probs, eps=eps) == pytest.approx(expected.item(), rel=1e-9)
    assert logloss(labels, 1 - probs) < 1e-6
