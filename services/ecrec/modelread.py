"""Reads of the whole model on the parameter servers, over a `PSClient`: every record page by page, the
logical model's hash (`params_sha256`), the dense replicas compared, the 2PC state left staged, and the
parity check (invariant I1).

Used by the launchers' final checks (`ecrec local`, the operator), `ecrec parity-check`, benchmarks and
tests; workers never call these. They read committed state through the same calls and cluster map as the
data path (ecrec.client), one server at a time, and change nothing.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ecrec.client import PSClient
from ecrec.core.codes import make_code
from ecrec.core.ranges import members_by_slot
from ecrec.core.vec import as_range
from ecrec.proto import ecrec_pb2 as pb
from ecrec.wire import ids_to_bytes

READ_PAGE_ROWS = 1 << 18


def record_pages(client: PSClient, shard: int, kind: int, chunk: int = 0):
    """(first record, records [n, W]) of every page of one kind on one server (DATA, PARITY, or DENSE chunk
    `chunk`). Each page is a read-only view of its answer's bytes: the caller copies it where it goes."""
    start = 0
    while True:
        req = pb.ReadRecordsRequest(
            epoch=client.epoch, kind=kind, start=start, count=READ_PAGE_ROWS, chunk=chunk
        )
        resp = client.result(shard, "ReadRecords", client.call(shard, "ReadRecords", req))
        if resp.count:
            yield start, torch.frombuffer(resp.records, dtype=torch.float32).view(resp.count, resp.width)
        elif start == 0:  # nothing there: an empty page still says the records' width
            yield start, torch.empty(0, resp.width)
        start += resp.count
        if resp.count < READ_PAGE_ROWS:
            return


def read_records(client: PSClient, shard: int, kind: int, chunk: int = 0) -> torch.Tensor:
    """Every record of one kind on one server (DATA, PARITY, or DENSE chunk `chunk`), page by page."""
    return torch.cat([page for _start, page in record_pages(client, shard, kind, chunk)])


def all_row_records(client: PSClient, tables: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Every embedding row record in global row order: [G, W]. `tables`: each server's data records, read
    already (`data_tables`)."""
    ctx, p = client.ctx, client.ctx.placement
    n = ctx.num_servers
    per = -(-p.num_rows // n)
    full = torch.zeros(per * n, ctx.record_width, dtype=torch.float32)
    grid = full.view(per, n, ctx.record_width)
    for s in range(n):
        if tables is not None:
            grid[: tables[s].shape[0], s] = tables[s]
            continue
        for start, page in record_pages(client, s, pb.DATA):  # each page straight to its rows
            grid[start : start + page.shape[0], s] = page
    return full[: p.num_rows]


def all_dense_records(client: PSClient) -> torch.Tensor:
    """Dense-parameter records (param + optimizer state per scalar) in parameter order: [D, Wd]."""
    ctx = client.ctx
    return torch.cat(
        [read_records(client, client.dense_targets(c)[0], pb.DENSE, c) for c in range(ctx.num_servers)]
    )


def params_sha256(client: PSClient, tables: list[torch.Tensor] | None = None) -> str:
    """Hash of the whole logical model, independent of the number of servers and of placement. `tables`:
    each server's data records, read already."""
    h = hashlib.sha256()
    for t in (all_row_records(client, tables), all_dense_records(client)):
        h.update(t.contiguous().numpy().data)
    return h.hexdigest()


def dense_replica_mismatches(client: PSClient) -> int:
    """Dense chunks whose live replicas differ (0 in deterministic mode, where updates are ordered)."""
    bad = 0
    for c in range(client.ctx.num_servers):
        holders = client.dense_targets(c)
        if len(holders) >= 2:
            first, *rest = (read_records(client, h, pb.DENSE, c).view(torch.int32) for h in holders)
            bad += int(not all(torch.equal(first, other) for other in rest))
    return bad


def staged_counts(client: PSClient) -> list[int]:
    """Undecided 2PC state per server (0 everywhere once the job is quiet)."""
    return [
        int(client.stubs[s].Info(pb.InfoRequest(), timeout=client.timeout).staged)
        for s in range(client.ctx.num_servers)
    ]


def read_versions(client: PSClient, server: int, kind: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All records of one kind on a server with their versions (DATA: [n, 1]; PARITY: pver [n, k]), page by
    page (one in flight: a server busy copying pages must still answer its heartbeats), each a range the
    server copies as a slice, into one preallocated tensor."""
    k = 1 if kind == pb.DATA else client.ctx.placement.k
    recs = torch.empty(n, client.ctx.record_width)
    vers = torch.empty(n, k, dtype=torch.int64)
    for lo in range(0, n, READ_PAGE_ROWS):
        hi = min(n, lo + READ_PAGE_ROWS)
        req = pb.ReadRowsRequest(
            epoch=client.epoch, kind=kind, index=ids_to_bytes(torch.arange(lo, hi)), src=-1
        )
        resp = client.result(server, "ReadRows", client.call(server, "ReadRows", req))
        records, versions = resp.records, resp.versions  # (each access to a bytes field copies it)
        recs[lo:hi] = torch.frombuffer(records, dtype=torch.float32).view(hi - lo, -1)
        vers[lo:hi] = torch.frombuffer(versions, dtype=torch.int64).view(hi - lo, k)
    return recs, vers


def _each_server(servers, read) -> list:
    """read(server) for every server, side by side (a thread each; one page in flight per server)."""
    servers = list(servers)
    with ThreadPoolExecutor(len(servers), thread_name_prefix="modelread") as pool:
        return list(pool.map(read, servers))


def data_tables(client: PSClient) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every server's data records with their versions ([rows_on(s), W], [rows_on(s)]), the servers read side
    by side."""
    p = client.ctx.placement
    tables = _each_server(
        range(client.ctx.num_servers), lambda s: read_versions(client, s, pb.DATA, p.rows_on(s))
    )
    return [(recs, vers.view(-1)) for recs, vers in tables]


def parity_check(
    client: PSClient, rounds: int = 5, data: list[tuple[torch.Tensor, torch.Tensor]] | None = None
) -> dict:
    """Invariant I1: every parity record equals the encoding of its stripe's members, entries and optimizer
    state (bit-exact for xor). Works on a running job: a stripe whose member versions differ from those its
    parity reflects has a commit in flight and is checked again in the next round. `data`: the first round's
    `data_tables`, read already."""
    ctx, p = client.ctx, client.ctx.placement
    if any(client.failed(s) or client.states.get(s) == "recovering" for s in range(ctx.num_servers)):
        raise RuntimeError("parity check needs every server up (a shard is failed or recovering)")
    code = make_code(ctx.spec.fault_tolerance.ecrec.code, p.r, p.k)
    pending = {s: None for s in range(ctx.num_servers)}  # parity server -> parity indices still to check
    stripes = mismatches = 0
    for attempt in range(rounds):
        if data is None or attempt:
            data = data_tables(client)
        servers = list(pending)
        parities = _each_server(
            servers, lambda s: read_versions(client, s, pb.PARITY, p.r * p.parity_rows_on(s))
        )
        read = dict(zip(servers, parities, strict=True))
        for server in list(pending):
            parity, pver = read[server]
            index = pending[server] if pending[server] is not None else torch.arange(parity.shape[0])
            js, blocks = p.parity_slot(index)  # (r = 2: P's records, then Q's, of different stripes)
            expected = torch.empty(index.numel(), ctx.record_width)
            mvers = torch.empty(index.numel(), p.k, dtype=torch.int64)
            for j in js.unique().tolist():
                at = (js == j).nonzero().squeeze(1)
                members = _pick(members_by_slot(p, server, j, [recs for recs, _v in data]), blocks[at])
                mvers[at] = _pick(members_by_slot(p, server, j, [v for _r, v in data]), blocks[at]).T
                expected[at] = code.encode(members, j) if p.r == 2 else code.encode(members)
            settled = (mvers == _pick(pver, index, dim=0)).all(dim=1)
            got = _pick(parity, index, dim=0)
            if code.exact:
                ok = (expected.view(torch.int32) == got.view(torch.int32)).all(dim=1)
            else:
                ok = torch.isclose(expected, got, rtol=1e-4, atol=1e-5).all(dim=1)
            stripes += int(settled.sum())
            mismatches += int((settled & ~ok).sum())
            if bool(settled.all()):
                del pending[server]
            else:
                pending[server] = index[~settled]
        if not pending:
            break
        time.sleep(0.05)
    in_flight = sum(v.numel() for v in pending.values() if v is not None)
    client.metrics.of(client.metrics.parity_checks, result="ok").inc(stripes - mismatches)
    client.metrics.of(client.metrics.parity_checks, result="mismatch").inc(mismatches)
    return {"stripes": stripes, "mismatches": mismatches, "in_flight": in_flight}


def _pick(t: torch.Tensor, index: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """t's entries `index` along `dim`: a view where they are one range (the first round reads every
    stripe), else a gather."""
    span = as_range(index)
    if span is None:
        return t.index_select(dim, index)
    return t.narrow(dim, span[0], span[1] - span[0])
