"""check_finite and unscale_: the finite check and the in-place unscale, on both backends."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _reference as ref
from _backends import BACKENDS, namespace_of

BAD_VALUES = (float("inf"), float("-inf"), float("nan"))


def _mixed_list(device, seed=0):
    sizes = (*ref.EDGE_SIZES, ref.MULTI_CHUNK_SIZE, 7)
    return ref.random_tensors(sizes, ref.FLOAT_DTYPES, seed=seed, device=device)


@pytest.mark.parametrize("dtype", ref.FLOAT_DTYPES, ids=ref.dtype_id)
@pytest.mark.parametrize("numel", (*ref.EDGE_SIZES, ref.MULTI_CHUNK_SIZE))
def test_check_finite_leaves_found_inf_zero_for_finite_tensors(amp_ops, device, dtype, numel):
    tensors = ref.random_tensors([numel, 5], [dtype], seed=1, device=device, scale=1e3)
    originals = ref.clone_all(tensors)
    found_inf = ref.flag(0.0, device)
    amp_ops.check_finite(tensors, found_inf)
    assert found_inf.item() == 0.0
    for t, original in zip(tensors, originals):
        assert torch.equal(t, original)


@pytest.mark.parametrize("bad", BAD_VALUES)
@pytest.mark.parametrize("dtype", ref.FLOAT_DTYPES, ids=ref.dtype_id)
@pytest.mark.parametrize("numel", (1, 33, 1031, ref.MULTI_CHUNK_SIZE))
def test_check_finite_flags_one_bad_element_anywhere_in_one_tensor_of_many(amp_ops, device, dtype, numel, bad):
    tensors = ref.random_tensors([17, numel, 0, 5, 1], [dtype, torch.float32], seed=2, device=device)
    for position in ref.bad_positions(numel):
        poisoned = ref.clone_all(tensors)
        poisoned[1][position] = bad
        found_inf = ref.flag(0.0, device)
        amp_ops.check_finite(poisoned, found_inf)
        assert found_inf.item() == 1.0, f"missed {bad} at position {position} of {numel}"


def test_check_finite_handles_several_hundred_tiny_tensors(amp_ops, device):
    tensors = ref.random_tensors([1 + i % 5 for i in range(300)], ref.FLOAT_DTYPES, seed=3, device=device)
    found_inf = ref.flag(0.0, device)
    amp_ops.check_finite(tensors, found_inf)
    assert found_inf.item() == 0.0
    tensors[299][-1] = float("nan")
    amp_ops.check_finite(tensors, found_inf)
    assert found_inf.item() == 1.0


def test_check_finite_never_clears_found_inf(amp_ops, device):
    found_inf = ref.flag(1.0, device)
    amp_ops.check_finite(_mixed_list(device), found_inf)
    assert found_inf.item() == 1.0


def test_check_finite_accepts_an_empty_list(amp_ops):
    found_inf = ref.flag(0.0)
    amp_ops.check_finite([], found_inf)
    assert found_inf.item() == 0.0


def test_check_finite_accepts_zero_dim_tensors_and_found_inf(amp_ops):
    found_inf = torch.zeros((), dtype=torch.float32)
    amp_ops.check_finite([torch.tensor(float("inf"))], found_inf)
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("inv_scale", (1.0, 2.0**-16, 1.0 / 3.0, 1e-30))
def test_unscale_multiplies_mixed_list_in_fp32_and_rounds_once(amp_ops, device, inv_scale):
    grads = ref.random_tensors(
        [*ref.EDGE_SIZES, ref.MULTI_CHUNK_SIZE, 7, 8], ref.FLOAT_DTYPES, seed=4, device=device, scale=1e4
    )
    expected = ref.unscale(grads, inv_scale)
    found_inf = ref.flag(0.0, device)
    amp_ops.unscale_(grads, found_inf, ref.flag(inv_scale, device))
    assert found_inf.item() == 0.0
    for got, want in zip(grads, expected):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_unscale_of_several_hundred_tensors_matches_reference(amp_ops, device):
    grads = ref.random_tensors([1 + i % 4 for i in range(300)], ref.FLOAT_DTYPES, seed=5, device=device)
    expected = ref.unscale(grads, 0.125)
    found_inf = ref.flag(0.0, device)
    amp_ops.unscale_(grads, found_inf, ref.flag(0.125, device))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("bad", BAD_VALUES)
@pytest.mark.parametrize("dtype", ref.FLOAT_DTYPES, ids=ref.dtype_id)
def test_unscale_flags_bad_grads_and_still_unscales_the_rest(amp_ops, device, dtype, bad):
    numel = 1031
    for position in ref.bad_positions(numel):
        grads = ref.random_tensors([9, numel, 3], [dtype], seed=6, device=device)
        grads[1][position] = bad
        expected = ref.unscale(grads, 0.5)
        found_inf = ref.flag(0.0, device)
        amp_ops.unscale_(grads, found_inf, ref.flag(0.5, device))
        assert found_inf.item() == 1.0, f"missed {bad} at position {position}"
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_unscale_checks_grads_before_scaling(amp_ops):
    # 1e30 * 1e-30 is finite, but the contract checks the incoming grads only:
    # an inf grad stays flagged even when inv_scale is 0 (inf * 0 = NaN).
    grads = [torch.tensor([float("inf"), 1.0])]
    found_inf = ref.flag(0.0)
    amp_ops.unscale_(grads, found_inf, ref.flag(0.0))
    assert found_inf.item() == 1.0


def test_unscale_never_clears_found_inf(amp_ops, device):
    found_inf = ref.flag(1.0, device)
    amp_ops.unscale_(_mixed_list(device), found_inf, ref.flag(0.5, device))
    assert found_inf.item() == 1.0


def test_unscale_accepts_an_empty_list_and_empty_tensors(amp_ops):
    found_inf = ref.flag(0.0)
    amp_ops.unscale_([], found_inf, ref.flag(0.5))
    amp_ops.unscale_([torch.empty(0), torch.empty(0, dtype=torch.float16)], found_inf, ref.flag(0.5))
    assert found_inf.item() == 0.0


def _tensor_strategy(dtype):
    values = st.one_of(
        st.floats(min_value=-1e3, max_value=1e3, width=16),
        st.sampled_from([float("inf"), float("-inf"), float("nan"), 0.0, -0.0]),
    )
    return st.lists(values, min_size=0, max_size=40).map(lambda v: torch.tensor(v, dtype=dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(
    tensors=st.lists(st.sampled_from(ref.FLOAT_DTYPES).flatmap(_tensor_strategy), min_size=0, max_size=6),
    already_set=st.booleans(),
)
def test_check_finite_agrees_with_isfinite_all(backend, tensors, already_set):
    amp_ops = namespace_of(backend)
    found_inf = ref.flag(1.0 if already_set else 0.0)
    amp_ops.check_finite(tensors, found_inf)
    expected = already_set or not all(bool(torch.isfinite(t).all()) for t in tensors)
    assert found_inf.item() == float(expected)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(min_value=2.0**-10, max_value=2.0**10), min_size=1, max_size=50),
    signs=st.lists(st.booleans(), min_size=50, max_size=50),
    dtype=st.sampled_from(ref.FLOAT_DTYPES),
    exponent=st.integers(min_value=-4, max_value=4),
)
def test_unscale_then_scale_by_a_power_of_two_is_identity(backend, values, signs, dtype, exponent):
    # Powers of two are exact in every float format, and these magnitudes stay
    # normal in fp16 after scaling, so the round trip must be bit-exact.
    amp_ops = namespace_of(backend)
    grads = torch.tensor([v if s else -v for v, s in zip(values, signs)], dtype=dtype)
    original = grads.clone()
    found_inf = ref.flag(0.0)
    amp_ops.unscale_([grads], found_inf, ref.flag(2.0**exponent))
    amp_ops.scale_([grads], [grads], ref.flag(2.0**-exponent), found_inf)
    assert found_inf.item() == 0.0
    assert torch.equal(grads, original)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ref.FLOAT_DTYPES, ids=ref.dtype_id)
def test_check_finite_and_unscale_see_a_bad_element_at_every_chunk_edge(amp_ops, device, dtype):
    # 4 CUDA chunks, 16 CPU units: splitting one tensor must not skip an edge.
    numel = 4 * ref.CHUNK + 5
    grads = ref.random_tensors([numel], [dtype], seed=9, device=device)
    edges = sorted({k * ref.CPU_UNIT + offset for k in range(1, 17) for offset in (-1, 0)})
    for position in edges:
        poisoned = ref.clone_all(grads)
        poisoned[0][position] = float("nan")
        found_inf = ref.flag(0.0, device)
        amp_ops.check_finite(poisoned, found_inf)
        assert found_inf.item() == 1.0, f"check_finite missed position {position}"
        found_inf = ref.flag(0.0, device)
        amp_ops.unscale_(poisoned, found_inf, ref.flag(0.5, device))
        assert found_inf.item() == 1.0, f"unscale_ missed position {position}"
    expected = ref.unscale(grads, 0.5)
    amp_ops.unscale_(grads, ref.flag(0.0, device), ref.flag(0.5, device))
    torch.testing.assert_close(grads[0], expected[0], rtol=0, atol=0)


@pytest.mark.parametrize("bad", (None, *BAD_VALUES))
@pytest.mark.parametrize("inv_scale", (1.0 / 3.0, 2.0**-16))
def test_written_out_unscale_is_torchs_fused_unscale_bit_for_bit(inv_scale, bad):
    # The fallback's unscale_ takes this path where torch's fused op has no kernel (bf16 on CUDA):
    # on the CPU, where torch's op has one, the two must agree exactly, flag included.
    from apex_amp import _fallback

    grads = ref.random_tensors([*ref.EDGE_SIZES, ref.MULTI_CHUNK_SIZE], ref.FLOAT_DTYPES, seed=6, scale=1e4)
    if bad is not None:
        grads[-1][5] = bad
    expected = [g.clone() for g in grads]
    expected_found, found = ref.flag(0.0, "cpu"), ref.flag(0.0, "cpu")
    torch._amp_foreach_non_finite_check_and_unscale_(expected, expected_found, ref.flag(inv_scale, "cpu"))
    _fallback.unscale_written_out_(grads, found, ref.flag(inv_scale, "cpu"))
    assert found.item() == expected_found.item() == (0.0 if bad is None else 1.0)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
