"""`ecrec bench codes`: what the erasure codes cost on this CPU, the r = 1 xor code beside the r = 2 P + Q code.

Pure tensor work in one thread, no servers: encode (a stripe's parity records from its k data records), the
delta a data server sends after an update (for P + Q, Q's: the costlier, with each row at its own slot), and
decode (xor: one lost data record; P + Q: two, the case only it survives). The ratio is what going from one to
two tolerated failures costs in the codes themselves; docs/benchmarks.md says how such ratios are read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ecrec.bench import Column, _rate, emit_table
from ecrec.core.codes import XorCode
from ecrec.core.raid6 import PQCode


def _records(gen: torch.Generator, *shape: int) -> torch.Tensor:
    # random bits, NaN patterns included: the codes never look at them as floats
    return torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int32).view(torch.float32)


def _measure_xor(k: int, rows: int, width: int, seconds: float, gen: torch.Generator) -> dict:
    code = XorCode()
    data, new = _records(gen, k, rows, width), _records(gen, rows, width)
    parity = code.encode(data)
    return {
        "code": "xor",
        "r": 1,
        "encode": _rate(lambda: code.encode(data), k * rows, seconds),
        "delta": _rate(lambda: code.delta(data[0], new), rows, seconds),
        "decode": _rate(lambda: code.decode(parity, data[1:]), rows, seconds),
        "lost": 1,
    }


def _measure_pq(k: int, rows: int, width: int, seconds: float, gen: torch.Generator) -> dict:
    code = PQCode(k)
    data, new = _records(gen, k, rows, width), _records(gen, rows, width)
    full = torch.cat([data, code.encode(data, 0)[None], code.encode(data, 1)[None]])
    slot = torch.arange(rows) % k
    return {
        "code": "pq",
        "r": 2,
        "encode": _rate(lambda: (code.encode(data, 0), code.encode(data, 1)), k * rows, seconds),
        "delta": _rate(lambda: code.delta(data[0], new, slot, 1), rows, seconds),
        "decode": _rate(lambda: code.decode(full, [0, 1]), rows, seconds),
        "lost": 2,
    }


def bench_codes(
    k: int = 4, width: int = 64, rows: int = 4096, seconds: float = 2.0, out_dir: Path | None = None
) -> list[dict]:
    """Rows per second of each code's encode, delta and decode on batches of `rows` stripes of k records of
    `width` floats; prints the table and writes OUT/summary.json."""
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # one core's rate, comparable across machines and less at the mercy of neighbours
    try:
        gen = torch.Generator().manual_seed(0)
        results = [_measure_xor(k, rows, width, seconds, gen), _measure_pq(k, rows, width, seconds, gen)]
    finally:
        torch.set_num_threads(threads)
    title = (
        f"# ecrec bench codes: k={k}, records of {width} floats, batches of {rows:,} stripes, one thread "
        "(encode: data rows covered; decode: stripes decoded, each rebuilding `lost` records)"
    )
    columns = [
        Column("code", lambda r: r["code"]),
        Column("parity records r", lambda r: r["r"]),
        Column("encode data rows/s", lambda r: round(r["encode"]), "{:,}"),
        Column("delta rows/s", lambda r: round(r["delta"]), "{:,}"),
        Column("decode stripes/s", lambda r: round(r["decode"]), "{:,}"),
        Column("lost", lambda r: r["lost"]),
        Column("rebuilt rows/s", lambda r: round(r["decode"] * r["lost"]), "{:,}"),
    ]
    return emit_table(title, columns, results, out_dir)
