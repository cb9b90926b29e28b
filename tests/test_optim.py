"""Row-record optimizers: agreement with torch.optim, per-row Adam steps, and batching-independent bits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ecrec.core.optim import MAX_ADAM_STEP, OPTIMIZERS, RowOptimizer, make_optimizer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# name -> (row optimizer, the torch.optim optimizer it must reproduce), with non-default hyperparameters so a
# hyperparameter that is dropped or swapped shows up.
TORCH_TWINS = {
    "sgd": (dict(lr=0.1), lambda p, wd: torch.optim.SGD([p], lr=0.1, weight_decay=wd)),
    "momentum": (
        dict(lr=0.05, momentum=0.8),
        lambda p, wd: torch.optim.SGD([p], lr=0.05, momentum=0.8, weight_decay=wd),
    ),
    "adagrad": (dict(lr=0.3), lambda p, wd: torch.optim.Adagrad([p], lr=0.3, weight_decay=wd)),
    "adam": (
        dict(lr=0.01, beta1=0.8, beta2=0.99),
        lambda p, wd: torch.optim.Adam([p], lr=0.01, betas=(0.8, 0.99), weight_decay=wd),
    ),
}

# Where the state of each optimizer sits in torch.optim's state dict, in record order.
TORCH_STATE_KEYS = {
    "sgd": [],
    "momentum": ["momentum_buffer"],
    "adagrad": ["sum"],
    "adam": ["exp_avg", "exp_avg_sq", "step"],
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns, so -0.0 vs 0.0 and NaN payloads count as differences."""
    return t.contiguous().view(torch.int32)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    mismatched = (bits(actual) != bits(expected)).sum().item()
    assert mismatched == 0, f"{mismatched} of {actual.numel()} floats differ in their bits"


def run_both(name: str, init: torch.Tensor, grads: list[torch.Tensor], weight_decay: float):
    """Apply the same gradients through the row optimizer and through its torch.optim twin."""
    kwargs, make_torch = TORCH_TWINS[name]
    opt = make_optimizer(name, weight_decay=weight_decay, **kwargs)
    records = opt.init_records(init)
    param = torch.nn.Parameter(init.clone())
    torch_opt = make_torch(param, weight_decay)
    for grad in grads:
        records = opt.apply(records, grad)
        param.grad = grad.clone()
        torch_opt.step()
    return opt, records, param, torch_opt.state[param]


def assert_matches_torch(name: str, records: torch.Tensor, param: torch.Tensor, state: dict, d: int) -> None:
    # Exact equality is expected, not just closeness: each update spells out the same float32 ops, in the
    # same order, as torch.optim's single-tensor CPU path (Adam's bias corrections are computed in float64
    # and rounded to float32 just as torch rounds its Python-float scalars).
    torch.testing.assert_close(records[:, :d], param.detach().reshape(-1, d), rtol=0, atol=0)
    offset = d
    for key in TORCH_STATE_KEYS[name]:
        expected = state[key].reshape(-1, 1).expand(records.shape[0], 1) if key == "step" else state[key]
        width = expected.reshape(records.shape[0], -1).shape[1]
        torch.testing.assert_close(
            records[:, offset : offset + width], expected.reshape(records.shape[0], -1), rtol=0, atol=0
        )
        offset += width
    assert offset == records.shape[1]


def random_grads(steps: int, n: int, d: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Scales spread over orders of magnitude, so eps and the accumulators are exercised, not just lr.
    return [
        torch.randn(n, d, generator=gen) * 10.0 ** torch.randint(-3, 2, (n, 1), generator=gen)
        for _ in range(steps)
    ]


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("name", sorted(TORCH_TWINS))
def test_every_row_updated_every_step_matches_torch_optim(name: str, weight_decay: float) -> None:
    n, d = 37, 8
    init = torch.randn(n, d, generator=torch.Generator().manual_seed(1))
    grads = random_grads(6, n, d, seed=2)
    _, records, param, state = run_both(name, init, grads, weight_decay)
    assert_matches_torch(name, records, param, state, d)
    assert not torch.equal(records[:, :d], init)  # the comparison is not between two untouched tables


@pytest.mark.parametrize("name", sorted(TORCH_TWINS))
def test_dense_parameters_as_width_one_records_match_torch_optim(name: str) -> None:
    dense = torch.randn(101, generator=torch.Generator().manual_seed(3))
    grads = [g.reshape(-1) for g in random_grads(5, 101, 1, seed=4)]
    kwargs, make_torch = TORCH_TWINS[name]
    opt = make_optimizer(name, **kwargs)
    records = opt.init_records(dense.view(-1, 1))
    assert records.shape == (101, opt.record_width(1))
    param = torch.nn.Parameter(dense.clone())
    torch_opt = make_torch(param, 0.0)
    for grad in grads:
        records = opt.apply(records, grad.view(-1, 1))
        param.grad = grad.clone()
        torch_opt.step()
    assert_matches_torch(name, records, param, torch_opt.state[param], 1)


def test_adam_rows_keep_their_own_bias_correction() -> None:
    n, d = 6, 4
    lr, beta1, beta2 = 0.02, 0.7, 0.95  # strong bias correction, so a wrong step count moves the result
    opt = make_optimizer("adam", lr, beta1=beta1, beta2=beta2)
    init = torch.randn(n, d, generator=torch.Generator().manual_seed(5))
    records = opt.init_records(init)
    grads = random_grads(4, n, d, seed=6)
    # Global steps 1..4; row 0 sits out step 2, row 1 is updated every step, row 2 only on step 4.
    updated = [[0, 1, 3, 4, 5], [1, 3], [0, 1, 4], [0, 1, 2]]
    for rows, grad in zip(updated, grads, strict=True):
        idx = torch.tensor(rows)
        records[idx] = opt.apply(records[idx], grad[idx])

    step_col = records[:, 3 * d]
    assert step_col.tolist() == [3.0, 4.0, 1.0, 2.0, 2.0, 1.0]
    for row in (0, 1, 2):
        param = torch.nn.Parameter(init[row].clone())
        torch_opt = torch.optim.Adam([param], lr=lr, betas=(beta1, beta2))
        for rows, grad in zip(updated, grads, strict=True):
            if row in rows:
                param.grad = grad[row].clone()
                torch_opt.step()
        torch.testing.assert_close(records[row, :d], param.detach(), rtol=0, atol=0)
        torch.testing.assert_close(records[row, d : 2 * d], torch_opt.state[param]["exp_avg"], rtol=0, atol=0)


def test_adam_bias_correction_holds_for_large_and_saturated_step_counts() -> None:
    d = 3
    lr, beta1, beta2, eps = 0.01, 0.9, 0.9999, 1e-8
    opt = make_optimizer("adam", lr, beta1=beta1, beta2=beta2)
    # Below and across the 4096-step table split, and at the float32 limit where the count saturates.
    steps = [0.0, 4094.0, 4095.0, 4096.0, 5000.0, 123_456.0, MAX_ADAM_STEP - 1.0, float(MAX_ADAM_STEP)]
    gen = torch.Generator().manual_seed(7)
    n = len(steps)
    records = torch.cat(
        [
            torch.randn(n, d, generator=gen),
            torch.randn(n, d, generator=gen),
            torch.rand(n, d, generator=gen),
            torch.tensor(steps).view(-1, 1),
        ],
        dim=1,
    )
    grads = torch.randn(n, d, generator=gen)
    out = opt.apply(records, grads)

    assert out[:, 3 * d].tolist() == [min(s + 1, MAX_ADAM_STEP) for s in steps]
    # Reference: torch.optim.Adam's formulas for one row, with Python's float pow for the bias corrections.
    for row, step in enumerate(out[:, 3 * d].tolist()):
        emb, m, v = records[row, :d], records[row, d : 2 * d], records[row, 2 * d : 3 * d]
        g = grads[row]
        m = m.lerp(g, 1 - beta1)
        v = v.mul(beta2).addcmul(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add(eps)
        expected = emb.addcdiv(m, denom, value=-step_size)
        # Above 4096 steps the table product may differ from libm's pow by an ulp of float64, which could
        # (rarely) flip the last float32 bit of the step size: close, not necessarily equal.
        torch.testing.assert_close(out[row, :d], expected, rtol=2e-7, atol=0)
        torch.testing.assert_close(out[row, d : 3 * d], torch.cat([m, v]), rtol=0, atol=0)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("eps", [None, 0.5])
def test_rowwise_adagrad_matches_reference(eps: float | None, weight_decay: float) -> None:
    n, d, lr = 29, 6, 0.2
    opt = make_optimizer("rowwise_adagrad", lr, eps=eps, weight_decay=weight_decay)
    expected_eps = 1e-8 if eps is None else eps  # FBGEMM's default
    init = torch.randn(n, d, generator=torch.Generator().manual_seed(8))
    records = opt.init_records(init)
    assert records.shape == (n, d + 1)
    emb, acc = init.clone(), torch.zeros(n, 1)
    for grad in random_grads(5, n, d, seed=9):
        records = opt.apply(records, grad)
        g = grad + weight_decay * emb
        acc = acc + (g**2).mean(dim=1, keepdim=True)
        emb = emb - lr * g / (acc.sqrt() + expected_eps)
    # The optimizer sums each row by a fixed pairwise fold, torch's mean by its own order: a rounding apart.
    torch.testing.assert_close(records[:, d:], acc, rtol=1e-6, atol=0)
    torch.testing.assert_close(records[:, :d], emb, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_record_layout_and_initial_state(name: str) -> None:
    opt = make_optimizer(name, 0.1)
    expected_state = {"sgd": 0, "momentum": 16, "adagrad": 16, "rowwise_adagrad": 1, "adam": 33}[name]
    assert opt.name == name
    assert opt.state_width(16) == expected_state
    assert opt.record_width(16) == 16 + expected_state
    rows = torch.randn(5, 16, dtype=torch.float64)
    records = opt.init_records(rows)
    assert records.dtype == torch.float32 and records.shape == (5, 16 + expected_state)
    torch.testing.assert_close(records[:, :16], rows.float(), rtol=0, atol=0)
    assert torch.count_nonzero(records[:, 16:]) == 0


def table_after_warmup(opt: RowOptimizer, n: int, d: int, device: str, seed: int) -> torch.Tensor:
    """Records with non-trivial state: a few steps on random subsets, so Adam rows hold different steps."""
    gen = torch.Generator().manual_seed(seed)
    records = opt.init_records(torch.randn(n, d, generator=gen)).to(device)
    for _ in range(3):
        idx = torch.randperm(n, generator=gen)[: max(1, n // 2)].to(device)
        records[idx] = opt.apply(records[idx], torch.randn(len(idx), d, generator=gen).to(device))
    return records


def splits_agree(opt: RowOptimizer, records: torch.Tensor, grads: torch.Tensor, parts: list[int]) -> None:
    whole = opt.apply(records, grads)
    pieces = [opt.apply(r, g) for r, g in zip(records.split(parts), grads.split(parts), strict=True)]
    assert_same_bits(torch.cat(pieces), whole)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [1, 7, 16])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_apply_gives_the_same_bits_however_rows_are_split(name: str, d: int, device: str) -> None:
    n = 53
    opt = make_optimizer(name, 0.05, weight_decay=0.01)
    records = table_after_warmup(opt, n, d, device, seed=10)
    grads = torch.randn(n, d, generator=torch.Generator().manual_seed(11)).to(device)
    splits_agree(opt, records, grads, [1] * n)  # one row at a time
    splits_agree(opt, records, grads, [26, 27])  # odd halves
    splits_agree(opt, records, grads, [3, 45, 5])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_apply_commutes_with_row_permutation(name: str, device: str) -> None:
    n, d = 41, 9
    opt = make_optimizer(name, 0.05)
    records = table_after_warmup(opt, n, d, device, seed=12)
    grads = torch.randn(n, d, generator=torch.Generator().manual_seed(13)).to(device)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(14)).to(device)
    assert_same_bits(opt.apply(records[perm], grads[perm]), opt.apply(records, grads)[perm])


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(OPTIMIZERS),
    n=st.integers(2, 70),
    d=st.integers(1, 33),
    cut=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_split_invariance_for_random_shapes(name: str, n: int, d: int, cut: float, seed: int) -> None:
    opt = make_optimizer(name, 0.03, weight_decay=0.02)
    records = table_after_warmup(opt, n, d, "cpu", seed)
    grads = torch.randn(n, d, generator=torch.Generator().manual_seed(seed + 1))
    head = min(n - 1, max(1, int(cut * n)))
    splits_agree(opt, records, grads, [head, n - head])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_apply_never_mutates_its_inputs(name: str, device: str) -> None:
    n, d = 10, 4
    opt = make_optimizer(name, 0.1, weight_decay=0.1)
    records = table_after_warmup(opt, n, d, device, seed=15)
    grads = torch.randn(n, d, generator=torch.Generator().manual_seed(16)).to(device)
    records_before, grads_before = records.clone(), grads.clone()
    out = opt.apply(records, grads)
    assert_same_bits(records, records_before)
    assert_same_bits(grads, grads_before)
    assert not torch.equal(out, records)
    out.fill_(0.0)  # the result is a fresh tensor, not a view of the input
    assert_same_bits(records, records_before)


def test_apply_rejects_records_that_do_not_fit_the_gradients() -> None:
    opt = make_optimizer("adagrad", 0.1)
    with pytest.raises(ValueError, match="records of shape"):
        opt.apply(torch.zeros(4, 7), torch.zeros(4, 4))
    with pytest.raises(ValueError, match="float32"):
        opt.apply(torch.zeros(4, 8, dtype=torch.float64), torch.zeros(4, 4))


def test_apply_on_no_rows_returns_no_rows() -> None:
    for name in OPTIMIZERS:
        opt = make_optimizer(name, 0.1)
        out = opt.apply(torch.zeros(0, opt.record_width(5)), torch.zeros(0, 5))
        assert out.shape == (0, opt.record_width(5))


def test_make_optimizer_rejects_unknown_names_listing_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        make_optimizer("lamb", 0.1)
    assert "lamb" in str(info.value)
    for name in OPTIMIZERS:
        assert name in str(info.value)


def test_make_optimizer_eps_defaults_follow_the_reference_implementations() -> None:
    assert make_optimizer("adagrad", 0.1).eps == 1e-10  # torch.optim.Adagrad
    assert make_optimizer("rowwise_adagrad", 0.1).eps == 1e-8  # FBGEMM row-wise Adagrad
    assert make_optimizer("adam", 0.1).eps == 1e-8  # torch.optim.Adam
    assert make_optimizer("adam", 0.1, eps=1e-6).eps == 1e-6


@pytest.mark.parametrize("bad", [dict(lr=-0.1), dict(lr=float("nan")), dict(weight_decay=-1.0)])
def test_make_optimizer_rejects_invalid_hyperparameters(bad: dict) -> None:
    kwargs = dict(lr=0.1) | bad
    with pytest.raises(ValueError):
        make_optimizer("adam", **kwargs)
    with pytest.raises(ValueError, match="beta2"):
        make_optimizer("adam", 0.1, beta2=1.0)
