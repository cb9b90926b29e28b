"""The parameter server over real gRPC on loopback: correctness of pull/push and rejection of bad input."""

from __future__ import annotations

import grpc
import pytest
import torch

from ecrec.core.optim import make_optimizer
from ecrec.metrics import Metrics
from ecrec.model import init_embedding_rows
from ecrec.proto import ecrec_pb2 as pb
from ecrec.proto import ecrec_pb2_grpc as pb_grpc
from ecrec.server import ADOPTING_AT_ONCE, ParameterServicer, start_grpc
from ecrec.serverlink import ClusterView
from ecrec.store import ShardStore
from ecrec.wire import floats_to_bytes, ids_to_bytes
from tests.conftest import make_ctx


@pytest.fixture
def served():
    ctx = make_ctx(servers__replicas=3)
    store = ShardStore(ctx, 1)
    servicer = ParameterServicer(store, Metrics("t", "server", "1"), epoch=5)
    server, port = start_grpc(servicer, "127.0.0.1:0", threads=4)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield ctx, store, pb_grpc.ParameterServerStub(channel)
    channel.close()
    server.stop(None)


def owned_ids(ctx, shard: int, n: int) -> torch.Tensor:
    return ctx.placement.global_id(shard, torch.arange(n))


def test_store_initializes_rows_from_global_ids(served):
    ctx, store, _ = served
    g = owned_ids(ctx, 1, 10)
    expected = init_embedding_rows(g, ctx.dim, ctx.spec.training.seed)
    assert torch.equal(store.pull(g), expected)


def test_pull_and_push_over_grpc_apply_the_optimizer(served):
    ctx, store, stub = served
    g = owned_ids(ctx, 1, 6)
    before = store.data[ctx.placement.local_row(g)].clone()
    grads = torch.randn(6, ctx.dim)
    resp = stub.Push(pb.PushRequest(epoch=5, ids=ids_to_bytes(g), grads=floats_to_bytes(grads), txn="w0-0"))
    assert resp.applied == 6
    opt = make_optimizer("adagrad", ctx.spec.training.learning_rate)
    expected = opt.apply(before, grads)
    pulled = torch.frombuffer(
        stub.Pull(pb.PullRequest(epoch=5, ids=ids_to_bytes(g))).rows, dtype=torch.float32
    )
    assert torch.equal(pulled.view(6, ctx.dim), expected[:, : ctx.dim])
    assert torch.equal(store.data[ctx.placement.local_row(g)], expected)  # optimizer state too


def test_dense_chunk_push_updates_param_and_state(served):
    ctx, store, stub = served
    n = store.chunk_len(1)
    before = stub.Pull(pb.PullRequest(epoch=5, dense_chunks=[1])).dense
    grads = torch.ones(n)
    stub.PushDense(pb.DensePushRequest(epoch=5, chunk=1, grads=floats_to_bytes(grads)))
    after = stub.Pull(pb.PullRequest(epoch=5, dense_chunks=[1])).dense
    b, a = torch.frombuffer(before, dtype=torch.float32), torch.frombuffer(after, dtype=torch.float32)
    assert bool((a < b).all())  # a positive gradient moves every parameter down


@pytest.mark.parametrize(
    "make_request, needle",
    [
        (lambda g, d: pb.PushRequest(ids=b"\x01\x02\x03", grads=b""), "int64"),
        (lambda g, d: pb.PushRequest(ids=ids_to_bytes(g), grads=b"\x00" * 12), "grads"),
        (
            lambda g, d: pb.PushRequest(
                ids=ids_to_bytes(g + 1), grads=floats_to_bytes(torch.zeros(len(g), d))
            ),
            "not owned",
        ),
        (
            lambda g, d: pb.PushRequest(
                ids=ids_to_bytes(torch.tensor([-3])), grads=floats_to_bytes(torch.zeros(1, d))
            ),
            "in [0",
        ),
        (
            lambda g, d: pb.PushRequest(
                ids=ids_to_bytes(g), grads=floats_to_bytes(torch.full((len(g), d), float("nan")))
            ),
            "NaN",
        ),
        (
            lambda g, d: pb.PushRequest(
                ids=ids_to_bytes(torch.cat([g, g])), grads=floats_to_bytes(torch.zeros(2 * len(g), d))
            ),
            "unique",
        ),
    ],
)
def test_malformed_push_is_invalid_argument_and_changes_nothing(served, make_request, needle):
    ctx, store, stub = served
    g = owned_ids(ctx, 1, 4)
    snapshot = store.data.clone()
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(make_request(g, ctx.dim))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    assert torch.equal(store.data, snapshot)
    # The server keeps serving.
    rows = stub.Pull(pb.PullRequest(ids=ids_to_bytes(g))).rows
    assert len(rows) == 4 * ctx.dim * 4


def test_one_pull_reads_rows_and_dense_chunks(served):
    ctx, store, stub = served
    g = owned_ids(ctx, 1, 5)
    resp = stub.Pull(pb.PullRequest(epoch=5, ids=ids_to_bytes(g), dense_chunks=[1]))
    assert torch.equal(torch.frombuffer(resp.rows, dtype=torch.float32).view(5, ctx.dim), store.pull(g))
    assert torch.equal(torch.frombuffer(resp.dense, dtype=torch.float32), store.pull_dense(1))
    assert stub.Pull(pb.PullRequest(epoch=5, ids=ids_to_bytes(g))).dense == b""


@pytest.mark.parametrize("chunks", [[0], [1, 1], [1, 2**31]])  # shard 1 holds chunk 1 only (no replication)
def test_unknown_or_repeated_dense_chunk_is_invalid_argument(served, chunks):
    ctx, _, stub = served
    with pytest.raises(grpc.RpcError) as err:
        stub.Pull(pb.PullRequest(ids=ids_to_bytes(owned_ids(ctx, 1, 3)), dense_chunks=chunks))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_read_is_invalid_argument(served):
    _, _, stub = served
    with pytest.raises(grpc.RpcError) as err:
        stub.ReadRecords(pb.ReadRecordsRequest(kind=pb.DATA, start=10**9))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_stale_epoch_is_rejected(served):
    ctx, _, stub = served
    with pytest.raises(grpc.RpcError) as err:
        stub.Pull(pb.PullRequest(epoch=4, ids=ids_to_bytes(owned_ids(ctx, 1, 2))))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale epoch" in err.value.details()


def test_a_rebuild_read_makes_the_server_adopt_its_epoch_first_or_is_refused():
    # A replacement's rebuild reads (ReadRows) carry its newer epoch. The server must hold it before reading,
    # so that no stage planned on the older map applies after the read (ShardStore._admit).
    ctx = make_ctx(servers__replicas=3)
    store, view = ShardStore(ctx, 1), ClusterView()
    servicer = ParameterServicer(store, Metrics("t", "server", "1"), view, epoch=5)
    server, port = start_grpc(servicer, "127.0.0.1:0", 4)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ParameterServerStub(channel)
    read = pb.ReadRowsRequest(epoch=7, kind=pb.DATA, index=ids_to_bytes(torch.arange(3)))
    with pytest.raises(grpc.RpcError) as err:  # the coordinator's map does not say 7 (no coordinator here)
        stub.ReadRows(read)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "ahead" in err.value.details()
    assert store.epoch == 5
    # It asked the map again before refusing; made-up epochs cannot hold every handler thread: past a few
    # waits at once, refused without asking again.
    asked = []
    confirm = view.confirm
    view.confirm = lambda e: asked.append(e) or confirm(e)
    with pytest.raises(grpc.RpcError):
        stub.ReadRows(read)
    assert len(asked) >= 2
    held = [servicer._adopting.acquire(blocking=False) for _ in range(ADOPTING_AT_ONCE)]
    asked.clear()
    with pytest.raises(grpc.RpcError):
        stub.ReadRows(read)
    assert all(held) and asked == [7]
    for _ in held:
        servicer._adopting.release()
    view.confirm = confirm
    view.update({"epoch": 7, "shards": []})  # the map says it now
    stub.ReadRows(read)
    assert store.epoch == 7
    with pytest.raises(grpc.RpcError) as err:  # a stage planned on the older map is refused from now on
        stub.Pull(pb.PullRequest(epoch=6, ids=ids_to_bytes(owned_ids(ctx, 1, 2))))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    channel.close()
    server.stop(None)


def test_read_records_pages_cover_the_table(served):
    ctx, store, stub = served
    first = stub.ReadRecords(pb.ReadRecordsRequest(kind=pb.DATA, start=0, count=7))
    rest = stub.ReadRecords(pb.ReadRecordsRequest(kind=pb.DATA, start=7, count=0))
    assert first.count == 7 and first.count + rest.count == store.num_rows
    recs = torch.frombuffer(first.records + rest.records, dtype=torch.float32).view(-1, first.width)
    assert torch.equal(recs, store.data)


def test_store_counters_are_exposed_in_prometheus_format(served):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from ecrec.server import StoreCollector

    ctx, store, stub = served
    m = Metrics("t", "server", "1")
    m.registry.register(StoreCollector(store, m.labels))
    store.stats["buffered"] = 3
    text = generate_latest(m.registry).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = [s for s in fams["ecrec_server_buffered_updates"].samples if s.name.endswith("_total")]
    assert sample.value == 3 and sample.labels == {"ecrec_job": "t", "role": "server", "shard": "1"}
    assert fams["ecrec_server_staged"].samples[0].value == 0


def ecrec_cluster():
    """Five ECRec servers over gRPC: (ctx, stores, servers, the map's shards)."""
    ctx = make_ctx(servers__replicas=5, faultTolerance__strategy="ecrec", faultTolerance__ecrec__k=4)
    stores, servers, shards = [], [], []
    for s in range(5):
        store = ShardStore(ctx, s)  # parity encoded at start from the initial records
        server, port = start_grpc(ParameterServicer(store, Metrics("t", "server", str(s))), "127.0.0.1:0", 4)
        stores.append(store)
        servers.append(server)
        shards.append({"shard": s, "address": f"127.0.0.1:{port}", "state": "up"})
    return ctx, stores, servers, shards


def test_a_server_s_reads_go_as_one_message_and_are_answered_in_order():
    from ecrec.core.stripes import Read
    from ecrec.server import GrpcPeers

    ctx, stores, servers, shards = ecrec_cluster()
    peers = GrpcPeers(ClusterView(snapshot={"epoch": 1, "shards": shards}), 0, Metrics("t", "server", "0"))
    sent = []
    call = peers._call
    peers._call = lambda server, method, *a, **k: (
        sent.append((server, method)) or call(server, method, *a, **k)
    )
    reads = [
        Read(2, "parity", torch.tensor([3, 1])),
        Read(3, "data", torch.arange(5, 9)),
        Read(2, "data", torch.tensor([7, 0, 4])),
        Read(2, "data", torch.arange(2, 6)),  # a range: served as a slice
    ]
    try:
        got = peers.read_rows(reads, 1)
        assert sorted(sent) == [(2, "ReadMany"), (3, "ReadRows")]
        for r, res in zip(reads, got, strict=True):
            want = stores[r.server].read_rows(r.kind, r.index)
            assert torch.equal(res.records, want.records) and torch.equal(res.versions, want.versions)
            assert (res.ready is None) == (r.kind == "data")
    finally:
        for server in servers:
            server.stop(None)


def test_parity_check_over_grpc_catches_a_corrupted_parity_record():
    from ecrec.client import PSClient
    from ecrec.modelread import parity_check

    ctx, stores, servers, shards = ecrec_cluster()
    client = PSClient(ctx, {"epoch": 1, "shards": shards})
    try:
        clean = parity_check(client)
        assert clean["stripes"] > 0 and clean["mismatches"] == 0 and clean["in_flight"] == 0
        stores[2].parity.parity[7, 3] += 1.0  # one flipped value in one record
        assert parity_check(client)["mismatches"] == 1
    finally:
        client.close()
        for server in servers:
            server.stop(None)


@pytest.mark.parametrize(
    "case",
    ["owned", "negative", "past the end", "not owned", "repeated", "repeated and not owned", "empty"],
)
def test_row_ids_are_checked_the_same_in_numpy_as_in_torch(case):
    """`local_rows` checks int64 CPU ids in numpy (the hot path of every pull, push and stage) and anything
    else with torch ops: the same local rows, or the same error, for every kind of request."""
    ctx = make_ctx(servers__replicas=3)
    store = ShardStore(ctx, 1)
    n, rows = ctx.num_servers, ctx.placement.num_rows
    g = owned_ids(ctx, 1, 8)
    g = {
        "owned": g,
        "negative": torch.cat([g, torch.tensor([-2])]),
        "past the end": torch.cat([g, torch.tensor([rows + n - 2])]),
        "not owned": torch.cat([g, torch.tensor([2])]),
        "repeated": torch.cat([g, g[:1]]),
        "repeated and not owned": torch.cat([g, g[:1], torch.tensor([0])]),
        "empty": g[:0],
    }[case]

    def answer(ids):
        try:
            return store.local_rows(ids).to(torch.int64).tolist()
        except Exception as e:  # noqa: BLE001 - the error is the answer compared
            return f"{type(e).__name__}: {e}"

    fast, slow = answer(g), answer(g.to(torch.int32))  # int32 ids take the torch path
    assert fast == slow
    assert isinstance(fast, list) == (case in ("owned", "empty"))
