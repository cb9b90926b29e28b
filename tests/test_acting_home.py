"""The acting home's state without I/O (ecrec.core.acting): degraded writes, their locks, materialized rows."""

from __future__ import annotations

import pytest
import torch

from ecrec.core.acting import ActingHome
from ecrec.core.txn import RowsBusy

W = 4  # record width
SRC = 2


def home() -> ActingHome:
    return ActingHome(lambda src: 10 + src, W)


def rows(*r: int) -> torch.Tensor:
    return torch.tensor(r, dtype=torch.int64)


def records(n: int, value: float) -> torch.Tensor:
    return torch.full((n, W), value)


def test_a_write_holds_its_rows_until_it_is_decided():
    h = home()
    h.lock("a", SRC, rows(1, 2))
    assert h.busy(SRC, rows(2, 3)) and not h.busy(SRC, rows(2), txn="a") and h.writing(SRC)
    assert not h.busy(SRC + 1, rows(2)) and not h.writing(SRC + 1)  # per failed shard
    with pytest.raises(RowsBusy):
        h.lock("b", SRC, rows(3, 2))
    h.stage("a", SRC, rows(1, 2), records(2, 1.0), rows(5, 6), now=0.0)
    assert "a" in h and len(h) == 1
    assert h.commit("a").src == SRC
    assert not h.busy(SRC, rows(1, 2)) and "a" not in h and not h.writing(SRC)
    assert h.commit("a") is None and h.abort("a") is None  # decided once


def test_an_aborted_write_releases_its_rows_and_materializes_nothing():
    h = home()
    h.begin(SRC, key=1)
    h.lock("a", SRC, rows(1))
    h.stage("a", SRC, rows(1), records(1, 7.0), rows(3), now=0.0)
    assert h.abort("a").versions.tolist() == [3]
    assert not h.busy(SRC, rows(1)) and not bool(h.cache[SRC].valid.any())


def test_a_write_whose_decode_failed_gives_its_rows_back():
    h = home()
    h.lock("a", SRC, rows(4))
    h.unlock("a", SRC)
    h.lock("b", SRC, rows(4))


def test_writes_of_a_dead_worker_expire():
    h = home()
    for txn, at in (("old", 0.0), ("new", 9.0)):
        h.lock(txn, SRC, rows(int(at)))
        h.stage(txn, SRC, rows(int(at)), records(1, 0.0), rows(1), now=at)
    assert h.expired(now=10.0, timeout=5.0) == ["old"]


def test_a_new_failure_of_the_shard_starts_from_an_empty_cache():
    h = home()
    h.begin(SRC, key=1)
    h.cache[SRC].valid[3] = True
    h.begin(SRC, key=1)  # the same failure: kept
    assert bool(h.cache[SRC].valid[3])
    h.begin(SRC, key=2)  # the shard was replaced and failed again: nothing from before is valid
    assert not bool(h.cache[SRC].valid.any()) and h.cache[SRC].records.shape == (12, W)
    h.begin(SRC, key=None)  # its failure unknown: keep nothing
    assert SRC not in h.cache
    h.begin(SRC, key=3)
    h.forget(SRC)
    assert SRC not in h.cache


def test_a_committed_write_is_materialized_and_read_back_at_the_version_the_parity_reflects():
    h = home()
    h.begin(SRC, key=1)
    h.lock("a", SRC, rows(1, 2))
    h.stage("a", SRC, rows(1, 2), torch.stack([records(1, 1.0)[0], records(1, 2.0)[0]]), rows(4, 4), 0.0)
    h.commit("a")
    seen = h.lookup(SRC, rows(1, 2, 3), lambda: rows(4, 5, 0))
    assert seen.hit.tolist() == [True, False, False]  # row 2's parity reflects a newer version: decode it
    asked = []
    nothing = h.lookup(SRC + 1, rows(1), lambda: asked.append(1))  # no cache: never asks for versions
    assert nothing.cache is None and not bool(nothing.hit.any()) and asked == []


def test_a_read_keeps_what_it_decoded_unless_something_changed_meanwhile():
    h = home()
    h.begin(SRC, key=1)
    r = rows(0, 1, 2)
    h.lock("w", SRC, rows(0))
    h.stage("w", SRC, rows(0), records(1, 9.0), rows(1), 0.0)
    h.commit("w")  # row 0 materialized at version 1
    seen = h.lookup(SRC, r, lambda: rows(1, 0, 0))
    assert seen.hit.tolist() == [True, False, False]
    # while rows 1 and 2 are decoded, a write commits row 1 (newer than what the decode read)
    h.lock("x", SRC, rows(1))
    h.stage("x", SRC, rows(1), records(1, 5.0), rows(1), 0.0)
    h.commit("x")
    recs, vers = torch.zeros(3, W), torch.zeros(3, dtype=torch.int64)
    recs[1:], vers[1:] = records(2, 3.0), 0  # the decoded misses
    h.materialize(SRC, r, seen, recs, vers)
    assert recs[:, 0].tolist() == [9.0, 3.0, 3.0] and vers.tolist() == [1, 0, 0]  # the hit filled in
    cache = h.cache[SRC]
    assert cache.records[1, 0] == 5.0 and cache.versions[1] == 1  # not overwritten by the older decode
    assert bool(cache.valid[2]) and cache.records[2, 0] == 3.0  # kept


def test_an_invalidated_cache_keeps_no_decode_that_started_before():
    h = home()
    h.begin(SRC, key=1)
    seen = h.lookup(SRC, rows(5, 6), lambda: rows(0, 0))
    h.invalidate(SRC, rows(6))  # a dead server's own delta committed on its behalf
    recs, vers = records(2, 4.0), rows(0, 0)
    h.materialize(SRC, rows(5, 6), seen, recs, vers)
    assert not bool(h.cache[SRC].valid.any())
    seen = h.lookup(SRC, rows(5), lambda: rows(0))
    h.begin(SRC, key=2)  # replaced by a new failure's cache meanwhile
    h.materialize(SRC, rows(5), seen, records(1, 4.0), rows(0))
    assert not bool(h.cache[SRC].valid.any())
