"""The job token (ecrec.auth): without it a parameter server answers UNAUTHENTICATED and the coordinator 401 to
anything that would change the job, and nothing changes; with it everything works as before."""

from __future__ import annotations

import grpc
import pytest
import torch
from fastapi.testclient import TestClient

from ecrec import auth
from ecrec.coordinator.app import create_app
from ecrec.coordinator.service import Coordinator
from ecrec.metrics import Metrics
from ecrec.proto import ecrec_pb2 as pb
from ecrec.proto import ecrec_pb2_grpc as pb_grpc
from ecrec.server import ParameterServicer, start_grpc
from ecrec.store import ShardStore
from ecrec.wire import floats_to_bytes, ids_to_bytes
from tests.conftest import make_ctx

TOKEN = auth.new_token()


@pytest.fixture
def served():
    ctx = make_ctx(servers__replicas=3)
    store = ShardStore(ctx, 1)
    servicer = ParameterServicer(store, Metrics("t", "server", "1"), epoch=5)
    server, port = start_grpc(servicer, "127.0.0.1:0", threads=4, token=TOKEN)
    yield ctx, store, f"127.0.0.1:{port}"
    server.stop(None)


def test_a_server_refuses_every_call_without_the_job_token_and_changes_nothing(served):
    ctx, store, addr = served
    g = ctx.placement.global_id(1, torch.arange(4))
    push = pb.PushRequest(
        epoch=5, ids=ids_to_bytes(g), grads=floats_to_bytes(torch.ones(4, ctx.dim)), txn="w0-0"
    )
    before = store.pull(g).clone()
    for token in (None, "not-the-token", TOKEN[:-1]):
        with auth.channel(addr, token) as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            for call, request in ((stub.Push, push), (stub.Info, pb.InfoRequest())):
                with pytest.raises(grpc.RpcError) as err:
                    call(request, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Every method of the service, with its own (empty) request message: refused before the request is read.
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    assert len(service.methods) >= 17
    with auth.channel(addr, None) as ch:
        for m in service.methods:
            call = ch.unary_unary(
                f"/{service.full_name}/{m.name}", request_serializer=lambda msg: msg.SerializeToString()
            )
            request = getattr(pb, m.input_type.name)()
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, m.name
    assert torch.equal(store.pull(g), before)
    with auth.channel(addr, TOKEN) as ch:  # the same calls with the token go through
        stub = pb_grpc.ParameterServerStub(ch)
        assert stub.Info(pb.InfoRequest(), timeout=5).data_rows == store.num_rows
        rows = stub.Pull(pb.PullRequest(epoch=5, ids=ids_to_bytes(g)), timeout=5).rows
        assert torch.equal(
            torch.frombuffer(bytearray(rows), dtype=torch.float32).view(4, -1), before[:, : ctx.dim]
        )


def test_the_coordinator_refuses_changes_without_the_token_and_keeps_reads_open():
    ctx = make_ctx(servers__replicas=2)
    coord = Coordinator(ctx.job, probe=lambda addr, inst: False, token=TOKEN)
    api = TestClient(create_app(coord))
    register = {"shard": 0, "address": "h:0", "instance": "s0"}
    for headers in ({}, auth.headers("wrong"), {"authorization": TOKEN}):  # the last lacks "Bearer "
        r = api.post("/v1/servers/register", json=register, headers=headers)
        assert r.status_code == 401, r.text
        assert api.post("/v1/failures", json={"shard": 0}, headers=headers).status_code == 401
    assert coord.cluster.shards[0].state.value == "pending" and not coord.progress.events
    # Reads are open: probes, dashboards and scrapers hold no token.
    assert api.get("/v1/status").status_code == 200 and api.get("/metrics").status_code == 200
    assert api.get("/healthz").status_code == 200 and api.get("/v1/cluster").status_code == 200
    r = api.post("/v1/servers/register", json=register, headers=auth.headers(TOKEN))
    assert r.status_code == 200 and coord.cluster.shards[0].state.value == "up"
    # Without a token of its own, a coordinator checks nothing (one started by hand, a unit test).
    open_api = TestClient(create_app(Coordinator(ctx.job, probe=lambda addr, inst: False)))
    assert open_api.post("/v1/servers/register", json=register).status_code == 200


def test_a_live_probe_that_is_refused_still_counts_as_alive(served):
    from ecrec.coordinator.probe import probe_server

    _ctx, _store, addr = served
    assert probe_server(addr, token=TOKEN) is True
    assert probe_server(addr, token="wrong") is True  # refused, but there: never declared dead for that
    assert probe_server("127.0.0.1:1", token=TOKEN) is False
