"""The hot-path primitives of ecrec.core.vec agree with the torch idioms they replace."""

import pytest
import torch

from ecrec.core.vec import all_finite, all_unique, in_range


@pytest.mark.parametrize("n", [0, 1, 2, 7, 400, 8192])
def test_all_unique_agrees_with_torch_unique(n):
    gen = torch.Generator().manual_seed(n)
    distinct = torch.randperm(10 * n + 1, generator=gen)[:n]
    assert all_unique(distinct) is (distinct.unique().numel() == distinct.numel())
    assert all_unique(distinct)
    if n >= 2:
        dup = distinct.clone()
        dup[n - 1] = dup[n // 3]  # one value twice, anywhere in the order
        assert not all_unique(dup)
        assert all_unique(distinct.flip(0))


def test_all_unique_on_a_strided_view():
    x = torch.arange(20)
    assert all_unique(x[::3])
    assert not all_unique(torch.tensor([5, 1, 5])[::1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_all_finite_finds_nan_and_inf_anywhere(dtype):
    x = torch.randn(37, 16, dtype=dtype)
    assert all_finite(x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[36, 15] = bad
        assert not all_finite(y)
        assert not all_finite(y.t())  # non-contiguous
        assert not all_finite(y[30:])  # a view with an offset


def test_all_finite_on_empty_integer_and_grad_tensors():
    assert all_finite(torch.empty(0, 16))
    assert all_finite(torch.arange(5))
    w = torch.randn(4, requires_grad=True)
    assert all_finite(w)
    assert not all_finite(w * float("inf"))


def test_in_range():
    assert in_range(torch.empty(0, dtype=torch.int64), 0)
    assert in_range(torch.tensor([0, 9, 3]), 10)
    assert not in_range(torch.tensor([0, 10]), 10)
    assert not in_range(torch.tensor([-1, 3]), 10)


def test_take_copies_a_range_as_a_slice_and_anything_else_as_a_gather():
    from ecrec.core.vec import take

    t = torch.arange(20.0).view(10, 2)
    for index in (torch.arange(3, 7), torch.tensor([5, 1, 8]), torch.tensor([4])):
        got = take(t, index)
        assert torch.equal(got, t[index])
        got += 1  # a copy: the table is not touched
    assert torch.equal(t, torch.arange(20.0).view(10, 2))
