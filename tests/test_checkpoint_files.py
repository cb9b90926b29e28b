"""Checkpoint files (ecrec.ft.files): atomic shard files, a manifest written last, checksums, the spec hash."""

from __future__ import annotations

import json

import pytest
import torch

from ecrec.ft.files import CheckpointError, ManifestStore, checkpoint_dir, job_hash, write_shard


def shard_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "rows": torch.randn(50, 16, generator=g),
        "versions": torch.arange(50, dtype=torch.int64),
        "dense.0": torch.randn(7, 2, generator=g),
    }


def commit(store: ManifestStore, checkpoint: int, shards=(0, 1)) -> list[dict]:
    files = [write_shard(store.root, checkpoint, s, shard_tensors(checkpoint * 10 + s)) for s in shards]
    store.commit(checkpoint, [{"rank": 0, "step": checkpoint * 10, "samples": 0}], files)
    return files


def test_a_committed_checkpoint_reads_back_exactly(tmp_path):
    store = ManifestStore(tmp_path, "h1")
    commit(store, 1)
    assert store.committed() == [1]
    got = store.read_shard(1, 1)
    for key, want in shard_tensors(11).items():
        assert torch.equal(got[key], want) and got[key].dtype == want.dtype
    assert not list(tmp_path.rglob("*.tmp"))  # nothing left under a temporary name


def test_shard_files_without_a_manifest_are_not_a_checkpoint(tmp_path):
    store = ManifestStore(tmp_path, "h1")
    commit(store, 1)
    write_shard(tmp_path, 2, 0, shard_tensors(20))  # a crash before shard 1 and the manifest
    assert store.committed() == [1]
    with pytest.raises(CheckpointError, match="never completed"):
        store.read_shard(2, 0)


def test_a_corrupt_file_and_another_jobs_checkpoint_are_refused_with_the_reason(tmp_path):
    store = ManifestStore(tmp_path, "h1")
    files = commit(store, 1)
    path = tmp_path / files[1]["file"]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        store.read_shard(1, 1)
    with pytest.raises(CheckpointError, match="of another job or spec: hash h1, this job's h2"):
        ManifestStore(tmp_path, "h2").read_shard(1, 0)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        store.commit(1, [], files)  # a manifest is never written over a file that changed since


def test_prune_keeps_the_newest_complete_ones_and_clear_removes_all(tmp_path):
    store = ManifestStore(tmp_path, "h1", keep=2)
    for c in (1, 2, 3):
        commit(store, c)
    write_shard(tmp_path, 4, 0, shard_tensors(40))  # in progress: newer than every complete one, kept
    store.prune()
    assert store.committed() == [2, 3] and checkpoint_dir(tmp_path, 4).exists()
    store.clear()
    assert store.committed() == [] and not list(tmp_path.glob("ckpt-*"))


def test_the_job_hash_ignores_what_a_restart_may_change():
    spec = {"model": {"preset": "tiny"}, "training": {"steps": 5}, "servers": {"replicas": 3, "image": "a"}}
    same = json.loads(json.dumps(spec)) | {"runPolicy": {"backoffLimit": 3}}
    same["servers"]["image"] = "b"
    assert job_hash(spec) == job_hash(same)
    other = json.loads(json.dumps(spec))
    other["servers"]["replicas"] = 4
    assert job_hash(spec) != job_hash(other)


def test_an_increment_holds_every_row_changed_since_its_base_even_past_an_abandoned_baseline():
    from ecrec.store import ShardStore
    from tests.conftest import make_ctx

    ctx = make_ctx(servers__replicas=2, faultTolerance__strategy="checknrun")
    store = ShardStore(ctx, 0)
    ids = ctx.placement.global_id(0, torch.arange(8))
    grads = torch.ones(2, ctx.dim)
    store.checkpoint_tensors(1)  # baseline 1 (committed, say)
    store.push(ids[[0, 1]], grads)
    store.checkpoint_tensors(2)  # baseline 2: copied, then abandoned (never committed)
    store.push(ids[[4, 5]], grads)
    inc = store.checkpoint_tensors(3, base=1)
    assert inc["index"].tolist() == [0, 1, 4, 5]  # rows 0, 1 were changed before the copy of baseline 2
    assert torch.equal(inc["rows"], store.data[[0, 1, 4, 5]])
    assert store.checkpoint_tensors(4, base=2)["index"].tolist() == [4, 5]
    # Restoring baseline + increment gives the same rows back; the next increment starts from there.
    base = store.checkpoint_tensors(0)
    base["rows"] = base["rows"].clone()
    base["rows"][[0, 1, 4, 5]] = 0.0
    store.load_checkpoint(base, inc, base=1)
    assert torch.equal(store.data[[0, 1, 4, 5]], inc["rows"])
    assert store.checkpoint_tensors(5, base=1)["index"].tolist() == [0, 1, 4, 5]


def test_prune_keeps_every_save_over_a_kept_full_checkpoint_and_the_hot_chain_reads_in_order(tmp_path):
    store = ManifestStore(tmp_path, "h1", keep=1)
    commit(store, 1)  # full
    for c in (2, 3):  # hot-row saves over 1
        files = [write_shard(tmp_path, c, s, shard_tensors(c)) for s in (0, 1)]
        store.commit(c, [], files, base=1, hot=True)
    store.prune()
    assert store.committed() == [1, 2, 3]  # all of 1's chain: a restore of 3 reads 1, 2 and 3
    assert store.hot_chain(3) == [1, 2, 3] and store.hot_chain(2) == [1, 2] and store.hot_chain(1) == [1]
    commit(store, 4)  # a newer full checkpoint: 1's chain can go
    store.prune()
    assert store.committed() == [4]
