"""Every op on dense tensors of any memory layout, against the plain-PyTorch reference, on both backends.

The kernels walk each tensor's memory as a flat array, so these tests use
layouts whose memory order differs from the logical one (channels_last,
channels_last_3d, a permutation, a transpose, a dense view at a storage
offset) and compare element by element in logical order. Corresponding
tensors of two lists share a layout, as ``*_like`` makes them (the rule of
csrc/checks.h; mismatches are refused, see test_ops_validation.py).
"""

from __future__ import annotations

import pytest
import torch

import _reference as ref

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# layout -> (shape, how to lay a contiguous tensor of that shape out)
LAYOUTS = {
    "channels_last": ((2, 5, 3, 7), lambda t: t.contiguous(memory_format=torch.channels_last)),
    "channels_last_3d": ((2, 3, 2, 3, 5), lambda t: t.contiguous(memory_format=torch.channels_last_3d)),
    "permuted": ((5, 3, 7), lambda t: t.permute(1, 2, 0).contiguous().permute(2, 0, 1)),
    "transposed": ((9, 13), lambda t: t.t().contiguous().t()),
    "view-at-offset": ((6, 5, 7), lambda t: _view_at_offset(t)),
    # More elements than two CUDA chunks (and many CPU work units).
    "channels_last-large": ((2, 33, 45, 46), lambda t: t.contiguous(memory_format=torch.channels_last)),
    "channels_last-empty": ((0, 3, 2, 2), lambda t: t.contiguous(memory_format=torch.channels_last)),
}


def _view_at_offset(t: torch.Tensor) -> torch.Tensor:
    # The second half of a channels_last buffer: dense, permuted, and not at the start of its storage.
    holder = torch.zeros(2, *t.shape, dtype=t.dtype, device=t.device).contiguous(memory_format=torch.channels_last)
    view = holder[1]
    view.copy_(t)
    return view


def laid_out(layout: str, dtype=F32, *, seed: int, device="cpu", scale: float = 1.0) -> torch.Tensor:
    shape, lay_out = LAYOUTS[layout]
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    t = lay_out(values.to(device=device, dtype=dtype))
    assert t.numel() == 0 or not t.is_contiguous(), f"{layout} must not be contiguous"
    return t


def laid_out_like(t: torch.Tensor, dtype, *, seed: int) -> torch.Tensor:
    """Random values of ``dtype`` with t's sizes and strides."""
    values = torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)).to(device=t.device, dtype=dtype)
    return torch.empty_like(t, dtype=dtype).copy_(values)


def _layout_of(t):
    return t.data_ptr(), t.stride()


def _plant(t: torch.Tensor, value: float) -> None:
    # At the last element in logical order, which is not the last in memory.
    if t.numel():
        t[(-1,) * t.dim()] = value


LAYOUT_IDS = list(LAYOUTS)
DTYPES = [pytest.param(d, id=ref.dtype_id(d)) for d in ref.FLOAT_DTYPES]


@pytest.mark.parametrize("layout", LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_check_finite_on_layouts(amp_ops, device, layout, dtype):
    tensors = [laid_out(layout, dtype, seed=1, device=device), laid_out(layout, F32, seed=2, device=device)]
    found_inf = ref.flag(0.0, device)
    amp_ops.check_finite(tensors, found_inf)
    assert found_inf.item() == 0.0
    _plant(tensors[1], float("nan"))
    amp_ops.check_finite(tensors, found_inf)
    assert found_inf.item() == float(tensors[1].numel() > 0)


@pytest.mark.parametrize("layout", LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_on_layouts_matches_reference(amp_ops, device, layout, dtype):
    grads = [laid_out(layout, dtype, seed=3, device=device, scale=1024.0), laid_out(layout, BF16, seed=4, device=device)]
    expected = ref.unscale(grads, 1 / 1024.0)
    layouts = [_layout_of(g) for g in grads]
    found_inf = ref.flag(0.0, device)
    amp_ops.unscale_(grads, found_inf, ref.flag(1 / 1024.0, device))
    assert [_layout_of(g) for g in grads] == layouts  # written in place
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)
    assert found_inf.item() == 0.0
    _plant(grads[0], float("inf"))
    amp_ops.unscale_(grads, found_inf, ref.flag(1.0, device))
    assert found_inf.item() == float(grads[0].numel() > 0)


@pytest.mark.parametrize("layout", LAYOUT_IDS)
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [(F16, F32), (F32, F16), (F32, BF16), (BF16, BF16)],
                         ids=["fp16-to-fp32", "fp32-to-fp16", "fp32-to-bf16", "bf16-to-bf16"])
def test_scale_on_layouts_matches_reference(amp_ops, device, layout, src_dtype, dst_dtype):
    src = [laid_out(layout, src_dtype, seed=5, device=device)]
    dst = [torch.empty_like(s, dtype=dst_dtype) for s in src]
    expected, expected_found = ref.scale(src, [dst_dtype], 0.5)
    found_inf = ref.flag(0.0, device)
    amp_ops.scale_(src, dst, ref.flag(0.5, device), found_inf)
    assert torch.equal(dst[0], expected[0]) and found_inf.item() == float(expected_found)
    _plant(src[0], float("-inf"))
    amp_ops.scale_(src, dst, ref.flag(0.5, device), found_inf)
    assert found_inf.item() == float(src[0].numel() > 0)


@pytest.mark.parametrize("layout", LAYOUT_IDS)
@pytest.mark.parametrize(("x_dtype", "y_dtype"), [(F32, F32), (F16, F32), (BF16, BF16)],
                         ids=["fp32-fp32", "fp16-fp32", "bf16-bf16"])
def test_axpby_on_layouts_matches_reference(amp_ops, device, layout, x_dtype, y_dtype):
    x = [laid_out(layout, x_dtype, seed=6, device=device)]
    y = [laid_out_like(x[0], y_dtype, seed=7)]
    expected, expected_found = ref.axpby(x, y, 0.25, 2.0)
    found_inf = ref.flag(0.0, device)
    amp_ops.axpby_(x, y, ref.flag(0.25, device), 2.0, found_inf)
    assert torch.equal(y[0], expected[0]) and found_inf.item() == float(expected_found)


@pytest.mark.parametrize("layout", LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_on_layouts_matches_reference(amp_ops, device, layout, dtype):
    tensors = [laid_out(layout, dtype, seed=8, device=device), laid_out(layout, F32, seed=9, device=device)]
    total, per_tensor = amp_ops.l2norm(tensors, True)
    want_total, want_per_tensor = ref.l2norm(tensors)
    assert total.item() == pytest.approx(want_total, rel=1e-5)
    assert per_tensor.tolist() == pytest.approx(want_per_tensor, rel=1e-5)


def _adam_run(amp_ops, params, grads, model_dtype, steps=3):
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    model_params = [p.to(model_dtype) for p in params]
    step = torch.zeros(1, device=params[0].device)
    cfg = ref.AdamConfig(lr=1e-2, weight_decay=0.01)
    for _ in range(steps):
        amp_ops.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model_params, [], [], step, *cfg.op_args(),
                            ref.flag(0.5, step.device), ref.flag(0.0, step.device))
    return params + exp_avgs + exp_avg_sqs + model_params


@pytest.mark.parametrize("layout", LAYOUT_IDS)
@pytest.mark.parametrize("grad_dtype", [F32, F16, BF16], ids=ref.dtype_id)
def test_fused_adam_on_layouts_matches_contiguous_bitwise_and_the_reference(amp_ops, device, layout, grad_dtype):
    # O2's call: fp32 masters, half grads scaled by 2 (inv_scale 0.5), a bf16 model copy, all laid out alike.
    params = [laid_out(layout, F32, seed=10, device=device)]
    grads = [laid_out_like(params[0], grad_dtype, seed=11)]
    initial = [p.clone() for p in params]
    state = _adam_run(amp_ops, params, grads, BF16)
    assert all(_layout_of(t)[1] == params[0].stride() for t in state)
    # The per-element math does not depend on where an element sits in memory: bitwise equal to a contiguous run.
    contiguous = _adam_run(amp_ops, [p.contiguous() for p in initial], [g.contiguous() for g in grads], BF16)
    for got, want in zip(state, contiguous):
        assert torch.equal(got, want)
    # And the textbook formula, one tensor at a time.
    param, exp_avg, exp_avg_sq = initial[0].clone(), torch.zeros_like(initial[0]), torch.zeros_like(initial[0])
    unscaled = grads[0].float() * 0.5
    for k in range(1, 4):
        ref.adam_step(param, unscaled, exp_avg, exp_avg_sq, k, ref.AdamConfig(lr=1e-2, weight_decay=0.01))
    torch.testing.assert_close(state[0], param, rtol=1e-5, atol=1e-6)
    assert torch.equal(state[3], state[0].to(BF16))


def test_contiguous_tensors_of_different_shapes_pair_in_row_major_order(amp_ops):
    # Both contiguous: element k of one is element k of the other, whatever the shapes.
    src, dst = [torch.arange(8.0).reshape(4, 2)], [torch.empty(8, dtype=F16)]
    amp_ops.scale_(src, dst, ref.flag(2.0), ref.flag(0.0))
    assert torch.equal(dst[0], (torch.arange(8.0) * 2).to(F16))
    params, grads = [torch.ones(2, 4)], [torch.arange(8.0)]
    reference_params = [torch.ones(8)]
    for p, g in ((params, grads), (reference_params, grads)):
        amp_ops.fused_adam_(p, g, [torch.zeros_like(p[0])], [torch.zeros_like(p[0])], [], [], [], torch.zeros(1),
                            *ref.AdamConfig(lr=0.1).op_args(), None, None)
    assert torch.equal(params[0].reshape(-1), reference_params[0])
