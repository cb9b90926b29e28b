"""ecrec_operator.leader: the Lease decision (pure) and the elector against an in-memory Lease with the API
server's optimistic concurrency (a write carrying a stale resourceVersion is a Conflict)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest

from ecrec_operator import leader
from ecrec_operator.leader import Conflict, Elector, LeaderElection, Record, decide

WALL = datetime(2026, 1, 1, tzinfo=UTC)


def test_no_lease_is_created_by_the_first_candidate():
    assert decide(None, 0.0, 100.0, WALL, "a", 15) == Record("a", 15, WALL, WALL, 0)


def test_a_held_lease_is_respected_until_it_expired_as_observed_locally():
    held = Record("b", 15, WALL, WALL, 3)
    assert decide(held, observed_at=100.0, now=114.9, wall=WALL, me="a", lease_duration=15) is None
    # expiry counts from when this candidate saw the record change, not from the record's renewTime
    taken = decide(held, observed_at=100.0, now=115.1, wall=WALL, me="a", lease_duration=15)
    assert taken == Record("a", 15, WALL, WALL, 4)


def test_the_holder_renews_keeping_acquire_time_and_transitions():
    earlier = datetime(2025, 1, 1, tzinfo=UTC)
    mine = Record("a", 15, earlier, earlier, 2)
    assert decide(mine, 0.0, 1000.0, WALL, "a", 15) == Record("a", 15, earlier, WALL, 2)


def test_a_released_lease_is_taken_at_once():
    gone = leader.released(Record("b", 15, WALL, WALL, 1), WALL)
    assert gone.holder == "" and gone.lease_duration == 1
    assert decide(gone, observed_at=100.0, now=100.0, wall=WALL, me="a", lease_duration=15).holder == "a"


class MemoryLease:
    """A Lease as the API server keeps it: a resourceVersion bumped by every write."""

    def __init__(self):
        self.record: Record | None = None
        self.version = 0
        self.name = "ecrec-operator"
        self.lock = threading.Lock()
        self.down = False  # the API server does not answer

    def get(self):
        if self.down:
            raise ConnectionError("no API server")
        with self.lock:
            return None if self.record is None else (self.record, str(self.version))

    def create(self, record):
        with self.lock:
            if self.record is not None:
                raise Conflict
            self.record, self.version = record, self.version + 1

    def update(self, record, version):
        if self.down:
            raise ConnectionError("no API server")
        with self.lock:
            if version != str(self.version):
                raise Conflict
            self.record, self.version = record, self.version + 1


def test_one_of_two_candidates_leads_and_the_other_takes_over_after_expiry_or_release(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(leader.time, "monotonic", lambda: now[0])
    lease = MemoryLease()
    a, b = Elector(lease, "a", 15), Elector(lease, "b", 15)
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    now[0] += 10
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()  # renewed: b saw it change
    now[0] += 14
    assert not b.try_acquire_or_renew()  # 14 s since b saw the last renewal
    now[0] += 2  # a stopped renewing (killed): 16 s since b last saw the record change
    assert b.try_acquire_or_renew() and lease.record.holder == "b" and lease.record.transitions == 1
    assert not a.try_acquire_or_renew()  # a, back, is a candidate again
    b.release()
    assert lease.record.holder == ""
    assert a.try_acquire_or_renew() and lease.record.transitions == 2  # no waiting for an expiry


def test_two_candidates_racing_for_an_expired_lease_one_wins():
    lease = MemoryLease()
    lease.record, lease.version = leader.released(Record("old", 15, WALL, WALL, 0), WALL), 7
    a, b = Elector(lease, "a", 15), Elector(lease, "b", 15)
    got_a, got_b = lease.get(), lease.get()  # both read version 7 ...
    new_a = decide(got_a[0], 0, 0, WALL, "a", 15)
    new_b = decide(got_b[0], 0, 0, WALL, "b", 15)
    lease.update(new_a, got_a[1])
    with pytest.raises(Conflict):  # ... and only the first write succeeds
        lease.update(new_b, got_b[1])
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()


def test_a_leader_that_cannot_renew_within_the_deadline_stops():
    lease = MemoryLease()
    lost = threading.Event()
    election = LeaderElection(
        Elector(lease, "a", 3.0), renew_deadline=0.6, retry_period=0.1, on_lost=lost.set
    )
    assert election.acquire()
    time.sleep(0.3)
    assert not lost.is_set()
    t_down = time.monotonic()
    lease.down = True
    assert lost.wait(5)
    # before another candidate could take the 3 s lease (counted from the last renewal it saw)
    assert time.monotonic() - t_down < 3.0
    election.stop.set()


def test_a_leader_whose_lease_was_taken_stops_at_its_next_try():
    lease = MemoryLease()
    lost = threading.Event()
    election = LeaderElection(
        Elector(lease, "a", 3.0), renew_deadline=2.0, retry_period=0.1, on_lost=lost.set
    )
    assert election.acquire()
    with lease.lock:  # e.g. it was paused past its lease and another candidate took it
        lease.record, lease.version = Record("b", 3, WALL, WALL, 1), lease.version + 1
    assert lost.wait(1.0)
    election.stop.set()


def test_a_clean_stop_releases_and_a_waiting_candidate_returns_on_stop():
    lease = MemoryLease()
    a = LeaderElection(Elector(lease, "a", 3.0), renew_deadline=2.0, retry_period=0.1)
    assert a.acquire()
    b = LeaderElection(Elector(lease, "b", 3.0), renew_deadline=2.0, retry_period=0.1)
    result = []
    t = threading.Thread(target=lambda: result.append(b.acquire()))
    t.start()
    time.sleep(0.3)
    assert not result
    a.release()
    t.join(timeout=5)
    assert result == [True] and lease.record.holder == "b"
    b.release()
    c = LeaderElection(Elector(lease, "c", 3.0), renew_deadline=2.0, retry_period=0.1)
    lease.record = Record("z", 3, WALL, WALL, 0)  # someone else holds it
    c.stop.set()
    assert c.acquire() is False


def test_timings_must_leave_the_leader_time_to_stop_before_the_lease_expires():
    with pytest.raises(ValueError):
        LeaderElection(Elector(MemoryLease(), "a", 10.0), renew_deadline=10.0, retry_period=2.0)


def test_a_candidate_answers_the_probes_until_it_leads():
    """The Deployment's probes ask /healthz; a candidate waiting for the Lease answers it itself."""
    import socket

    import httpx

    from ecrec_operator.main import _standby_health

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = _standby_health("127.0.0.1", port)
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert r.status_code == 200 and "standby" in r.text
        assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=5).status_code == 404
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:  # the port is free again for kopf's own endpoint (aiohttp reuses addresses)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
