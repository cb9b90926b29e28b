"""A worker step's update under the worker-coordinated two-phase commit: which parts remain, and where they go.

Pure bookkeeping with no I/O (docs/protocol.md, "Update path"). The driver — UpdateDriver.apply
(ecrec.updater) over gRPC, or the in-memory worker of tests/netsim.py — asks for a plan under its current view
of the cluster map, runs the pass (stage, deltas, commit, decisions), and reports each part's outcome back.
The step is finished when every row's update is applied exactly once and every live replica of every dense
chunk holds the step.

Parts are planned afresh on every pass, so a part whose server died is re-routed: rows of a failed shard go
to their acting homes (the parity servers of their stripes), and a dense chunk goes to the replicas that do
not hold the step yet. A replica's progress is remembered per *incarnation*: a process that dies takes its
copy of the chunk with it, and a replacement that copied the chunk from the surviving replica before that
replica applied this step must still receive it. Sending a dense chunk to a replica that already holds the
step is harmless (ShardStore.stage skips steps in its copy log), so erring toward sending is safe.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ecrec.core.placement import Placement

_TXN = re.compile(r"([^/\s]{1,64})/(\d{1,6})\.(-1|\d{1,6})\.(\d{1,9})")


def parse_txn(txn: str) -> tuple[str, int, int, int]:
    """(step, target, src, attempt) of a part's txn id "<step>/<target>.<src>.<attempt>" (see
    StepUpdate.plan); ValueError if `txn` is not of that form."""
    m = _TXN.fullmatch(txn)
    if m is None:
        raise ValueError(
            f"txn: {txn[:80]!r} is not a part of a worker step (<step>/<target>.<src>.<attempt>)"
        )
    return m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))


def step_of(txn: str) -> str:
    """The worker step a part belongs to: part txn ids are "<step>/<part>" (see StepUpdate.plan)."""
    return txn.split("/", 1)[0]


_STEP = re.compile(r"w(\d{1,6})(?:i(\d{1,6}))?-(\d{1,12})")
_YOUNGEST = 1 << 62


def txn_age(txn: str) -> tuple[int, int, str]:
    """The order in which parts may wait for each other's rows (wait-die, docs/protocol.md): a smaller key is
    older. Worker steps "w<rank>[i<incarnation>]-<step>[...]" order by step, then rank, so a worker that fell
    behind wins its conflicts and catches up; the whole id breaks ties, so the order is total, and a part's
    retries keep their age (the attempt is not part of the step). Other ids (tests, pushes) are youngest."""
    step = step_of(txn)
    m = _STEP.match(step)
    if m is None:
        return (_YOUNGEST, 0, txn)
    return (int(m.group(3)), int(m.group(1)), step)


def txn_worker(txn: str) -> tuple[int, int] | None:
    """(rank, incarnation) of the worker process whose step `txn` belongs to ("w<rank>[i<incarnation>]-...";
    no "i" is incarnation 1); None for other ids (tests, pushes)."""
    m = _STEP.match(step_of(txn))
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2) or 1)


@dataclass
class WorkerFence:
    """Worker processes known to be gone, as the coordinator says (docs/protocol.md, "A worker that dies"):
    rank -> the newest incarnation of that rank whose process died or was replaced. What such a process left
    staged will never be committed by it, so a server aborts or settles it at once instead of after
    txnTimeout. Only grows: a process that is gone stays gone."""

    gone: dict[int, int] = field(default_factory=dict)

    def update(self, gone: Mapping[int, int]) -> bool:
        """Take the coordinator's word; True if some process is newly known gone."""
        changed = False
        for rank, inc in gone.items():
            rank, inc = int(rank), int(inc)
            if inc > self.gone.get(rank, 0):
                self.gone[rank] = inc
                changed = True
        return changed

    def fenced(self, txn: str) -> bool:
        """Did the worker process that staged `txn` die (or get replaced)?"""
        w = txn_worker(txn)
        return w is not None and w[1] <= self.gone.get(w[0], 0)


@dataclass
class Part:
    """One part of a step's 2PC: rows of one data shard (or of a failed shard at its acting home)."""

    target: int
    src: int  # -1: the target's own rows; else the failed shard whose rows the target serves
    pos: torch.Tensor  # positions into the step's row arrays
    dense: list[int] = field(default_factory=list)  # dense chunks staged with this part
    txn: str = ""  # "<step>/<target>.<src>.<attempt>": the servers recover the step from it
    epoch: int = 0  # the map epoch the part was planned under; its stage claims no newer map
    incarnation: int = 0  # the target's incarnation in that map
    # Rows a parity server refused, written again (r = 2): the version each row's update took at the failed
    # incarnation (0: never got there). The acting home, or the replacement that rebuilt the rows, skips the
    # rows both parity records hold already.
    versions: torch.Tensor | None = None


class ParityTargets:
    """Where the parity records of a part's rows live: per parity j (P, and Q when r = 2), each row's parity
    server and parity index. A worker turns the parity servers' answers about a part's deltas into rows with
    it: a row is applied once every one of its parity servers applied it."""

    def __init__(self, placement: Placement, shard: int, local: torch.Tensor) -> None:
        self.by_j = []
        for j in range(placement.r):
            server, block = placement.parity_of(shard, local, j)
            self.by_j.append((server, placement.parity_index(j, block)))
        self.n = local.numel()

    def at(self, servers: int | Iterable[int]) -> torch.Tensor:
        """Rows with a parity record on `servers` (one, or any of several)."""
        one = isinstance(servers, int)  # the riding path: once per delta batch answered
        ids = None if one else torch.tensor(sorted(servers), dtype=torch.int64)
        out = torch.zeros(self.n, dtype=torch.bool)
        for server, _index in self.by_j:
            out |= (server == servers) if one else torch.isin(server, ids)
        return out

    def refused(self, server: int, index: torch.Tensor) -> torch.Tensor:
        """Rows whose parity record on `server` is among the parity indices `index` (refused there)."""
        out = torch.zeros(self.n, dtype=torch.bool)
        for s, i in self.by_j:
            out |= (s == server) & torch.isin(i, index)
        return out


def part_versions(placement: Placement, local: torch.Tensor, batches: Iterable) -> torch.Tensor:
    """The version each of a part's rows (`local`, of one data shard) took, from the part's delta batches
    [(parity indices, stripe slots, versions)]; 0 for rows none of them names."""
    out = torch.zeros(local.numel(), dtype=torch.int64)
    if local.numel() == 0:
        return out
    order = torch.argsort(local)
    ordered = local[order]
    for index, slot, version in batches:
        rows = placement.parity_slot(index)[1] * placement.k + slot
        at = torch.searchsorted(ordered, rows).clamp(max=local.numel() - 1)
        hit = ordered[at] == rows
        out[order[at[hit]]] = version[hit]
    return out


@dataclass(frozen=True)
class MapView:
    """A consistent snapshot of what a plan needs from the driver's cluster map."""

    epoch: int
    failed_shards: frozenset[int] = frozenset()
    incarnations: Mapping[int, int] = field(default_factory=dict)

    def failed(self, shard: int) -> bool:
        return shard in self.failed_shards

    def incarnation(self, shard: int) -> int:
        return self.incarnations.get(shard, 0)


class StepUpdate:
    """Progress of one step's update: rows still to apply, and (replica, incarnation) pairs holding each
    dense chunk's update."""

    def __init__(
        self,
        step: str,
        placement: Placement,
        g: torch.Tensor,
        dense_holders: Sequence[Sequence[int]] = (),
        stable_txns: bool = False,
    ):
        if "/" in step:
            raise ValueError(f"step id {step!r} must not contain '/': it separates the step in txn ids")
        self.step, self.placement, self.g = step, placement, g.reshape(-1)
        self.dense_holders = [tuple(h) for h in dense_holders]
        self.rows_done = torch.zeros(self.g.numel(), dtype=torch.bool)
        # deltaLog: rows whose deltas some live parity server may or may not have applied (its answer did not
        # come). Not planned again until it says: written again elsewhere, they could be applied twice.
        self.rows_waiting = torch.zeros(self.g.numel(), dtype=torch.bool)
        self.dense_done: list[set[tuple[int, int]]] = [set() for _ in self.dense_holders]
        # The version each row's update took at its data server, where a parity server refused it (the rows
        # are written again, and a parity record may hold them already: Part.versions).
        self.versions = torch.zeros(self.g.numel(), dtype=torch.int64)
        self.attempt = 0
        # commit: deltaLog applies a part when it is staged, so a retry must reach its server under the same
        # txn (answered from the server's log, applied once): every pass then names its parts alike. (A
        # replacement never saw the txn and applies it: the process that did is gone, and so is its copy.)
        self.stable_txns = stable_txns

    def dense_todo(self, view: MapView) -> dict[int, list[int]]:
        """Live replicas of each chunk that do not hold this step's update in their current incarnation."""
        out = {}
        for c, holders in enumerate(self.dense_holders):
            done = self.dense_done[c]
            todo = [h for h in holders if not view.failed(h) and (h, view.incarnation(h)) not in done]
            if todo:
                out[c] = todo
        return out

    def finished(self, view: MapView) -> bool:
        return bool(self.rows_done.all()) and not self.dense_todo(view)

    def plan(self, view: MapView) -> list[Part]:
        """The parts of the next pass under `view` (empty once finished), ordered by (target, src)."""
        if self.finished(view):
            return []
        p, attempt = self.placement, self.attempt
        self.attempt += 1
        todo = (~(self.rows_done | self.rows_waiting)).nonzero().reshape(-1)
        parts: dict[tuple[int, int], Part] = {}
        for s, pos, local in p.group_by_shard(self.g[todo]):
            pos = todo[pos]
            # a failed shard's rows: degraded writes, each at its acting home (its first live parity server)
            if view.failed(s):
                pservers, _ = p.acting_parity(s, local, view.failed_shards)
                for ps in pservers.unique().tolist():
                    sub = pos[pservers == ps]
                    took = self.versions[sub]
                    parts[(ps, s)] = Part(ps, s, sub, versions=took if bool(took.any()) else None)
            else:  # (a replacement skips rows whose refused update its rebuild found: Part.versions)
                took = self.versions[pos]
                parts[(s, -1)] = Part(s, -1, pos, versions=took if bool(took.any()) else None)
        empty = torch.empty(0, dtype=torch.int64)
        for c, holders in self.dense_todo(view).items():
            for h in holders:
                parts.setdefault((h, -1), Part(h, -1, empty)).dense.append(c)
        for part in parts.values():
            part.epoch, part.incarnation = view.epoch, view.incarnation(part.target)
            part.txn = f"{self.step}/{part.target}.{part.src}.{0 if self.stable_txns else attempt}"
        return sorted(parts.values(), key=lambda q: (q.target, q.src))

    def committed(self, part: Part) -> None:
        """The part's target committed it (or is committing it: the decision is taken)."""
        self.rows_done[part.pos] = True
        for c in part.dense:
            self.dense_done[c].add((part.target, part.incarnation))

    def rows_applied(self, part: Part, mask: torch.Tensor) -> None:
        """Some of the part's rows are applied (deltaLog: their deltas reached every live parity server)."""
        self.rows_done[part.pos[mask]] = True

    def rows_refused(self, part: Part, mask: torch.Tensor, versions: torch.Tensor) -> None:
        """deltaLog: a parity server refused the part's rows under `mask` (their data server failed or was
        replaced): they are planned again, with `versions` [part rows] — what the update took at the data
        server, for the acting home to tell whether a parity record holds it already."""
        self.rows_waiting[part.pos[mask]] = False
        took = part.pos[mask & (versions > 0)]
        self.versions[took] = versions[mask & (versions > 0)]

    def rows_unanswered(self, part: Part, mask: torch.Tensor, waiting: bool = True) -> None:
        """deltaLog: whether the part's rows under `mask` wait for a parity server's answer about their deltas
        (`plan` leaves them out until it comes)."""
        self.rows_waiting[part.pos[mask]] = waiting

    def dense_applied(self, part: Part) -> None:
        """The part's dense chunks are applied at its target (deltaLog: when it is staged)."""
        for c in part.dense:
            self.dense_done[c].add((part.target, part.incarnation))

    def committed_by_dead_target(self, part: Part) -> None:
        """The target acked the stage and died: its parity servers hold (and commit) the rows' update, but
        its dense chunks died with it; the surviving replica, or a replacement's copy of it, holds the step."""
        self.rows_done[part.pos] = True


class DecisionQueue:
    """Commit decisions a worker owes its parity servers, by server, in the order they were made.

    They are not sent on their own: each rides on the next message the worker sends that server anyway (a
    stage), which applies it before anything else (docs/protocol.md, "Update path"). A plain data structure:
    the driver that shares it between threads locks it (ecrec.updater.LockedDecisions)."""

    def __init__(self) -> None:
        self._by_server: dict[int, list] = {}

    def add(self, decisions: Iterable[tuple[int, object]]) -> None:
        """Queue (parity server, decision) pairs."""
        for server, decision in decisions:
            self._by_server.setdefault(server, []).append(decision)

    def take(self, server: int) -> list:
        """Everything queued for `server`, oldest first; the queue keeps none of it."""
        return self._by_server.pop(server, [])

    def take_all(self) -> dict[int, list]:
        out, self._by_server = self._by_server, {}
        return out

    def put_back(self, server: int, decisions: list) -> None:
        """Decisions taken but not delivered: ahead of anything queued since, so the order is kept."""
        self._by_server.setdefault(server, [])[:0] = decisions

    def __bool__(self) -> bool:
        return any(self._by_server.values())
