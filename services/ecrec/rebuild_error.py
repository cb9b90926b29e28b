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

This module is the launcher's side (the rerun and the comparison); the servers' side, which logs and
captures the records, is `ecrec.rebuild_tap`, whose names it re-exports. It does not import the launcher:
`measure` gets the function that runs a job (`ecrec.local.run_local`) from its caller.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ecrec.core.optim import RowOptimizer
from ecrec.rebuild_tap import (
    CAPTURE_ENV,
    DECODE_LOG_ENV,
    KINDS,
    append_records,
    read_records,
)

__all__ = [
    "CAPTURE_ENV",
    "DECODE_LOG_ENV",
    "KINDS",
    "append_records",
    "compare",
    "measure",
    "read_records",
]


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


def measure(ctx, work_dir: Path, run_local: Callable[..., dict], *, progress: bool = False) -> dict:
    """After a run whose servers logged their decodes to work_dir/decoded: run the job again without
    faults (with `run_local`, ecrec.local's), capture the reference records and compare (the report's
    `rebuild_error`)."""

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
