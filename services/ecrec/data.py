"""Training data: the `DataSource` protocol, a synthetic generator and a reader for Criteo-format TSV files.

`Batch`, `DataSource` and the seed streams are `ecrec.batches`' (importable from here too), shared with
`ecrec.movielens`. This module owns how a batch number becomes a `Batch` (so any worker can produce any
batch), the held-out split used for AUC/log-loss, the synthetic "teacher" that makes labels learnable, and the Criteo TSV format
(`label \\t I1..I13 \\t C1..C_T`, hex categorical ids hashed into the table sizes, dense = log(x+1)).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ecrec.batches import EVAL_STREAM as _EVAL_STREAM
from ecrec.batches import SETUP_STREAM as _SETUP_STREAM
from ecrec.batches import TRAIN_STREAM as _TRAIN_STREAM
from ecrec.batches import Batch, DataSource
from ecrec.batches import slices as _slices
from ecrec.batches import stream_generator as _stream_generator
from ecrec.model import counter_uniform

if TYPE_CHECKING:
    from ecrec.spec import JobSpec

# Seed streams (ecrec.batches): training batch i uses (TRAIN, i), the held-out split (EVAL, 0); the teacher
# hashes with its own salt.
_TEACHER_SALT = 0x7EAC4E5
_MAX_COUNT = 1 << 20  # dense counts are capped: log1p stays exact to round-trip through float32 and text


def dense_transform(counts: Tensor) -> Tensor:
    """Model input from non-negative integer counts: log(count + 1), float32."""
    return torch.log1p(counts.to(torch.float32))


class SyntheticData:
    """Zipf-distributed ids per table, geometric-ish dense counts, labels from a fixed random teacher.

    Teacher logit = bias + sum_t w_t[id_t] + v . standardized(dense) + p_0[id_0] * p_1[id_1], with the
    per-row weights w, p drawn by a counter-based hash of (global row id, seed): O(1) memory, and the same
    teacher in every process. Its scales put the teacher's own AUC around 0.8.
    """

    SPARSE_STD, DENSE_STD, PAIR_STD, BIAS = 1.2, 0.6, 0.6, -1.0

    def __init__(
        self,
        table_sizes: Sequence[int],
        num_dense: int = 13,
        zipf_exponent: float = 1.05,
        seed: int = 0,
        eval_samples: int = 8192,
    ):
        self.table_sizes = tuple(int(n) for n in table_sizes)
        if not self.table_sizes or min(self.table_sizes) < 1:
            raise ValueError(f"table_sizes must be non-empty and every size >= 1, got {self.table_sizes}")
        if num_dense < 0 or zipf_exponent <= 0 or eval_samples < 1:
            raise ValueError("num_dense must be >= 0, zipf_exponent > 0 and eval_samples >= 1")
        self.num_dense, self.zipf_exponent, self.seed = num_dense, float(zipf_exponent), seed
        self.eval_samples = eval_samples
        sizes = torch.tensor(self.table_sizes, dtype=torch.int64)
        self._table_start = torch.cumsum(sizes, 0) - sizes  # also the global-id offsets of the teacher
        # All tables' CDFs in one sorted array, table t's shifted by +t, so one searchsorted serves every
        # table: a uniform u for table t is looked up as t + u. Built once: O(total rows) float64.
        cdfs = []
        for t, n in enumerate(self.table_sizes):
            p = torch.arange(1, n + 1, dtype=torch.float64).pow_(-self.zipf_exponent)
            cdf = torch.cumsum(p, 0) / p.sum()
            cdf[-1] = 1.0
            cdfs.append(cdf + t)
        self._cdf = torch.cat(cdfs)
        self._setup_dense()
        self._eval: Batch | None = None

    def _setup_dense(self) -> None:
        """Per-feature count distributions and the teacher's dense weights, fixed by the seed."""
        g = _stream_generator(self.seed, _SETUP_STREAM, 0)
        D = self.num_dense
        self._count_mean = torch.exp(torch.rand(D, generator=g, dtype=torch.float64) * 6.0)  # 1 .. 400
        self._zero_prob = 0.1 + 0.4 * torch.rand(D, generator=g, dtype=torch.float64)
        self._dense_w = torch.rand(D, generator=g, dtype=torch.float64) * 2 - 1
        # Standardize the teacher's dense input with moments of a fixed calibration sample.
        x = dense_transform(self._draw_counts(g, 4096)).to(torch.float64)
        self._dense_mu = x.mean(0)
        self._dense_sd = x.std(0).clamp_min(1e-6)

    def _draw_counts(self, g: torch.Generator, n: int) -> Tensor:
        D = self.num_dense
        u = torch.rand(n, D, generator=g, dtype=torch.float64).clamp_min_(1e-300)
        counts = torch.floor(-torch.log(u) * self._count_mean)  # exponential, floored: geometric
        zero = torch.rand(n, D, generator=g, dtype=torch.float64) < self._zero_prob
        return counts.masked_fill_(zero, 0).clamp_(max=_MAX_COUNT).to(torch.int64)

    def _draw_ids(self, g: torch.Generator, n: int) -> Tensor:
        T = len(self.table_sizes)
        u = torch.rand(n, T, generator=g, dtype=torch.float64)
        pos = torch.searchsorted(self._cdf, u + torch.arange(T, dtype=torch.float64), right=True)
        ids = pos - self._table_start
        # Rounding of t + u near t + 1 could step into the next table; clamp keeps ids in range.
        return torch.minimum(ids.clamp_min_(0), torch.tensor(self.table_sizes) - 1)

    def teacher_logits(self, dense: Tensor, ids: Tensor) -> Tensor:
        """The teacher's logit for transformed dense features [B, D] and per-table ids [B, T] -> [B] float64."""
        T = len(self.table_sizes)
        gids = (ids.to(torch.int64) + self._table_start).reshape(-1)
        w = (counter_uniform(gids, 2, self.seed ^ _TEACHER_SALT) * 2 - 1).view(-1, T, 2)
        # U(-1, 1) has variance 1/3: sqrt(3) makes each term unit-variance before scaling.
        logit = self.SPARSE_STD * math.sqrt(3.0 / T) * w[..., 0].sum(1) + self.BIAS
        if self.num_dense:
            z = (dense.to(torch.float64) - self._dense_mu) / self._dense_sd
            logit = logit + self.DENSE_STD * math.sqrt(3.0 / self.num_dense) * (z @ self._dense_w)
        if T >= 2:
            logit = logit + self.PAIR_STD * 3.0 * w[:, 0, 1] * w[:, 1, 1]
        return logit

    def _generate(self, g: torch.Generator, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """(counts [n, D] int64, ids [n, T] int64, labels [n] float32) drawn from `g`."""
        ids = self._draw_ids(g, n)
        counts = self._draw_counts(g, n)
        p = torch.sigmoid(self.teacher_logits(dense_transform(counts), ids))
        labels = (torch.rand(n, generator=g, dtype=torch.float64) < p).to(torch.float32)
        return counts, ids, labels

    def raw_batch(self, index: int, batch_size: int) -> tuple[Tensor, Tensor, Tensor]:
        """Training batch `index` before the dense transform: (counts, ids, labels)."""
        if index < 0 or batch_size < 1:
            raise ValueError(f"batch index must be >= 0 and batch_size >= 1, got {index}, {batch_size}")
        return self._generate(_stream_generator(self.seed, _TRAIN_STREAM, index), batch_size)

    def batch(self, index: int, batch_size: int) -> Batch:
        counts, ids, labels = self.raw_batch(index, batch_size)
        return Batch(dense_transform(counts), ids, labels)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        if self._eval is None:
            counts, ids, labels = self._generate(
                _stream_generator(self.seed, _EVAL_STREAM, 0), self.eval_samples
            )
            self._eval = Batch(dense_transform(counts), ids, labels)
        yield from _slices(self._eval, batch_size)


# -- Criteo TSV ----------------------------------------------------------------------------------------


def write_criteo_tsv(
    path: str | os.PathLike, source: SyntheticData, num_samples: int, batch_size: int = 4096
) -> None:
    """Write training batches 0, 1, 2, ... of `source` (batch size `batch_size`) as Criteo TSV lines.

    Categorical ids are 8-hex-digit strings of the id, so `int(h, 16) % table_size` reads back the same id;
    dense columns are the integer counts.
    """
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for index in range(math.ceil(num_samples / batch_size)):
            counts, ids, labels = source.raw_batch(index, batch_size)
            n = min(batch_size, num_samples - index * batch_size)
            lab = labels[:n].to(torch.int64).tolist()
            lines = [
                "\t".join([str(y), *map(str, c), *(format(i, "08x") for i in h)])
                for y, c, h in zip(lab, counts[:n].tolist(), ids[:n].tolist(), strict=True)
            ]
            f.write("\n".join(lines))
            f.write("\n")


_PARSE_CHUNK = 1 << 16  # lines parsed per numpy conversion: bounds the Python-object memory of huge files


class CriteoFileData:
    """Criteo-format TSV file(s) loaded into tensors once; the last `eval_fraction` of lines is held out.

    `batch(index, B)` takes training rows [index*B, (index+1)*B), wrapping around (epochs), in file order so
    a file written by `write_criteo_tsv` replays the synthetic batches exactly. `seed` is accepted for
    interface symmetry with `SyntheticData`; file order is not shuffled. `eval_samples`, if given, caps how
    many held-out rows `eval_batches` yields (the first ones), bounding evaluation cost on large files.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        table_sizes: Sequence[int],
        num_dense: int = 13,
        eval_fraction: float = 0.1,
        seed: int = 0,
        eval_samples: int | None = None,
    ):
        self.table_sizes = tuple(int(n) for n in table_sizes)
        if not self.table_sizes or min(self.table_sizes) < 1:
            raise ValueError(f"table_sizes must be non-empty and every size >= 1, got {self.table_sizes}")
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        if not paths:
            raise ValueError("CriteoFileData needs at least one TSV path")
        self.num_dense, self.seed = num_dense, seed
        parts = [self._load(p) for p in paths]
        labels = torch.cat([p[0] for p in parts])
        counts = torch.cat([p[1] for p in parts])
        ids = torch.cat([p[2] for p in parts])
        n = labels.numel()
        n_eval = round(n * eval_fraction)
        n_train = n - n_eval
        if n_train < 1:
            raise ValueError(f"{n} samples in {list(map(str, paths))}: none left for training")
        dense = dense_transform(counts)
        self.train = Batch(dense[:n_train], ids[:n_train], labels[:n_train])
        m = n if eval_samples is None else min(n, n_train + eval_samples)
        self.held_out = Batch(dense[n_train:m], ids[n_train:m], labels[n_train:m])

    def _load(self, path: str | os.PathLike) -> tuple[Tensor, Tensor, Tensor]:
        D, T = self.num_dense, len(self.table_sizes)
        width = 1 + D + T
        chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        fields: list[str] = []
        linenos: list[int] = []
        with open(path, encoding="ascii") as f:
            for lineno, line in enumerate(f, start=1):
                line = line.rstrip("\r\n")
                if not line:
                    continue
                parts = line.split("\t")
                if len(parts) != width:
                    raise ValueError(
                        f"{path}:{lineno}: expected {width} tab-separated columns "
                        f"(label, {D} integer, {T} categorical), got {len(parts)}"
                    )
                fields.extend(parts)
                linenos.append(lineno)
                if len(linenos) == _PARSE_CHUNK:
                    chunks.append(self._parse_chunk(fields, linenos, path))
                    fields, linenos = [], []
        if linenos:
            chunks.append(self._parse_chunk(fields, linenos, path))
        if not chunks:
            return torch.zeros(0), torch.zeros(0, D, dtype=torch.int64), torch.zeros(0, T, dtype=torch.int64)
        labels, counts, ids = (torch.from_numpy(np.concatenate(c)) for c in zip(*chunks, strict=True))
        return labels, counts, ids

    def _parse_chunk(
        self, fields: list[str], linenos: list[int], path: str | os.PathLike
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tab-split fields of len(linenos) lines -> (labels float32, counts int64, ids int64)."""
        D, rows = self.num_dense, len(linenos)
        a = np.array(fields, dtype=object).reshape(rows, -1)
        try:
            num = a[:, : 1 + D]
            num[num == ""] = "0"  # a missing value reads as 0, label and counts alike
            num = num.astype(np.int64)
            cats = a[:, 1 + D :].ravel().tolist()
            sizes = self.table_sizes * rows  # the table size of every categorical field, row-major
            ids = np.array(
                [int(x, 16) % n if x else 0 for x, n in zip(cats, sizes, strict=True)], dtype=np.int64
            )
        except ValueError:
            raise self._locate_bad_field(a, linenos, path) from None
        bad = (num[:, 0] != 0) & (num[:, 0] != 1)
        if bad.any():
            raise ValueError(f"{path}:{linenos[int(bad.argmax())]}: label must be 0 or 1")
        return num[:, 0].astype(np.float32), np.maximum(num[:, 1:], 0), ids.reshape(rows, -1)

    def _locate_bad_field(self, a: np.ndarray, linenos: list[int], path: str | os.PathLike) -> ValueError:
        # Error path only: find the first offending line so the message names it.
        D = self.num_dense
        for row, lineno in zip(a, linenos, strict=True):
            for col, x in enumerate(row):
                try:
                    if x:
                        int(x, 10 if col <= D else 16)
                except ValueError:
                    kind = "label" if col == 0 else f"I{col}" if col <= D else f"C{col - D}"
                    return ValueError(f"{path}:{lineno}: column {kind} is not a valid number: {x!r}")
        return ValueError(f"{path}: malformed numeric field")

    def batch(self, index: int, batch_size: int) -> Batch:
        if index < 0 or batch_size < 1:
            raise ValueError(f"batch index must be >= 0 and batch_size >= 1, got {index}, {batch_size}")
        n = len(self.train)
        rows = (torch.arange(batch_size, dtype=torch.int64) + index * batch_size) % n
        return Batch(self.train.dense[rows], self.train.ids[rows], self.train.labels[rows])

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        yield from _slices(self.held_out, batch_size)


CHECK_LINES = 1000  # lines of each file that check_data reads: a wrong format shows in the first lines


def check_data(spec: JobSpec, lines: int = CHECK_LINES) -> list[str]:
    """What is wrong with the job's training data, found before any process starts (empty when nothing).

    For `data.source: criteo`, each of `data.paths` (relative to the current directory, as the processes
    open them) must be a readable file, and its first `lines` lines must parse as `CriteoFileData` reads
    them: 1 + numDense + one column per table, tab-separated; label 0 or 1; integer counts; hexadecimal
    categorical ids; empty fields allowed. One problem per file at most (its first bad line), each naming
    the file and the line, e.g. `spec.data.paths[0]: day_0.tsv:3: label must be 0 or 1, got '2'`.
    For `data.source: movielens100k`, the three MovieLens-100k files must be found (ecrec.movielens); the
    problem, if any, says how to get them. Synthetic data has nothing to check.
    """
    if spec.data.source == "movielens100k":
        from ecrec.movielens import MovieLensNotFound, movielens_dir

        try:
            movielens_dir()
        except MovieLensNotFound as e:
            return [f"spec.data.source: {e}"]
        return []
    if spec.data.source != "criteo":
        return []
    m = spec.model_config_resolved()
    out: list[str] = []
    samples = 0
    for i, path in enumerate(spec.data.paths):
        problem, n = _check_criteo_file(path, m.num_dense, len(m.table_sizes), lines)
        samples += n
        if problem:
            out.append(f"spec.data.paths[{i}]: {problem}")
    if spec.data.paths and not out and samples == 0:
        out.append(f"spec.data.paths: no samples in {', '.join(spec.data.paths)} (every file is empty)")
    return out


def _check_criteo_file(path: str, num_dense: int, num_tables: int, lines: int) -> tuple[str | None, int]:
    """(the first problem of `path`'s first `lines` lines or None, the samples seen among them)."""
    width = 1 + num_dense + num_tables
    samples = 0
    try:
        with open(path, "rb") as f:  # bytes: a compressed or binary file is named as such, not a traceback
            for lineno, raw in enumerate(f, start=1):
                if lineno > lines:
                    break
                try:
                    line = raw.decode("ascii").rstrip("\r\n")
                except UnicodeDecodeError:
                    hint = " (gzip-compressed? decompress it first)" if raw.startswith(b"\x1f\x8b") else ""
                    return f"{path}:{lineno}: not ASCII text{hint}", samples
                if not line:
                    continue  # the reader skips empty lines
                parts = line.split("\t")
                if len(parts) != width:
                    return (
                        f"{path}:{lineno}: expected {width} tab-separated columns (label, {num_dense} "
                        f"integer, {num_tables} categorical), got {len(parts)}",
                        samples,
                    )
                bad = _bad_field(parts, num_dense)
                if bad:
                    return f"{path}:{lineno}: {bad}", samples
                samples += 1
    except FileNotFoundError:
        return f"{path}: no such file", samples
    except IsADirectoryError:
        return f"{path}: is a directory, not a Criteo TSV file", samples
    except OSError as e:
        return f"{path}: cannot read: {e.strerror or e}", samples
    return None, samples


def _bad_field(parts: list[str], num_dense: int) -> str | None:
    """What CriteoFileData would refuse in one line's fields (the same int() parses), or None."""
    if parts[0] not in ("", "0", "1"):
        try:
            label_ok = int(parts[0]) in (0, 1)
        except ValueError:
            label_ok = False
        if not label_ok:
            return f"label must be 0 or 1, got {parts[0]!r}"
    for col in range(1, len(parts)):
        x = parts[col]
        if not x:
            continue  # a missing value reads as 0
        dense = col <= num_dense
        name = f"I{col}" if dense else f"C{col - num_dense}"
        try:
            v = int(x, 10 if dense else 16)
        except ValueError:
            what = "an integer" if dense else "a hexadecimal id"
            return f"column {name} is not {what}: {x!r}"
        if dense and not -(2**63) <= v < 2**63:
            return f"column {name} is out of the int64 range: {x!r}"
    return None


def make_data_source(
    kind: str,
    table_sizes: Sequence[int],
    num_dense: int,
    seed: int,
    zipf_exponent: float = 1.05,
    eval_samples: int = 8192,
    paths: Sequence[str | os.PathLike] | None = None,
) -> DataSource:
    """The data source a job spec names: "synthetic", "criteo" (TSV `paths`) or "movielens100k"."""
    if kind == "synthetic":
        return SyntheticData(table_sizes, num_dense, zipf_exponent, seed=seed, eval_samples=eval_samples)
    if kind == "criteo":
        if not paths:
            raise ValueError("data source 'criteo' needs at least one TSV path")
        return CriteoFileData(paths, table_sizes, num_dense, seed=seed, eval_samples=eval_samples)
    if kind == "movielens100k":
        from ecrec.movielens import MovieLensData  # pyarrow and the files only for this source

        return MovieLensData(table_sizes, num_dense, seed=seed, eval_samples=eval_samples)
    raise ValueError(f"unknown data source kind {kind!r}: expected 'synthetic', 'criteo' or 'movielens100k'")
