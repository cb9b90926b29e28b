"""The DLRM's dense part, its flat-vector views and the deterministic initial values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ecrec.model import (
    DLRM,
    ModelConfig,
    counter_bits,
    counter_uniform,
    dense_numel,
    flatten_dense,
    flatten_dense_grad,
    init_dense,
    init_embedding_rows,
    load_dense_,
    splitmix64,
    top_input_width,
)

TINY = dict(num_dense=5, num_tables=3, dim=4, bottom_mlp=[8, 4], top_mlp=[6, 1])
TINY_ARGS = (5, 3, 4, [8, 4], [6, 1])


def tiny() -> DLRM:
    return DLRM(**TINY)


def test_forward_returns_one_logit_per_sample() -> None:
    m = tiny()
    out = m(torch.randn(7, 5), torch.randn(7, 3, 4))
    assert out.shape == (7,)
    assert out.dtype == torch.float32


def test_top_input_width_is_367_for_the_criteo_kaggle_shape() -> None:
    assert top_input_width(26, 16) == 367
    m = DLRM(13, 26, 16, [512, 256, 64, 16], [512, 256, 1])
    assert m.top[0].in_features == 367
    assert m(torch.randn(2, 13), torch.randn(2, 26, 16)).shape == (2,)


def test_forward_is_bottom_mlp_then_lower_triangle_dots_then_top_mlp() -> None:
    m = tiny()
    dense, sparse = torch.randn(3, 5), torch.randn(3, 3, 4)
    b = m.bottom
    x = b[2](torch.relu(b[0](dense)))  # ReLU between layers, none after the last
    vecs = [x, *sparse.unbind(1)]
    dots = [(vecs[i] * vecs[j]).sum(1) for i in range(4) for j in range(i)]
    t = m.top
    expected = t[2](torch.relu(t[0](torch.cat([x, torch.stack(dots, 1)], 1)))).squeeze(1)
    torch.testing.assert_close(m(dense, sparse), expected)


def test_forward_rejects_sparse_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match="sparse must be"):
        tiny()(torch.randn(2, 5), torch.randn(2, 4, 4))


@pytest.mark.parametrize(
    ("bottom", "top", "message"),
    [
        ([8, 3], [6, 1], "must equal the embedding dim 4"),
        ([8, 4], [6, 2], "must be 1"),
        ([], [1], "non-empty"),
    ],
)
def test_mlp_widths_are_validated(bottom: list[int], top: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DLRM(5, 3, 4, bottom, top)
    with pytest.raises(ValueError, match=message):
        init_dense(5, 3, 4, bottom, top, seed=0)


def test_flatten_load_round_trip_is_in_place() -> None:
    m = tiny()
    params = list(m.parameters())
    flat = torch.randn(dense_numel(m), dtype=torch.float64)  # any dtype: converted on load
    load_dense_(m, flat)
    assert all(a is b for a, b in zip(params, m.parameters(), strict=True))  # optimizers keep references
    out = flatten_dense(m)
    assert out.dtype == torch.float32 and out.shape == (dense_numel(m),)
    torch.testing.assert_close(out, flat.float())
    # flatten_dense is a detached copy: changing it does not touch the model.
    out.zero_()
    torch.testing.assert_close(flatten_dense(m), flat.float())


def test_load_dense_rejects_a_vector_of_the_wrong_size() -> None:
    m = tiny()
    with pytest.raises(ValueError, match=str(dense_numel(m))):
        load_dense_(m, torch.zeros(dense_numel(m) + 1))


def test_flatten_dense_grad_uses_the_parameter_order() -> None:
    m = tiny()
    load_dense_(m, torch.randn(dense_numel(m)))
    for p in m.parameters():
        p.grad = p.detach() * 3 + 1  # each gradient entry tied to its parameter entry
    torch.testing.assert_close(flatten_dense_grad(m), flatten_dense(m) * 3 + 1)


def test_flatten_dense_grad_after_backward_with_zeros_for_missing_grads() -> None:
    m = tiny()
    m(torch.randn(4, 5), torch.randn(4, 3, 4)).sum().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
    torch.testing.assert_close(flatten_dense_grad(m), expected)
    last_bias = m.top[2].bias
    last_bias.grad = None
    g = flatten_dense_grad(m)
    assert g.shape == (dense_numel(m),)
    assert torch.equal(g[-1:], torch.zeros(1))
    assert torch.equal(g[:-1], expected[:-1])


def test_init_dense_is_deterministic_per_seed_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a = init_dense(*TINY_ARGS, seed=3)
    b = init_dense(*TINY_ARGS, seed=3)
    c = init_dense(*TINY_ARGS, seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.dtype == torch.float32 and a.numel() == dense_numel(tiny())


def test_init_dense_bounds_each_layer_by_its_fan_in() -> None:
    m = DLRM(13, 4, 16, [64, 16], [32, 1])
    load_dense_(m, init_dense(13, 4, 16, [64, 16], [32, 1], seed=11))
    for layer in [*m.bottom, *m.top]:
        if isinstance(layer, torch.nn.Linear):
            bound = 1 / math.sqrt(layer.in_features)
            assert layer.weight.abs().max() <= bound and layer.bias.abs().max() <= bound
            # Spread over the whole range (>= 32 draws each), not squeezed near zero.
            assert layer.weight.abs().max() > 0.8 * bound
            assert layer.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.25)


def test_building_a_dlrm_draws_nothing_from_global_rng_and_holds_seed_zero() -> None:
    state = torch.random.get_rng_state()
    m = tiny()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(flatten_dense(m), init_dense(*TINY_ARGS, seed=0))


def test_init_embedding_rows_is_a_pure_function_of_the_global_id() -> None:
    full = init_embedding_rows(torch.arange(20), 8, seed=5)
    some = init_embedding_rows(torch.tensor([5, 9]), 8, seed=5)
    assert torch.equal(some, full[[5, 9]])
    # Order and batching do not matter either: a reversed, chunked init gives the same rows.
    rev = torch.cat(
        [
            init_embedding_rows(torch.arange(19, 9, -1), 8, 5),
            init_embedding_rows(torch.arange(9, -1, -1), 8, 5),
        ]
    )
    assert torch.equal(rev.flip(0), full)
    assert not torch.equal(init_embedding_rows(torch.arange(20), 8, seed=6), full)


def test_init_embedding_rows_handles_ids_beyond_32_bits() -> None:
    big = torch.tensor([2**32 + 7, 2**40, 2**40 + 1, 7], dtype=torch.int64)
    rows = init_embedding_rows(big, 8, seed=0)
    assert rows.shape == (4, 8) and rows.dtype == torch.float32
    assert torch.isfinite(rows).all()
    assert len({tuple(r) for r in rows.tolist()}) == 4  # 2**32 + 7 and 7 do not alias
    assert torch.equal(rows[1], init_embedding_rows(torch.tensor([2**40]), 8, seed=0)[0])


def test_init_embedding_rows_values_are_small_centered_and_uncorrelated() -> None:
    dim = 16
    rows = init_embedding_rows(torch.arange(2**40, 2**40 + 50_000), dim, seed=1)
    scale = 1 / math.sqrt(dim)
    assert rows.abs().max() <= scale
    assert abs(rows.mean().item()) < 0.01 * scale
    # Uniform on [-s, s] has standard deviation s / sqrt(3).
    assert rows.std().item() == pytest.approx(scale / math.sqrt(3), rel=0.02)
    corr = torch.corrcoef(rows.T.double()) - torch.eye(dim, dtype=torch.float64)
    assert corr.abs().max() < 0.03


def _fmix32_ref(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@settings(max_examples=50, deadline=None)
@given(key=st.integers(0, 2**62), seed=st.integers(-(2**70), 2**70))
def test_counter_bits_stays_in_32_bits_and_matches_python_big_int_arithmetic(key: int, seed: int) -> None:
    # The torch version splits products to stay below 2**63; Python's unbounded ints are the reference.
    s = splitmix64(seed)
    s0, s1, s2 = s & 0xFFFFFFFF, s >> 32, splitmix64(s) & 0xFFFFFFFF
    h = _fmix32_ref(_fmix32_ref((key & 0xFFFFFFFF) ^ s0) ^ (key >> 32) ^ s1)
    expected = [_fmix32_ref(h ^ _fmix32_ref(((c * 0x9E3779B9) & 0xFFFFFFFF) ^ s2)) for c in range(3)]
    assert counter_bits(torch.tensor([key]), 3, seed)[0].tolist() == expected


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(-(2**70), 2**70), dim=st.integers(1, 40), first=st.integers(0, 2**62 - 5000))
def test_the_cpu_paths_match_the_torch_path_other_devices_take_bit_for_bit(seed: int, dim: int, first: int):
    # On the CPU the hash runs in uint32 numpy and the rows in blocks (model._init_rows_np); a CUDA worker or
    # server takes the int64 torch path. Every initial row must be the same number either way.
    from ecrec.model import _counter_bits_torch, _seed_words, embedding_init_scale

    ids = torch.cat([torch.arange(first, first + 4500), torch.tensor([0, 2**62, 2**32 - 1, 2**32])])
    ref_bits = _counter_bits_torch(ids, dim, *_seed_words(seed))
    assert torch.equal(counter_bits(ids, dim, seed), ref_bits)
    u = ((ref_bits >> 8).to(torch.float64) + 0.5) / float(1 << 24)
    assert torch.equal(counter_uniform(ids, dim, seed), u)
    ref_rows = ((2.0 * u - 1.0) * embedding_init_scale(dim)).to(torch.float32)
    assert torch.equal(init_embedding_rows(ids, dim, seed), ref_rows)


def test_model_config_offsets_rows_and_build() -> None:
    cfg = ModelConfig(num_dense=5, dim=4, table_sizes=[10, 3, 7], bottom_mlp=[8, 4], top_mlp=(6, 1))
    assert cfg.table_sizes == (10, 3, 7) and cfg.bottom_mlp == (8, 4)
    assert hash(cfg) == hash(ModelConfig(5, 4, (10, 3, 7), (8, 4), (6, 1)))
    assert (cfg.num_tables, cfg.num_rows) == (3, 20)
    assert torch.equal(cfg.table_offsets, torch.tensor([0, 10, 13]))
    assert cfg.table_offsets.dtype == torch.int64
    m = cfg.build()
    assert isinstance(m, DLRM) and dense_numel(m) == cfg.init_dense(0).numel() == cfg.dense_numel
    with pytest.raises(ValueError, match="table_sizes"):
        ModelConfig(5, 4, (10, 0), (8, 4), (6, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_runs_on_cuda_with_parameters_loaded_from_host() -> None:
    m = tiny().cuda()
    flat = init_dense(*TINY_ARGS, seed=2)
    load_dense_(m, flat)
    assert torch.equal(flatten_dense(m).cpu(), flat)
    sparse = torch.randn(4, 3, 4, device="cuda", requires_grad=True)
    m(torch.randn(4, 5, device="cuda"), sparse).sum().backward()
    assert flatten_dense_grad(m).device.type == "cuda" and sparse.grad is not None
    ids = torch.tensor([3, 2**40], device="cuda")
    assert torch.equal(init_embedding_rows(ids, 8, 1).cpu(), init_embedding_rows(ids.cpu(), 8, 1))
