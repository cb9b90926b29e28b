"""CPR's hot-row trackers (cpr-partial-recovery.txt §4.2): which embedding rows a server saves between full
checkpoints, so that a partial recovery loses little of the rows that change most. Pure, vectorized.

- **MFU** (most frequently used): a counter per row, +1 each time the row is read for a step; a save takes the
  rN rows with the highest counts and clears their counters.
- **SSU** (sub-sampled used): every `period`-th read request adds its rows to a list of at most rN rows; when
  the list overflows, random entries are dropped (sub-sampling acts as a high-pass filter: rows read often
  are likely to be listed). A save takes the list and empties it.
"""

from __future__ import annotations

import torch


class MfuTracker:
    def __init__(self, num_rows: int):
        self.counts = torch.zeros(num_rows, dtype=torch.int32)

    def access(self, local: torch.Tensor) -> None:
        """Rows read by one request (unique local row ids)."""
        self.counts[local] += 1

    def take(self, k: int) -> torch.Tensor:
        """The (at most) k most used rows since they were last taken, sorted; their counters restart."""
        used = int((self.counts > 0).sum())
        if k <= 0 or used == 0:
            return torch.zeros(0, dtype=torch.int64)
        top = torch.topk(self.counts, min(k, used), sorted=False).indices
        self.counts[top] = 0
        return top.sort().values


class SsuTracker:
    def __init__(self, num_rows: int, capacity: int, period: int = 2, seed: int = 0):
        if period < 1:
            raise ValueError("period must be >= 1")
        self.listed = torch.zeros(num_rows, dtype=torch.bool)
        self.capacity, self.period = max(1, capacity), period
        self.calls = 0
        self.gen = torch.Generator().manual_seed(seed)

    def access(self, local: torch.Tensor) -> None:
        self.calls += 1
        if self.calls % self.period:
            return
        self.listed[local] = True
        rows = self.listed.nonzero().squeeze(1)
        over = rows.numel() - self.capacity
        if over > 0:
            self.listed[rows[torch.randperm(rows.numel(), generator=self.gen)[:over]]] = False

    def take(self, k: int | None = None) -> torch.Tensor:
        rows = self.listed.nonzero().squeeze(1)
        self.listed.zero_()
        return rows if k is None else rows[:k]


def make_tracker(kind: str, num_rows: int, fraction: float, period: int = 2, seed: int = 0):
    """The tracker for `cpr.hotRows` (none: None); lists hold at most fraction x rows."""
    capacity = max(1, int(num_rows * fraction))
    if kind == "mfu":
        return MfuTracker(num_rows)
    if kind == "ssu":
        return SsuTracker(num_rows, capacity, period, seed)
    return None
