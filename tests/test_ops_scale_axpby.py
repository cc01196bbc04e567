"""scale_ (copy with scale and dtype conversion) and axpby_ (accumulation), on both backends."""

from __future__ import annotations

import itertools

import pytest
import torch

import _reference as ref

DTYPE_PAIRS = list(itertools.product(ref.FLOAT_DTYPES, repeat=2))
PAIR_IDS = [f"{ref.dtype_id(a)}-to-{ref.dtype_id(b)}" for a, b in DTYPE_PAIRS]
SIZES = (*ref.EDGE_SIZES, ref.MULTI_CHUNK_SIZE, 6)


def _tolerance(dtype):
    # The kernels round a*x and b*y to fp32 before adding (CUDA may fuse them);
    # the reference adds in float64. One fp32 rounding apart at most, which a
    # half-precision result can turn into one half ulp.
    if dtype == torch.float32:
        return {"rtol": 1e-6, "atol": 1e-6}
    return {}  # torch's defaults for fp16/bf16: about one ulp


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), DTYPE_PAIRS, ids=PAIR_IDS)
def test_scale_converts_dtype_and_multiplies_in_fp32(amp_ops, device, src_dtype, dst_dtype):
    src = ref.random_tensors(SIZES, [src_dtype], seed=10, device=device, scale=100.0)
    dst = [torch.full_like(s, 7.0, dtype=dst_dtype) for s in src]
    expected, expected_flag = ref.scale(src, [dst_dtype] * len(src), 1.0 / 3.0)
    found_inf = ref.flag(0.0, device)
    amp_ops.scale_(src, dst, ref.flag(1.0 / 3.0, device), found_inf)
    assert found_inf.item() == float(expected_flag) == 0.0
    for got, want in zip(dst, expected):
        assert got.dtype == dst_dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_scale_by_one_is_an_exact_cast_of_a_mixed_list(amp_ops, device):
    # The master -> model parameter copy of O2.
    src = ref.random_tensors([1031, 3, 0, 64], [torch.float32], seed=11, device=device)
    dst_dtypes = [torch.float16, torch.bfloat16, torch.float16, torch.float32]
    dst = [torch.empty_like(s, dtype=d) for s, d in zip(src, dst_dtypes)]
    amp_ops.scale_(src, dst, ref.flag(1.0, device), ref.flag(0.0, device))
    for s, d in zip(src, dst):
        assert torch.equal(d, s.to(d.dtype))


def test_scale_in_place_when_dst_is_src(amp_ops, device):
    src = ref.random_tensors([1031, 5, 1], ref.FLOAT_DTYPES, seed=12, device=device)
    expected, _ = ref.scale(src, [t.dtype for t in src], 0.25)
    amp_ops.scale_(src, src, ref.flag(0.25, device), ref.flag(0.0, device))
    for got, want in zip(src, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("bad", (float("inf"), float("nan")))
@pytest.mark.parametrize("src_dtype", ref.FLOAT_DTYPES, ids=ref.dtype_id)
def test_scale_flags_bad_source_elements(amp_ops, device, src_dtype, bad):
    numel = 1031
    for position in ref.bad_positions(numel):
        src = ref.random_tensors([4, numel], [src_dtype], seed=13, device=device)
        src[1][position] = bad
        dst = [torch.zeros_like(s, dtype=torch.float32) for s in src]
        expected, _ = ref.scale(src, [torch.float32] * 2, 2.0)
        found_inf = ref.flag(0.0, device)
        amp_ops.scale_(src, dst, ref.flag(2.0, device), found_inf)
        assert found_inf.item() == 1.0, f"missed {bad} at position {position}"
        for got, want in zip(dst, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("position", (0, 1030, 1028), ids=("first", "last", "tail"))
def test_scale_flags_overflow_of_the_fp16_result(amp_ops, device, position):
    src = [torch.ones(1031, device=device)]
    src[0][position] = 60000.0
    dst = [torch.zeros(1031, dtype=torch.float16, device=device)]
    found_inf = ref.flag(0.0, device)
    amp_ops.scale_(src, dst, ref.flag(2.0, device), found_inf)  # 120000 > fp16 max 65504
    assert found_inf.item() == 1.0
    assert torch.isinf(dst[0][position])


def test_scale_never_clears_found_inf(amp_ops, device):
    src = ref.random_tensors([33, 1], ref.FLOAT_DTYPES, seed=14, device=device)
    found_inf = ref.flag(1.0, device)
    amp_ops.scale_(src, ref.clone_all(src), ref.flag(1.0, device), found_inf)
    assert found_inf.item() == 1.0


def test_scale_of_several_hundred_mixed_tensors(amp_ops, device):
    sizes = [1 + i % 3 for i in range(300)]
    src = ref.random_tensors(sizes, ref.FLOAT_DTYPES, seed=15, device=device)
    dst = [torch.empty_like(s, dtype=torch.float32) for s in src]
    expected, _ = ref.scale(src, [torch.float32] * len(src), 0.5)
    amp_ops.scale_(src, dst, ref.flag(0.5, device), ref.flag(0.0, device))
    for got, want in zip(dst, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(("x_dtype", "y_dtype"), DTYPE_PAIRS, ids=PAIR_IDS)
def test_axpby_matches_reference(amp_ops, device, x_dtype, y_dtype):
    x = ref.random_tensors(SIZES, [x_dtype], seed=20, device=device, scale=1000.0)
    y = ref.random_tensors(SIZES, [y_dtype], seed=21, device=device)
    expected, expected_flag = ref.axpby(x, y, 2.0**-10, 0.75)
    found_inf = ref.flag(0.0, device)
    amp_ops.axpby_(x, y, ref.flag(2.0**-10, device), 0.75, found_inf)
    assert found_inf.item() == float(expected_flag) == 0.0
    for got, want in zip(y, expected):
        assert got.dtype == y_dtype
        torch.testing.assert_close(got, want, **_tolerance(y_dtype))


def test_axpby_accumulates_gradients_over_two_backward_passes(amp_ops, device):
    # Stash unscaled grads, then add the next pass's grads scaled by 1/1024.
    stash = ref.random_tensors([1031, 7], [torch.float32], seed=22, device=device)
    new_scaled = ref.random_tensors([1031, 7], [torch.float16], seed=23, device=device, scale=1024.0)
    expected = [s + n.float() / 1024.0 for s, n in zip(stash, new_scaled)]
    amp_ops.axpby_(new_scaled, stash, ref.flag(1.0 / 1024.0, device), 1.0, ref.flag(0.0, device))
    for got, want in zip(stash, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_axpby_when_x_is_y(amp_ops, device):
    y = ref.random_tensors([1031, 1], ref.FLOAT_DTYPES, seed=24, device=device)
    expected, _ = ref.axpby(y, y, 0.5, 0.25)
    amp_ops.axpby_(y, y, ref.flag(0.5, device), 0.25, ref.flag(0.0, device))
    for got, want in zip(y, expected):
        torch.testing.assert_close(got, want, **_tolerance(got.dtype))


@pytest.mark.parametrize("bad", (float("inf"), float("-inf"), float("nan")))
@pytest.mark.parametrize("x_dtype", ref.FLOAT_DTYPES, ids=ref.dtype_id)
def test_axpby_flags_bad_x_elements(amp_ops, device, x_dtype, bad):
    numel = 1031
    for position in ref.bad_positions(numel):
        x = ref.random_tensors([5, numel, 2], [x_dtype], seed=25, device=device)
        x[1][position] = bad
        y = ref.random_tensors([5, numel, 2], [torch.float32], seed=26, device=device)
        found_inf = ref.flag(0.0, device)
        amp_ops.axpby_(x, y, ref.flag(0.5, device), 1.0, found_inf)
        assert found_inf.item() == 1.0, f"missed {bad} at position {position}"
        assert not torch.isfinite(y[1][position])


def test_axpby_flags_a_result_that_overflows_fp16_y(amp_ops, device):
    x = [torch.full((33,), 40000.0, device=device)]
    y = [torch.full((33,), 40000.0, dtype=torch.float16, device=device)]
    found_inf = ref.flag(0.0, device)
    amp_ops.axpby_(x, y, ref.flag(1.0, device), 1.0, found_inf)  # 80000 > fp16 max
    assert found_inf.item() == 1.0


def test_axpby_never_clears_found_inf_and_accepts_empty_lists(amp_ops, device):
    found_inf = ref.flag(1.0, device)
    amp_ops.axpby_([], [], ref.flag(1.0, device), 1.0, found_inf)
    x = ref.random_tensors([3, 0], [torch.float32], seed=27, device=device)
    amp_ops.axpby_(x, ref.clone_all(x), ref.flag(1.0, device), 1.0, found_inf)
    assert found_inf.item() == 1.0
