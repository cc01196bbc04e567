"""fused_adam_: Adam/AdamW against torch.optim and a reference formula, on both backends."""

from __future__ import annotations

import pytest
import torch

import _reference as ref
from apex_amp.optimizers import fused_adam

SIZES = (1, 33, 1031, 7, 0)
# Over 100 fp32 steps the kernels and torch.optim round in slightly different
# places (e.g. step_size * m / denom vs m / denom * step_size).
TRAJECTORY_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# Against a float64 reference the fp32 rounding itself accumulates to a few
# 1e-6 over 100 steps (an fp32 run of the textbook formula drifts as much).
FP64_REFERENCE_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _grad_sequence(sizes, steps, *, seed, device, dtype=torch.float32):
    return [ref.random_tensors(sizes, [dtype], seed=seed + k, device=device) for k in range(steps)]


class AdamState:
    """params, moments and step of one fused_adam_ run."""

    def __init__(self, params, model_dtype=None):
        self.params = params
        self.exp_avgs = [torch.zeros_like(p) for p in params]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in params]
        self.model_params = [] if model_dtype is None else [p.to(model_dtype) for p in params]
        self.step = torch.zeros(1, device=params[0].device)

    def run(self, amp_ops, grads, cfg, inv_scale=None, found_inf=None):
        tensors = (self.params, grads, self.exp_avgs, self.exp_avg_sqs, self.model_params, [], [], self.step)
        amp_ops.fused_adam_(*tensors, *cfg.op_args(), inv_scale, found_inf)

    def snapshot(self):
        return [t.clone() for t in (*self.params, *self.exp_avgs, *self.exp_avg_sqs, *self.model_params, self.step)]


def _assert_bitwise_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g.view(-1).view(torch.uint8), w.view(-1).view(torch.uint8))


@pytest.mark.parametrize(
    ("optimizer_class", "adamw_mode", "weight_decay"),
    [
        (torch.optim.Adam, False, 0.0),
        (torch.optim.Adam, False, 0.1),
        (torch.optim.AdamW, True, 0.0),
        (torch.optim.AdamW, True, 0.1),
    ],
    ids=("adam", "adam-l2", "adamw-no-decay", "adamw"),
)
def test_fused_adam_matches_torch_optim_over_100_steps(amp_ops, device, optimizer_class, adamw_mode, weight_decay):
    cfg = ref.AdamConfig(lr=1e-2, weight_decay=weight_decay, adamw_mode=adamw_mode)
    initial = ref.random_tensors(SIZES, [torch.float32], seed=40, device=device)
    fused = AdamState(ref.clone_all(initial))
    torch_params = [p.clone() for p in initial]
    betas = (cfg.beta1, cfg.beta2)
    optimizer = optimizer_class(
        torch_params, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=weight_decay, foreach=False
    )
    for grads in _grad_sequence(SIZES, 100, seed=41, device=device):
        fused.run(amp_ops, grads, cfg)
        for p, g in zip(torch_params, grads):
            p.grad = g
        optimizer.step()
    assert fused.step.item() == 100.0
    for got, want in zip(fused.params, torch_params):
        torch.testing.assert_close(got, want, **TRAJECTORY_TOLERANCE)
    for got, p in zip(fused.exp_avg_sqs, torch_params):
        torch.testing.assert_close(got, optimizer.state[p]["exp_avg_sq"], **TRAJECTORY_TOLERANCE)


@pytest.mark.parametrize("adamw_mode", (False, True), ids=("adam", "adamw"))
def test_fused_adam_without_bias_correction_matches_reference_formula(amp_ops, device, adamw_mode):
    cfg = ref.AdamConfig(lr=1e-3, weight_decay=0.05, adamw_mode=adamw_mode, bias_correction=False)
    initial = ref.random_tensors(SIZES, [torch.float32], seed=42, device=device)
    fused = AdamState(ref.clone_all(initial))
    reference = AdamState([p.double() for p in initial])
    for step, grads in enumerate(_grad_sequence(SIZES, 100, seed=43, device=device), start=1):
        fused.run(amp_ops, grads, cfg)
        for p, g, m, v in zip(reference.params, grads, reference.exp_avgs, reference.exp_avg_sqs):
            ref.adam_step(p, g, m, v, step, cfg)
    for got, want in zip(fused.params, reference.params):
        torch.testing.assert_close(got, want.float(), **FP64_REFERENCE_TOLERANCE)


def test_fused_adam_first_step_moves_each_weight_by_lr_against_the_grad_sign(amp_ops, device):
    # After one bias-corrected step m_hat = g and v_hat = g^2: the update is lr * sign(g).
    cfg = ref.AdamConfig(lr=0.5, eps=0.0)
    state = AdamState(ref.random_tensors([1031], [torch.float32], seed=44, device=device))
    before = state.params[0].clone()
    grads = ref.random_tensors([1031], [torch.float32], seed=45, device=device)
    state.run(amp_ops, grads, cfg)
    torch.testing.assert_close(state.params[0], before - 0.5 * grads[0].sign(), rtol=1e-6, atol=1e-6)
    assert state.step.item() == 1.0


def test_fused_adam_bias_correction_uses_the_incremented_resumed_step(amp_ops, device):
    cfg = ref.AdamConfig(lr=1e-2, beta1=0.5, beta2=0.6)
    params = ref.random_tensors([33], [torch.float32], seed=46, device=device)
    state = AdamState(ref.clone_all(params))
    state.exp_avgs[0].fill_(0.1)
    state.exp_avg_sqs[0].fill_(0.2)
    state.step.fill_(2.0)
    reference = [params[0].double(), state.exp_avgs[0].double(), state.exp_avg_sqs[0].double()]
    grads = ref.random_tensors([33], [torch.float32], seed=47, device=device)
    state.run(amp_ops, grads, cfg)
    ref.adam_step(reference[0], grads[0], reference[1], reference[2], 3, cfg)
    assert state.step.item() == 3.0
    torch.testing.assert_close(state.params[0], reference[0].float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("half_dtype", (torch.float16, torch.bfloat16), ids=ref.dtype_id)
def test_master_weights_match_fp32_run_and_model_copy_is_their_cast(amp_ops, device, half_dtype):
    cfg = ref.AdamConfig(lr=1e-2, weight_decay=0.01)
    initial = ref.random_tensors(SIZES, [torch.float32], seed=48, device=device)
    fused = AdamState(ref.clone_all(initial), model_dtype=half_dtype)
    fp32_run = AdamState(ref.clone_all(initial))
    for grads in _grad_sequence(SIZES, 20, seed=49, device=device, dtype=half_dtype):
        fused.run(amp_ops, grads, cfg)
        fp32_run.run(amp_ops, [g.float() for g in grads], cfg)
        for master, model in zip(fused.params, fused.model_params):
            assert model.dtype == half_dtype and torch.equal(model, master.to(half_dtype))
    for got, want in zip(fused.params, fp32_run.params):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    reference = AdamState([p.double() for p in initial])
    for step, grads in enumerate(_grad_sequence(SIZES, 20, seed=49, device=device, dtype=half_dtype), start=1):
        for p, g, m, v in zip(reference.params, grads, reference.exp_avgs, reference.exp_avg_sqs):
            ref.adam_step(p, g.double(), m, v, step, cfg)
    for got, want in zip(fused.params, reference.params):
        torch.testing.assert_close(got, want.float(), **FP64_REFERENCE_TOLERANCE)


def test_master_weights_with_a_mixed_list_of_grad_and_model_dtypes(amp_ops, device):
    cfg = ref.AdamConfig(lr=1e-2)
    sizes = [1 + i % 5 for i in range(300)] + [ref.MULTI_CHUNK_SIZE]
    initial = ref.random_tensors(sizes, [torch.float32], seed=50, device=device)
    grad_dtypes = [ref.FLOAT_DTYPES[i % 3] for i in range(len(sizes))]
    grads = [g.to(d) for g, d in zip(ref.random_tensors(sizes, [torch.float32], seed=51, device=device), grad_dtypes)]
    fused = AdamState(ref.clone_all(initial))
    fused.model_params = [p.to(torch.bfloat16 if i % 2 else torch.float16) for i, p in enumerate(initial)]
    fused.run(amp_ops, grads, cfg)
    reference = AdamState([p.double() for p in initial])
    for p, g, m, v in zip(reference.params, grads, reference.exp_avgs, reference.exp_avg_sqs):
        ref.adam_step(p, g.double(), m, v, 1, cfg)
    for got, model, want in zip(fused.params, fused.model_params, reference.params):
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-7)
        assert torch.equal(model, got.to(model.dtype))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=ref.dtype_id)
def test_low_precision_params_step_in_fp32_and_round_once(amp_ops, device, dtype):
    cfg = ref.AdamConfig(lr=1e-2, weight_decay=0.01)
    params = ref.random_tensors((1031, 33, 1), [dtype], seed=52, device=device)
    state = AdamState(ref.clone_all(params))
    grads = ref.random_tensors((1031, 33, 1), [dtype], seed=53, device=device)
    state.run(amp_ops, grads, cfg)
    for p, g, got, got_m, got_v in zip(params, grads, state.params, state.exp_avgs, state.exp_avg_sqs):
        p, m, v = p.double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
        ref.adam_step(p, g.double(), m, v, 1, cfg)
        assert got.dtype == got_m.dtype == got_v.dtype == dtype
        torch.testing.assert_close(got, p.to(dtype))
        torch.testing.assert_close(got_m, m.to(dtype))
        torch.testing.assert_close(got_v, v.to(dtype))


@pytest.mark.parametrize("grad_dtype", ref.FLOAT_DTYPES, ids=ref.dtype_id)
def test_inv_scale_folding_equals_unscale_then_step(amp_ops, device, grad_dtype):
    cfg = ref.AdamConfig(lr=1e-2, weight_decay=0.01)
    initial = ref.random_tensors((1031, 33, 1), [torch.float32], seed=54, device=device)
    grads = ref.random_tensors((1031, 33, 1), [grad_dtype], seed=55, device=device)
    loss_scale = 2.0**10  # a power of two: scaling the grads is exact
    scaled = [g * loss_scale for g in grads]
    folded, separate = (AdamState(ref.clone_all(initial), torch.float16) for _ in range(2))
    folded.run(amp_ops, scaled, cfg, inv_scale=ref.flag(1.0 / loss_scale, device))
    unscaled = ref.clone_all(scaled)
    amp_ops.unscale_(unscaled, ref.flag(0.0, device), ref.flag(1.0 / loss_scale, device))
    separate.run(amp_ops, unscaled, cfg)
    _assert_bitwise_equal(folded.snapshot(), separate.snapshot())


@pytest.mark.parametrize("bad_grad", (None, float("inf"), float("nan")), ids=("finite", "inf", "nan"))
def test_found_inf_makes_the_whole_step_a_no_op(amp_ops, device, bad_grad):
    cfg = ref.AdamConfig(lr=1e-2, weight_decay=0.1)
    state = AdamState(ref.random_tensors((1031, 33), [torch.float32], seed=56, device=device), torch.bfloat16)
    state.run(amp_ops, ref.random_tensors((1031, 33), [torch.float32], seed=57, device=device), cfg)
    before = state.snapshot()
    grads = ref.random_tensors((1031, 33), [torch.float16], seed=58, device=device)
    if bad_grad is not None:
        grads[0][-3] = bad_grad
    state.run(amp_ops, grads, cfg, inv_scale=ref.flag(0.5, device), found_inf=ref.flag(1.0, device))
    _assert_bitwise_equal(state.snapshot(), before)
    assert state.step.item() == 1.0


def test_found_inf_zero_takes_the_same_step_as_no_found_inf(amp_ops, device):
    cfg = ref.AdamConfig(lr=1e-2)
    initial = ref.random_tensors((1031, 33), [torch.float32], seed=59, device=device)
    grads = ref.random_tensors((1031, 33), [torch.bfloat16], seed=60, device=device)
    with_flag, without = (AdamState(ref.clone_all(initial), torch.bfloat16) for _ in range(2))
    with_flag.run(amp_ops, grads, cfg, found_inf=ref.flag(0.0, device))
    without.run(amp_ops, grads, cfg)
    _assert_bitwise_equal(with_flag.snapshot(), without.snapshot())


def test_fallback_skip_decided_on_the_device_is_also_bitwise_a_no_op(monkeypatch):
    # On CUDA the fallback cannot read found_inf without a sync, so it masks
    # every write instead; force that path on CPU and check both outcomes.
    monkeypatch.setattr(fused_adam, "step_taken", lambda found_inf: found_inf.reshape(()) == 0)
    amp_ops = torch.ops.apex_amp_fallback
    cfg = ref.AdamConfig(lr=1e-2, weight_decay=0.1)
    initial = ref.random_tensors((1031, 1), [torch.float32], seed=61, device="cpu")
    grads = ref.random_tensors((1031, 1), [torch.float16], seed=62, device="cpu")
    skipped, taken, plain = (AdamState(ref.clone_all(initial), torch.float16) for _ in range(3))
    before = skipped.snapshot()
    skipped.run(amp_ops, grads, cfg, found_inf=ref.flag(1.0))
    _assert_bitwise_equal(skipped.snapshot(), before)
    taken.run(amp_ops, grads, cfg, found_inf=ref.flag(0.0))
    monkeypatch.undo()
    plain.run(amp_ops, grads, cfg)
    _assert_bitwise_equal(taken.snapshot(), plain.snapshot())


def test_fused_adam_with_empty_lists_only_counts_the_step(amp_ops):
    step = torch.zeros(1)
    amp_ops.fused_adam_([], [], [], [], [], [], [], step, *ref.AdamConfig().op_args())
    assert step.item() == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("half_dtype", (torch.float16, torch.bfloat16), ids=ref.dtype_id)
def test_master_weights_over_many_chunks_and_threads_match_reference(amp_ops, device, half_dtype):
    # About 1.3M elements in tensors that start and end mid-chunk.
    cfg = ref.AdamConfig(lr=1e-3, weight_decay=0.01)
    sizes = (7 * ref.CHUNK + 11, ref.CHUNK, 3, 12 * ref.CHUNK - 5, 1)
    initial = ref.random_tensors(sizes, [torch.float32], seed=63, device=device)
    fused = AdamState(ref.clone_all(initial), model_dtype=half_dtype)
    reference = AdamState([p.double() for p in initial])
    for step, grads in enumerate(_grad_sequence(sizes, 3, seed=64, device=device, dtype=half_dtype), start=1):
        fused.run(amp_ops, [g * 256 for g in grads], cfg, inv_scale=ref.flag(1 / 256, device))
        for p, g, m, v in zip(reference.params, grads, reference.exp_avgs, reference.exp_avg_sqs):
            ref.adam_step(p, g.double(), m, v, step, cfg)
    for got, model, want in zip(fused.params, fused.model_params, reference.params):
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
        assert torch.equal(model, got.to(half_dtype))
