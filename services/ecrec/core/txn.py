"""Two-phase commit participants of the update path, as state without I/O (docs/protocol.md).

A *part* is the rows of one worker step on one data server. The data server stages the new records and
computes the deltas for each row's parity server (`DeltaBatch`es, which the worker delivers); on commit it
applies the records and advances the rows' versions, and the worker then tells the parity servers. Rows are
staged by at most one transaction at a time (`RowLocks`), so deltas never chain on uncommitted values (I3).

`ParityParticipant` keeps staged deltas per (txn, source shard) and applies them on commit, in version order
per member, remembering the version of each stripe member it reflects (`pver`), so readers can check that
member records and a parity record form a consistent cut.

Everything here is plain torch on tensors handed in by the caller; the caller holds the server's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ecrec.core import heldrows, ordered_xor
from ecrec.core.codes import Code
from ecrec.core.optim import RowOptimizer
from ecrec.core.placement import Placement
from ecrec.core.raid6 import PQCode
from ecrec.core.vec import all_unique


def never_gone(txn: str) -> bool:
    """No worker process is known to be gone (the default of the `expired` methods)."""
    return False


class RowsBusy(Exception):
    """Some requested rows are staged by another transaction (or locked for recovery): wait and retry."""


class UnknownTxn(KeyError):
    pass


@dataclass
class DeltaBatch:
    """Deltas of one part for one parity server."""

    parity_server: int
    txn: str
    src: int  # data shard whose rows changed
    index: torch.Tensor  # parity indices [n]
    slot: torch.Tensor  # stripe slot of each row [n]
    delta: torch.Tensor  # [n, W]
    version: torch.Tensor  # the rows' versions once committed [n]
    incarnation: int = 0  # commit: deltaLog: the incarnation of src that applied the rows (0: not said)
    # r = 2, src failed: the acting home of the rows that sent it (-1: src itself), with a degraded write's
    # delta for the other parity record, or (`base` set: the versions the record reflects now) an alignment
    # (ParityParticipant.realign; ecrec.store.twoparity).
    via: int = -1
    base: torch.Tensor | None = None
    # The rows' (record, member) keys at a parity server, kept by its CPU path for the batches it holds: a held
    # batch is looked at again on every release, its keys never change.
    keys: np.ndarray | None = field(default=None, compare=False, repr=False)

    def member_keys(self, k: int) -> np.ndarray:
        """The rows' (record, member) keys, index * k + slot (`ParityParticipant.key_of` in numpy), computed
        once."""
        if self.keys is None:
            self.keys = self.index.numpy() * k + self.slot.numpy()
        return self.keys


class RowLocks:
    """Owner of each row of a row space (-1 = free). All-or-nothing acquisition, vectorized."""

    FREE = -1

    def __init__(self, num_rows: int):
        self.owner = torch.full((num_rows,), self.FREE, dtype=torch.int64)
        self._ids: dict[str, int] = {}
        self._rows: dict[str, torch.Tensor] = {}
        self._next = 0

    def busy(self, rows: torch.Tensor, txn: str | None = None) -> bool:
        if not self._ids or (len(self._ids) == 1 and txn in self._ids):
            return False  # nobody else holds a lock (under deltaLog, the usual case: only rebuilds lock)
        owners = self.owner.index_select(0, rows)
        mine = self._ids.get(txn, -2) if txn is not None else -2
        return bool(((owners != self.FREE) & (owners != mine)).any())

    def holders_of(self, rows: torch.Tensor) -> set[str]:
        """The txns holding any of `rows`."""
        ids = set(self.owner[rows].unique().tolist()) - {self.FREE}
        return {t for t, i in self._ids.items() if i in ids} if ids else set()

    def lock(self, txn: str, rows: torch.Tensor) -> None:
        if self.busy(rows, txn):
            raise RowsBusy(txn)
        if txn not in self._ids:
            self._ids[txn], self._next = self._next, self._next + 1
            self._rows[txn] = rows.clone()
        else:
            self._rows[txn] = torch.cat([self._rows[txn], rows])
        self.owner.index_fill_(0, rows, self._ids[txn])

    def unlock(self, txn: str) -> torch.Tensor:
        rows = self._rows.pop(txn, None)
        if rows is None:
            return torch.empty(0, dtype=torch.int64)
        self.owner.index_fill_(0, rows, self.FREE)
        del self._ids[txn]
        return rows

    def holders(self) -> list[str]:
        return list(self._ids)

    def clear(self) -> None:
        """Free every row (a checkpoint was loaded: nothing that held them is in flight any more). In place, so
        a waiter holding this object sees the rows free; a holder's late unlock then finds nothing."""
        self.owner.fill_(self.FREE)
        self._ids.clear()
        self._rows.clear()


@dataclass
class StagedPart:
    txn: str
    rows: torch.Tensor  # local rows
    new: torch.Tensor  # staged records [n, W]
    batches: list[DeltaBatch]
    staged_at: float
    parity_servers: tuple[int, ...] = ()


@dataclass
class DataParticipant:
    """Phase 1 and 2 of the parts that update this data server's own rows."""

    shard: int
    placement: Placement
    code: Code | PQCode  # PQCode: r = 2 (P and Q deltas)
    optimizer: RowOptimizer
    records: torch.Tensor  # [L, W] row records (owned by the server)
    versions: torch.Tensor  # [L] int64
    locks: RowLocks = field(init=False)
    staged: dict[str, StagedPart] = field(default_factory=dict)
    # Told the rows of each commit once their versions advanced (the rebuild-error report's reference run).
    on_commit: Callable[[torch.Tensor], None] | None = None

    def __post_init__(self) -> None:
        self.locks = RowLocks(self.records.shape[0])

    def stage(self, txn: str, rows: torch.Tensor, grads: torch.Tensor, now: float) -> StagedPart:
        """Stage new records for `rows` (unique local rows). Raises RowsBusy if another txn holds any."""
        if txn in self.staged:
            return self.staged[txn]  # a retried stage is answered with the same result
        self.locks.lock(txn, rows)
        old = self.records.index_select(0, rows)
        new = self.optimizer.apply(old, grads)
        version = self.versions.index_select(0, rows) + 1
        batches = self.delta_batches(txn, rows, self.code.delta(old, new), version)
        part = StagedPart(txn, rows, new, batches, now, tuple(b.parity_server for b in batches))
        self.staged[txn] = part
        return part

    def apply(self, txn: str, rows: torch.Tensor, grads: torch.Tensor) -> list[DeltaBatch]:
        """Stage and commit in one (commit: deltaLog), without taking locks: the caller has made sure no lock
        holds `rows`. Returns the deltas for the parity servers."""
        old = self.records.index_select(0, rows)
        new = self.optimizer.apply(old, grads)
        version = self.versions.index_select(0, rows) + 1
        batches = self.delta_batches(txn, rows, self.code.delta(old, new), version)
        self.records.index_copy_(0, rows, new)
        self.versions.index_copy_(0, rows, version)
        if self.on_commit is not None:
            self.on_commit(rows)
        return batches

    def delta_batches(
        self, txn: str, rows: torch.Tensor, delta: torch.Tensor, version: torch.Tensor
    ) -> list[DeltaBatch]:
        p, out = self.placement, []
        if p.r == 0 or rows.numel() == 0:
            return out
        # A row's parity server depends only on its stripe slot (placement.parity_of): sort the part by slot
        # once and cut it into one batch per slot (views), instead of gathering every field per server.
        if rows.device.type == "cpu":  # numpy: each op ~1 µs at a part's few hundred rows, torch's ~5-10
            r = rows.numpy()
            slot_np = r % p.k
            order_np = np.argsort(slot_np, kind="stable")
            sizes = np.bincount(slot_np, minlength=p.k).tolist()
            order = torch.from_numpy(order_np)
            index, slot = torch.from_numpy((r // p.k)[order_np]), torch.from_numpy(slot_np[order_np])
            fields = [t.split(sizes) for t in (index, slot)]
            fields += [t.index_select(0, order).split(sizes) for t in (delta, version)]
        else:
            slot = torch.remainder(rows, p.k)
            index = torch.div(rows, p.k, rounding_mode="floor")
            order = torch.argsort(slot, stable=True)
            sizes = torch.bincount(slot, minlength=p.k).tolist()
            fields = [t.index_select(0, order).split(sizes) for t in (index, slot, delta, version)]
        index_, slot_, delta_, version_ = fields
        for j in range(p.r):
            servers = [
                ((self.shard - i + p.k + j) % p.num_servers, i) for i, size in enumerate(sizes) if size
            ]
            for server, i in sorted(servers):  # batches by parity server, ascending
                pindex, d = index_[i], delta_[i]
                if (
                    j
                ):  # Q (r = 2): the rows of slot i take g^i times P's delta, at Q's rows of the parity table
                    pindex, d = p.parity_index(j, pindex), self.code.for_parity(d, i, j)
                out.append(DeltaBatch(server, txn, self.shard, pindex, slot_[i], d, version_[i]))
        return out

    def commit(self, txn: str) -> torch.Tensor:
        """Apply a staged part (after its parity servers committed). Returns the rows it changed."""
        part = self.staged.pop(txn, None)
        if part is None:
            raise UnknownTxn(txn)
        self.records.index_copy_(0, part.rows, part.new)
        self.versions.index_add_(0, part.rows, torch.ones_like(part.rows))
        self.locks.unlock(txn)
        if self.on_commit is not None:
            self.on_commit(part.rows)
        return part.rows

    def abort(self, txn: str) -> StagedPart | None:
        part = self.staged.pop(txn, None)
        self.locks.unlock(txn)
        return part

    def expired(self, now: float, timeout: float, gone: Callable[[str], bool] = never_gone) -> list[str]:
        """Parts whose worker never committed (it died): staged for longer than `timeout`, or staged by a
        worker process known to be `gone`. The adapter aborts them."""
        return [t for t, p in self.staged.items() if now - p.staged_at > timeout or gone(t)]

    def load(self, records: torch.Tensor, versions: torch.Tensor) -> None:
        """Every row takes the record and version given (a checkpoint's, or the initial state), in place;
        every part in flight is forgotten: nothing staged, no row locked."""
        self.records.copy_(records)
        self.versions.copy_(versions)
        self.staged.clear()
        self.locks.clear()


@dataclass
class ParityParticipant:
    """The parity records this server holds, and the deltas staged for them."""

    shard: int
    placement: Placement
    code: Code | PQCode  # PQCode: r = 2 (P and Q deltas)
    parity: torch.Tensor  # [P, W]
    pver: torch.Tensor  # [P, k] int64: member versions the parity reflects
    # [P] bool; False while a replacement has not rebuilt the record. Given at construction; then only
    # `install` changes it.
    ready: torch.Tensor | None = None
    staged: dict[tuple[str, int], list[DeltaBatch]] = field(default_factory=dict)
    staged_at: dict[tuple[str, int], float] = field(default_factory=dict)
    resolved: OrderedDict = field(default_factory=OrderedDict)
    pending: list[DeltaBatch] = field(default_factory=list)  # committed before their record was rebuilt
    max_resolved: int = 65536

    def __post_init__(self) -> None:
        if self.ready is None:
            self.ready = torch.ones(self.parity.shape[0], dtype=torch.bool)
        # Every record rebuilt (the usual case): `apply` skips its per-row check. Only install sets rows ready.
        self._all_ready = bool(self.ready.all())
        # (record, member) keys that have a held row: only an update of one of those can let a held row apply,
        # so an update elsewhere skips the retry of every held batch (on hot rows, with several workers, held
        # batches are many, and each retry costs a few tensor ops). May be True where nothing is held any
        # more; never False where something is.
        self._held_keys = torch.zeros(self.pver.numel(), dtype=torch.bool)
        # Counts changes that may have taken rows out of `held` (applied or dropped): what a delivery waiting for
        # its held rows needs to look again (a wake-up on every delivery cost a live server ~9% of its time).
        self.releases = 0
        cpu_xor = (
            self.code.name in ("xor", "pq")  # P and Q both take their deltas by xor
            and self.parity.device.type == "cpu"
            and self.parity.dtype == torch.float32
            and self.parity.is_contiguous()
            and self.pver.is_contiguous()
        )
        # Committed deltas held ahead of a member's previous update: in C's flat arrays (`_rows`) or, on the
        # other paths, as batches (`_held_list`); `held` shows either as batches.
        self._held_list: list[DeltaBatch] = []
        self._rows: heldrows.HeldRows | None = None
        self.choose_path(("c" if heldrows.AVAILABLE else "numpy") if cpu_xor else "torch")

    def choose_path(self, path: str) -> None:
        """Which implementation applies deltas in version order: "c" (ecrec.core.heldrows, xor on float32
        CPU records, where the extension is built), "numpy" (ecrec.core.ordered_xor, the same records) or
        "torch" (any code and device: the reference the others are tested against). Before anything is held."""
        if self.holding():
            raise RuntimeError("choose_path: rows are held")
        if path not in ("c", "numpy", "torch"):
            raise ValueError(f"choose_path: {path!r}")
        self.path = path
        self._rows = (
            heldrows.HeldRows(self.parity, self.pver, self.placement.k, DeltaBatch) if path == "c" else None
        )

    @property
    def held(self) -> list[DeltaBatch]:
        """The committed rows held for a predecessor, as batches: on the C path new ones grouped back by part
        (for the failure paths that ask by part), on the others the list itself, which they append to."""
        return self._rows.batches() if self._rows is not None else self._held_list

    @held.setter
    def held(self, batches: list[DeltaBatch]) -> None:
        if self._rows is not None:
            self._rows.load(batches)
        else:
            self._held_list = batches

    def holding(self) -> bool:
        """Is any row held for a predecessor?"""
        return len(self._rows) > 0 if self._rows is not None else bool(self._held_list)

    def held_marks(self) -> torch.Tensor:
        """[P * k] bool: True for every (record, member) key with a row held (the torch and numpy paths may
        leave a key marked where nothing is held any more)."""
        if self._rows is not None:
            return torch.from_numpy(self._rows.marks > 0)
        return self._held_keys.clone()

    def stage(self, batch: DeltaBatch, now: float = 0.0) -> None:
        """Stage a part's deltas. A part sends this server one batch per parity record j (P's rows, and with
        r = 2 Q's rows of other stripes), so a re-delivered batch (its ack was lost and the sender retried)
        replaces the first of its j instead of being applied twice."""
        key = (batch.txn, batch.src)
        if key in self.resolved:
            return  # a late duplicate of something already decided
        if self.placement.r == 1:
            self.staged[key] = [batch]
        else:
            j = self._j(batch)
            self.staged[key] = [b for b in self.staged.get(key, ()) if self._j(b) != j] + [batch]
        self.staged_at[key] = now

    def _j(self, b: DeltaBatch) -> int:
        """The parity record (0: P, 1: Q) whose rows a batch holds (one j per batch: check_deltas)."""
        return int(self.placement.parity_slot(b.index[:1])[0][0]) if b.index.numel() else 0

    def apply_now(self, batch: DeltaBatch) -> str:
        """Stage and commit in one (updates without 2PC); a re-delivered batch is applied once."""
        key = (batch.txn, batch.src)
        if key in self.resolved:
            return self.resolved[key]
        self.staged.pop(key, None)
        self.staged_at.pop(key, None)
        self.apply(batch)
        self._resolve(key, "committed")
        return "committed"

    def expired(
        self, now: float, timeout: float, gone: Callable[[str], bool] = never_gone
    ) -> list[tuple[str, int]]:
        """(txn, src) of deltas undecided for longer than `timeout`, or staged by a worker process known to be
        `gone` (it will never deliver the decision): the adapter asks their data server."""
        return [key for key, at in self.staged_at.items() if now - at > timeout or gone(key[0])]

    def staged_members(self, src: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(txn, parity index, slot) of deltas from `src` still undecided: those rows are busy."""
        return [(t, b.index, b.slot) for (t, s), bs in self.staged.items() if s == src for b in bs]

    def held_members(self, src: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(txn, parity index, slot) of committed deltas from `src` waiting for a predecessor: the record does
        not reflect them yet, so those rows are busy too (nothing may build on what the record holds)."""
        return [(b.txn, b.index, b.slot) for b in self.held if b.src == src]

    def key_of(self, b: DeltaBatch) -> torch.Tensor:
        """One id per (parity record, stripe slot): a member row of this server's stripes."""
        return b.index * self.placement.k + b.slot

    def held_parts(self) -> set[tuple[str, int]]:
        """(txn, src) of the batches with rows held for a predecessor. A delivered batch is reflected once it is
        not among them: each of its rows was applied, kept for a rebuild (which replays it), or held — and
        a held row leaves `held` only when it is applied or dropped (`drop_held`, which names it). Cheap: a
        waiting delivery asks this on every wake-up."""
        if self._rows is not None:
            return self._rows.parts()
        return {(h.txn, h.src) for h in self._held_list}

    def unreflected(self, b: DeltaBatch) -> torch.Tensor:
        """Rows of a delivered batch the record does not reflect yet (held for a predecessor): a mask. Rows
        whose record is being rebuilt count as reflected — the rebuild replays them (`install`)."""
        behind = self.pver.view(-1).index_select(0, self.key_of(b)) < b.version
        return behind & self.ready.index_select(0, b.index)

    def why_held(self, batches: list[DeltaBatch]) -> str:
        """What the first of `batches` with a row still behind waits for, in words (for the log)."""
        for b in batches:
            behind = self.unreflected(b)
            if bool(behind.any()):
                i = int(behind.nonzero()[0])
                have = int(self.pver.view(-1)[self.key_of(b)[i]])
                return (
                    f"{int(behind.sum())} rows of txn {b.txn} from shard {b.src} wait for an earlier update: e.g. "
                    f"parity record {int(b.index[i])} slot {int(b.slot[i])} at version {int(b.version[i])}, "
                    f"the record reflects version {have}"
                )
        return "nothing held"

    def drop_held(self, src: int, incarnation: int | None = None) -> list[DeltaBatch]:
        """Forget the held rows of data server `src` (it failed or was replaced: the predecessors they wait for
        will be refused, so they can never apply); with `incarnation`, only those stamped with another one
        (0: not said, kept). Returns what was dropped."""
        held = self.held
        stale = [
            h.src == src and (incarnation is None or h.incarnation not in (0, incarnation)) for h in held
        ]
        dropped = [h for h, x in zip(held, stale, strict=True) if x]
        if dropped:
            self.held = [h for h, x in zip(held, stale, strict=True) if not x]
            self.mark_held()
        return dropped

    def commit(self, txn: str, src: int) -> str:
        """Apply the deltas of (txn, src). Idempotent: returns "committed" / "aborted" / "unknown"."""
        key = (txn, src)
        if key in self.resolved:
            return self.resolved[key]
        batches = self.staged.pop(key, None)
        self.staged_at.pop(key, None)
        if batches is None:
            return "unknown"
        for b in batches:
            self.apply(b)
        self._resolve(key, "committed")
        return "committed"

    def commit_many(self, keys: list[tuple[str, int]]) -> list[str]:
        """`commit` of several (txn, src), with the outcome of each. The usual message (a worker's decisions
        riding on its next stage) takes rows each to their next version, and then the version check and the
        pver update are done once for all its batches; the deltas are still applied batch by batch (rows of
        different members share parity records, and a scatter of several deltas into one record would keep
        only one of them). Anything else — a row not next in version order, records not rebuilt, held deltas
        waiting — goes one by one through `commit`."""
        todo = list(dict.fromkeys(k for k in keys if k not in self.resolved and k in self.staged))
        batches = [b for k in todo for b in self.staged[k]]
        if len(batches) > 1 and self._all_ready and not self.holding():
            key = torch.cat([self.key_of(b) for b in batches])
            version = torch.cat([b.version for b in batches])
            flat = self.pver.view(-1)
            # each member row once, each at its next version: then batch order does not matter
            if bool((version - flat.index_select(0, key) == 1).all()) and all_unique(key):
                for b in batches:
                    self.code.apply_delta_(self.parity, b.index, b.delta)
                flat.index_copy_(0, key, version)
                for k in todo:
                    del self.staged[k]
                    self.staged_at.pop(k, None)
                    self._resolve(k, "committed")
                return [self.resolved.get(k, "unknown") for k in keys]
        return [self.commit(txn, src) for txn, src in keys]

    def abort(self, txn: str, src: int) -> str:
        """Drop the deltas of (txn, src). Deltas never staged answer "unknown" and leave no trace (a stray
        abort must not make this server ignore deltas that arrive later and are committed)."""
        key = (txn, src)
        if key in self.resolved:
            return self.resolved[key]
        if key not in self.staged:
            return "unknown"
        self.staged.pop(key, None)
        self.staged_at.pop(key, None)
        self._resolve(key, "aborted")
        return "aborted"

    def apply(self, b: DeltaBatch) -> bool:
        """Apply one committed delta batch: rows whose record is not rebuilt yet are kept for the rebuild;
        the others are applied in version order (see _apply_in_order). True if the record now reflects
        every row (none is held for a predecessor; kept rows count: the rebuild replays them)."""
        if self._all_ready:
            return self._apply_in_order(b)
        ready = self.ready[b.index]
        if not bool(ready.all()):
            self.pending.append(select_rows(b, ~ready))
            if not bool(ready.any()):
                return True
            b = select_rows(b, ready)
        return self._apply_in_order(b)

    def _apply_in_order(self, b: DeltaBatch) -> bool:
        """pver holds, per record and member, the version up to which every update is reflected. A delta
        the record already reflects is skipped (duplicates, replays after a rebuild); one that is next
        is applied; one further ahead is held until its predecessor is applied. Decisions for one row can
        arrive out of order — the worker delivers them after the data server committed, and a later update
        of the row may be decided first — while a decode needs pver to mean exactly what the record holds."""
        if self._rows is not None:
            done, released = self._rows.apply(b)
            self.releases += released
            return done
        if self.path == "numpy":
            return ordered_xor.apply_in_order(self, b)
        flat = self.pver.view(-1)
        key = self.key_of(b)
        step = b.version - flat.index_select(0, key)  # 1: next; > 1: ahead of a predecessor; < 1: reflected
        done = True
        if bool((step == 1).all()):  # the usual case, in one pass: no masks
            self.code.apply_delta_(self.parity, b.index, b.delta)
            flat.index_copy_(0, key, b.version)
        else:
            now, ahead = step == 1, step > 1
            if bool(ahead.any()):
                self.held.append(select_rows(b, ahead))
                self._held_keys[key[ahead]] = True
                done = False
            if not bool(now.any()):
                return done
            self.code.apply_delta_(self.parity, b.index[now], b.delta[now])
            key = key[now]
            flat[key] = b.version[now]
        if self.held and bool(self._held_keys.index_select(0, key).any()):
            self.releases += 1
            held, self.held = self.held, []
            self._held_keys.zero_()  # marked again by what stays held
            for h in held:
                self._apply_in_order(h)
        return done

    def mark_held(self) -> None:
        """Mark exactly the keys of the rows held now (after `held` was cut: a drop or a release), and count it
        as a release (deliveries waiting for held rows look again)."""
        self.releases += 1
        if self._rows is not None:  # its marks are exact: counted by the C side, recounted by `held = ...`
            return
        if self.path == "numpy":  # numpy on the same memory: a boolean scatter per batch is torch's slow path
            marks = self._held_keys.numpy()
            marks[:] = False
            for h in self.held:
                marks[h.member_keys(self.placement.k)] = True
            return
        self._held_keys.zero_()
        for h in self.held:
            self._held_keys[self.key_of(h)] = True

    def realign(self, b: DeltaBatch) -> torch.Tensor:
        """Move a failed member's contribution to another prefix of its updates (r = 2, the acting home's
        alignment: core/cuts.py): where the record reflects version `b.base` of the row, xor in the delta and
        reflect `b.version` instead. Returns the rows that were not at `b.base` (left alone). Rows whose
        record is not rebuilt are not at any base."""
        if b.base is None or b.base.shape != b.version.shape:
            raise ValueError("realign: a batch with a base version for every row")
        flat = self.pver.view(-1)
        key = self.key_of(b)
        at = (flat.index_select(0, key) == b.base) & self.ready.index_select(0, b.index)
        if not all_unique(key):
            raise ValueError("realign: each (record, slot) once")
        if bool(at.any()):
            self.code.apply_delta_(self.parity, b.index[at], b.delta[at])
            flat[key[at]] = b.version[at]
            self.releases += 1
        return ~at

    def install(self, index: torch.Tensor, records: torch.Tensor, versions: torch.Tensor) -> None:
        """Install rebuilt parity records; replay kept deltas newer than what the rebuild reflects."""
        self.parity[index] = records
        self.pver[index] = versions
        self.ready[index] = True
        self._all_ready = bool(self.ready.all())
        self.releases += 1  # (kept rows replayed)
        kept, self.pending = self.pending, []
        for b in kept:
            now_ready = self.ready[b.index]
            if bool(now_ready.any()):
                self._apply_in_order(select_rows(b, now_ready))
            if not bool(now_ready.all()):
                self.pending.append(select_rows(b, ~now_ready))

    def load(self, parity: torch.Tensor, pver: torch.Tensor) -> None:
        """Every parity record and the member versions it reflects take the values given (a checkpoint's,
        or the initial state's), in place, and nothing is in flight any more (`reset`)."""
        self.parity.copy_(parity)
        self.pver.copy_(pver)
        self.reset()

    def reset(self) -> None:
        """Forget every delta in flight, as a freshly started server that rebuilt everything: nothing staged,
        pending or held, every record ready. Decisions remembered are forgotten too: a step replayed after a
        rollback under an id used before (workers' ids carry the rollback's generation, a replay in a test may
        not) must apply, not be skipped as a late duplicate of a decision about an update the load undid."""
        self.staged.clear()
        self.staged_at.clear()
        self.resolved.clear()
        self.pending = []
        self.held = []
        self.releases += 1
        self._held_keys.zero_()
        self.ready.fill_(True)
        self._all_ready = True

    def _resolve(self, key: tuple[str, int], outcome: str) -> None:
        self.resolved[key] = outcome
        while len(self.resolved) > self.max_resolved:
            self.resolved.popitem(last=False)


def select_rows(b: DeltaBatch, mask: torch.Tensor) -> DeltaBatch:
    """The rows of a batch selected by a boolean mask."""
    return DeltaBatch(
        b.parity_server,
        b.txn,
        b.src,
        b.index[mask],
        b.slot[mask],
        b.delta[mask],
        b.version[mask],
        b.incarnation,
        b.via,
        None if b.base is None else b.base[mask],
    )
