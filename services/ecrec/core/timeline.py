"""Samples trained over time, placed where the steps that trained them completed (pure, no I/O).

The coordinator learns a worker's samples from its progress reports, every 0.5 s per worker. A total logged
when each report arrives puts every step at its report's arrival, up to half a second late and in lumps — too
coarse for a recovery that lasts a few tenths of a second, where `ecrec bench recovery` counts the samples
trained between the kill and full recovery. Reports also carry the completion time of each of their steps
(the same list that times "training continued"), so the samples are put into time bins by those times
instead. Bins are `width` seconds wide; when there would be more than `max_bins`, the width doubles and
neighbouring bins merge, so a long job's timeline stays bounded and a short one (a benchmark) keeps its
resolution.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

WIDTH = 0.05  # seconds: finer than a recovery's phases (~0.2-1 s here), about one step of a worker
MAX_BINS = 4096  # 0.05 s bins for the first ~3.4 minutes of training, then 0.1 s, ...


class SamplesTimeline:
    def __init__(self, width: float = WIDTH, max_bins: int = MAX_BINS):
        if width <= 0 or max_bins < 2:
            raise ValueError("width must be > 0 and max_bins >= 2")
        self.width, self.max_bins = width, max_bins
        self.origin: float | None = None  # wall time of the first point (training start, or a restore)
        self.base = 0.0  # the total at the origin
        self.total = 0.0  # the total placed so far
        self.bins: dict[int, float] = {}  # bin index (from the origin) -> samples completed in it

    def start(self, at: float, total: float = 0.0) -> None:
        """The timeline begins at `at` with `total` samples already trained (a restored coordinator's)."""
        self.origin, self.base, self.total, self.bins = at, float(total), float(total), {}

    def update(self, total: float, now: float, step_times: Iterable[float] = (), steps: int = 0) -> None:
        """The job's total is now `total`. What it gained came from `steps` steps that completed at
        `step_times` (the latest ones: a report carries a bounded list; the samples of steps whose times it
        dropped are put at the earliest time it kept). Without times, or when the total went down (a
        checkpoint strategy's rollback), the change is put at `now`."""
        if self.origin is None:
            return
        gained = float(total) - self.total
        if gained == 0:
            return
        self.total = float(total)
        times = sorted(t for t in step_times if math.isfinite(t))
        if gained < 0 or not times:
            self._put(now, gained)
            return
        per_step = gained / max(steps, len(times))
        self._put(times[0], gained - per_step * (len(times) - 1))
        for t in times[1:]:
            self._put(t, per_step)

    def _put(self, at: float, samples: float) -> None:
        # (a time before the origin goes into the first bin: a successor coordinator's first reports)
        i = max(0, math.floor((at - self.origin) / self.width))
        self.bins[i] = self.bins.get(i, 0.0) + samples
        while len(self.bins) > self.max_bins:
            self.width *= 2
            merged: dict[int, float] = {}
            for j, n in self.bins.items():
                merged[j // 2] = merged.get(j // 2, 0.0) + n
            self.bins = merged

    def series(self) -> list[tuple[float, float]]:
        """(wall time, total) points, linear between them: a bin's samples spread evenly over its width, a bin
        without samples flat. Empty before the start."""
        if self.origin is None:
            return []
        out = [(self.origin, self.base)]
        total = self.base
        for i in sorted(self.bins):
            begin, end = self.origin + i * self.width, self.origin + (i + 1) * self.width
            if begin > out[-1][0]:
                out.append((begin, total))
            total += self.bins[i]
            out.append((end, total))
        return out
