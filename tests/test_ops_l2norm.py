"""l2norm: the total and per-tensor L2 norms, on both backends."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _reference as ref
from _backends import BACKENDS, namespace_of

# fp32 accumulation in a different order than the float64 reference.
NORM_TOLERANCE = {"rtol": 2e-5, "atol": 1e-6}


def _assert_norms(total, per_tensor, tensors, device):
    want_total, want_per_tensor = ref.l2norm(tensors)
    assert total.dtype == torch.float32 and total.dim() == 0 and total.device.type == device
    torch.testing.assert_close(total.item(), want_total, **NORM_TOLERANCE)
    assert per_tensor.dtype == torch.float32 and per_tensor.shape == (len(tensors),)
    torch.testing.assert_close(per_tensor.cpu(), torch.tensor(want_per_tensor, dtype=torch.float32), **NORM_TOLERANCE)


@pytest.mark.parametrize("dtype", ref.FLOAT_DTYPES, ids=ref.dtype_id)
def test_l2norm_total_and_per_tensor_match_float64_reference(amp_ops, device, dtype):
    tensors = ref.random_tensors([*ref.EDGE_SIZES, ref.MULTI_CHUNK_SIZE, 5], [dtype], seed=30, device=device)
    total, per_tensor = amp_ops.l2norm(tensors, True)
    _assert_norms(total, per_tensor, tensors, device)


def test_l2norm_of_a_mixed_list_of_several_hundred_tensors(amp_ops, device):
    tensors = ref.random_tensors([1 + i % 7 for i in range(300)], ref.FLOAT_DTYPES, seed=31, device=device)
    total, per_tensor = amp_ops.l2norm(tensors, True)
    _assert_norms(total, per_tensor, tensors, device)


def test_l2norm_without_per_tensor_returns_an_empty_tensor(amp_ops, device):
    tensors = ref.random_tensors([33, 1], ref.FLOAT_DTYPES, seed=32, device=device)
    total, per_tensor = amp_ops.l2norm(tensors, False)
    assert per_tensor.dtype == torch.float32 and per_tensor.numel() == 0
    torch.testing.assert_close(total.item(), ref.l2norm(tensors)[0], **NORM_TOLERANCE)


def test_l2norm_accumulates_fp16_in_fp32_without_overflow(amp_ops):
    # Each square (60000^2) overflows fp16; the fp32 accumulator must not.
    tensors = [torch.full((100,), 60000.0, dtype=torch.float16)]
    total, per_tensor = amp_ops.l2norm(tensors, True)
    torch.testing.assert_close(total.item(), 600000.0, rtol=1e-6, atol=0)
    torch.testing.assert_close(per_tensor.item(), 600000.0, rtol=1e-6, atol=0)


def test_l2norm_of_empty_tensors_is_zero(amp_ops):
    total, per_tensor = amp_ops.l2norm([torch.empty(0), torch.empty(0, dtype=torch.bfloat16)], True)
    assert total.item() == 0.0
    assert per_tensor.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("bad", (float("inf"), float("nan")))
def test_l2norm_is_not_finite_when_an_element_is_not(amp_ops, device, bad):
    for position in ref.bad_positions(1031):
        tensors = ref.random_tensors([3, 1031], [torch.bfloat16], seed=33, device=device)
        tensors[1][position] = bad
        total, per_tensor = amp_ops.l2norm(tensors, True)
        assert not torch.isfinite(total)
        assert torch.isfinite(per_tensor[0]) and not torch.isfinite(per_tensor[1])


def test_l2norm_results_are_new_tensors(amp_ops):
    tensors = [torch.ones(4)]
    total, per_tensor = amp_ops.l2norm(tensors, True)
    total.add_(1.0)
    per_tensor.add_(1.0)
    assert torch.equal(tensors[0], torch.ones(4))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=8),
    dtype=st.sampled_from(ref.FLOAT_DTYPES),
    magnitude=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_l2norm_agrees_with_torch_vector_norm(backend, sizes, dtype, magnitude, seed):
    tensors = ref.random_tensors(sizes, [dtype], seed=seed, scale=magnitude)
    total, per_tensor = namespace_of(backend).l2norm(tensors, True)
    want_per_tensor = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])
    want_total = torch.linalg.vector_norm(torch.cat([t.float() for t in tensors]))
    torch.testing.assert_close(per_tensor, want_per_tensor, rtol=2e-5, atol=1e-6 * magnitude)
    torch.testing.assert_close(total, want_total, rtol=2e-5, atol=1e-6 * magnitude)


@pytest.mark.slow
def test_l2norm_of_tensors_spanning_many_chunks(amp_ops, device):
    tensors = ref.random_tensors((9 * ref.CHUNK + 3, 5, 4 * ref.CHUNK - 1), ref.FLOAT_DTYPES, seed=34, device=device)
    total, per_tensor = amp_ops.l2norm(tensors, True)
    _assert_norms(total, per_tensor, tensors, device)
