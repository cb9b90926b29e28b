"""The coordinator's one client (ecrec.coordinator.client.CoordinatorClient) against a real coordinator: its
app served by uvicorn on a loopback port, real HTTP both ways, nothing mocked."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from ecrec import auth
from ecrec.coordinator.app import create_app
from ecrec.coordinator.client import CoordinatorClient, Refused
from ecrec.coordinator.contract import Heartbeat, RegisterServer
from ecrec.coordinator.service import Coordinator
from tests.conftest import make_ctx

TOKEN = auth.new_token()


@contextlib.contextmanager
def served(coord: Coordinator) -> Iterator[str]:
    """The coordinator's app on 127.0.0.1 (a port of its own), in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(coord), log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < end and thread.is_alive(), "the coordinator did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def coordinator() -> Iterator[tuple[Coordinator, str, set[str]]]:
    """A 2-server job's coordinator that demands the job token; its probe finds the addresses in `alive`."""
    alive: set[str] = set()
    coord = Coordinator(make_ctx().job, probe=lambda addr, inst: addr in alive, token=TOKEN)
    with served(coord) as url:
        yield coord, url, alive


def register_both(client: CoordinatorClient, alive: set[str]) -> None:
    for s in range(2):
        alive.add(f"127.0.0.1:{9000 + s}")
        client.register_server(RegisterServer(shard=s, address=f"127.0.0.1:{9000 + s}", instance=f"i{s}"))


def test_a_server_registers_and_heartbeats_and_the_cluster_map_reads_back(coordinator):
    coord, url, alive = coordinator
    with CoordinatorClient(url, token=TOKEN) as client:
        assert client.healthz() == {"ok": True}
        first = client.register_server(RegisterServer(shard=0, address="127.0.0.1:9000", instance="i0"))
        assert first["cluster"]["shards"][0]["state"] == "up" and not first["cluster"]["ready"]
        client.register_server(RegisterServer(shard=1, address="127.0.0.1:9001", instance="i1"))
        beat = client.server_heartbeat(
            Heartbeat(shard=0, address="127.0.0.1:9000", instance="i0", epoch=1, cpuSeconds=0.5)
        )
        assert beat["ok"] is True and beat["epoch"] == 1
        cluster = client.cluster()
        assert cluster["ready"] and cluster["epoch"] == 1
        assert [(s["state"], s["address"], s["instance"]) for s in cluster["shards"]] == [
            ("up", "127.0.0.1:9000", "i0"),
            ("up", "127.0.0.1:9001", "i1"),
        ]
        assert beat["cluster"] == cluster
        assert client.job()["name"] == "test" and client.status()["cluster"] == cluster
        # A process the coordinator does not list as its shard's is told so in the answer, not refused.
        stranger = client.server_heartbeat(Heartbeat(shard=0, address="127.0.0.1:1", instance="x"))
        assert stranger["ok"] is False


def test_a_refused_request_raises_refused_with_the_coordinators_reason_and_changes_nothing(coordinator):
    coord, url, alive = coordinator
    with CoordinatorClient(url, token=TOKEN) as client:
        register_both(client, alive)
        before = client.cluster()
        # A second process for a shard whose registered server still answers its probe.
        with pytest.raises(Refused) as refused:
            client.register_server(
                RegisterServer(shard=1, address="127.0.0.1:9100", instance="x", replacement=True)
            )
        assert refused.value.response.status_code == 409 and "answering" in refused.value.detail
        assert isinstance(refused.value, httpx.HTTPStatusError)  # callers that treat every failure alike
        with pytest.raises(Refused) as refused:  # a rebuild, in a job without parity
            client.start_recovery(1)
        assert refused.value.detail == "recovery needs faultTolerance.strategy 'ecrec'"
        assert client.cluster() == before and client.recoveries() == []


def test_a_write_without_the_token_is_refused_while_reads_stay_open(coordinator):
    coord, url, alive = coordinator
    with CoordinatorClient(url) as anonymous, CoordinatorClient(url, token="not-the-token") as wrong:
        for client in (anonymous, wrong):
            with pytest.raises(httpx.HTTPStatusError) as denied:
                client.register_server(RegisterServer(shard=0, address="127.0.0.1:9000", instance="i0"))
            assert denied.value.response.status_code == 401 and not isinstance(denied.value, Refused)
        # Reads are open: probes, dashboards and scrapers hold no token.
        assert anonymous.healthz() == {"ok": True}
        assert anonymous.cluster()["shards"][0]["state"] != "up"  # the refused write changed nothing
        assert anonymous.job()["name"] == "test" and "phase" in anonymous.status()
    with CoordinatorClient(url, token=TOKEN) as client:  # the same write with the token goes through
        client.register_server(RegisterServer(shard=0, address="127.0.0.1:9000", instance="i0"))
        assert client.cluster()["shards"][0]["state"] == "up"


def test_no_coordinator_listening_raises_a_transport_error():
    with socket.socket() as sock:  # a loopback port that nothing listens on once this closes
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with CoordinatorClient(f"http://127.0.0.1:{port}", token=TOKEN, timeout=2.0) as client:
        with pytest.raises(httpx.TransportError):
            client.cluster()
        with pytest.raises(httpx.TransportError):
            client.register_server(RegisterServer(shard=0, address="127.0.0.1:9000", instance="i0"))
