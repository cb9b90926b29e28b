"""ecrec.core.spares: the coordinator's pool of warm spares."""

from __future__ import annotations

import pytest

from ecrec.core.spares import SparePool


def test_failed_shards_get_idle_spares_in_registration_order_once_each():
    pool = SparePool()
    pool.register("a", "h:1", "", now=0.0)
    pool.register("b", "h:2", "", now=1.0)
    assert [(s, sp.instance) for s, sp in pool.assign([3, 1], now=2.0)] == [(1, "a"), (3, "b")]
    assert pool.assign([1, 3, 4], now=3.0) == []  # 1 and 3 have theirs; none is left for 4
    assert pool.assigned_to(3).instance == "b"
    assert pool.register("a", "h:9", "", now=4.0).assigned == 1  # a repeated registration keeps it
    assert pool.taken("a").assigned == 1 and "a" not in pool.spares  # it registered as shard 1
    assert pool.snapshot() == [{"instance": "b", "address": "h:2", "assigned": 3}]


def test_a_released_or_silent_spare_gives_its_shard_back():
    pool = SparePool()
    pool.register("a", "h:1", "", now=0.0)
    pool.register("b", "h:2", "", now=0.0)
    pool.assign([0, 1], now=0.0)
    assert (
        pool.release(0).instance == "a" and pool.spares["a"].assigned is None
    )  # shard 0 got its own process
    assert pool.heartbeat("a", now=5.0) is not None and pool.heartbeat("zz", now=5.0) is None
    [gone] = pool.expire(now=5.5, timeout=3.0)  # b was silent since 0
    assert gone.instance == "b" and gone.assigned == 1
    assert [(s, sp.instance) for s, sp in pool.assign([1], now=6.0)] == [(1, "a")]
    with pytest.raises(ValueError, match="name itself"):
        pool.register("", "h", "", now=7.0)


def test_a_spare_that_heartbeats_but_never_takes_its_shard_is_dropped_and_the_shard_reassigned():
    # A stuck spare, or a stray client with the token posing as one: its heartbeats must not hold the shard.
    pool = SparePool()
    pool.register("stray", "h:1", "", now=0.0)
    pool.register("real", "h:2", "", now=1.0)
    assert [(s, sp.instance) for s, sp in pool.assign([2], now=2.0)] == [(2, "stray")]
    for t in (3.0, 4.0, 4.9):
        assert pool.heartbeat("stray", now=t) is not None and pool.heartbeat("real", now=t) is not None
        assert pool.expire(now=t, timeout=3.0) == []
    [gone] = pool.expire(now=5.1, timeout=3.0)  # assigned at 2.0, still not registered as shard 2
    assert gone.instance == "stray" and gone.assigned == 2
    assert [(s, sp.instance) for s, sp in pool.assign([2], now=5.2)] == [(2, "real")]
