"""Server-side optimizers that update row records in place of torch.optim.

A parameter server keeps each embedding row and its optimizer state together as one flat float32 row record
`[emb(d), state...]`, stored as `records[n, W]`; dense parameters use the same layout with d = 1 (one record
per scalar). This module owns the record layouts, their initial state and the update rule of each optimizer.

Every `apply` is a pure function of `(records, grads)`, and each row's result depends only on that row:
the system compares bit-exact parameter hashes between runs whose servers batch rows differently, so an update
must give the same bits whether a row is applied alone, in a half batch or in the full batch. Hence only
elementwise ops and row-local folds are used, and the per-row Adam bias correction is looked up in tables
rather than computed with a vectorized `pow` (whose SIMD and scalar code paths may round differently).

Updates reproduce torch.optim's single-tensor (CPU) arithmetic op for op, so on CPU they are bit-identical to
torch.optim.SGD / SGD(momentum) / Adagrad / Adam for rows updated on every step.
"""

from __future__ import annotations

import abc
import math

import torch
from torch import Tensor

OPTIMIZERS: tuple[str, ...] = ("sgd", "momentum", "adagrad", "rowwise_adagrad", "adam")

# Adam's step count lives in the float32 record, which counts exactly up to 2**24; past that it saturates
# (2**24 + 1 rounds back to 2**24), and by then both bias corrections are 1.0 anyway.
MAX_ADAM_STEP = 1 << 24
_POW_SPLIT = 1 << 12  # step = hi * 4096 + lo; beta**step = table_hi[hi] * table_lo[lo]

# Domains of record parts: the values an optimizer can produce there. A record decoded with an inexact code
# (core/codes.py, Code.exact) is projected back onto them before it is used (RowOptimizer.project).
REAL = "real"  # any float: embeddings, momentum, Adam's first moment
NON_NEGATIVE = "non_negative"  # sums of squares (Adagrad's accumulator, Adam's second moment): sqrt is taken
COUNT = "count"  # integral step counts in [0, MAX_ADAM_STEP] (Adam's bias correction indexes tables by them)


class RowOptimizer(abc.ABC):
    """One optimizer over row records `[emb(d), state(state_width(d))]`."""

    name: str = ""
    # (name, domain) of each state field, in record order (widths: _state_layout).
    state_fields: tuple[tuple[str, str], ...] = ()

    def __init__(self, lr: float, *, weight_decay: float = 0.0) -> None:
        _check_non_negative("lr", lr)
        _check_non_negative("weight_decay", weight_decay)
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)

    @abc.abstractmethod
    def state_width(self, dim: int) -> int:
        """Floats of optimizer state stored after a row of `dim` entries."""

    def record_width(self, dim: int) -> int:
        return dim + self.state_width(dim)

    def init_records(self, rows: Tensor) -> Tensor:
        """[n, d] rows -> NEW [n, W] float32 records with zeroed state (every algorithm here starts at 0)."""
        if rows.dim() != 2:
            raise ValueError(f"rows must be [n, d], got shape {tuple(rows.shape)}")
        n, d = rows.shape
        state = torch.zeros((n, self.state_width(d)), dtype=torch.float32, device=rows.device)
        return torch.cat([rows.to(torch.float32), state], dim=1)

    def apply(self, records: Tensor, grads: Tensor) -> Tensor:
        """records [n, W] float32, grads [n, d] (cast to float32) -> NEW records [n, W]; inputs are never mutated.

        Rows must be unique (the caller sums duplicate-row gradients first); each row is updated independently.
        """
        if records.dim() != 2 or grads.dim() != 2:
            raise ValueError(
                f"records and grads must be 2-D, got {tuple(records.shape)}, {tuple(grads.shape)}"
            )
        if records.dtype != torch.float32:
            raise ValueError(f"row records are float32, got {records.dtype}")
        n, d = grads.shape
        if d < 1 or records.shape != (n, self.record_width(d)):
            raise ValueError(
                f"{self.name}: grads {tuple(grads.shape)} need records of shape (n, {self.record_width(d)}),"
                f" got {tuple(records.shape)}"
            )
        # Contiguous parts, so every op sees the same dense layout however the rows were batched. Every op
        # below is out of place (in-place only on fresh temporaries): the caller's tensors are never written.
        emb, *state = (part.contiguous() for part in records.split([d, *self._state_layout(d)], dim=1))
        grad = grads.to(torch.float32).contiguous()
        if self.weight_decay != 0.0:
            grad = grad.add(emb, alpha=self.weight_decay)  # L2 on the gradient, as torch.optim does
        return torch.cat(self._update(emb, state, grad), dim=1)

    def _state_layout(self, dim: int) -> list[int]:
        """Widths of the state fields after the embedding, in record order."""
        return [self.state_width(dim)] if self.state_width(dim) else []

    def record_parts(self, dim: int) -> list[tuple[str, int, str]]:
        """(name, width, domain) of each part of a record: "emb", then the state fields, in record order."""
        widths = self._state_layout(dim)
        return [("emb", dim, REAL), *((n, w, d) for (n, d), w in zip(self.state_fields, widths, strict=True))]

    def project(self, records: Tensor, dim: int) -> Tensor:
        """records [n, W] -> records whose every part lies in its domain; the input is never mutated.

        For records decoded with an inexact code: a rounding error of the sum code turns an Adagrad
        accumulator of 0 into -1e-10, and sqrt of it into NaN. Projection moves such a value to the nearest
        one of its domain (0; for a count, the nearest integer), which is no farther from the true value than
        the decode was (for a count, while its error is below 0.5: integral sums below 2**24 are exact). It
        is the identity (same bits) on records the optimizer produced, and returns `records` itself when
        every part is unbounded. Elementwise: a row's result does not depend on its batch.
        """
        parts = self.record_parts(dim)
        widths = [w for _n, w, _d in parts]
        if records.dim() != 2 or records.shape[1] != sum(widths):
            raise ValueError(
                f"{self.name}: records of dim {dim} are [n, {sum(widths)}], got {tuple(records.shape)}"
            )
        if all(d == REAL for _n, _w, d in parts):
            return records
        out = []
        for part, (_n, _w, domain) in zip(records.split(widths, dim=1), parts, strict=True):
            if domain == NON_NEGATIVE:
                part = part.clamp(min=0.0)
            elif domain == COUNT:
                part = part.round().clamp(0.0, float(MAX_ADAM_STEP))
            out.append(part)
        return torch.cat(out, dim=1)

    @abc.abstractmethod
    def _update(self, emb: Tensor, state: list[Tensor], grad: Tensor) -> list[Tensor]:
        """emb [n, d], state fields per `_state_layout`, grad [n, d] (weight decay applied) -> new record parts."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class Sgd(RowOptimizer):
    """Record `[emb]`; torch.optim.SGD without momentum."""

    name = "sgd"

    def state_width(self, dim: int) -> int:
        return 0

    def _update(self, emb: Tensor, state: list[Tensor], grad: Tensor) -> list[Tensor]:
        return [emb.add(grad, alpha=-self.lr)]


class MomentumSgd(RowOptimizer):
    """Record `[emb, mom(d)]`; torch.optim.SGD(momentum=m, dampening=0, nesterov=False).

    torch sets the buffer to g on the first step; a zero-initialized buffer gives m*0 + g == g, so no
    first-step flag is needed.
    """

    name = "momentum"
    state_fields = (("momentum", REAL),)

    def __init__(self, lr: float, *, momentum: float = 0.9, weight_decay: float = 0.0) -> None:
        super().__init__(lr, weight_decay=weight_decay)
        _check_non_negative("momentum", momentum)
        self.momentum = float(momentum)

    def state_width(self, dim: int) -> int:
        return dim

    def _update(self, emb: Tensor, state: list[Tensor], grad: Tensor) -> list[Tensor]:
        mom = state[0].mul(self.momentum).add(grad)
        return [emb.add(mom, alpha=-self.lr), mom]


class Adagrad(RowOptimizer):
    """Record `[emb, acc(d)]`; torch.optim.Adagrad (lr_decay=0, initial_accumulator_value=0)."""

    name = "adagrad"
    state_fields = (("acc", NON_NEGATIVE),)

    def __init__(self, lr: float, *, eps: float = 1e-10, weight_decay: float = 0.0) -> None:
        super().__init__(lr, weight_decay=weight_decay)
        _check_non_negative("eps", eps)
        self.eps = float(eps)

    def state_width(self, dim: int) -> int:
        return dim

    def _update(self, emb: Tensor, state: list[Tensor], grad: Tensor) -> list[Tensor]:
        acc = state[0].addcmul(grad, grad, value=1)
        std = acc.sqrt().add(self.eps)
        return [emb.addcdiv(grad, std, value=-self.lr), acc]


class RowwiseAdagrad(RowOptimizer):
    """Record `[emb, acc(1)]`; the FBGEMM/TorchRec exact row-wise Adagrad.

    acc += mean(g**2 over the row); emb -= lr * g / (sqrt(acc) + eps). The default eps, 1e-8, is FBGEMM's
    (SplitTableBatchedEmbeddingBagsCodegen), since this is FBGEMM's algorithm, not torch's Adagrad (1e-10).
    """

    name = "rowwise_adagrad"
    state_fields = (("acc", NON_NEGATIVE),)

    def __init__(self, lr: float, *, eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(lr, weight_decay=weight_decay)
        _check_non_negative("eps", eps)
        self.eps = float(eps)

    def state_width(self, dim: int) -> int:
        return 1

    def _update(self, emb: Tensor, state: list[Tensor], grad: Tensor) -> list[Tensor]:
        acc = state[0] + _row_sum(grad * grad) / grad.shape[1]
        denom = acc.sqrt() + self.eps
        return [emb - (self.lr * grad) / denom, acc]


class Adam(RowOptimizer):
    """Record `[emb, m(d), v(d), step(1)]`; per-row ("lazy") torch.optim.Adam, amsgrad off.

    Each row counts its own steps, so a row updated on 3 of 5 global steps is bias-corrected as step 3,
    exactly as torch.optim.Adam run on that row alone for 3 steps.
    """

    name = "adam"
    state_fields = (("exp_avg", REAL), ("exp_avg_sq", NON_NEGATIVE), ("step", COUNT))

    def __init__(
        self,
        lr: float,
        *,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(lr, weight_decay=weight_decay)
        for label, beta in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{label} must be in [0, 1), got {beta}")
        _check_non_negative("eps", eps)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.eps = float(eps)
        self._pow_tables: dict[torch.device, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

    def state_width(self, dim: int) -> int:
        return 2 * dim + 1

    def _state_layout(self, dim: int) -> list[int]:
        return [dim, dim, 1]

    def _update(self, emb: Tensor, state: list[Tensor], grad: Tensor) -> list[Tensor]:
        exp_avg, exp_avg_sq, step = state
        exp_avg = exp_avg.lerp(grad, 1 - self.beta1)
        exp_avg_sq = exp_avg_sq.mul(self.beta2).addcmul(grad, grad, value=1 - self.beta2)
        step = (step + 1).clamp_(max=MAX_ADAM_STEP)  # float32 count saturates at 2**24 anyway

        # Bias corrections in float64, as torch computes them from Python floats, then rounded to float32 the
        # way torch rounds a Python scalar operand.
        pow1, pow2 = self._beta_powers(step)
        # torch.div, not `lr / t`: Tensor.__rtruediv__ is reciprocal(t) * lr, which rounds twice.
        neg_step_size = torch.div(-self.lr, 1.0 - pow1).to(torch.float32)
        bias_correction2_sqrt = (1.0 - pow2).sqrt().to(torch.float32)

        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add(self.eps)
        # torch's CPU addcdiv computes self + (value * t1) / t2; spelled out here because value is per row.
        return [emb + (neg_step_size * exp_avg) / denom, exp_avg, exp_avg_sq, step]

    def _beta_powers(self, step: Tensor) -> tuple[Tensor, Tensor]:
        """beta1**step and beta2**step (float64, [n, 1]) for integral float32 steps in [0, 2**24].

        Two table lookups and one multiply per row: exact Python `beta ** step` below 4096 steps, within
        1.5 ulp (float64) above, and the same bits wherever the row is, unlike a SIMD `pow`.
        """
        lo1, hi1, lo2, hi2 = self._tables(step.device)
        k = step.to(torch.int64)
        lo, hi = k % _POW_SPLIT, k // _POW_SPLIT
        return lo1[lo] * hi1[hi], lo2[lo] * hi2[hi]

    def _tables(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        tables = self._pow_tables.get(device)
        if tables is None:
            built = []
            for beta in (self.beta1, self.beta2):
                lo = [beta**j for j in range(_POW_SPLIT)]
                hi = [beta ** (_POW_SPLIT * j) for j in range(MAX_ADAM_STEP // _POW_SPLIT + 1)]
                built += [torch.tensor(t, dtype=torch.float64, device=device) for t in (lo, hi)]
            tables = (built[0], built[1], built[2], built[3])
            self._pow_tables[device] = tables
        return tables


def make_optimizer(
    name: str,
    lr: float,
    *,
    momentum: float = 0.9,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float | None = None,
    weight_decay: float = 0.0,
) -> RowOptimizer:
    """Build the named optimizer; hyperparameters it does not use are ignored, eps=None means its default."""
    if name == "sgd":
        return Sgd(lr, weight_decay=weight_decay)
    if name == "momentum":
        return MomentumSgd(lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adagrad":
        return Adagrad(lr, weight_decay=weight_decay, **_eps_arg(eps))
    if name == "rowwise_adagrad":
        return RowwiseAdagrad(lr, weight_decay=weight_decay, **_eps_arg(eps))
    if name == "adam":
        return Adam(lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, **_eps_arg(eps))
    raise ValueError(f"unknown optimizer {name!r}; valid optimizers: {', '.join(OPTIMIZERS)}")


def _eps_arg(eps: float | None) -> dict[str, float]:
    return {} if eps is None else {"eps": eps}


def _check_non_negative(label: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{label} must be a finite number >= 0, got {value}")


def _row_sum(x: Tensor) -> Tensor:
    """Sum along dim 1 -> [n, 1] by a fixed pairwise fold of elementwise adds.

    The summation order depends only on the row width, never on n or on the backend's reduction strategy,
    so a row's sum has the same bits however rows are batched.
    """
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        folded = x[:, :half] + x[:, half : 2 * half]
        x = torch.cat([folded, x[:, 2 * half :]], dim=1) if x.shape[1] % 2 else folded
    return x
