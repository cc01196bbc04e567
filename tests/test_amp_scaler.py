"""Loss scaling: scale trajectory vs a plain-Python reference, exact skips, overflow log, several losses."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

import _reference as ref
from apex_amp import amp
from apex_amp.optimizers import FusedAdam

INF = float("inf")


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "SGD":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if kind == "Adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3)
    return FusedAdam(params, lr=1e-2, weight_decay=1e-3)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def train_step(model, optimizer, step, inject=None, loss_id=0):
    x, y = batch(step)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
        scaled.backward()
        if inject is not None:
            model[0].weight.grad[0, 0] = inject  # the gradient the backward produced (half under O2)
    optimizer.step()
    return loss


def snapshot(model, optimizer):
    # Parameters, masters and optimizer state (not BN running stats: the forward updates those).
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [p.detach().clone() for p in amp.master_params(optimizer)]
    for state in optimizer.state.values():
        tensors += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def bitwise_equal(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


# ---- skips are exact ------------------------------------------------------------------
CASES = [
    ("O1", torch.bfloat16, {}),
    ("O1", torch.float16, {}),
    ("O2", torch.bfloat16, {}),
    ("O2", torch.float16, {}),
    ("O3", torch.bfloat16, {"skip_nonfinite": True}),
    ("O0", torch.float16, {"skip_nonfinite": True}),
]


@pytest.mark.parametrize("kind", ["SGD", "Adam", "FusedAdam"])
@pytest.mark.parametrize("level, half, extra", CASES)
def test_injected_overflow_skips_exactly_those_steps_bitwise(level, half, extra, kind):
    model = tiny_model()
    optimizer = make_optimizer(kind, model.parameters())
    amp.initialize(model, optimizer, opt_level=level, half_dtype=half, verbosity=0, **extra)
    inject_at = {1: INF, 3: float("nan"), 4: -INF}
    for step in range(6):
        before = snapshot(model, optimizer)
        train_step(model, optimizer, step, inject=inject_at.get(step))
        after = snapshot(model, optimizer)
        assert amp.step_was_skipped(optimizer) == (step in inject_at)
        if step in inject_at:
            assert bitwise_equal(before, after), f"step {step} was not a no-op"
        else:
            assert not bitwise_equal(before, after), f"step {step} changed nothing"
        assert all(torch.isfinite(t).all() for t in after)


def test_nan_loss_skips_the_step():
    model = tiny_model()
    optimizer = make_optimizer("FusedAdam", model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    before = snapshot(model, optimizer)
    x, y = batch(0)
    loss = nn.functional.cross_entropy(model(x), y) * float("nan")
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert amp.step_was_skipped(optimizer)
    # The first step creates FusedAdam's state lazily; skipped, it stays at its initial zeros.
    after = snapshot(model, optimizer)
    assert bitwise_equal(before, after[: len(before)])
    assert all(not t.any() for t in after[len(before):])
    assert amp.loss_scale() == 32768.0


def test_static_levels_do_not_check_by_default():
    model = tiny_model()
    optimizer = make_optimizer("SGD", model.parameters())
    amp.initialize(model, optimizer, opt_level="O3", half_dtype=torch.bfloat16, verbosity=0)
    train_step(model, optimizer, 0, inject=INF)
    assert not amp.step_was_skipped(optimizer)
    assert not torch.isfinite(model[0].weight).all()  # apex's O3: the user asked for no checks


# ---- scale trajectory ---------------------------------------------------------------------
# Isolated overflows (steps 1, 3), a run of three (7-9), clean runs that grow the scale (window 3).
OVERFLOWS = [False, True, False, True, False, False, False, True, True, True, False, False, False, False, False,
             False, True, False]


@pytest.mark.parametrize(("hysteresis", "consecutive"), [(1, True), (2, True), (2, False)])
@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
def test_scale_trajectory_matches_reference(kind, hysteresis, consecutive):
    model = tiny_model()
    optimizer = make_optimizer(kind, model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0, scale_window=3, hysteresis=hysteresis,
                   consecutive_hysteresis=consecutive, max_loss_scale=2.0**24)
    scales = []
    for step, overflow in enumerate(OVERFLOWS):
        train_step(model, optimizer, step, inject=INF if overflow else None)
        scales.append(amp.loss_scale())
    rule = ref.ScaleRule(growth_interval=3, hysteresis=hysteresis, consecutive_hysteresis=consecutive)
    assert scales == ref.scale_trajectory(OVERFLOWS, 65536.0, rule)


def test_the_two_hysteresis_rules_differ_on_isolated_overflows():
    # What makes the trajectory test above able to tell the rules apart.
    apex, megatron = (ref.ScaleRule(growth_interval=3, hysteresis=2, consecutive_hysteresis=c) for c in (True, False))
    assert ref.scale_trajectory(OVERFLOWS[:4], 65536.0, apex) == [65536.0] * 4
    assert ref.scale_trajectory(OVERFLOWS[:4], 65536.0, megatron) == [65536.0] * 3 + [32768.0]


def test_scale_never_drops_below_min_loss_scale():
    model = tiny_model()
    optimizer = make_optimizer("FusedAdam", model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0, min_loss_scale=4096.0)
    for step in range(8):
        train_step(model, optimizer, step, inject=INF)
    assert amp.loss_scale() == 4096.0
    assert amp.state_dict()["loss_scaler0"]["overflows"] == 8


def test_static_scale_never_changes_but_o2_still_skips():
    model = tiny_model()
    optimizer = make_optimizer("Adam", model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", loss_scale=128.0, verbosity=0)
    for step in range(4):
        before = snapshot(model, optimizer)
        train_step(model, optimizer, step, inject=INF if step % 2 else None)
        assert amp.loss_scale() == 128.0
        assert bitwise_equal(before, snapshot(model, optimizer)) == bool(step % 2)


def test_scale_grows_after_window_and_is_capped():
    model = tiny_model()
    optimizer = make_optimizer("SGD", model.parameters())
    amp.initialize(model, optimizer, opt_level="O1", verbosity=0, scale_window=2, max_loss_scale=2.0**17)
    for step in range(6):
        train_step(model, optimizer, step)
    assert amp.loss_scale() == 2.0**17


# ---- the overflow log -----------------------------------------------------------------------
def test_overflow_message_is_apex_exact(caplog):
    model = tiny_model()
    optimizer = make_optimizer("FusedAdam", model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=1)
    with caplog.at_level(logging.WARNING, logger="apex_amp"):
        train_step(model, optimizer, 0, inject=INF)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0"]


def test_overflow_log_is_rate_limited_with_a_summary(caplog):
    model = tiny_model()
    optimizer = make_optimizer("SGD", model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=1)
    with caplog.at_level(logging.WARNING, logger="apex_amp"):
        for step in range(40):
            train_step(model, optimizer, step, inject=INF)
    messages = [r.getMessage() for r in caplog.records]
    overflow_lines = [m for m in messages if m.startswith("Gradient overflow.  Skipping step")]
    summaries = [m for m in messages if "were not logged" in m]
    assert len(overflow_lines) == 12  # overflows 1..10, 16 and 32
    assert len(summaries) == 2 and "5 more overflows" in summaries[0] and "16 steps skipped" in summaries[0]
    assert "15 more overflows" in summaries[1] and "32 steps skipped so far" in summaries[1]


def test_verbosity_zero_silences_overflow_messages(caplog):
    model = tiny_model()
    optimizer = make_optimizer("SGD", model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    with caplog.at_level(logging.WARNING, logger="apex_amp"):
        train_step(model, optimizer, 0, inject=INF)
    assert not caplog.records


# ---- several losses / models / optimizers ----------------------------------------------------------
def test_overflow_in_one_loss_skips_only_its_optimizers_and_halves_only_its_scale():
    model_a, model_b = tiny_model(1), tiny_model(2)
    opt_a = make_optimizer("FusedAdam", model_a.parameters())
    opt_b = make_optimizer("SGD", model_b.parameters())
    amp.initialize([model_a, model_b], [opt_a, opt_b], opt_level="O2", num_losses=2, verbosity=0)
    x, y = batch(0)
    before_a, before_b = snapshot(model_a, opt_a), snapshot(model_b, opt_b)
    for model, opt, loss_id in ((model_a, opt_a, 0), (model_b, opt_b, 1)):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
            scaled.backward()
            if loss_id == 1:
                model[0].weight.grad.fill_(INF)
        opt.step()
    assert not amp.step_was_skipped(opt_a) and amp.step_was_skipped(opt_b)
    assert not bitwise_equal(before_a, snapshot(model_a, opt_a))
    assert bitwise_equal(before_b, snapshot(model_b, opt_b))
    assert amp.loss_scale(0) == 65536.0 and amp.loss_scale(1) == 32768.0


def test_one_loss_over_two_optimizers_skips_both():
    model = tiny_model()
    head = list(model[3].parameters())
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    opt_body, opt_head = make_optimizer("Adam", body), make_optimizer("FusedAdam", head)
    amp.initialize(model, [opt_body, opt_head], opt_level="O2", verbosity=0)
    x, y = batch(0)
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, [opt_body, opt_head]) as scaled:
        scaled.backward()
        model[3].weight.grad[0, 0] = INF
    opt_body.step()
    opt_head.step()
    assert amp.step_was_skipped(opt_body) and amp.step_was_skipped(opt_head)
    assert math.isclose(amp.loss_scale(), 32768.0)
