"""LR schedulers, gradient clipping and delay_unscale accumulation under amp, against plain fp32 runs.

Complements tests/test_amp_integration.py (StepLR under O2 with a skipped
step, the LambdaLR hold pattern under O1) and tests/test_amp_accumulation.py
(accumulated and clipped gradients at the default scale): here every scheduler
kind, both creation orders, O1 and O2 and both optimizer kinds follow the fp32
LR (and momentum) trajectory exactly; clipping is checked against an fp32
reference fed the same unscaled gradients, with scales large enough that
clipping the scaled gradients would be off by orders of magnitude; and
accumulation is checked on the weights after the step, clipping included.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdam

INF = float("inf")
STEPS = 6
ORDER_WARNING = "lr_scheduler.step()"  # torch: "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def data(seed: int, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def make_optimizer(kind: str, params, lr: float = 0.05):
    if kind == "SGD":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)  # OneCycleLR cycles the momentum
    return FusedAdam(params, lr=lr)


def make_scheduler(name: str, optimizer):
    if name == "StepLR":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if name == "OneCycleLR":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=STEPS)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 / (1.0 + epoch) ** 2)


AMP_SETTINGS = {
    "O1": dict(opt_level="O1", half_dtype=torch.bfloat16),
    "O2": dict(opt_level="O2", half_dtype=torch.float16),  # dynamic scale 65536
}


def hyper(optimizer) -> tuple[float, float]:
    group = optimizer.param_groups[0]
    momentum = group["momentum"] if "momentum" in group else group["betas"][0]
    return group["lr"], momentum


def run_with_scheduler(kind, scheduler_name, level=None, created="after", inject_at=()):
    """Train ``steps`` steps; return the (lr, momentum) of every step, which steps were skipped,
    and the scheduler-order warnings torch raised."""
    model = tiny_model()
    optimizer = make_optimizer(kind, model.parameters())
    trajectory, skipped = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if created == "before":
            scheduler = make_scheduler(scheduler_name, optimizer)
        if level is not None:
            amp.initialize(model, optimizer, verbosity=0, **AMP_SETTINGS[level])
        if created == "after":
            scheduler = make_scheduler(scheduler_name, optimizer)
        for step in range(STEPS):
            trajectory.append(hyper(optimizer))
            x, y = data(step)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x).float(), y)
            if level is None:
                loss.backward()
            else:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                    if step in inject_at:
                        model[0].weight.grad[0, 0] = INF
            optimizer.step()
            skipped.append(level is not None and amp.step_was_skipped(optimizer))
            scheduler.step()  # on every step, skipped or not, as in a plain loop
    order_warnings = [str(w.message) for w in caught if ORDER_WARNING in str(w.message)]
    return trajectory, skipped, order_warnings


# ---- LR schedulers ----------------------------------------------------------------------------
def test_the_order_warning_is_detected_when_it_happens():
    # The control for the tests below: this capture does see torch's warning.
    model = tiny_model()
    optimizer = make_optimizer("SGD", model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler = make_scheduler("StepLR", optimizer)
        scheduler.step()  # before any optimizer.step()
    assert any(ORDER_WARNING in str(w.message) for w in caught)


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("created", ["before", "after"])
@pytest.mark.parametrize("scheduler_name", ["StepLR", "OneCycleLR", "LambdaLR"])
def test_scheduler_follows_the_fp32_trajectory_through_a_skipped_step(scheduler_name, created, level, kind):
    reference, _, reference_warnings = run_with_scheduler(kind, scheduler_name)
    trajectory, skipped, order_warnings = run_with_scheduler(
        kind, scheduler_name, level, created, inject_at=(2,)
    )
    assert skipped == [step == 2 for step in range(STEPS)]
    # The skipped step still counts as an optimizer step for the scheduler: no warning, same schedule.
    assert order_warnings == reference_warnings == []
    assert trajectory == reference
    assert len(set(trajectory)) > 1  # the schedule really moved


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("scheduler_name", ["StepLR", "OneCycleLR", "LambdaLR"])
def test_holding_the_scheduler_on_skipped_steps_shifts_the_schedule_to_taken_steps(scheduler_name, kind):
    # The pattern: `if not amp.step_was_skipped(optimizer): scheduler.step()`. The first
    # steps overflow for real here: fp16 with an initial scale of 2**24 (the cap), halved
    # at each overflow until the scaled gradients fit.
    model = tiny_model()
    optimizer = make_optimizer(kind, model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    state = amp.state_dict()
    state["loss_scaler0"]["loss_scale"] = 2.0**24
    amp.load_state_dict(state)
    scheduler = make_scheduler(scheduler_name, optimizer)
    taken_trajectory, skipped = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = 0
        while len(taken_trajectory) < STEPS:  # OneCycleLR raises if stepped past total_steps
            current = hyper(optimizer)
            x, y = data(len(taken_trajectory))
            optimizer.zero_grad()
            with amp.scale_loss(nn.functional.cross_entropy(model(x), y), optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            skipped.append(amp.step_was_skipped(optimizer))
            if not skipped[-1]:
                taken_trajectory.append(current)
                scheduler.step()
            step += 1
            assert step < 40, "the loss scale never recovered"
    assert skipped[0] and not all(skipped)
    assert amp.loss_scale() == 2.0**24 / 2 ** sum(skipped)  # one halving per reported skip
    assert [str(w.message) for w in caught if ORDER_WARNING in str(w.message)] == []
    reference, _, _ = run_with_scheduler(kind, scheduler_name)
    assert taken_trajectory == reference  # every taken step got the LR it would have had in fp32


# ---- gradient clipping ------------------------------------------------------------------------
def fp32_grad_norm(x, y) -> float:
    model = tiny_model()
    nn.functional.cross_entropy(model(x), y).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=INF))


CLIP_CASES = {
    # level, half dtype, static loss scale: large, so clipping scaled gradients would show
    "O2-fp16": ("O2", torch.float16, 2.0**14),
    "O2-bf16": ("O2", torch.bfloat16, 2.0**20),
    "O1-bf16": ("O1", torch.bfloat16, 2.0**20),
}


def reference_optimizer(kind, params, lr):
    if kind == "SGD":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)  # FusedAdam's default mode is AdamW; weight_decay 0 makes them equal


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("regime", ["clips", "under-the-limit"])
@pytest.mark.parametrize("case", list(CLIP_CASES))
def test_clipping_master_params_clips_the_unscaled_gradients(case, regime, kind):
    level, half_dtype, loss_scale = CLIP_CASES[case]
    x, y = data(0, n=64)
    true_norm = fp32_grad_norm(x, y)
    # "clips": the limit is below the true norm; "under-the-limit": above it but far below
    # the scaled norm, so only clipping the scaled gradients would change them.
    max_norm = true_norm / 4 if regime == "clips" else true_norm * 4
    model = tiny_model()
    optimizer = make_optimizer(kind, model.parameters())
    amp.initialize(model, optimizer, opt_level=level, half_dtype=half_dtype, loss_scale=loss_scale, verbosity=0)
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), optimizer) as scaled_loss:
        scaled_loss.backward()
    masters = list(amp.master_params(optimizer))
    unscaled = [p.grad.detach().clone() for p in masters]

    # The reference: fp32 tensors with the same values and the same unscaled gradients.
    ref_params = [p.detach().clone().requires_grad_() for p in masters]
    for param, grad in zip(ref_params, unscaled):
        param.grad = grad.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    ref_optimizer = reference_optimizer(kind, ref_params, lr=0.05)
    ref_optimizer.step()

    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    assert float(norm) == pytest.approx(true_norm, rel=5e-2)  # the unscaled norm, not loss_scale times it
    for param, ref_param, grad_before in zip(amp.master_params(optimizer), ref_params, unscaled):
        torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-6, atol=1e-9)
        if regime == "under-the-limit":
            assert torch.equal(param.grad, grad_before)
    optimizer.step()
    assert not amp.step_was_skipped(optimizer)
    for param, ref_param in zip(amp.master_params(optimizer), ref_params):
        assert param.dtype == torch.float32
        torch.testing.assert_close(param, ref_param, rtol=1e-5, atol=1e-6)
    if level == "O2":  # the half model holds the rounded masters
        for model_param, master in zip(model.parameters(), amp.master_params(optimizer)):
            assert torch.equal(model_param, master.to(half_dtype))


# ---- accumulation with delay_unscale ------------------------------------------------------------
def big_batch_step(kind, x, y, max_norm):
    model = tiny_model()
    optimizer = make_optimizer(kind, model.parameters())
    nn.functional.cross_entropy(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return float(norm), [p.detach().clone() for p in model.parameters()]


ACCUMULATION_CASES = {
    # level, half dtype, loss scale, tolerance of the weights after one step
    "O0-dynamic": ("O0", torch.float16, "dynamic", 1e-6),  # power-of-two scaling is exact in fp32
    "O1-bf16": ("O1", torch.bfloat16, "dynamic", 2e-2),
    "O2-fp16": ("O2", torch.float16, "dynamic", 5e-3),
    "O2-bf16": ("O2", torch.bfloat16, 2.0**16, 2e-2),
}


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("case", list(ACCUMULATION_CASES))
def test_delay_unscale_micro_batches_step_like_one_big_batch(case, kind):
    level, half_dtype, loss_scale, tolerance = ACCUMULATION_CASES[case]
    x, y = data(1, n=32)
    chunks = list(zip(x.chunk(4), y.chunk(4)))
    max_norm = 0.5 * fp32_grad_norm(x, y)  # the accumulated gradient gets clipped too
    ref_norm, ref_weights = big_batch_step(kind, x, y, max_norm)

    model = tiny_model()
    optimizer = make_optimizer(kind, model.parameters())
    amp.initialize(model, optimizer, opt_level=level, half_dtype=half_dtype, loss_scale=loss_scale, verbosity=0)
    scale_before = amp.loss_scale()
    for index, (xs, ys) in enumerate(chunks):
        loss = nn.functional.cross_entropy(model(xs), ys) / len(chunks)
        with amp.scale_loss(loss, optimizer, delay_unscale=index < len(chunks) - 1) as scaled_loss:
            scaled_loss.backward()
        if index < len(chunks) - 1:  # still scaled in place: the scaler has not seen them yet
            assert amp.loss_scale() == scale_before
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)
    optimizer.step()
    assert not amp.step_was_skipped(optimizer)
    assert float(norm) == pytest.approx(ref_norm, rel=tolerance)
    for got, want in zip(amp.master_params(optimizer), ref_weights):
        torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * 1e-1)


def test_delay_unscale_overflow_in_an_early_micro_batch_skips_the_step():
    # The delayed passes are checked with the last one: an inf in the first micro-batch
    # still skips the step and backs off the scale once.
    model = tiny_model()
    optimizer = make_optimizer("FusedAdam", model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    before = [p.detach().clone() for p in amp.master_params(optimizer)]
    x, y = data(2, n=32)
    for index, (xs, ys) in enumerate(zip(x.chunk(4), y.chunk(4))):
        with amp.scale_loss(nn.functional.cross_entropy(model(xs), ys), optimizer, delay_unscale=index < 3) as s:
            s.backward()
            if index == 0:
                model[0].weight.grad[0, 0] = INF
    optimizer.step()
    assert amp.step_was_skipped(optimizer)
    assert amp.loss_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(optimizer)))
