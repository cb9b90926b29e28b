"""The DLRM's dense (NN) part and the deterministic initial values of every parameter.

This module owns the DLRM network (bottom MLP, pairwise dot interaction, top MLP), the flat-vector view of its
dense parameters that servers store and workers pull/push, the seeded initial values of those dense
parameters, and the initial value of every embedding row. Embedding tables are NOT part of the module: they
live on parameter servers, and a worker hands `DLRM.forward` the already-gathered embedding vectors.

Initialization never touches torch's global RNG. Embedding rows come from a counter-based hash of
(global row id, column, seed), so any server can initialize exactly the rows it holds and the values do not
depend on how rows are spread over servers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


# -- counter-based hashing (uint32 numpy on the CPU; int64 torch elsewhere) ------------------------------


def splitmix64(x: int) -> int:
    """Python-side 64-bit mixer for seeds and salts (arbitrary Python ints, negative ones included)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mul32(h: Tensor, c: int) -> Tensor:
    """(h * c) mod 2**32 for h in [0, 2**32): split h in 16-bit halves so no product exceeds 2**48."""
    lo = h & 0xFFFF
    hi = h >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer: a bijection on [0, 2**32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _fmix32_np(h: np.ndarray) -> np.ndarray:
    """`_fmix32` on uint32 arrays, in place: numpy's uint32 products wrap mod 2**32 by themselves."""
    h ^= h >> 16
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> 13
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> 16
    return h


def _counter_bits_np(k: np.ndarray, columns: int, s0: int, s1: int, s2: int) -> np.ndarray:
    """`counter_bits` on the CPU as uint32 [n, columns]: the same values, ~10x faster than the int64 torch
    path (which splits every product in 16-bit halves to stay below 2**63): start-up initializes every row."""
    lo = (k & _M32).astype(np.uint32)
    h = _fmix32_np(lo ^ np.uint32(s0))
    h ^= (k >> 32).astype(np.uint32) ^ np.uint32(s1)  # (k >> 32) & M32 == the pattern's high word
    h = _fmix32_np(h)
    cols = np.arange(columns, dtype=np.uint32) * np.uint32(0x9E3779B9)
    col_key = _fmix32_np(cols ^ np.uint32(s2))
    return _fmix32_np(h[:, None] ^ col_key[None, :])


def _seed_words(seed: int) -> tuple[int, int, int]:
    s = splitmix64(seed)
    return s & _M32, (s >> 32) & _M32, splitmix64(s) & _M32


def counter_bits(keys: Tensor, columns: int, seed: int) -> Tensor:
    """[n] int64 keys -> [n, columns] int64 hash values in [0, 2**32), a pure function of (key, column, seed).

    Keys are read as 64-bit patterns (ids up to 2**63 are distinct inputs); works on any device.
    """
    s0, s1, s2 = _seed_words(seed)
    k = keys.to(torch.int64).reshape(-1)
    if k.device.type == "cpu":
        return torch.from_numpy(_counter_bits_np(k.numpy(), columns, s0, s1, s2).astype(np.int64))
    return _counter_bits_torch(k, columns, s0, s1, s2)


def _counter_bits_torch(k: Tensor, columns: int, s0: int, s1: int, s2: int) -> Tensor:
    """`counter_bits` in int64 torch ops on any device (every intermediate < 2**63)."""
    h = _fmix32((k & _M32) ^ s0)
    h = _fmix32(h ^ ((k >> 32) & _M32) ^ s1)
    cols = torch.arange(columns, dtype=torch.int64, device=k.device)
    col_key = _fmix32(_mul32(cols, 0x9E3779B9) ^ s2)
    return _fmix32(h[:, None] ^ col_key[None, :])


def counter_uniform(keys: Tensor, columns: int, seed: int) -> Tensor:
    """[n] int64 keys -> [n, columns] float64 uniforms in the open interval (0, 1), see `counter_bits`."""
    bits = counter_bits(keys, columns, seed) >> 8  # 24 bits: plenty, and exact in float64
    return (bits.to(torch.float64) + 0.5) / float(1 << 24)


# -- the network -----------------------------------------------------------------------------------------


def top_input_width(num_tables: int, dim: int) -> int:
    """Width of the top MLP's input: bottom output + strictly-lower-triangle dot products of T+1 vectors."""
    return dim + (num_tables + 1) * num_tables // 2


def _check_args(num_dense: int, num_tables: int, dim: int, bottom_mlp: Sequence[int], top_mlp: Sequence[int]):
    if num_dense < 1 or num_tables < 1 or dim < 1:
        raise ValueError(f"num_dense, num_tables and dim must be >= 1, got {num_dense}, {num_tables}, {dim}")
    if not bottom_mlp or not top_mlp or min(*bottom_mlp, *top_mlp) < 1:
        raise ValueError(f"MLP widths must be non-empty and >= 1, got bottom {bottom_mlp}, top {top_mlp}")
    if bottom_mlp[-1] != dim:
        raise ValueError(f"bottom_mlp's last width {bottom_mlp[-1]} must equal the embedding dim {dim}")
    if top_mlp[-1] != 1:
        raise ValueError(f"top_mlp's last width {top_mlp[-1]} must be 1 (the click logit)")


def _linear_shapes(
    num_dense: int, num_tables: int, dim: int, bottom_mlp: Sequence[int], top_mlp: Sequence[int]
) -> list[tuple[int, int]]:
    """(fan_in, fan_out) of every Linear layer, bottom MLP first: the order of `DLRM.parameters()`."""
    bottom = [num_dense, *bottom_mlp]
    top = [top_input_width(num_tables, dim), *top_mlp]
    return [(a, b) for widths in (bottom, top) for a, b in zip(widths[:-1], widths[1:], strict=True)]


class _Linear(nn.Linear):
    """A Linear whose parameters start uninitialized: no draw from the global RNG, values are loaded
    afterwards. (`nn.utils.skip_init` does the same through the meta device, whose first use costs a process
    0.3-0.4 s of CPU in lazy imports: every server, worker and coordinator paid it at start.)"""

    def reset_parameters(self) -> None:
        pass


def _mlp(widths: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(_Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP on dense features, dot interaction with the gathered embeddings, top MLP to one logit.

    Both MLPs have a ReLU between consecutive layers and none after their last layer. A freshly built module
    holds `init_dense(..., seed=0)`; building one never draws from torch's global RNG.
    """

    def __init__(
        self, num_dense: int, num_tables: int, dim: int, bottom_mlp: Sequence[int], top_mlp: Sequence[int]
    ):
        super().__init__()
        bottom_mlp, top_mlp = list(bottom_mlp), list(top_mlp)
        _check_args(num_dense, num_tables, dim, bottom_mlp, top_mlp)
        self.num_dense, self.num_tables, self.dim = num_dense, num_tables, dim
        self.bottom = _mlp([num_dense, *bottom_mlp])
        self.top = _mlp([top_input_width(num_tables, dim), *top_mlp])
        li, lj = torch.tril_indices(num_tables + 1, num_tables + 1, offset=-1)
        self.register_buffer("_li", li, persistent=False)
        self.register_buffer("_lj", lj, persistent=False)
        load_dense_(self, init_dense(num_dense, num_tables, dim, bottom_mlp, top_mlp, seed=0))

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        """dense [B, num_dense], sparse [B, num_tables, dim] (gathered embedding rows) -> logits [B]."""
        B = dense.shape[0]
        if sparse.shape != (B, self.num_tables, self.dim):
            raise ValueError(f"sparse must be [{B}, {self.num_tables}, {self.dim}], got {list(sparse.shape)}")
        x = self.bottom(dense)
        z = torch.cat([x.unsqueeze(1), sparse], dim=1)  # [B, T+1, dim]
        dots = torch.bmm(z, z.transpose(1, 2))  # [B, T+1, T+1]
        inter = dots[:, self._li, self._lj]  # strictly lower triangle: each unordered pair once, no self-dots
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


# -- flat views of the dense parameters ------------------------------------------------------------------


def dense_numel(model: nn.Module) -> int:
    """Number of dense parameters (the length of `flatten_dense(model)`)."""
    return sum(p.numel() for p in model.parameters())


def flatten_dense(model: nn.Module) -> Tensor:
    """All parameters in `model.parameters()` order as one 1-D float32 tensor (a detached copy)."""
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in model.parameters()])


def flatten_dense_grad(model: nn.Module) -> Tensor:
    """Gradients in `flatten_dense` order as one 1-D float32 tensor; zeros for parameters without a grad."""
    parts = [
        p.grad.detach().reshape(-1).to(torch.float32)
        if p.grad is not None
        else torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        for p in model.parameters()
    ]
    return torch.cat(parts)


def load_dense_(model: nn.Module, flat: Tensor) -> None:
    """Copy a flat vector (any device) into the parameters in place, so optimizers keep their references."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    if flat.dim() != 1 or flat.numel() != n:
        raise ValueError(f"flat dense vector must be 1-D with {n} elements, got shape {list(flat.shape)}")
    if not params:
        return
    # One host-to-device transfer for the whole vector rather than one per parameter.
    flat = flat.to(device=params[0].device, dtype=params[0].dtype)
    with torch.no_grad():
        off = 0
        for p in params:
            p.copy_(flat[off : off + p.numel()].view_as(p))
            off += p.numel()


# -- initial values --------------------------------------------------------------------------------------


def init_dense(
    num_dense: int, num_tables: int, dim: int, bottom_mlp: Sequence[int], top_mlp: Sequence[int], seed: int
) -> Tensor:
    """Flat initial dense parameters for a seed: every Linear's weight then bias, U(-1/sqrt(fan_in), +...).

    Drawn from a private `torch.Generator`, so the global RNG is untouched and the result depends only on
    the arguments.
    """
    bottom_mlp, top_mlp = list(bottom_mlp), list(top_mlp)
    _check_args(num_dense, num_tables, dim, bottom_mlp, top_mlp)
    gen = torch.Generator().manual_seed(splitmix64(seed) >> 1)  # manual_seed wants a non-negative int64
    parts = []
    for fan_in, fan_out in _linear_shapes(num_dense, num_tables, dim, bottom_mlp, top_mlp):
        bound = 1.0 / math.sqrt(fan_in)
        for n in (fan_in * fan_out, fan_out):  # weight [out, in] flattened row-major, then bias [out]
            parts.append((torch.rand(n, generator=gen, dtype=torch.float32) * 2 - 1) * bound)
    return torch.cat(parts)


def embedding_init_scale(dim: int) -> float:
    """Half-width of the initial embedding values: 1/sqrt(dim) keeps the initial dot products O(1/sqrt(dim))."""
    return 1.0 / math.sqrt(dim)


def init_embedding_rows(global_ids: Tensor, dim: int, seed: int) -> Tensor:
    """[n] int64 global row ids -> [n, dim] float32 initial rows, uniform in [-1/sqrt(dim), 1/sqrt(dim)].

    A pure function of (global id, column, seed) via `counter_uniform`, on the ids' device; ids up to 2**62.
    """
    k = global_ids.to(torch.int64).reshape(-1)
    if k.device.type == "cpu":
        return torch.from_numpy(_init_rows_np(k.numpy(), dim, seed))
    u = counter_uniform(k, dim, seed)
    return ((2.0 * u - 1.0) * embedding_init_scale(dim)).to(torch.float32)


def _init_rows_np(k: np.ndarray, dim: int, seed: int, block: int = 4096) -> np.ndarray:
    """`init_embedding_rows` on the CPU, bit for bit, in cache-sized blocks (start-up initializes every row: a
    float64 temporary of the whole table cost more than the hash). With b the 24 hash bits, 2u - 1 is
    (2b + 1 - 2**24) / 2**24 exactly, and scaling by a power of two is exact: the one float64 rounding of the
    product, then the one to float32, are those of the reference's expression."""
    words = _seed_words(seed)
    c = embedding_init_scale(dim) / float(1 << 24)
    out = np.empty((k.shape[0], dim), np.float32)
    for lo in range(0, k.shape[0], block):
        b = _counter_bits_np(k[lo : lo + block], dim, *words) >> np.uint32(8)
        m = b.view(np.int32) * np.int32(2) + np.int32(1 - (1 << 24))
        out[lo : lo + block] = m * c
    return out


# -- the shape of a job's model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """The model shape a job trains; global row id of (table t, id i) = table_offsets[t] + i."""

    num_dense: int
    dim: int
    table_sizes: tuple[int, ...]
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]

    def __post_init__(self) -> None:
        # Tuples even when handed lists, so configs stay hashable and comparable.
        for name in ("table_sizes", "bottom_mlp", "top_mlp"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        if not self.table_sizes or min(self.table_sizes) < 1:
            raise ValueError(f"table_sizes must be non-empty and every size >= 1, got {self.table_sizes}")
        _check_args(self.num_dense, self.num_tables, self.dim, self.bottom_mlp, self.top_mlp)

    @property
    def num_tables(self) -> int:
        return len(self.table_sizes)

    @property
    def num_rows(self) -> int:
        return sum(self.table_sizes)

    @property
    def table_offsets(self) -> Tensor:
        """LongTensor [T]: exclusive cumulative sum of table sizes."""
        sizes = torch.tensor(self.table_sizes, dtype=torch.int64)
        return torch.cumsum(sizes, 0) - sizes

    @property
    def dense_numel(self) -> int:
        """Number of dense parameters (`dense_numel(self.build())`, without building the network)."""
        shapes = _linear_shapes(self.num_dense, self.num_tables, self.dim, self.bottom_mlp, self.top_mlp)
        return sum(a * b + b for a, b in shapes)

    def build(self) -> DLRM:
        return DLRM(self.num_dense, self.num_tables, self.dim, self.bottom_mlp, self.top_mlp)

    def init_dense(self, seed: int) -> Tensor:
        """`init_dense` for this shape."""
        return init_dense(self.num_dense, self.num_tables, self.dim, self.bottom_mlp, self.top_mlp, seed)
