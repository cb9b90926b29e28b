"""The acting home's state, without I/O: degraded writes of a failed shard's rows (docs/protocol.md, "Failure,
degraded mode and recovery").

While a data shard is failed, the parity server of a stripe stands in for the shard's member of it: it is
the rows' *acting home* and their only writer. A degraded write locks the rows (one `RowLocks` per failed
shard), decodes their committed records, applies the optimizer and stages the difference into the parity
records it holds; the write is then decided like any part (commit, abort, or expiry when its worker dies).
Since nobody else writes those rows, the acting home keeps what it decoded (*materialized* rows, per failed
shard and per failure) and updates them on commit, so that degraded reads and writes become local after the
first touch. A materialized row is only as good as the version the parity record reflects for it: a dead
server's own delta committed on its behalf changes the row without this home writing it, so such commits
invalidate the rows they touch and bump the cache's generation, and a lookup compares versions as well.

`ActingHome` keeps these three things; the caller (ShardStore) holds the server's lock around every call,
decodes through its peers, and owns the parity records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ecrec.core.txn import RowLocks, never_gone


@dataclass
class ActingWrite:
    """A degraded write staged at this acting home and not decided yet."""

    src: int  # the failed shard whose rows it writes
    rows: torch.Tensor  # local rows of src
    new: torch.Tensor  # their new records
    versions: torch.Tensor  # the versions they take on commit
    staged_at: float


@dataclass
class ActingCache:
    """Materialized rows of one failed shard, valid for one failure of it (`key`: its incarnation)."""

    key: object
    records: torch.Tensor
    versions: torch.Tensor
    valid: torch.Tensor
    generation: int = 0  # bumped whenever rows are invalidated: a decode started before must not be kept

    @classmethod
    def empty(cls, key, rows: int, width: int) -> ActingCache:
        return cls(
            key,
            torch.zeros(rows, width),
            torch.zeros(rows, dtype=torch.int64),
            torch.zeros(rows, dtype=torch.bool),
        )


@dataclass
class Lookup:
    """What the cache holds of some rows: `hit` marks rows materialized at the version the parity reflects;
    `cache` and `generation` say which cache answered, for `materialize` after the misses are decoded."""

    hit: torch.Tensor
    cache: ActingCache | None
    generation: int


class ActingHome:
    """Degraded writes, their row locks and the materialized rows of the failed shards this server stands in
    for. `rows_on(src)`: how many local rows shard src has; `width`: the record width."""

    def __init__(self, rows_on: Callable[[int], int], width: int):
        self.rows_on, self.width = rows_on, width
        self.locks: dict[int, RowLocks] = {}
        self.staged: dict[str, ActingWrite] = {}
        self.cache: dict[int, ActingCache] = {}

    def __contains__(self, txn: str) -> bool:
        return txn in self.staged

    def reset(self) -> None:
        """Stand in for nobody (a checkpoint was loaded: every shard's rows are its own again): no write
        staged, no row locked, nothing materialized. A decode that started before keeps nothing
        (`materialize` finds its cache replaced)."""
        for locks in self.locks.values():
            locks.clear()  # in place: a write waiting for rows sees them free
        self.locks.clear()
        self.staged.clear()
        self.cache.clear()

    def __len__(self) -> int:
        return len(self.staged)

    # -- writes ---------------------------------------------------------------------------------------------
    def busy(self, src: int, rows: torch.Tensor, txn: str | None = None) -> bool:
        """Does a degraded write other than `txn` hold any of shard src's `rows`?"""
        locks = self.locks.get(src)
        return locks is not None and locks.busy(rows, txn)

    def writing(self, src: int) -> bool:
        """Is any degraded write of shard src's rows under way (locked, possibly still decoding)?"""
        locks = self.locks.get(src)
        return locks is not None and bool(locks.holders())

    def lock(self, txn: str, src: int, rows: torch.Tensor) -> None:
        """Take the rows for `txn` (RowsBusy if another write holds any)."""
        self.locks.setdefault(src, RowLocks(self.rows_on(src))).lock(txn, rows)

    def unlock(self, txn: str, src: int) -> None:
        """Give up the rows of a write that never got staged (its decode failed)."""
        self.locks[src].unlock(txn)

    def stage(self, txn: str, src: int, rows, new, versions, now: float) -> None:
        self.staged[txn] = ActingWrite(src, rows, new, versions, now)

    def commit(self, txn: str) -> ActingWrite | None:
        """The write's rows take their new records: released, and materialized at their new versions (they
        are newer than anything decoded). None if `txn` is not a write staged here."""
        w = self.staged.pop(txn, None)
        if w is None:
            return None
        self.locks[w.src].unlock(txn)
        cache = self.cache.get(w.src)
        if cache is not None:
            cache.records[w.rows], cache.versions[w.rows], cache.valid[w.rows] = w.new, w.versions, True
        return w

    def abort(self, txn: str) -> ActingWrite | None:
        w = self.staged.pop(txn, None)
        if w is not None:
            self.locks[w.src].unlock(txn)
        return w

    def expired(self, now: float, timeout: float, gone: Callable[[str], bool] = never_gone) -> list[str]:
        """Writes whose worker never decided them (it died: `timeout` passed, or its process is known to be
        `gone`): aborted by the caller, or the failed shard's rows would stay locked."""
        return [t for t, w in self.staged.items() if now - w.staged_at > timeout or gone(t)]

    # -- materialized rows ----------------------------------------------------------------------------------
    def begin(self, src: int, key) -> None:
        """Degraded work on shard src's rows for its failure `key` (None: unknown, keep nothing): a new
        failure of src starts from an empty cache, since nothing decoded before it is valid."""
        cache = self.cache.get(src)
        if key is None:
            self.cache.pop(src, None)
        elif cache is None or cache.key != key:
            self.cache[src] = ActingCache.empty(key, self.rows_on(src), self.width)

    def forget(self, src: int) -> None:
        """Shard src is no longer failed: its rows have a writer of their own again."""
        self.cache.pop(src, None)

    def lookup(self, src: int, rows: torch.Tensor, reflected) -> Lookup:
        """Which of shard src's `rows` are materialized at the version the parity records reflect for them.
        `reflected()` gives those versions; it is only called when some row is materialized at all."""
        cache = self.cache.get(src)
        if cache is None:
            return Lookup(torch.zeros(rows.numel(), dtype=torch.bool), None, 0)
        hit = cache.valid[rows]
        if bool(hit.any()):
            hit = hit & (cache.versions[rows] == reflected())
        return Lookup(hit, cache, cache.generation)

    def materialize(
        self, src: int, rows: torch.Tensor, seen: Lookup, records: torch.Tensor, versions: torch.Tensor
    ) -> None:
        """Complete a read of `rows` whose misses were decoded into `records` and `versions` (every row's
        place, in order): the hits are filled in from the cache that answered, and the decoded rows are kept
        — unless that cache was replaced or invalidated meanwhile (a decode started before may be stale),
        and never over rows a commit has materialized since (those are newer)."""
        cache = seen.cache
        if cache is None:
            return
        h = seen.hit.nonzero().squeeze(1)
        records[h], versions[h] = cache.records[rows[h]], cache.versions[rows[h]]
        if self.cache.get(src) is not cache or cache.generation != seen.generation:
            return
        miss = (~seen.hit).nonzero().squeeze(1)
        fresh = ~cache.valid[rows[miss]]
        keep = rows[miss][fresh]
        cache.records[keep], cache.versions[keep] = records[miss][fresh], versions[miss][fresh]
        cache.valid[keep] = True

    def invalidate(self, src: int, rows: torch.Tensor) -> None:
        """Shard src's `rows` changed without this home writing them (a dead server's own delta, committed
        on its behalf): read them again, and do not keep decodes that started before."""
        cache = self.cache.get(src)
        if cache is not None:
            cache.valid[rows] = False
            cache.generation += 1
