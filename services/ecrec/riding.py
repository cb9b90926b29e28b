"""Deliveries that ride on the worker's next stages (commit: deltaLog, faultTolerance.ecrec.deliveries: ride).

Under deltaLog a step costs a worker three messages per server: pull, stage, deliver. Riding takes the third
away: a step's deltas stay with the worker after its stages are answered, and travel to each parity server
with the next step's stage there (StageRequest.carried). The parity server applies them before the stage and
answers at once; rows it holds for a predecessor (another worker's earlier update of the same row, which that
worker carries in turn) are named (`held`) and asked about on the stage after (`ask`), so no stage waits for
another worker's step. Until every row of a part is known applied the part stays in its data server's log,
which forwards it itself if this worker dies (ecrec.store.logged).

This module is the bookkeeping, without I/O: what rides to which server, and what the answers mean for each
carried update's rows. The driver (ecrec.delivery.DeltaLogDriver) sends and receives. Anything unusual — a
message that failed (the deltas may or may not have arrived), rows refused because their data server failed
— ends riding for that update: the driver delivers what is left of it the way an update without riding is
delivered (asked again, waiting for the answer, refused rows written again as degraded writes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ecrec.core.placement import Placement
from ecrec.core.update import ParityTargets, Part, StepUpdate, part_versions
from ecrec.proto import ecrec_pb2 as pb
from ecrec.wire import bytes_to_ids

# Stages a held part is asked about on before the driver waits for it: a predecessor normally arrives with
# its worker's next step, so this only bounds a rare straggler.
MAX_RIDES = 8


@dataclass
class Carried:
    """A step's update whose stages are answered (its rows applied at their data servers) and whose deltas
    are not yet known applied at every parity server."""

    update: StepUpdate
    g: torch.Tensor
    grads: torch.Tensor
    dense_grad: torch.Tensor
    fresh: list[tuple[Part, list]]  # (part, deltas) not delivered yet
    held: list[tuple[Part, Any]] = field(default_factory=list)  # (part, delta) held at delta.parity_server
    lost: list[tuple[Part, list]] = field(default_factory=list)  # (part, deltas) whose message failed
    rides: int = 0  # applies it has ridden on
    # id(part) -> where its rows' parity records are, built the first time an answer needs it: a held part
    # is settled again on every ride until its rows apply
    targets: dict[int, ParityTargets] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for part, _deltas in self.fresh:  # not planned again while their deltas are on their way
            self.update.rows_unanswered(part, torch.ones(part.pos.numel(), dtype=torch.bool))

    def unanswered(self) -> list[tuple[Part, list]]:
        """Everything not known applied, as (part, deltas) to deliver again and wait for."""
        return list(self.lost) + list(self.fresh) + [(part, [d]) for part, d in self.held]


@dataclass
class Settled:
    """What the answers of one apply's rides say about a carried update."""

    carried: Carried
    done: list[Part]  # parts every row of which is now applied
    trouble: list[tuple[Part, list]]  # (part, deltas) whose message failed: applied or not is unknown
    refused: bool  # some rows were refused: written again (their data server failed)

    @property
    def needs_finish(self) -> bool:
        return bool(self.trouble) or self.refused or self.carried.rides >= MAX_RIDES


class Rides:
    """What one apply carries to each parity server — the fresh deltas of the carried updates, and questions
    about their held parts — and the answers."""

    def __init__(self, carried: list[Carried], failed):
        """`failed(server)`: a parity server the map has failed gets nothing (its records are re-encoded from
        the data rows when it is rebuilt), as without riding."""
        self.carried = carried
        self._entries: dict[int, list[tuple[Carried, Part, Any, bool]]] = {}
        for c in carried:
            c.rides += 1
            for part, deltas in c.fresh:
                for d in deltas:
                    if not failed(d.parity_server):
                        self._entries.setdefault(d.parity_server, []).append((c, part, d, True))
            for part, d in c.held:
                if not failed(d.parity_server):
                    self._entries.setdefault(d.parity_server, []).append((c, part, d, False))
        self._answers: dict[int, tuple[dict[str, torch.Tensor], set[str]]] = {}
        self._lost: set[int] = set()

    def servers(self) -> list[int]:
        return sorted(self._entries)

    def fields(self, server: int) -> tuple[list, list]:
        """(deltas, asks) for `server`: StageRequest.carried / .ask, or DeliverDeltas' batches / ask."""
        entries = self._entries.get(server, [])
        deltas = [d for _c, _p, d, fresh in entries if fresh]
        asks = [pb.PartRef(txn=d.txn, src=d.src) for _c, _p, d, fresh in entries if not fresh]
        return deltas, asks

    def answered(self, server: int, resp) -> None:
        """A StageResponse or DeliverResponse from `server` to what rode to it."""
        refused: dict[str, torch.Tensor] = {}
        for r in resp.refused:  # with r = 2 a part may have P's rows and Q's rows at one server
            idx = bytes_to_ids(r.index)
            refused[r.txn] = torch.cat([refused[r.txn], idx]) if r.txn in refused else idx
        self._answers[server] = (refused, {h.txn for h in resp.held})

    def lost(self, server: int) -> None:
        """The message that carried to `server` failed: whether it applied them is unknown."""
        self._lost.add(server)

    def settle(self, placement: Placement) -> list[Settled]:
        """Mark each carried update's rows by the answers (every server in `servers()` answered or lost)."""
        by_part: dict[int, list] = {}  # id(part) -> its deltas that rode
        for entries in self._entries.values():
            for _c, part, d, _fresh in entries:
                by_part.setdefault(id(part), []).append(d)
        out = []
        for c in self.carried:
            settled = Settled(c, [], [], False)
            held: list[tuple[Part, Any]] = []
            parts = [part for part, _ in c.fresh] + [part for part, _ in c.held]
            for part in {id(part): part for part in parts}.values():  # (once, if held at two servers)
                self._settle_part(c, part, by_part.get(id(part), []), placement, settled, held)
            c.fresh, c.held, c.lost = [], held, list(settled.trouble)
            out.append(settled)
        return out

    def _outcome(self, d) -> tuple[str, torch.Tensor | None]:
        """What the delta's parity server did with it: "lost" (the server failed), "held" (rows wait for a
        predecessor), "refused" (with the refused rows) or "applied" (whole)."""
        if d.parity_server in self._lost:
            return "lost", None
        refused, still = self._answers[d.parity_server]
        if d.txn in still:
            return "held", None
        bad = refused.get(d.txn)
        if bad is not None and bad.numel():
            return "refused", bad
        return "applied", None

    def _settle_part(
        self, c: Carried, part: Part, deltas: list, placement, settled: Settled, held: list
    ) -> None:
        update, n = c.update, part.pos.numel()
        outcomes = [self._outcome(d) for d in deltas]
        if all(o == "applied" for o, _bad in outcomes):  # the usual answer
            update.rows_applied(part, update.rows_waiting[part.pos])
            update.rows_unanswered(part, torch.ones(n, dtype=torch.bool), waiting=False)
            if bool(update.rows_done[part.pos].all()):
                settled.done.append(part)
            return
        targets = c.targets.get(id(part))
        if targets is None:
            targets = c.targets[id(part)] = ParityTargets(
                placement, part.target, placement.local_row(c.g[part.pos])
            )
        refused_rows = torch.zeros(n, dtype=torch.bool)
        waiting = torch.zeros(n, dtype=torch.bool)
        for d, (outcome, bad) in zip(deltas, outcomes, strict=True):
            if outcome == "lost":
                waiting |= targets.at(d.parity_server)
                settled.trouble.append((part, [d]))
            elif outcome == "held":
                waiting |= targets.at(d.parity_server)
                held.append((part, d))
            elif outcome == "refused":
                refused_rows |= targets.refused(d.parity_server, bad)
                settled.refused = True
        # A row refused by any parity server is decided: written again (at its acting home, which finds out
        # whether another parity record holds it: Participant._stage_acting), whatever another parity server
        # holds it for; a row decided before (refused on an earlier ride) is not counted again. Rows of failed
        # parity servers (skipped) count as applied.
        refused_rows &= update.rows_waiting[part.pos]
        waiting &= ~refused_rows
        update.rows_applied(part, update.rows_waiting[part.pos] & ~waiting & ~refused_rows)
        update.rows_unanswered(part, ~waiting, waiting=False)  # refused rows are planned again
        if bool(refused_rows.any()):
            update.rows_refused(part, refused_rows, took(placement, c.g[part.pos], deltas))
        if bool(update.rows_done[part.pos].all()):
            settled.done.append(part)


def took(placement, g: torch.Tensor, deltas: list) -> torch.Tensor:
    """The versions a part's rows (global ids `g`) took at their data server, from its delta messages."""
    return part_versions(
        placement,
        placement.local_row(g),
        [(bytes_to_ids(d.index), bytes_to_ids(d.slot), bytes_to_ids(d.version)) for d in deltas],
    )
