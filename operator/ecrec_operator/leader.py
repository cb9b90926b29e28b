"""Leader election for the operator: a coordination.k8s.io/v1 Lease, with client-go's semantics.

Several operator replicas may run (the chart's `operator.replicas`, and a RollingUpdate's old and new pod);
only the holder of the Lease acts. As in client-go (k8s.io/client-go/tools/leaderelection):
- a candidate takes the Lease when it has none, when its holder is empty (released), or when the record has
  not changed for `leaseDurationSeconds` *as this candidate observed it* (its own monotonic clock: clocks
  of different nodes are never compared; renewTime is written for people and other tools);
- the holder renews every `retry_period`; one that has not renewed for `renew_deadline` (< lease duration)
  stops leading (the operator exits at once, and its pod restarts as a candidate), so it has stopped before
  any candidate can consider the Lease expired;
- every write carries the resourceVersion it read: of two candidates that saw the same expired record, one
  wins and the other gets a Conflict;
- a holder that stops cleanly (SIGTERM) releases the Lease (holder "", duration 1 s): its successor takes over
  at its next try instead of after a lease duration.

Why not kopf's peering: with equal priorities (replicas of one Deployment) kopf only warns about "possibly
conflicting operators" and every replica keeps acting; it also needs its own CRDs.

`decide` is the whole decision, pure; `Elector` keeps what it observed between tries; `LeaseLock` is the
Kubernetes I/O; `LeaderElection` runs the tries in a thread. Lock discipline: `Elector` is used by one thread
at a time (the caller's until it leads, then the renewal thread); `LeaderElection.stop` is an Event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

log = logging.getLogger("ecrec_operator.leader")

LEASE_DURATION = 15.0  # client-go's defaults (kube-controller-manager's too)
RENEW_DEADLINE = 10.0
RETRY_PERIOD = 2.0


@dataclass(frozen=True)
class Record:
    """A Lease's spec."""

    holder: str = ""
    lease_duration: int = int(LEASE_DURATION)
    acquire_time: datetime | None = None
    renew_time: datetime | None = None
    transitions: int = 0


def decide(
    record: Record | None,
    observed_at: float,
    now: float,
    wall: datetime,
    me: str,
    lease_duration: float,
) -> Record | None:
    """The record to write to lead (take or renew the Lease), or None: another candidate leads.

    `record`: the Lease as read (None: there is none); `observed_at`: when (monotonic, this process) the record
    last changed as this candidate saw it; `now`: monotonic; `wall`: now, for the record's timestamps."""
    duration = max(1, round(lease_duration))
    if record is None:
        return Record(me, duration, wall, wall, 0)
    if record.holder and record.holder != me and observed_at + record.lease_duration > now:
        return None  # held, and not expired as far as this candidate has seen
    if record.holder == me:
        return replace(record, lease_duration=duration, renew_time=wall)
    return Record(me, duration, wall, wall, record.transitions + 1)


def released(record: Record, wall: datetime) -> Record:
    """What a holder writes when it stops cleanly (client-go's ReleaseOnCancel)."""
    return replace(record, holder="", lease_duration=1, acquire_time=wall, renew_time=wall)


class Conflict(Exception):
    """The Lease changed since it was read (or was created meanwhile)."""


class Elector:
    """One candidate's tries: remembers the record it last saw and when it changed."""

    def __init__(self, lock: LeaseLock, identity: str, lease_duration: float = LEASE_DURATION):
        self.lock, self.identity, self.lease_duration = lock, identity, lease_duration
        self._observed: Record | None = None
        self._observed_at = 0.0
        self.held: Record | None = None  # the record this candidate last wrote as the leader

    def try_acquire_or_renew(self) -> bool:
        """One try (client-go's tryAcquireOrRenew): True if this candidate leads now."""
        now = time.monotonic()
        got = self.lock.get()
        record, version = got if got is not None else (None, None)
        if record is not None and record != self._observed:
            self._observed, self._observed_at = record, now
        new = decide(record, self._observed_at, now, _utcnow(), self.identity, self.lease_duration)
        if new is None:
            self.held = None
            return False
        try:
            if version is None:
                self.lock.create(new)
            else:
                self.lock.update(new, version)
        except Conflict:
            self.held = None
            return False
        self._observed, self._observed_at, self.held = new, time.monotonic(), new
        return True

    def release(self) -> None:
        """Give the Lease up, if this candidate still holds it."""
        got = self.lock.get()
        if got is None or got[0].holder != self.identity:
            return
        try:
            self.lock.update(released(got[0], _utcnow()), got[1])
        except Conflict:
            pass


class LeaseLock:
    """The Lease `namespace/name` through the kubernetes client (coordination.k8s.io/v1)."""

    def __init__(self, namespace: str, name: str, api=None):
        from kubernetes import client

        self.namespace, self.name = namespace, name
        self.api = api or client.CoordinationV1Api()

    def get(self) -> tuple[Record, str] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        s = lease.spec
        record = Record(
            s.holder_identity or "",
            int(s.lease_duration_seconds or 0),
            s.acquire_time,
            s.renew_time,
            int(s.lease_transitions or 0),
        )
        return record, lease.metadata.resource_version

    def _body(self, record: Record, version: str | None):
        from kubernetes import client

        return client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace, resource_version=version),
            spec=client.V1LeaseSpec(
                holder_identity=record.holder,
                lease_duration_seconds=record.lease_duration,
                acquire_time=record.acquire_time,
                renew_time=record.renew_time,
                lease_transitions=record.transitions,
            ),
        )

    def create(self, record: Record) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.api.create_namespaced_lease(self.namespace, self._body(record, None))
        except ApiException as e:
            if e.status == 409:
                raise Conflict from e
            raise

    def update(self, record: Record, version: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.api.replace_namespaced_lease(self.name, self.namespace, self._body(record, version))
        except ApiException as e:
            if e.status == 409:
                raise Conflict from e
            raise


class LeaderElection:
    """`acquire()` blocks until this candidate leads (or `stop` is set); then a thread renews the Lease, and
    `on_lost` is called if it cannot for `renew_deadline` seconds."""

    def __init__(
        self,
        elector: Elector,
        renew_deadline: float = RENEW_DEADLINE,
        retry_period: float = RETRY_PERIOD,
        on_lost: Callable[[], object] | None = None,
    ):
        if not retry_period < renew_deadline < elector.lease_duration:
            raise ValueError(
                "leader election: need retry period < renew deadline < lease duration, got "
                f"{retry_period:g} < {renew_deadline:g} < {elector.lease_duration:g}"
            )
        self.elector, self.renew_deadline, self.retry_period = elector, renew_deadline, retry_period
        self.on_lost = on_lost
        self.stop = threading.Event()
        self._renewing: threading.Thread | None = None

    def _try(self) -> bool:
        try:
            return self.elector.try_acquire_or_renew()
        except Exception as e:  # the API server did not answer: no lead from this try
            log.warning("leader election: %s: %s", type(e).__name__, e)
            return False

    def acquire(self) -> bool:
        """True once this candidate leads; False if `stop` was set first."""
        ident, logged = self.elector.identity, None
        while not self.stop.is_set():
            if self._try():
                log.info("leader election: %s leads (lease %s)", ident, self.elector.lock.name)
                self._renewing = threading.Thread(target=self._renew, daemon=True, name="lease-renewal")
                self._renewing.start()
                return True
            holder = (self.elector._observed or Record()).holder
            if holder != logged:
                log.info("leader election: %s waits; %s leads", ident, holder or "nobody")
                logged = holder
            self.stop.wait(self.retry_period)
        return False

    def _renew(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(self.retry_period):
            if self._try():
                last = time.monotonic()
            elif self.elector.held is None and self.elector._observed is not None and self._lost_to_other():
                break
            if time.monotonic() - last > self.renew_deadline:
                break
        else:
            return
        log.error("leader election: %s lost the lease; stopping", self.elector.identity)
        if self.on_lost is not None:
            self.on_lost()

    def _lost_to_other(self) -> bool:
        seen = self.elector._observed
        return seen is not None and seen.holder not in ("", self.elector.identity)

    def release(self) -> None:
        """Stop renewing and give the Lease up (a clean shutdown)."""
        self.stop.set()
        if self._renewing is not None:
            self._renewing.join(timeout=self.retry_period + 5)
        try:
            self.elector.release()
        except Exception as e:
            log.warning("leader election: could not release the lease: %s", e)


def _utcnow() -> datetime:
    return datetime.now(UTC)
