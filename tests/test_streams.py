"""Unary calls as messages on long-lived streams (ecrec.streams), over real gRPC on loopback: the same answers
and the same errors as the unary calls, a deadline per message, a bounded number of streams per server."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from ecrec import auth, streams
from ecrec.client import PSClient
from ecrec.metrics import Metrics
from ecrec.proto import ecrec_pb2 as pb
from ecrec.proto import ecrec_pb2_grpc as pb_grpc
from ecrec.server import ParameterServicer, start_grpc
from ecrec.store import ShardStore
from ecrec.streams import StreamPool
from ecrec.wire import floats_to_bytes, ids_to_bytes
from tests.conftest import make_ctx
from tests.test_store_protocol import Background

SHARD = 1


def serve(token: str | None = None, max_streams: int | None = None):
    ctx = make_ctx(servers__replicas=3)
    store = ShardStore(ctx, SHARD)
    servicer = ParameterServicer(store, Metrics("t", "server", str(SHARD)), epoch=5)
    if max_streams is not None:
        servicer.streams.max_streams = max_streams
    server, port = start_grpc(servicer, "127.0.0.1:0", threads=4, token=token)
    return ctx, store, servicer, server, f"127.0.0.1:{port}"


@pytest.fixture
def served():
    ctx, store, servicer, server, address = serve()
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.ParameterServerStub(channel)
    pool = StreamPool(stub, size=2)
    yield ctx, store, servicer, stub, pool
    pool.close()
    channel.close()
    server.stop(None)


def ids(ctx, n: int) -> torch.Tensor:
    return ctx.placement.global_id(SHARD, torch.arange(n))


def test_a_call_on_a_stream_answers_as_the_unary_call_does(served):
    ctx, store, servicer, stub, pool = served
    req = pb.PullRequest(epoch=5, ids=ids_to_bytes(ids(ctx, 300)), dense_chunks=[1])
    assert pool.call("Pull", req, 5.0) == stub.Pull(req, timeout=5.0)
    grads = torch.randn(300, ctx.dim)
    push = pb.PushRequest(epoch=5, ids=req.ids, grads=floats_to_bytes(grads), txn="w0-0")
    assert pool.call("Push", push, 5.0).applied == 300
    assert pool.call("Pull", req, 5.0) == stub.Pull(req, timeout=5.0)  # the push was applied once
    assert servicer.streams.open == 1  # one stream carried all three calls


def test_a_failed_call_raises_its_status_and_the_stream_goes_on(served):
    ctx, store, servicer, stub, pool = served
    for bad, code in [
        (pb.PushRequest(epoch=5, ids=b"\x01\x02\x03", grads=b""), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.PushRequest(epoch=4, ids=b"", grads=b""), grpc.StatusCode.FAILED_PRECONDITION),  # stale epoch
    ]:
        with pytest.raises(grpc.RpcError) as unary:
            stub.Push(bad, timeout=5.0)
        with pytest.raises(grpc.RpcError) as streamed:
            pool.call("Push", bad, 5.0)
        assert streamed.value.code() == unary.value.code() == code
        assert streamed.value.details() == unary.value.details()
    good = pb.PullRequest(epoch=5, ids=ids_to_bytes(ids(ctx, 3)))
    assert len(pool.call("Pull", good, 5.0).rows) == 3 * ctx.dim * 4
    assert servicer.streams.open == 1


def test_a_malformed_message_is_invalid_argument_and_the_stream_goes_on(served):
    ctx, store, servicer, stub, pool = served
    calls = [  # on a raw stream, as a stray client would send them
        pb.Call(method="Pull", body=b"\xff\xff\xff", timeout=5.0),  # not a PullRequest
        pb.Call(method="NoSuchMethod", body=b"", timeout=5.0),
        pb.Call(method="Calls", body=b"", timeout=5.0),  # the stream itself is not a unary method
        pb.Call(
            method="Pull", body=pb.PullRequest(epoch=5, ids=ids_to_bytes(ids(ctx, 2))).SerializeToString()
        ),
    ]
    got = list(stub.Calls(iter(calls), timeout=10.0))
    codes = [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNIMPLEMENTED]
    assert [g.code for g in got[:3]] == [c.value[0] for c in codes]
    assert got[3].code == 0 and len(pb.PullResponse.FromString(got[3].body).rows) == 2 * ctx.dim * 4


def test_a_server_that_does_not_answer_fails_the_call_at_its_deadline(served, monkeypatch):
    # As a paused server would: the handler outlives the caller's deadline and never looks at it.
    ctx, store, servicer, stub, pool = served
    real_pull = store.pull
    monkeypatch.setattr(store, "pull", lambda g, *a, **k: (time.sleep(1.5), real_pull(g, *a, **k))[1])
    req = pb.PullRequest(epoch=5, ids=ids_to_bytes(ids(ctx, 2)))
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        pool.call("Pull", req, 0.3)
    took = time.monotonic() - start
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and 0.3 <= took < 1.0
    monkeypatch.setattr(store, "pull", real_pull)
    assert len(pool.call("Pull", req, 5.0).rows) == 2 * ctx.dim * 4  # a new stream


def test_a_server_killed_mid_call_fails_it_as_unavailable():
    ctx, store, servicer, server, address = serve()
    channel = grpc.insecure_channel(address)
    pool = StreamPool(pb_grpc.ParameterServerStub(channel), size=2)
    try:
        req = pb.PullRequest(epoch=5, ids=ids_to_bytes(ids(ctx, 2)))
        pool.call("Pull", req, 5.0)
        real_pull = store.pull
        store.pull = lambda g, *a, **k: (time.sleep(1.0), real_pull(g, *a, **k))[1]
        threading.Timer(0.2, server.stop, args=(None,)).start()
        with pytest.raises(grpc.RpcError) as err:
            pool.call("Pull", req, 5.0)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    finally:
        pool.close()
        channel.close()


def test_past_its_stream_limit_a_server_refuses_streams_and_the_client_calls_unary(monkeypatch):
    ctx, store, servicer, server, address = serve(max_streams=1)
    channel = grpc.insecure_channel(address)
    pool = StreamPool(pb_grpc.ParameterServerStub(channel), size=2)
    try:
        real_pull = store.pull
        monkeypatch.setattr(store, "pull", lambda g, *a, **k: (time.sleep(0.5), real_pull(g, *a, **k))[1])
        req = pb.PullRequest(epoch=5, ids=ids_to_bytes(ids(ctx, 2)))
        slow = threading.Thread(target=pool.call, args=("Pull", req, 5.0))
        slow.start()  # holds the one stream the server allows
        time.sleep(0.2)
        assert len(pool.call("Pull", req, 5.0).rows) == 2 * ctx.dim * 4  # refused as a stream, then unary
        slow.join()
        assert pool.unary_only and servicer.streams.open <= 1
    finally:
        pool.close()
        channel.close()
        server.stop(None)


def test_streams_carry_the_job_token_and_a_stream_without_it_is_refused():
    ctx, store, servicer, server, address = serve(token="s3cret")
    req = pb.PullRequest(epoch=5, ids=ids_to_bytes(ids(ctx, 2)))
    with auth.channel(address, "s3cret") as ch:
        pool = StreamPool(pb_grpc.ParameterServerStub(ch), size=1)
        assert len(pool.call("Pull", req, 5.0).rows) == 2 * ctx.dim * 4
        assert servicer.streams.open == 1
        pool.close()
    with grpc.insecure_channel(address) as ch:
        pool = StreamPool(pb_grpc.ParameterServerStub(ch), size=1)
        with pytest.raises(grpc.RpcError) as err:
            pool.call("Pull", req, 5.0)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        pool.close()
    server.stop(None)


@pytest.mark.parametrize("streams", [0, 2])
def test_a_workers_pulls_go_on_streams_unless_call_streams_is_0(streams):
    ctx, store, servicer, server, address = serve()
    cluster = {
        "epoch": 5,
        "shards": [{"shard": s, "state": "up", "address": address, "incarnation": 1} for s in range(3)],
    }
    client = PSClient(ctx, cluster, streams=streams)
    try:
        g = ids(ctx, 50)
        rows, _ = client.pull(g, dense=False)
        assert torch.equal(rows, store.pull(g))
        assert servicer.streams.open == (1 if streams else 0)
    finally:
        client.close()
        server.stop(None)


def test_call_streams_is_a_bounded_count():
    assert make_ctx().spec.workers.call_streams == 4
    for bad in (-1, 33):
        with pytest.raises(ValueError, match="callStreams|call_streams"):
            make_ctx(workers__callStreams=bad)


def test_a_stream_the_watchdog_cancels_as_its_answer_arrives_is_not_lent_again(served, monkeypatch):
    ctx, store, servicer, stub, pool = served
    req = pb.PullRequest(epoch=5, ids=ids_to_bytes(ids(ctx, 2)))
    real = streams.WATCHDOG.unwatch

    def late(stream):  # the watchdog fires between the answer and the caller's unwatch
        real(stream)
        stream.expired = True
        stream.cancel()
        return True

    monkeypatch.setattr(streams.WATCHDOG, "unwatch", late)
    assert len(pool.call("Pull", req, 5.0).rows) == 2 * ctx.dim * 4  # the answer came: it counts
    monkeypatch.setattr(streams.WATCHDOG, "unwatch", real)
    assert pool._idle == []  # the cancelled stream was dropped, not put back
    assert len(pool.call("Pull", req, 5.0).rows) == 2 * ctx.dim * 4  # on a new stream


def test_a_map_change_leaves_the_old_channel_to_its_calls_in_flight(monkeypatch):
    # A shard moved (a replacement's address): the client's call still on the old channel's stream gets its
    # answer; the old channel is not closed under it (closing a channel a stream still uses can crash the
    # process); later calls go to the new address.
    ctx, store, servicer, server, address = serve()
    _, store2, servicer2, server2, address2 = serve()

    def cluster(epoch, addr):
        return {
            "epoch": epoch,
            "shards": [{"shard": s, "state": "up", "address": addr, "incarnation": 1} for s in range(3)],
        }

    client = PSClient(ctx, cluster(5, address), streams=2)
    try:
        g = ids(ctx, 20)
        real_pull = store.pull
        monkeypatch.setattr(store, "pull", lambda g, *a, **k: (time.sleep(0.5), real_pull(g, *a, **k))[1])
        slow = Background(client.pull, g, False)
        slow.start()
        time.sleep(0.2)
        old = client.channels[SHARD]
        client.update_cluster(cluster(5, address2))  # (the servers of this test confirm no newer epoch)
        slow.join()
        assert slow.error is None and torch.equal(slow.result[0], real_pull(g))
        assert client.channels[SHARD] is not old
        rows, _ = client.pull(g, dense=False)
        assert torch.equal(rows, store2.pull(g)) and servicer2.streams.open == 1
    finally:
        client.close()
        server.stop(None)
        server2.stop(None)
