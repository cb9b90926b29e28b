"""CPU seconds the job's processes spend on training, by role: where the cost of fault tolerance goes.

Every process reads its own counter (`time.process_time()`: user + system time of all its threads) and sends
it with what it sends the coordinator anyway — a server with its registration and heartbeats, a worker with
its registration and progress reports. `CpuAccount` keeps, per process, the first value (at registration:
imports and model building done, training not begun) and the latest, and sums latest − first by role. A dead
process keeps what it reported last; its replacement counts from its own registration (a rebuild's work
counts, a start-up does not). Pure bookkeeping, no clock and no I/O.
"""

from __future__ import annotations

from ecrec.core.roles import ROLES


class CpuAccount:
    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], list[float]] = {}  # (role, instance) -> [first, latest]

    def report(self, role: str, instance: str, cpu_seconds: float | None) -> None:
        """`instance` said its counter reads `cpu_seconds` (None or negative: a process that did not say)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if cpu_seconds is None or not cpu_seconds >= 0:  # (also refuses NaN)
            return
        seen = self._seen.get((role, instance))
        if seen is None:
            self._seen[(role, instance)] = [cpu_seconds, cpu_seconds]
        else:
            seen[1] = max(
                seen[1], cpu_seconds
            )  # a counter never goes back: a late stale report changes nothing

    def by_role(self) -> dict[str, float]:
        out = dict.fromkeys(ROLES, 0.0)
        for (role, _instance), (first, latest) in self._seen.items():
            out[role] += latest - first
        return {role: round(seconds, 3) for role, seconds in out.items()}

    def by_instance(self, role: str) -> dict[str, float]:
        """Latest − first per process of `role`: how the role's work is spread (servers' load balance)."""
        return {
            i: round(latest - first, 3) for (r, i), (first, latest) in sorted(self._seen.items()) if r == role
        }

    def processes(self, role: str) -> int:
        return sum(1 for r, _ in self._seen if r == role)
