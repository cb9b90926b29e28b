"""Stray requests — stale, replayed, misrouted or malformed — are refused and change nothing.

Servers are real gRPC servers on loopback around in-process stores; the coordinator is its FastAPI app. The
end-to-end half (tests/test_stray_jobs.py) sends the same kinds of requests to live jobs.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from fastapi.testclient import TestClient

from ecrec.coordinator.app import create_app
from ecrec.coordinator.service import Coordinator
from ecrec.core.txn import DeltaBatch
from ecrec.metrics import Metrics
from ecrec.proto import ecrec_pb2 as pb
from ecrec.proto import ecrec_pb2_grpc as pb_grpc
from ecrec.server import ClusterView, ParameterServicer, start_grpc
from ecrec.store import MAX_WAITING, ShardStore
from ecrec.wire import InvalidRequest, floats_to_bytes, ids_to_bytes
from tests.conftest import make_ctx

N = 5


def ecrec_ctx(**extra):
    return make_ctx(
        servers__replicas=N, faultTolerance__strategy="ecrec", faultTolerance__ecrec__k=4, **extra
    )


def snapshot(epoch: int, states: dict[int, str] | None = None, instances: dict[int, str] | None = None):
    states, instances = states or {}, instances or {}
    return {
        "epoch": epoch,
        "shards": [
            {
                "shard": s,
                "state": states.get(s, "up"),
                "address": "",
                "incarnation": 1,
                "instance": instances.get(s, f"i{s}"),
            }
            for s in range(N)
        ],
    }


class Served:
    """One server (shard `shard`) of a 5-server ECRec job, served over gRPC; the other shards are not running."""

    def __init__(
        self, shard: int = 1, epoch: int = 3, replacement: bool = False, states=None, commit: str = "rowLocks"
    ):
        # rowLocks by default: most tests here send the two-phase commit's messages
        self.ctx = ecrec_ctx(faultTolerance__ecrec__commit=commit)
        self.store = ShardStore(self.ctx, shard, replacement=replacement, wait_timeout=5.0)
        view = ClusterView(snapshot=snapshot(epoch, states, {shard: "me"}))
        self.servicer = ParameterServicer(
            self.store, Metrics("t", "server", str(shard)), view, epoch=epoch, instance="me"
        )
        self.server, port = start_grpc(self.servicer, "127.0.0.1:0", threads=32)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ParameterServerStub(self.channel)
        self.shard, self.epoch = shard, epoch

    def ids(self, n: int = 4) -> torch.Tensor:
        return self.ctx.placement.global_id(self.shard, torch.arange(n))

    def close(self) -> None:
        self.channel.close()
        self.server.stop(None)


@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


def refused(call, code: grpc.StatusCode, needle: str = "") -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    assert needle in err.value.details()
    return err.value.details()


def state_of(store: ShardStore) -> tuple:
    return (
        store.data.clone(),
        store.rows.versions.clone(),
        store.parity.parity.clone(),
        store.parity.pver.clone(),
        {c: d.clone() for c, d in store.dense.records.items()},
        dict(store.outcomes),
        dict(store.parity.resolved),
        store.staged_count(),
        store.epoch,
    )


def assert_same(a: tuple, b: tuple) -> None:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(
                x.view(torch.int32) if x.is_floating_point() else x,
                y.view(torch.int32) if y.is_floating_point() else y,
            )
        elif isinstance(x, dict) and x and isinstance(next(iter(x.values())), torch.Tensor):
            assert all(torch.equal(x[k], y[k]) for k in x)
        else:
            assert x == y


# -- epochs -------------------------------------------------------------------------------------------------
def test_an_epoch_ahead_of_the_coordinator_is_refused_and_never_stored(served):
    before = state_of(served.store)
    refused(
        lambda: served.stub.Pull(pb.PullRequest(epoch=2**40, dense_chunks=[served.shard])),
        grpc.StatusCode.FAILED_PRECONDITION,
        "ahead of the coordinator",
    )
    assert served.store.epoch == served.epoch
    assert_same(state_of(served.store), before)
    # Workers on the published map are still served.
    served.stub.Pull(
        pb.PullRequest(epoch=served.epoch, ids=ids_to_bytes(served.ids()), dense_chunks=[served.shard])
    )


def test_commits_and_decisions_naming_an_unpublished_epoch_are_served_and_the_epoch_not_stored(served):
    """Messages that do not depend on the map (check_epoch=False) are not refused for an epoch this server
    cannot confirm yet: a worker may legitimately be ahead of it for up to the view's fetch interval."""
    me, other = served.shard, (served.shard + 1) % N
    before = state_of(served.store)
    commit = served.stub.Commit(pb.TxnRequest(epoch=2**40, txn=f"w0-1/{me}.-1.0"))
    decision = pb.DeltaDecision(txn=f"w0-1/{other}.-1.0", src=other, commit=True)
    decided = served.stub.DecideMany(pb.DecisionsRequest(epoch=2**40, decisions=[decision]))
    assert commit.outcome == "unknown" and list(decided.outcomes) == ["unknown"]  # never staged: no trace
    assert served.store.epoch == served.epoch
    assert_same(state_of(served.store), before)


def test_a_newer_epoch_is_adopted_once_the_coordinator_publishes_it():
    ctx = ecrec_ctx()
    coord = Coordinator(ctx.job, probe=lambda a, i: False)
    api = TestClient(create_app(coord))
    for s in range(N):
        api.post("/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    view = ClusterView("http://coordinator")
    view.coordinator.http = api  # the coordinator's real app, in process
    servicer = ParameterServicer(ShardStore(ctx, 0), Metrics("t", "server", "0"), view, epoch=1)
    with pytest.raises(Exception, match="ahead"):
        servicer.observe_epoch(2, check=True)
    assert servicer.store.epoch == 1
    api.post("/v1/failures", json={"shard": 3})  # probe says dead: the coordinator publishes epoch 2
    time.sleep(0.06)  # the view asks the coordinator at most every 50 ms
    servicer.observe_epoch(2, check=True)
    assert servicer.store.epoch == 2 and view.is_failed(3)


# -- 2PC messages for txns the server never staged ------------------------------------------------------------
@pytest.mark.parametrize("method", ["Commit", "Abort", "Outcome"])
def test_txn_messages_are_checked_and_unknown_txns_change_nothing(served, method):
    call = getattr(served.stub, method)
    before = state_of(served.store)
    for junk in ["", "junk", "w0-1/2.-1.0", "w0-1/1.3", "x" * 500]:  # malformed, or a part of another server
        refused(lambda junk=junk: call(pb.TxnRequest(txn=junk)), grpc.StatusCode.INVALID_ARGUMENT, "txn")
    assert call(pb.TxnRequest(txn="w0-77/1.-1.0")).outcome == "unknown"
    assert_same(state_of(served.store), before)


def test_a_stray_abort_does_not_doom_the_part_it_names(served):
    """Before: an abort of a txn not yet staged was remembered, and the real stage was then refused."""
    txn = "w0-5/1.-1.0"
    assert served.stub.Abort(pb.TxnRequest(txn=txn)).outcome == "unknown"
    g = served.ids(3)
    resp = served.stub.Stage(
        pb.StageRequest(
            epoch=served.epoch,
            txn=txn,
            ids=ids_to_bytes(g),
            grads=floats_to_bytes(torch.ones(3, served.ctx.dim)),
            src=-1,
        )
    )
    assert resp.staged == 3
    assert served.stub.Commit(pb.TxnRequest(txn=txn)).outcome == "committed"


def test_decisions_for_deltas_never_staged_leave_no_trace(served):
    before = state_of(served.store)
    out = served.stub.DecideMany(
        pb.DecisionsRequest(
            decisions=[
                pb.DeltaDecision(txn="w0-9/2.-1.0", src=2, commit=True),
                pb.DeltaDecision(txn="w0-9/3.-1.0", src=3, commit=False),
            ]
        )
    )
    assert list(out.outcomes) == ["unknown", "unknown"]
    assert_same(state_of(served.store), before)
    for bad in [
        pb.DeltaDecision(txn="w0-9/2.-1.0", src=7),  # no such shard
        pb.DeltaDecision(txn="w0-9/2.-1.0", src=1),  # this server itself
        pb.DeltaDecision(txn="w0-9/3.-1.0", src=2),  # the txn is a part of another data server
        pb.DeltaDecision(txn="nonsense", src=2),
    ]:
        refused(
            lambda bad=bad: served.stub.DecideMany(pb.DecisionsRequest(decisions=[bad])),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
    assert_same(state_of(served.store), before)


def parity_one_members(ctx) -> tuple[int, int, int]:
    """(src, slot, wrong): the member at slot 0 of the stripe whose parity shard 1 holds at index 0, and a
    shard that is no member of it."""
    shards, _locs, _present = ctx.placement.stripe_members(1, torch.tensor([0]))
    src = int(shards[0, 0])
    return src, 0, next(s for s in range(N) if s != 1 and s != src)


def malformed(batch, src: int, slot: int, wrong: int) -> list[tuple[object, str]]:
    """Delta batches a parity server must refuse, each with a word of the reason it gives."""
    return [
        (batch(wrong, slot), "not parity records"),
        (batch(src, slot, index=10**6), "out of range"),
        (batch(src, 7), "slot"),
        (batch(src, slot, version=0), "version"),
    ]


def delta_request(ctx, src: int, slot: int, index: int = 0, version: int = 1, fill: float = 0.0):
    """One row's delta of shard src for parity server 1."""
    return pb.DeltaRequest(
        txn=f"w0-1/{src}.-1.0",
        src=src,
        index=ids_to_bytes(torch.tensor([index])),
        slot=ids_to_bytes(torch.tensor([slot])),
        delta=floats_to_bytes(torch.full((1, ctx.record_width), fill)),
        version=ids_to_bytes(torch.tensor([version])),
        parity_server=1,
    )


def test_deltas_only_from_shards_whose_parity_this_server_holds(served):
    src, slot, wrong = parity_one_members(served.ctx)

    def batch(src_, slot_, index=0, version=1):
        return delta_request(served.ctx, src_, slot_, index, version)

    before = state_of(served.store)
    for b, needle in malformed(batch, src, slot, wrong):
        refused(
            lambda b=b: served.stub.StageDeltas(pb.StageDeltasRequest(epoch=served.epoch, batches=[b])),
            grpc.StatusCode.INVALID_ARGUMENT,
            needle,
        )
    assert_same(state_of(served.store), before)
    served.stub.StageDeltas(pb.StageDeltasRequest(epoch=served.epoch, batches=[batch(src, slot)]))
    assert served.store.staged_count() == 1
    # Without 2PC there is no Delta message in a 2PC job, and no Push.
    refused(lambda: served.stub.Delta(batch(src, slot)), grpc.StatusCode.FAILED_PRECONDITION)
    refused(
        lambda: served.stub.Push(
            pb.PushRequest(
                ids=ids_to_bytes(served.ids(1)), grads=floats_to_bytes(torch.ones(1, served.ctx.dim))
            )
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
    )


def test_delta_log_refuses_malformed_deliveries_and_the_other_commits_messages():
    s = Served(commit="deltaLog")
    try:
        src, slot, wrong = parity_one_members(s.ctx)

        def batch(src_, slot_, index=0, version=1):  # ones: applied, the parity record changes
            return delta_request(s.ctx, src_, slot_, index, version, fill=1.0)

        def deliver(*batches, delivered=()):
            return s.stub.DeliverDeltas(
                pb.StageDeltasRequest(epoch=s.epoch, batches=list(batches), delivered=list(delivered))
            )

        before = state_of(s.store)
        for b, needle in malformed(batch, src, slot, wrong):
            # one bad batch refuses the whole message: the good one beside it is not applied either
            refused(lambda b=b: deliver(batch(src, slot), b), grpc.StatusCode.INVALID_ARGUMENT, needle)
        refused(lambda: deliver(delivered=[f"w0-1/{wrong}.-1.0"]), grpc.StatusCode.INVALID_ARGUMENT, "txn")
        refused(
            lambda: s.stub.StageDeltas(pb.StageDeltasRequest(epoch=s.epoch, batches=[batch(src, slot)])),
            grpc.StatusCode.FAILED_PRECONDITION,
            "DeliverDeltas",
        )
        g = ids_to_bytes(s.ids(1))
        decision = pb.DeltaDecision(txn=f"w0-1/{src}.-1.0", src=src, commit=True)
        stage = pb.StageRequest(
            epoch=s.epoch, txn="w0-1/1.-1.0", ids=g, grads=floats_to_bytes(torch.ones(1, s.ctx.dim)), src=-1
        )
        stage.decisions.append(decision)
        refused(lambda: s.stub.Stage(stage), grpc.StatusCode.INVALID_ARGUMENT, "decisions")
        assert_same(state_of(s.store), before)
        # A well-formed delivery is applied at once (nothing waits for a decision), and only once.
        for _ in range(2):
            assert list(deliver(batch(src, slot)).refused) == []
        assert int(s.store.parity.pver[0, slot]) == 1
        assert not torch.equal(s.store.parity.parity[0], before[2][0]) and s.store.staged_count() == 0
    finally:
        s.close()


def test_deltas_riding_on_a_stage_are_checked_with_it_and_refused_whole():
    s = Served(commit="deltaLog")
    try:
        src, slot, wrong = parity_one_members(s.ctx)

        def batch(src_, slot_, index=0, version=1):
            return delta_request(s.ctx, src_, slot_, index, version, fill=1.0)

        g = ids_to_bytes(s.ids(1))

        def stage(carried=(), ask=()):
            return s.stub.Stage(
                pb.StageRequest(
                    epoch=s.epoch,
                    txn="w0-2/1.-1.0",
                    ids=g,
                    grads=floats_to_bytes(torch.ones(1, s.ctx.dim)),
                    src=-1,
                    carried=list(carried),
                    ask=list(ask),
                )
            )

        before = state_of(s.store)
        for b, needle in malformed(batch, src, slot, wrong):
            # one bad riding batch refuses the stage: neither the good batch nor the stage's rows are applied
            refused(lambda b=b: stage([batch(src, slot), b]), grpc.StatusCode.INVALID_ARGUMENT, needle)
        refused(
            lambda: stage(ask=[pb.PartRef(txn=f"w0-1/{wrong}.-1.0", src=src)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "txn",
        )
        refused(
            lambda: s.stub.DeliverDeltas(
                pb.StageDeltasRequest(epoch=s.epoch, ask=[pb.PartRef(txn=f"w0-1/{src}.-1.0", src=src)])
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "early",
        )
        assert_same(state_of(s.store), before)
        # Well formed: the riding batch is applied before the stage, and answered at once.
        resp = stage([batch(src, slot)], ask=[pb.PartRef(txn=f"w0-1/{src}.-1.0", src=src)])
        assert resp.staged == 1 and list(resp.refused) == [] and list(resp.held) == []
        assert int(s.store.parity.pver[0, slot]) == 1
    finally:
        s.close()


def test_out_of_range_shards_and_chunks_are_invalid_argument_not_unknown(served):
    g = ids_to_bytes(served.ids(2))
    for call in [
        lambda: served.stub.DegradedPull(pb.DegradedPullRequest(epoch=served.epoch, src=99, ids=g)),
        lambda: served.stub.DegradedPull(pb.DegradedPullRequest(epoch=served.epoch, src=-4, ids=g)),
        lambda: served.stub.ReadRows(
            pb.ReadRowsRequest(kind=pb.PARITY, index=ids_to_bytes(torch.tensor([0])), src=42)
        ),
        lambda: served.stub.ReadRows(
            pb.ReadRowsRequest(
                kind=pb.PARITY, index=ids_to_bytes(torch.tensor([0])), as_of=ids_to_bytes(torch.tensor([0]))
            )
        ),
        lambda: served.stub.ReadRows(  # a version for each row, not fewer
            pb.ReadRowsRequest(
                kind=pb.DATA, index=ids_to_bytes(torch.tensor([0, 1])), as_of=ids_to_bytes(torch.tensor([0]))
            )
        ),
        lambda: served.stub.ReadRows(
            pb.ReadRowsRequest(kind=pb.DATA, index=ids_to_bytes(torch.tensor([0])), as_of=b"\x01")
        ),
        lambda: served.stub.ReadMany(  # one bad read refuses them all
            pb.ReadManyRequest(
                reads=[
                    pb.ReadRowsRequest(kind=pb.DATA, index=ids_to_bytes(torch.tensor([0]))),
                    pb.ReadRowsRequest(kind=pb.PARITY, index=ids_to_bytes(torch.tensor([0])), src=42),
                ]
            )
        ),
        lambda: served.stub.Pull(pb.PullRequest(epoch=served.epoch, ids=g, dense_chunks=[0], warm=True)),
        lambda: served.stub.CopyDense(pb.CopyDenseRequest(chunk=2**31)),
        lambda: served.stub.Stage(pb.StageRequest(epoch=served.epoch, txn="w0-1/1.9.0", ids=g, src=9)),
        lambda: served.stub.ReadRecords(pb.ReadRecordsRequest(kind=7)),
    ]:
        refused(call, grpc.StatusCode.INVALID_ARGUMENT)
    # DegradedPull for a shard that is not failed: the map says no.
    p = served.ctx.placement
    local = torch.arange(p.rows_on(2))
    mine = local[p.parity_of(2, local)[0] == served.shard][:3]
    g2 = ids_to_bytes(p.global_id(2, mine))
    refused(
        lambda: served.stub.DegradedPull(pb.DegradedPullRequest(epoch=served.epoch, src=2, ids=g2)),
        grpc.StatusCode.FAILED_PRECONDITION,
    )


def test_an_unexpected_error_is_internal_and_the_server_keeps_serving(served, monkeypatch):
    def boom(*_a, **_k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(served.store, "pull", boom)
    for _ in range(3):
        refused(
            lambda: served.stub.Pull(pb.PullRequest(ids=ids_to_bytes(served.ids()))),
            grpc.StatusCode.INTERNAL,
            "ZeroDivisionError",
        )
    monkeypatch.undo()
    served.stub.Pull(pb.PullRequest(ids=ids_to_bytes(served.ids())))


# -- recovery ---------------------------------------------------------------------------------------------
def test_recover_only_on_a_replacement_under_recovery_and_inside_its_table():
    healthy = Served(shard=2)
    try:
        refused(
            lambda: healthy.stub.Recover(pb.RecoverRequest(epoch=3, kind=pb.DATA, start=0, count=10)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "not a replacement under recovery",
        )
    finally:
        healthy.close()
    # A replacement the map does not (yet) show as recovering: refused as well.
    early = Served(shard=2, replacement=True)
    try:
        refused(
            lambda: early.stub.Recover(pb.RecoverRequest(epoch=3, kind=pb.DATA, start=0, count=10)),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
    finally:
        early.close()
    rep = Served(shard=2, replacement=True, states={2: "recovering"})
    try:
        rows = rep.store.num_rows
        for start, count in [(rows, 1), (0, rows + 1), (5, 0), (2**40, 3)]:
            refused(
                lambda s=start, c=count: rep.stub.Recover(
                    pb.RecoverRequest(epoch=3, kind=pb.DATA, start=s, count=c)
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "start/count",
            )
        refused(
            lambda: rep.stub.Recover(pb.RecoverRequest(epoch=3, kind=9)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "kind",
        )
        assert not bool(rep.store.row_ready.any())  # nothing was touched
    finally:
        rep.close()


# -- bounded harm ----------------------------------------------------------------------------------------------
def test_waiting_requests_honour_their_deadline_and_hold_a_bounded_share_of_threads(served):
    g = served.ids(4)
    dim = served.ctx.dim
    served.stub.Stage(
        pb.StageRequest(
            epoch=served.epoch,
            txn="w0-1/1.-1.0",
            ids=ids_to_bytes(g),
            grads=floats_to_bytes(torch.ones(4, dim)),
            src=-1,
        )
    )
    local = served.ctx.placement.local_row(g)
    # A rebuild's read of staged rows waits until they are decided; 40 such reads at once, 1 s deadline each.
    answers: list[grpc.StatusCode] = []

    def wait_read():
        try:
            served.stub.ReadRows(
                pb.ReadRowsRequest(kind=pb.DATA, index=ids_to_bytes(local), src=3), timeout=1.0
            )
            answers.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            answers.append(e.code())

    threads = [threading.Thread(target=wait_read) for _ in range(40)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert 0 < served.store.waiting <= MAX_WAITING
    # Meanwhile a worker's pull of other rows is answered at once.
    t0 = time.monotonic()
    served.stub.Pull(
        pb.PullRequest(
            epoch=served.epoch, ids=ids_to_bytes(served.ctx.placement.global_id(1, torch.arange(10, 20)))
        ),
        timeout=2.0,
    )
    assert time.monotonic() - t0 < 0.5
    for t in threads:
        t.join(timeout=10)
    assert set(answers) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}, answers
    assert grpc.StatusCode.ABORTED in answers  # more than MAX_WAITING: the rest were told busy at once
    time.sleep(0.3)  # the waits end with their callers' deadlines
    assert served.store.waiting == 0


# -- the coordinator ---------------------------------------------------------------------------------------
@pytest.fixture
def coordinator():
    alive = {f"h:{s}" for s in range(N)}
    coord = Coordinator(ecrec_ctx(workers__replicas=2).job, probe=lambda addr, inst: addr in alive)
    api = TestClient(create_app(coord))
    for s in range(N):
        assert (
            api.post(
                "/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"}
            ).status_code
            == 200
        )
    for w in range(2):
        api.post("/v1/workers/register", json={"rank": w, "instance": f"w{w}"})
    return coord, api, alive


def test_a_second_registration_for_a_live_shard_is_refused(coordinator):
    coord, api, alive = coordinator
    before = api.get("/v1/cluster").json()
    r = api.post(
        "/v1/servers/register",
        json={"shard": 2, "address": "127.0.0.1:1", "instance": "x", "replacement": True},
    )
    assert r.status_code == 409 and "answering" in r.json()["detail"]
    r = api.post("/v1/servers/heartbeat", json={"shard": 2, "address": "127.0.0.1:1", "instance": "x"})
    assert r.json()["ok"] is False
    assert api.get("/v1/cluster").json() == before
    # A first process may not claim to be a replacement, and a new process must be one.
    r = api.post("/v1/servers/register", json={"shard": 2, "address": "h:9", "instance": "y"})
    assert r.status_code == 409 and "replacement" in r.json()["detail"]
    # Once the registered process stops answering, the same request is the real replacement path.
    alive.discard("h:2")
    r = api.post(
        "/v1/servers/register", json={"shard": 2, "address": "h:7", "instance": "i2b", "replacement": True}
    )
    assert r.status_code == 200
    info = api.get("/v1/cluster").json()["shards"][2]
    assert info["state"] == "recovering" and info["incarnation"] == 2 and info["address"] == "h:7"
    # The same process registering again (a lost answer) changes nothing; the superseded one is refused.
    epoch = api.get("/v1/cluster").json()["epoch"]
    assert (
        api.post(
            "/v1/servers/register",
            json={"shard": 2, "address": "h:7", "instance": "i2b", "replacement": True},
        ).status_code
        == 200
    )
    assert api.get("/v1/cluster").json()["epoch"] == epoch
    r = api.post(
        "/v1/servers/register", json={"shard": 2, "address": "h:2", "instance": "i2", "replacement": True}
    )
    assert r.status_code == 409 and "superseded" in r.json()["detail"]


def test_recoveries_only_for_a_registered_replacement(coordinator):
    coord, api, alive = coordinator
    r = api.post("/v1/recoveries", json={"shard": 1})
    assert r.status_code == 409 and "it is up" in r.json()["detail"]
    assert api.get("/v1/recoveries").json() == []
    alive.discard("h:1")
    api.post("/v1/failures", json={"shard": 1})
    r = api.post("/v1/recoveries", json={"shard": 1})
    assert r.status_code == 409 and "no replacement" in r.json()["detail"]
    assert api.post("/v1/recoveries", json={"shard": 11}).status_code == 400


def test_progress_and_loss_reports_only_from_the_registered_worker(coordinator):
    coord, api, _ = coordinator
    ok = {"rank": 0, "instance": "w0", "step": 3, "samples": 192}
    assert api.post("/v1/workers/progress", json=ok).status_code == 200
    assert api.post("/v1/workers/progress", json={**ok, "instance": "w9", "done": True}).status_code == 409
    assert api.post("/v1/workers/progress", json={**ok, "step": 1, "samples": 64}).status_code == 409
    assert api.post("/v1/workers/register", json={"rank": 0, "instance": "other"}).status_code == 409
    assert api.post("/v1/workers/lost", json={"rank": 1, "instance": "nope"}).status_code == 409
    assert (
        api.post("/v1/workers/progress", json={**ok, "step": 4, "samples": 256, "loss": None}).status_code
        == 200
    )
    assert api.post("/v1/events", json={"kind": "bogus"}).status_code == 400
    status = api.get("/v1/status").json()
    assert status["phase"] == "Running" and not any(w["done"] for w in status["workers"])


def test_more_than_r_servers_lost_fails_the_job_at_once_naming_them(coordinator):
    coord, api, alive = coordinator
    alive.difference_update({"h:1", "h:2"})
    api.post("/v1/failures", json={"shard": 1})
    coord.tick()
    assert api.get("/v1/status").json()["phase"] == "Degraded"
    api.post("/v1/failures", json={"shard": 2})
    coord.tick()
    status = api.get("/v1/status").json()
    assert status["phase"] == "Failed"
    assert "shards 1 (failed), 2 (failed)" in status["reason"] and "stripes lost" in status["reason"]


def test_a_shard_not_recovered_in_time_and_a_stalled_job_fail_with_the_reason():
    now = [1000.0]
    ctx = ecrec_ctx(coordinator__recoveryTimeoutSeconds=30, coordinator__progressTimeoutSeconds=20)
    coord = Coordinator(ctx.job, clock=lambda: now[0], probe=lambda a, i: False)
    api = TestClient(create_app(coord))
    for s in range(N):
        api.post("/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    api.post("/v1/workers/register", json={"rank": 0, "instance": "w0"})
    api.post("/v1/failures", json={"shard": 4})
    for t in (10, 20, 29):
        now[0] = 1000.0 + t
        api.post("/v1/workers/progress", json={"rank": 0, "instance": "w0", "step": t, "samples": t})
        for s in range(N - 1):
            api.post("/v1/servers/heartbeat", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
        coord.tick()
    assert api.get("/v1/status").json()["phase"] == "Degraded"
    now[0] = 1031.0
    for s in range(N - 1):
        api.post("/v1/servers/heartbeat", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    coord.tick()
    status = api.get("/v1/status").json()
    assert status["phase"] == "Failed" and "shard 4 not recovered within 30s" in status["reason"]

    coord = Coordinator(ctx.job, clock=lambda: now[0], probe=lambda a, i: True)
    api = TestClient(create_app(coord))
    for s in range(N):
        api.post("/v1/servers/register", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    api.post("/v1/workers/register", json={"rank": 0, "instance": "w0"})
    now[0] += 36.0
    for s in range(N):  # the servers are fine; the worker never completes a step
        api.post("/v1/servers/heartbeat", json={"shard": s, "address": f"h:{s}", "instance": f"i{s}"})
    coord.tick()
    status = api.get("/v1/status").json()
    assert status["phase"] == "Failed" and "no worker completed a step" in status["reason"]


def test_checkpoint_and_restore_are_refused_where_no_checkpoint_strategy_runs(served):
    before = state_of(served.store)
    refused(
        lambda: served.stub.Restore(pb.RestoreRequest(checkpoint=0)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "takes no checkpoints",
    )
    refused(
        lambda: served.stub.Checkpoint(pb.CheckpointRequest(checkpoint=1)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "takes no checkpoints",
    )
    assert_same(before, state_of(served.store))


def test_a_restore_of_a_checkpoint_that_was_never_committed_changes_nothing(tmp_path):
    ctx = make_ctx(
        servers__replicas=N,
        faultTolerance__strategy="checkpoint",
        faultTolerance__checkpoint__path=str(tmp_path),
    )
    store = ShardStore(ctx, 1, wait_timeout=5.0)
    servicer = ParameterServicer(
        store, Metrics("t", "server", "1"), ClusterView(snapshot=snapshot(3)), epoch=3
    )
    server, port = start_grpc(servicer, "127.0.0.1:0", threads=4)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            before = state_of(store)
            refused(
                lambda: stub.Restore(pb.RestoreRequest(checkpoint=7)),
                grpc.StatusCode.FAILED_PRECONDITION,
                "never completed",
            )
            refused(
                lambda: stub.Checkpoint(pb.CheckpointRequest(checkpoint=0)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "ids start at 1",
            )
            assert_same(before, state_of(store))
            # Its own shard file of a checkpoint, without a manifest, is no checkpoint either.
            assert stub.Checkpoint(pb.CheckpointRequest(checkpoint=7)).rows == store.num_rows
            refused(
                lambda: stub.Restore(pb.RestoreRequest(checkpoint=7)),
                grpc.StatusCode.FAILED_PRECONDITION,
                "never completed",
            )
            assert_same(before, state_of(store))
    finally:
        server.stop(None)


@pytest.mark.parametrize("servers,k", [(5, 4), (5, 2), (6, 3), (3, 2)])
def test_the_delta_placement_check_agrees_with_stripe_members_row_by_row(servers, k):
    """ShardStore.check_deltas checks a batch's source, slots and indices in closed form; placement's
    stripe_members is the definition. Every (source, slot, index) near both ends of the parity space —
    padding rows included — is accepted exactly when stripe_members says that member is a real row of the
    source."""
    ctx = make_ctx(servers__replicas=servers, faultTolerance__strategy="ecrec", faultTolerance__ecrec__k=k)
    p, w = ctx.placement, ctx.record_width
    for shard in range(servers):
        store = ShardStore(ctx, shard)
        n_par = store.parity.parity.shape[0]
        indices = sorted({0, 1, n_par // 2, n_par - 2, n_par - 1} & set(range(n_par)))
        shards, _locs, present = p.stripe_members(shard, torch.tensor(indices))
        for src in range(servers):
            if src == shard:
                continue
            for slot in range(k):
                for row, index in enumerate(indices):
                    b = DeltaBatch(
                        shard, "w0-1/0.-1.0", src, torch.tensor([index]), torch.tensor([slot]),
                        torch.zeros(1, w), torch.tensor([1]),
                    )  # fmt: skip
                    valid = int(shards[row, slot]) == src and bool(present[row, slot])
                    try:
                        store.check_deltas(b)
                        accepted = True
                    except InvalidRequest:
                        accepted = False
                    assert accepted == valid, (shard, src, slot, index)
