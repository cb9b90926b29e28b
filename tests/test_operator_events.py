"""The operator's record of lost servers and its RecoveryStarted event (ecrec_operator.handlers), without an
API server: the coordinator starts a replacement's rebuild when it registers, so the operator no longer
starts it in the common case and must see it started instead (the end-to-end tests check the events on a
real API server)."""

from __future__ import annotations

import pytest

from ecrec_operator import handlers, metrics

NS, JOB = "ns", "job"


def coordinator_pod() -> dict:
    return {
        "metadata": {"name": f"{JOB}-coordinator-1", "labels": {"ecrec.dev/role": "coordinator"}},
        "status": {"phase": "Running", "podIP": "10.0.0.1"},
    }


def status(**shards: tuple[str, str]) -> dict:
    """A coordinator status whose shard N (written sN) is (state, instance)."""
    return {
        "cluster": {
            "shards": [
                {"shard": int(k[1:]), "state": st, "instance": inst} for k, (st, inst) in shards.items()
            ]
        }
    }


@pytest.fixture
def recorded(monkeypatch):
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(handlers.kopf, "info", lambda obj, reason, message: events.append((reason, message)))
    monkeypatch.setattr(handlers.kopf, "warn", lambda obj, reason, message: events.append((reason, message)))
    monkeypatch.setattr(handlers, "_post", lambda *a, **k: None)
    monkeypatch.setattr(handlers, "_lost_at", {})
    monkeypatch.setattr(handlers, "_registered", {})
    monkeypatch.setattr(handlers, "_reported", set())
    return events


def pod_deleted(name: str, shard: int) -> None:
    handlers.server_pod_event(
        event={"type": "DELETED"},
        name=name,
        namespace=NS,
        labels={"ecrec.dev/job": JOB, "ecrec.dev/shard": str(shard)},
        meta={},
        status={},
        pods_by_job={(NS, JOB): [coordinator_pod()]},
        suspended_jobs={(NS, JOB): [False]},
    )


def seen(coord_status: dict) -> None:
    """What a reconcile pass does with the coordinator's status around its actions."""
    handlers._registered[(NS, JOB)] = {i: s["instance"] for i, s in handlers._shards(coord_status).items()}
    handlers._recoveries_started({}, NS, JOB, coord_status)


def test_recovery_started_once_when_another_process_registered_for_the_lost_shard(recorded):
    before = metrics.replacement_seconds._sum.get()
    seen(status(s0=("up", "a-0"), s1=("up", "a-1")))
    pod_deleted("a-1", 1)
    assert (NS, JOB, 1) in handlers._lost_at
    seen(status(s0=("up", "a-0"), s1=("failed", "a-1")))  # declared, no replacement yet
    assert [r for r, _ in recorded if r == "RecoveryStarted"] == []
    seen(status(s0=("up", "a-0"), s1=("up", "spare-0-1")))  # taken over and rebuilt between two passes
    seen(status(s0=("up", "a-0"), s1=("up", "spare-0-1")))
    started = [m for r, m in recorded if r == "RecoveryStarted"]
    assert started == ["server 1: spare-0-1 is being rebuilt"] and handlers._lost_at == {}
    assert metrics.replacement_seconds._sum.get() > before


def test_a_superseded_process_deleted_later_is_no_loss(recorded):
    # The operator deletes an older process of a shard that another one serves: nothing to recover, and no
    # RecoveryStarted for it.
    seen(status(s0=("up", "a-0-2")))
    pod_deleted("a-0-1", 0)
    seen(status(s0=("up", "a-0-2")))
    assert handlers._lost_at == {} and [r for r, _ in recorded if r == "RecoveryStarted"] == []
