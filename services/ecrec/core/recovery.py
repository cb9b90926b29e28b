"""Recovery of a replaced server, as a plan of steps and the progress through it (no I/O).

The coordinator walks the plan: copy the dense replicas, rebuild the data rows lock group by lock group, and
re-encode the parity records the server holds — the three kinds side by side, each kind's steps in order.
Each step is one `Recover` call on the replacement; the plan is data, so it can be printed, tested and shown
by `GET /recoveries`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Step:
    kind: str  # "dense" | "data" | "parity"
    start: int
    count: int


def plan_recovery(data_rows: int, parity_rows: int, lock_group_rows: int) -> list[Step]:
    if lock_group_rows < 1:
        raise ValueError("lock_group_rows must be >= 1")
    steps = [Step("dense", 0, 0)]
    steps += [
        Step("data", lo, min(lock_group_rows, data_rows - lo)) for lo in range(0, data_rows, lock_group_rows)
    ]
    steps += [
        Step("parity", lo, min(lock_group_rows, parity_rows - lo))
        for lo in range(0, parity_rows, lock_group_rows)
    ]
    return steps


MAX_STEP_TIMES = 256  # step completion times one worker report carries (the latest ones)


@dataclass
class RecoveryRecord:
    """One failure of one shard, from kill (if known) to full recovery; times are wall-clock seconds."""

    shard: int
    killed_at: float | None = None
    detected_at: float | None = None
    continued_at: float | None = None
    started_at: float | None = None
    completed_at: float | None = None
    rows_recovered: int = 0
    parity_recovered: int = 0
    steps_done: int = 0
    steps_total: int = 0
    state: str = "detected"  # detected | waiting | running | completed | failed | interrupted
    error: str | None = None
    plan: list[Step] = field(default_factory=list)
    # Seconds the Recover calls of each step kind took (dense, data, parity): where a rebuild's time goes.
    seconds: dict[str, float] = field(default_factory=dict)
    done: dict[str, int] = field(default_factory=dict)  # steps done by kind (the kinds run side by side)

    SEEDED = (
        "shard",
        "killed_at",
        "detected_at",
        "continued_at",
        "started_at",
        "completed_at",
        "rows_recovered",
        "parity_recovered",
        "state",
    )

    def continue_at(self, steps_at: list[float]) -> float | None:
        """Note when training continued after the detection, from the completion times of steps a worker
        reported (sorted); returns it the first time there is one, else None."""
        if self.detected_at is None or self.continued_at is not None:
            return None
        self.continued_at = next((t for t in steps_at if t > self.detected_at), None)
        return self.continued_at

    def seed(self) -> dict:
        """The record as a successor coordinator restores it (wall-clock times, no plan)."""
        return {k: getattr(self, k) for k in self.SEEDED}

    @classmethod
    def restore(cls, seed: dict) -> RecoveryRecord:
        """A record from a dead coordinator's seed. One that had not completed is `interrupted`: its rebuild
        driver died with that coordinator, and the launcher asks for it again (steps already done are
        no-ops on the replacement)."""
        rec = cls(int(seed["shard"]))
        for k in cls.SEEDED[1:-1]:
            setattr(rec, k, seed.get(k))
        rec.rows_recovered = int(seed.get("rows_recovered") or 0)
        rec.parity_recovered = int(seed.get("parity_recovered") or 0)
        rec.state = "completed" if seed.get("state") == "completed" else "interrupted"
        return rec

    def to_dict(self, t0: float | None) -> dict:
        def rel(x: float | None) -> float | None:
            return None if x is None or t0 is None else round(x - t0, 3)

        return {
            "shard": self.shard,
            "state": self.state,
            "killed_at": rel(self.killed_at),
            "detected_at": rel(self.detected_at),
            "continued_at": rel(self.continued_at),
            "started_at": rel(self.started_at),
            "completed_at": rel(self.completed_at),
            "rows_recovered": self.rows_recovered,
            "parity_recovered": self.parity_recovered,
            "steps_done": self.steps_done,
            "steps_total": self.steps_total,
            "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
            "error": self.error,
        }

    def step_done(self, kind: str, seconds: float) -> None:
        """A step of `kind` is done; it took `seconds` (the Recover call, as its driver saw it)."""
        self.steps_done += 1
        self.done[kind] = self.done.get(kind, 0) + 1
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
