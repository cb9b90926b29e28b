"""`ecrec local --rebuild-error`: how far the records decoded through a failure are from the truth.

Deterministic training is a pure function of the spec, and a row's version counts the commits applied to it,
so "row g at version v" is the same point of training in a run with a kill and in the same run without one.
The run with the kill logs every record its servers decode — at the acting home of a failed shard (degraded
reads and writes) and at a replacement (rebuilt rows) — with its global id and version. The launcher then runs
the job again without the kill; that run's servers capture the records of those rows when they reach those
versions, and the report compares the two, per part of the record (the embedding, each optimizer-state field).

With the xor code every error is 0 (decoding is exact and the run with the kill is the run without it). With
the sum code a record's error is the decode's rounding plus whatever the earlier decodes of the run changed
in training before it (the two runs part at the first decoded update): see docs/protocol.md, "The sum code".

Servers take part only when the launcher sets the variables below; otherwise `Tap.from_env` is None and
nothing is logged.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ecrec.core.optim import RowOptimizer
from ecrec.core.txn import DataParticipant

DECODE_LOG_ENV = "ECREC_DECODE_LOG"  # a directory: servers append every record they decode
CAPTURE_ENV = "ECREC_CAPTURE_ROWS"  # a file of (global id, version) pairs: servers capture those records
KINDS = ("degraded", "rebuilt")  # decoded at the acting home of a failed shard / by a replacement
_ID_BYTES = 16  # int64 global id + int64 version before each record
_NO_PAIRS = torch.empty(0, 2, dtype=torch.int64)


def append_records(path: Path, g: torch.Tensor, versions: torch.Tensor, records: torch.Tensor) -> None:
    """Append (global id, version, record) rows to a log file: int64, int64, float32[W], little-endian."""
    n = g.numel()
    if n == 0:
        return
    row = torch.cat(
        [
            g.to(torch.int64).reshape(n, 1).view(torch.uint8),
            versions.to(torch.int64).reshape(n, 1).view(torch.uint8),
            records.to(torch.float32).contiguous().view(torch.uint8),
        ],
        dim=1,
    )
    with open(path, "ab") as f:
        f.write(row.numpy().tobytes())


def read_records(paths: list[Path], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(global ids [n], versions [n], records [n, W]) of every row in these logs. A row cut short by a
    SIGKILL in the middle of a write is dropped."""
    size = _ID_BYTES + 4 * width
    chunks = []
    for path in paths:
        data = path.read_bytes()
        data = data[: len(data) - len(data) % size]
        if data:
            chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, size))
    rows = torch.cat(chunks) if chunks else torch.empty(0, size, dtype=torch.uint8)
    g = rows[:, :8].contiguous().view(torch.int64).reshape(-1)
    v = rows[:, 8:16].contiguous().view(torch.int64).reshape(-1)
    return g, v, rows[:, 16:].contiguous().view(torch.float32)


class Tap:
    """One server's part: log what it decodes (the run with the kill), or capture the records of wanted
    rows when a commit takes them to the wanted version (the reference run)."""

    def __init__(self, shard: int, rows: DataParticipant, log_dir: Path | None, want: Path | None):
        self.shard, self.rows = shard, rows
        self.log_dir, self.tag = log_dir, f"shard{shard}-pid{os.getpid()}"
        self.want = torch.empty(0, dtype=torch.int64)
        if want is not None:
            data = want.read_bytes()
            pairs = torch.frombuffer(bytearray(data), dtype=torch.int64).view(-1, 2) if data else _NO_PAIRS
            p = rows.placement
            mine = pairs[p.data_shard(pairs[:, 0]) == shard]
            self.want = torch.unique(_key(p.local_row(mine[:, 0]), mine[:, 1]))  # sorted
            self.captured = want.parent / f"reference-{self.tag}.bin"
            rows.on_commit = self._capture
            self._capture(torch.arange(rows.records.shape[0]))  # rows wanted as initialized (version 0)

    @classmethod
    def from_env(cls, shard: int, rows: DataParticipant) -> Tap | None:
        log_dir, want = os.environ.get(DECODE_LOG_ENV), os.environ.get(CAPTURE_ENV)
        if not log_dir and not want:
            return None
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        return cls(shard, rows, Path(log_dir) if log_dir else None, Path(want) if want else None)

    def decoded(self, src: int, local: torch.Tensor, versions: torch.Tensor, records: torch.Tensor) -> None:
        """Records of shard src's rows this server decoded (src == its own shard: a replacement's rebuild)."""
        if self.log_dir is None:
            return
        kind = "rebuilt" if src == self.shard else "degraded"
        g = self.rows.placement.global_id(src, local)
        append_records(self.log_dir / f"{kind}-{self.tag}.bin", g, versions, records)

    def _capture(self, rows: torch.Tensor) -> None:
        versions = self.rows.versions[rows]
        hit = torch.isin(_key(rows, versions), self.want)
        if bool(hit.any()):
            rows = rows[hit]
            g = self.rows.placement.global_id(self.shard, rows)
            append_records(self.captured, g, versions[hit], self.rows.records[rows])


def _key(local: torch.Tensor, versions: torch.Tensor) -> torch.Tensor:
    return local * (1 << 32) + versions


def compare(
    opt: RowOptimizer,
    dim: int,
    decoded: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    reference: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> dict:
    """Per kind of decode: how many records, and per record part the max and mean absolute error against
    the reference's record of the same row at the same version (float64, over every value of the part).

    `code_only` repeats it for the records decoded at the first version decoded of their row anywhere: the
    row was not trained since its shard failed, so (with one failure) its record was written before the two
    runs parted and the reference holds its exact value — their error is the code's alone. The others also
    carry how far training went apart after the first decoded value was used."""
    rg, rv, rrec = reference
    rkey, first = _unique_first(rg * (1 << 32) + rv)
    rrec = rrec[first]
    all_g = torch.cat([d[0] for d in decoded.values()])
    ids, inv = torch.unique(all_g, return_inverse=True)
    all_v = torch.cat([d[1] for d in decoded.values()])
    first_v = torch.full((ids.numel(),), 1 << 62, dtype=torch.int64).scatter_reduce_(0, inv, all_v, "amin")
    parts = opt.record_parts(dim)
    out: dict = {}
    for kind, (g, v, rec) in decoded.items():
        key = g * (1 << 32) + v
        pos = torch.searchsorted(rkey, key).clamp(max=max(rkey.numel() - 1, 0))
        found = rkey[pos] == key if rkey.numel() else torch.zeros(key.numel(), dtype=torch.bool)
        err = (rec[found].double() - rrec[pos[found]].double()).abs()
        at_failure = v[found] == first_v[torch.searchsorted(ids, g[found])]
        out[kind] = {
            "records": int(key.numel()),
            "rows": int(g.unique().numel()),
            "missing": int((~found).sum()),  # no reference record: a bug of the measurement
            "exact_records": int((err == 0).all(dim=1).sum()),
            "parts": _by_part(parts, err),
            "code_only": {"records": int(at_failure.sum()), "parts": _by_part(parts, err[at_failure])},
        }
    return out


def _by_part(parts: list[tuple[str, int, str]], err: torch.Tensor) -> dict:
    out = {}
    for (name, _w, _d), e in zip(parts, err.split([w for _n, w, _d in parts], dim=1), strict=True):
        out[name] = {
            "max_abs": float(e.max()) if e.numel() else 0.0,
            "mean_abs": float(e.mean()) if e.numel() else 0.0,
        }
    return out


def _unique_first(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique keys and, for each, the position of one row holding it."""
    uniq, inv = torch.unique(key, return_inverse=True)
    first = torch.empty(uniq.numel(), dtype=torch.int64).scatter_(0, inv, torch.arange(key.numel()))
    return uniq, first


def measure(ctx, work_dir: Path, *, progress: bool = False) -> dict:
    """After a run whose servers logged their decodes to work_dir/decoded: run the job again without
    faults, capture the reference records and compare (the report's `rebuild_error`)."""
    from ecrec.local import run_local

    width = ctx.record_width
    decoded = {
        kind: read_records(sorted((work_dir / "decoded").glob(f"{kind}-*.bin")), width) for kind in KINDS
    }
    g = torch.cat([d[0] for d in decoded.values()])
    v = torch.cat([d[1] for d in decoded.values()])
    if g.numel() == 0:  # nothing failed: nothing to compare, and no need to run the job again
        empty = (g, v, torch.empty(0, width))
        return {"reference": None, **compare(ctx.optimizer, ctx.dim, decoded, empty)}
    want = work_dir / "capture" / "want.bin"
    want.parent.mkdir(parents=True, exist_ok=True)
    for old in want.parent.glob("reference-*.bin"):
        old.unlink()
    want.write_bytes(torch.stack([g, v], dim=1).numpy().tobytes())
    ref = run_local(ctx, work_dir / "reference", progress=progress, env={CAPTURE_ENV: str(want)})
    reference = read_records(sorted(want.parent.glob("reference-*.bin")), width)
    return {
        "reference": {"params_sha256": ref["params_sha256"], "eval": ref["eval"]},
        **compare(ctx.optimizer, ctx.dim, decoded, reference),
    }
