"""The servers' part in `ecrec local --rebuild-error` (ecrec.rebuild_error): log every record they decode, or
capture the records of wanted rows at wanted versions, to files the launcher compares afterwards.

Servers take part only when the launcher sets the variables below; otherwise `Tap.from_env` is None and
nothing is logged. The file format (`append_records`, `read_records`) is shared with the launcher's side.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

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
