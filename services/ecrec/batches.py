"""What every data source hands the workers, and the seeding they share: `Batch`, the `DataSource` protocol,
the seed streams, and slicing a split into batches. Public helpers for the sources (ecrec.data's synthetic
and Criteo ones, ecrec.movielens), so that none reaches into another's private names."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ecrec.model import splitmix64

# Seed streams: training batch i uses (TRAIN_STREAM, i), the held-out split (EVAL_STREAM, 0), a source's own
# setup (SETUP_STREAM, 0). Distinct streams mean the eval split never replays a training batch.
TRAIN_STREAM, EVAL_STREAM, SETUP_STREAM = 0, 1, 2


@dataclass
class Batch:
    dense: Tensor  # [B, num_dense] float32, log(count + 1)
    ids: Tensor  # [B, T] int64, per-table ids in [0, table_sizes[t])
    labels: Tensor  # [B] float32 in {0, 1}

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class DataSource(Protocol):
    def batch(self, index: int, batch_size: int) -> Batch:
        """Training batch number `index` (>= 0); the same tensors on every call and in every process."""
        ...

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """The held-out split in batches, the same on every call."""
        ...


def stream_generator(seed: int, stream: int, index: int) -> torch.Generator:
    key = splitmix64(splitmix64(splitmix64(seed) ^ stream) ^ index)
    return torch.Generator().manual_seed(key >> 1)  # manual_seed wants a non-negative int64


def slices(b: Batch, batch_size: int) -> Iterator[Batch]:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for lo in range(0, len(b), batch_size):
        hi = lo + batch_size
        yield Batch(b.dense[lo:hi], b.ids[lo:hi], b.labels[lo:hi])
