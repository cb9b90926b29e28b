"""Tensors on the wire: raw little-endian bytes <-> torch tensors, and request validation.

gRPC hands us immutable `bytes`; torch.frombuffer wraps them without a copy (the tensor is read-only in
spirit, so callers that keep or mutate it must clone). Every decoder checks sizes and raises
`InvalidRequest` (ecrec.core.errors, re-exported here), which servicers turn into INVALID_ARGUMENT.

Importing this module silences torch's "buffer is not writable" warning process-wide: every process that
decodes tensors from gRPC bytes imports it (the client's own reads of records rely on it too). The core does
not import it, so the core's import changes no filter.
"""

from __future__ import annotations

import warnings

import torch

from ecrec.core.errors import InvalidRequest
from ecrec.core.vec import all_finite

# torch.frombuffer warns that bytes are not writable; we never write through these views.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

__all__ = [
    "InvalidRequest",
    "bytes_to_floats",
    "bytes_to_ids",
    "check_finite",
    "floats_to_bytes",
    "ids_to_bytes",
]


def ids_to_bytes(ids: torch.Tensor) -> bytes:
    if ids.dtype == torch.int64 and ids.device.type == "cpu":  # the usual case: no conversions to dispatch
        return ids.numpy().tobytes()  # (numpy copies a strided view out in order)
    return ids.to(device="cpu", dtype=torch.int64).contiguous().numpy().tobytes()


def floats_to_bytes(x: torch.Tensor) -> bytes:
    if x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad:
        return x.numpy().tobytes()
    return x.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes()


def bytes_to_ids(buf: bytes, what: str = "ids") -> torch.Tensor:
    if len(buf) % 8:
        raise InvalidRequest(f"{what}: {len(buf)} bytes is not a whole number of int64 values")
    if not buf:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(buf, dtype=torch.int64)


def bytes_to_floats(buf: bytes, rows: int, width: int, what: str = "values") -> torch.Tensor:
    """Decode a float32 [rows, width] matrix, checking the size first."""
    expected = rows * width * 4
    if len(buf) != expected:
        raise InvalidRequest(
            f"{what}: expected {rows}x{width} float32 ({expected} bytes), got {len(buf)} bytes"
        )
    if rows * width == 0:
        return torch.empty(rows, width, dtype=torch.float32)
    return torch.frombuffer(buf, dtype=torch.float32).view(rows, width)


def check_finite(x: torch.Tensor, what: str) -> None:
    if not all_finite(x):
        raise InvalidRequest(f"{what}: contains NaN or Inf")
