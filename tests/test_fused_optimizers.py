"""apex's fused optimizers as optimizers: against torch.optim or apex's math, under amp, under GradScaler.

Every optimizer of the family trains a small model at O2 fp16 (and bf16, and O1/O3) through an
overflow to within a tolerance of an fp32 run that skips the same step; runs under
``torch.amp.GradScaler`` as torch's fused optimizers do; resumes from its state_dict bit for
bit; and takes apex's arguments.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import _optimizer_reference as oref
from apex_amp import amp
from apex_amp.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad,
                                 FusedOptimizer, FusedSGD)

OVERFLOW = 1e38
FAMILY = {
    "FusedSGD": lambda params: FusedSGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "FusedSGD-nesterov": lambda params: FusedSGD(params, lr=0.05, momentum=0.9, nesterov=True),
    "FusedAdam": lambda params: FusedAdam(params, lr=1e-2),
    "FusedAdagrad": lambda params: FusedAdagrad(params, lr=1e-2),
    "FusedNovoGrad": lambda params: FusedNovoGrad(params, lr=1e-2, betas=(0.95, 0.98), weight_decay=1e-3),
    "FusedLAMB": lambda params: FusedLAMB(params, lr=1e-2),
    "FusedLAMB-nvlamb": lambda params: FusedLAMB(params, lr=1e-2, weight_decay=0.0, use_nvlamb=True),
}


def make_model(seed=0):
    # No bias before the BatchNorm: its true gradient is 0, and sign-like updates (Adam, Adagrad,
    # LAMB) would turn the rounding noise of a half run into full steps.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def batches(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)) for _ in range(n)]


def train(kind, opt_level=None, half_dtype=torch.float16, poisoned=(2,), data=None):
    """A run of optimizer `kind`; with opt_level, under amp with an overflow at the steps in `poisoned`."""
    model = make_model()
    optimizer = FAMILY[kind](model.parameters())
    if opt_level is not None:
        amp.initialize(model, optimizer, opt_level=opt_level, half_dtype=half_dtype, loss_scale="dynamic",
                       verbosity=0)
    skipped = []
    for index, (x, y) in enumerate(data or batches()):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        if opt_level is None:
            if index in poisoned:  # its forward ran (BatchNorm's statistics moved, as in the amp run)
                skipped.append(True)
                continue
            loss.backward()
            optimizer.step()
            skipped.append(False)
            continue
        with amp.scale_loss(loss * (OVERFLOW if index in poisoned else 1.0), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        skipped.append(amp.step_was_skipped(optimizer))
    return model, optimizer, skipped


def weights(model):
    return {name: value.detach().float().clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("kind", list(FAMILY))
@pytest.mark.parametrize(("opt_level", "half_dtype", "tolerance"), [
    ("O2", torch.float16, 2e-2), ("O2", torch.bfloat16, 5e-2), ("O1", torch.bfloat16, 5e-2),
    ("O3", torch.bfloat16, 1e-1)], ids=["O2-fp16", "O2-bf16", "O1-bf16", "O3-bf16"])
def test_trains_through_an_overflow_like_its_fp32_run(kind, opt_level, half_dtype, tolerance):
    reference, _, _ = train(kind)
    model, optimizer, skipped = train(kind, opt_level, half_dtype)
    assert skipped == [False, False, True, False, False, False]
    got, want = weights(model), weights(reference)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=tolerance, rtol=tolerance, msg=name)
    if opt_level == "O2":
        # The half model copy was written from the fp32 masters in the same pass.
        for master in amp.master_params(optimizer):
            if master.dtype == torch.float32 and master.dim() == 2:
                assert master.dtype == torch.float32
        assert next(model.parameters()).dtype == half_dtype


def test_the_family_are_fused_optimizers_and_real_torch_optimizers():
    for kind, make in FAMILY.items():
        optimizer = make(make_model().parameters())
        assert isinstance(optimizer, FusedOptimizer) and isinstance(optimizer, torch.optim.Optimizer), kind
        assert optimizer._step_supports_amp_scaling


# ---- against torch.optim and apex's math ---------------------------------------------------------
def _run_plain(optimizer, params, steps=5):
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
        optimizer.step()


@pytest.mark.parametrize("options", [dict(momentum=0.9), dict(momentum=0.9, dampening=0.2, weight_decay=0.01),
                                     dict(momentum=0.9, nesterov=True), dict(momentum=0.0, weight_decay=0.01)],
                         ids=["momentum", "dampening-wd", "nesterov", "plain"])
def test_fused_sgd_matches_torch_sgd(options):
    torch.manual_seed(0)
    initial = [torch.randn(17, 5), torch.randn(300)]
    ours = [p.clone().requires_grad_() for p in initial]
    theirs = [p.clone().requires_grad_() for p in initial]
    _run_plain(FusedSGD(ours, lr=0.05, **options), ours)
    _run_plain(torch.optim.SGD(theirs, lr=0.05, foreach=False, **options), theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_adagrad_matches_torch_adagrad():
    torch.manual_seed(0)
    initial = [torch.randn(17, 5), torch.randn(300)]
    ours = [p.clone().requires_grad_() for p in initial]
    theirs = [p.clone().requires_grad_() for p in initial]
    _run_plain(FusedAdagrad(ours, lr=0.05, weight_decay=0.01), ours)
    _run_plain(torch.optim.Adagrad(theirs, lr=0.05, weight_decay=0.01, eps=1e-10, foreach=False), theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["FusedNovoGrad", "FusedLAMB"])
def test_novograd_and_lamb_follow_apexs_math_across_param_groups(kind):
    torch.manual_seed(0)
    initial = [torch.randn(17, 5), torch.randn(300), torch.randn(7)]
    params = [p.clone().requires_grad_() for p in initial]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}]
    if kind == "FusedNovoGrad":
        optimizer = FusedNovoGrad(groups, lr=1e-2, betas=(0.95, 0.98), weight_decay=1e-3)
    else:
        optimizer = FusedLAMB(groups, lr=1e-2, max_grad_norm=0.5)
    ref_params = oref.f64(initial)
    ref_m = [torch.zeros_like(p) for p in ref_params]
    ref_v = [torch.zeros_like(p) for p in ref_params]
    moments = [None] * len(initial)
    for step in range(1, 5):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
                 for i, p in enumerate(params)]
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
        for group_slice, lr in ((slice(0, 2), 1e-2), (slice(2, 3), 3e-3)):
            sub = ref_params[group_slice]
            if kind == "FusedNovoGrad":
                subm, submo = ref_m[group_slice], moments[group_slice]
                oref.novograd(sub, grads[group_slice], subm, submo, step, lr=lr, beta1=0.95, beta2=0.98, eps=1e-8,
                              weight_decay=1e-3, bias_correction=True, grad_averaging=True,
                              reg_inside_moment=False, norm_type=2)
                ref_m[group_slice], moments[group_slice] = subm, submo
            else:
                # apex clips by the norm of every gradient, all groups together.
                total = sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5
                subm, subv = ref_m[group_slice], ref_v[group_slice]
                oref.lamb(sub, grads[group_slice], subm, subv, step, lr=lr, beta1=0.9, beta2=0.999, eps=1e-6,
                          weight_decay=0.01, bias_correction=True, grad_averaging=True, adam_w_mode=True,
                          max_grad_norm=0.5, use_nvlamb=False, global_grad_norm=total)
                ref_m[group_slice], ref_v[group_slice] = subm, subv
            ref_params[group_slice] = sub
    for got, want in zip(params, ref_params):
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-6)


# ---- torch.amp.GradScaler -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(FAMILY))
def test_grad_scaler_drives_the_step_and_skips_an_overflow(kind):
    model = make_model()
    optimizer = FAMILY[kind](model.parameters())
    reference = make_model()
    ref_optimizer = FAMILY[kind](reference.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for index, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y) * (OVERFLOW if index == 2 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        ref_loss = nn.functional.cross_entropy(reference(x), y)
        if index != 2:
            ref_loss.backward()
            ref_optimizer.step()
    assert scaler.get_scale() == 1024.0 / 2  # backed off once, then 3 clean steps
    for (name, got), want in zip(weights(model).items(), weights(reference).values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", list(FAMILY))
def test_grad_scaler_leaves_the_gradients_unscaled_like_torchs_fused_optimizers(kind):
    # A grad-norm logger after scaler.step reads true gradients with torch's fused optimizers
    # (and apex's); an overflowed step leaves them as they were.
    model = make_model()
    optimizer = FAMILY[kind](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    (x, y), _ = batches(2)
    for factor in (1.0, OVERFLOW):
        optimizer.zero_grad()
        scaler.scale(nn.functional.cross_entropy(model(x), y) * factor).backward()
        scaled = [p.grad.clone() for p in model.parameters()]
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        for p, grad in zip(model.parameters(), scaled):
            want = grad if factor == OVERFLOW else grad * (1.0 / scale)
            torch.testing.assert_close(p.grad, want, rtol=0, atol=0, equal_nan=True)


def test_fused_sgd_takes_the_learning_rate_of_each_param_group():
    # apex's FusedSGD (and torch's SGD) need no lr= when every group has its own.
    model = make_model()
    params = list(model.parameters())
    optimizer = FusedSGD([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.01}], momentum=0.9)
    reference = torch.optim.SGD([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.01}],
                                momentum=0.9)
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in reference.param_groups]
    with pytest.raises(ValueError, match="didn't specify a value of required optimization parameter lr"):
        FusedSGD([{"params": params[:2], "lr": 0.1}, {"params": params[2:]}])


def test_mixed_precision_lamb_reads_reduced_precision_dtype_at_the_step():
    # apex's own test sets it after construction; the step must then keep fp32 masters.
    model = make_model().to(torch.float16)
    optimizer = FusedMixedPrecisionLamb(model.parameters(), lr=1e-2)
    optimizer.reduced_precision_dtype = torch.float16
    x, y = batches(1)[0]
    nn.functional.cross_entropy(model(x.half()).float(), y).backward()
    optimizer.step()
    state = optimizer.state[next(model.parameters())]
    assert state["master_param"].dtype == state["exp_avg"].dtype == torch.float32
    assert torch.equal(next(model.parameters()), state["master_param"].to(torch.float16))
    optimizer.reduced_precision_dtype = torch.float32
    with pytest.raises(ValueError, match="reduced_precision_dtype must be torch.float16, torch.bfloat16 or None"):
        optimizer.step()


def test_issue_reproducer_fused_adam_with_fp16_params_under_grad_scaler():
    # apex's testGradScaler: capturable, master weights, fp16 params; the scaler does not have to unscale.
    p = nn.Parameter(torch.ones(4, dtype=torch.float16))
    optimizer = FusedAdam([p], capturable=True, master_weights=True, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # 65536 would overflow these fp16 gradients
    scaler.scale(p.float().sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    master = optimizer.state[p]["master_param"]
    assert master.dtype == torch.float32 and torch.equal(p, master.to(torch.float16))
    torch.testing.assert_close(master, torch.full((4,), 0.9))  # Adam's first step: lr times the sign


def test_apexs_explicit_grad_scaler_argument_works():
    # FusedMixedPrecisionLamb's users call optimizer.step(grad_scaler=scaler), as apex documented.
    model = make_model().to(torch.bfloat16)
    optimizer = FusedMixedPrecisionLamb(model.parameters(), lr=1e-2, reduced_precision_dtype=torch.bfloat16)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    x, y = batches(1)[0]
    scaler.scale(nn.functional.cross_entropy(model(x.bfloat16()).float(), y) * OVERFLOW).backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step(grad_scaler=scaler)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == 128.0


# ---- FusedMixedPrecisionLamb ----------------------------------------------------------------------
def test_mixed_precision_lamb_keeps_fp32_masters_and_moments_for_reduced_params():
    model = make_model().to(torch.bfloat16)
    optimizer = FusedMixedPrecisionLamb(model.parameters(), lr=torch.tensor(1e-2), step=10,
                                        reduced_precision_dtype=torch.bfloat16)
    reference = make_model()
    ref_optimizer = FusedLAMB(reference.parameters(), lr=1e-2)
    for x, y in batches(3):
        for m, o, inputs in ((model, optimizer, x.bfloat16()), (reference, ref_optimizer, x)):
            o.zero_grad()
            nn.functional.cross_entropy(m(inputs).float(), y).backward()
    state = optimizer.state[next(model.parameters())]
    optimizer.step()
    assert state["master_param"].dtype == state["exp_avg"].dtype == torch.float32
    assert float(optimizer.param_groups[0]["step"]) == 11.0  # started from step=10
    assert torch.equal(next(model.parameters()), state["master_param"].to(torch.bfloat16))


# ---- checkpoints and apex's arguments -------------------------------------------------------------
@pytest.mark.parametrize("kind", list(FAMILY))
def test_state_dict_round_trip_resumes_bitwise(kind):
    data = batches(6)
    full, _, _ = train(kind, "O2", torch.bfloat16, poisoned=(), data=data)
    first, optimizer, _ = train(kind, "O2", torch.bfloat16, poisoned=(), data=data[:3])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    model = make_model(seed=9)
    optimizer = FAMILY[kind](model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, loss_scale="dynamic", verbosity=0)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    for x, y in data[3:]:
        optimizer.zero_grad()
        with amp.scale_loss(nn.functional.cross_entropy(model(x).float(), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    for name, value in full.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def test_apexs_constructor_arguments_are_accepted():
    params = list(make_model().parameters())
    FusedSGD(params, lr=0.1, momentum=0.9, dampening=0, weight_decay=1e-4, nesterov=False, wd_after_momentum=True,
             materialize_master_grads=False, set_grad_none=True)
    FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
              weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=True, master_weights=True)
    FusedLAMB(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
              amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
              use_nvlamb=False)
    FusedNovoGrad(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                  amsgrad=False, reg_inside_moment=False, grad_averaging=True, norm_type=2, init_zero=False,
                  set_grad_none=True)
    FusedAdagrad(params, lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True, adagrad_w_mode=False)
    FusedMixedPrecisionLamb(params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                            weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
                            max_grad_norm=1.0, use_nvlamb=False, reduced_precision_dtype=torch.bfloat16)
    for bad in (lambda: FusedLAMB(params, amsgrad=True), lambda: FusedNovoGrad(params, norm_type=1),
                lambda: FusedSGD(params, lr=0.1, nesterov=True), lambda: FusedSGD(params)):
        with pytest.raises((ValueError, RuntimeError, TypeError)):
            bad()


def test_apexs_removed_step_arguments_raise_apexs_message():
    model = make_model()
    optimizer = FusedSGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="apex's optimizers dropped these arguments"):
        optimizer.step(grads=[p.grad for p in model.parameters()])
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        optimizer.step(bogus=1)


def test_sparse_gradients_are_refused_by_name():
    embedding = nn.Embedding(10, 4, sparse=True)
    for make in (lambda p: FusedSGD(p, lr=0.1), lambda p: FusedLAMB(p)):
        optimizer = make(embedding.parameters())
        embedding(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(RuntimeError, match="does not support sparse gradients"):
            optimizer.step()
        embedding.zero_grad()


def test_fused_sgd_keeps_no_buffer_from_a_skipped_first_step_with_dampening():
    # With dampening the first step's buffer is the gradient itself: a skipped first step must
    # not leave a zero buffer behind that the next step would damp.
    model = make_model()
    optimizer = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    amp.initialize(model, optimizer, opt_level="O1", half_dtype=torch.bfloat16, loss_scale="dynamic", verbosity=0)
    for index, (x, y) in enumerate(batches(3)):
        optimizer.zero_grad()
        with amp.scale_loss(nn.functional.cross_entropy(model(x).float(), y) * (OVERFLOW if index == 0 else 1.0),
                            optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_out = reference(x)
        if index > 0:
            nn.functional.cross_entropy(ref_out.float(), y).backward()
            ref_optimizer.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)
    assert "momentum_buffer" in optimizer.state[next(model.parameters())]
