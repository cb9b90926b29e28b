"""Checkpoint files on stable storage: one safetensors file per shard, written by its server, and a manifest
the coordinator writes last.

    <root>/ckpt-00000007/shard-0002.safetensors    tensors of shard 2 (rows, versions, dense chunks; under
                                                   ecrec also its parity records and their pver)
    <root>/ckpt-00000007/manifest.json             spec hash, each rank's step and samples, files + sha256

A file is written under a temporary name, fsynced and renamed, so a crash never leaves half a file under
the real name; a checkpoint counts only once its manifest exists (it is written last, the same way), so a
crash mid-checkpoint leaves the previous one the latest. Reading checks the manifest's spec hash and each
file's checksum (of the whole file: every tensor in it) and refuses a mismatch with the reason; the shapes
are checked by the store that loads them (ecrec.store.checkpoints).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt or of another job."""


def job_hash(spec_dict: dict) -> str:
    """What a checkpoint must match to be loaded: the spec's model, data order and placement, i.e. the whole
    spec but the parts a restart may change (run policy, images and resources, timeouts)."""
    keep = {
        k: v for k, v in spec_dict.items() if k in ("model", "data", "training", "servers", "faultTolerance")
    }
    servers = {k: v for k, v in keep.get("servers", {}).items() if k == "replicas"}
    doc = json.dumps({**keep, "servers": servers}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def checkpoint_dir(root: str | Path, checkpoint: int) -> Path:
    return Path(root) / f"ckpt-{checkpoint:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_shard(root: str | Path, checkpoint: int, shard: int, tensors: dict[str, torch.Tensor]) -> dict:
    """Write one shard's tensors atomically, whatever their names (ecrec's `parity` and `pver` too); returns
    its manifest entry (file, sha256, bytes)."""
    d = checkpoint_dir(root, checkpoint)
    d.mkdir(parents=True, exist_ok=True)
    name = f"shard-{shard:04d}.safetensors"
    tmp = d / f".{name}.{os.getpid()}.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    _publish(tmp, d / name)
    return {
        "shard": shard,
        "file": f"{d.name}/{name}",
        "sha256": _sha256(d / name),
        "bytes": (d / name).stat().st_size,
    }


class ManifestStore:
    """The checkpoints under one job's directory: commit, find the latest, read a shard, prune."""

    def __init__(self, root: str | Path, job_hash: str, keep: int = 2):
        self.root, self.hash, self.keep = Path(root), job_hash, keep

    @classmethod
    def for_job(cls, job) -> ManifestStore:
        found = job.spec.fault_tolerance.checkpoints()
        if found is None:
            raise ValueError(f"job {job.name} writes no checkpoints")
        settings = found[1]
        return cls(settings.path, job_hash(job.spec.to_dict()), keep=settings.keep)

    def commit(
        self,
        checkpoint: int,
        progress: list[dict],
        files: list[dict],
        final: bool = False,
        base: int | None = None,
        hot: bool = False,
    ) -> Path:
        """Write the manifest of a checkpoint whose shard files are all written (checked here). `base`: the
        baseline checkpoint an increment (checknrun) applies to."""
        d = checkpoint_dir(self.root, checkpoint)
        for f in files:
            if _sha256(self.root / f["file"]) != f["sha256"]:
                raise CheckpointError(f"checkpoint {checkpoint}: {f['file']} does not match its checksum")
        doc = {
            "format": FORMAT,
            "checkpoint": checkpoint,
            "jobHash": self.hash,
            "final": final,
            "base": base,
            "hot": hot,
            "progress": progress,
            "files": files,
        }
        tmp = d / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        _publish(tmp, d / MANIFEST)
        return d / MANIFEST

    def manifest(self, checkpoint: int) -> dict:
        path = checkpoint_dir(self.root, checkpoint) / MANIFEST
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint {checkpoint} has no manifest ({path}): it was never completed"
            ) from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {checkpoint}: unreadable manifest {path}: {e}") from None
        if doc.get("jobHash") != self.hash:
            raise CheckpointError(
                f"checkpoint {checkpoint} ({path}) is of another job or spec: hash {doc.get('jobHash')}, "
                f"this job's {self.hash}"
            )
        return doc

    def committed(self) -> list[int]:
        """Ids of the checkpoints with a manifest, oldest first."""
        if not self.root.is_dir():
            return []
        ids = []
        for d in self.root.glob("ckpt-*"):
            if (d / MANIFEST).is_file():
                try:
                    ids.append(int(d.name.removeprefix("ckpt-")))
                except ValueError:
                    continue
        return sorted(ids)

    def read_chain(self, checkpoint: int, shard: int) -> tuple[dict[str, torch.Tensor], dict | None]:
        """A shard's tensors of `checkpoint`: (its baseline's, the increment's) for an increment, (its own,
        None) for a baseline."""
        base = self.manifest(checkpoint).get("base")
        if base is None:
            return self.read_shard(checkpoint, shard), None
        return self.read_shard(int(base), shard), self.read_shard(checkpoint, shard)

    def hot_chain(self, checkpoint: int) -> list[int]:
        """cpr: [full checkpoint, hot-row saves over it up to `checkpoint`, oldest first] ([checkpoint] for a
        full one)."""
        doc = self.manifest(checkpoint)
        if not doc.get("hot"):
            return [checkpoint]
        base = int(doc["base"])
        hots = [
            c
            for c in self.committed()
            if base < c <= checkpoint and (m := self.manifest(c)).get("hot") and m.get("base") == base
        ]
        return [base, *hots]

    def read_shard(self, checkpoint: int, shard: int) -> dict[str, torch.Tensor]:
        doc = self.manifest(checkpoint)
        entry = next((f for f in doc["files"] if f["shard"] == shard), None)
        if entry is None:
            raise CheckpointError(f"checkpoint {checkpoint} has no file for shard {shard}")
        path = self.root / entry["file"]
        if not path.is_file():
            raise CheckpointError(f"checkpoint {checkpoint}: {path} is missing")
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint {checkpoint}: {path} is corrupt (sha256 does not match the manifest)"
            )
        return load_file(str(path))

    def clear(self) -> None:
        """Remove every checkpoint under the directory: a job that starts from nothing must never load one of
        an earlier run of the same spec (checkpoint ids start at 1 again)."""
        for d in self.root.glob("ckpt-*") if self.root.is_dir() else ():
            shutil.rmtree(d, ignore_errors=True)

    def prune(self) -> None:
        """Keep the newest `keep` complete checkpoints; delete older ones and any incomplete one older than the
        newest complete (a crash mid-write left it)."""
        ids = self.committed()
        if not ids:
            return
        # The newest `keep` full checkpoints, and every increment or hot-row save over one of them (a restore
        # reads its base and, for cpr, every hot-row save since).
        bases = {c: self.manifest(c).get("base") for c in ids}
        fulls = set([c for c in ids if bases[c] is None][-self.keep :])
        keep = fulls | {c for c in ids if bases[c] in fulls}
        for d in self.root.glob("ckpt-*"):
            try:
                n = int(d.name.removeprefix("ckpt-"))
            except ValueError:
                continue
            if n not in keep and n < max(ids):
                shutil.rmtree(d, ignore_errors=True)


# -- Check-N-Run's quantized records -------------------------------------------------------------------------
def encode_records(records: torch.Tensor, dim: int, bits: int) -> dict[str, torch.Tensor]:
    """Row records for a checknrun file: the embedding columns at `bits` (32: as they are, 16: float16, 8 and
    4: Check-N-Run's per-row quantization), the optimizer-state columns at full precision (the paper
    quantizes the embedding vectors; the state steers every later step size)."""
    from ecrec.core.quantize import quantize

    emb, state = records[:, :dim], records[:, dim:]
    out = {"state": state.contiguous()}
    if bits == 32:
        out["emb"] = emb.contiguous()
    elif bits == 16:
        out["emb.f16"] = emb.to(torch.float16)
    else:
        qz = quantize(emb, bits)
        out |= {"emb.codes": qz.codes, "emb.lo": qz.lo, "emb.scale": qz.scale}
    return out


def decode_records(t: dict[str, torch.Tensor], dim: int, bits: int) -> torch.Tensor:
    from ecrec.core.quantize import Quantized, dequantize

    if "emb" in t:
        emb = t["emb"]
    elif "emb.f16" in t:
        emb = t["emb.f16"].float()
    else:
        emb = dequantize(Quantized(t["emb.codes"], t["emb.lo"], t["emb.scale"], bits, dim))
    return torch.cat([emb, t["state"]], dim=1)
