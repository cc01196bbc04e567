"""apex's overflow check by hand: ``amp._amp_state.loss_scalers[i]._overflow_buf`` and ``update_scale()``.

NVIDIA's BERT ``run_pretraining.py`` (``--allreduce_post_accumulation``) all-reduces the
gradients itself, has ``amp_C.multi_tensor_scale`` write an overflow into its own int buffer,
puts the buffer in the scaler's ``_overflow_buf``, calls ``update_scale()`` and steps only when it
returns a false value. The scale must then move by amp's own rule, exactly as the same overflows
met in backward passes move it; and apex's first API ``amp.init`` exists and says what to use.
Its passes use ``scale_loss(..., delay_overflow_check=True)``, which (as in apex) leaves the scale
update to ``update_scale()``, once per step; amp still never applies gradients it saw non-finite,
and a step the client skipped by dropping the gradients does not skip the next one.
"""

from __future__ import annotations

import pytest
import torch

from apex_amp import amp

from _misuse import BF16, small_model, train_step


@pytest.fixture(params=[torch.float16, BF16], ids=["fp16", "bf16"])
def half_dtype(request):
    return request.param


def _initialized(half_dtype, **overrides):
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=half_dtype, loss_scale="dynamic", verbosity=0,
                   **overrides)
    return model, optimizer


def test_the_view_is_one_object_per_scaler_with_an_int_buffer_on_the_scales_device(half_dtype):
    _initialized(half_dtype)
    scaler = amp._amp_state.loss_scalers[0]
    assert amp._amp_state.loss_scalers[0] is scaler  # a buffer set on it stays
    assert scaler._overflow_buf.dtype == torch.int32 and scaler._overflow_buf.tolist() == [0]
    own = torch.zeros(1, dtype=torch.int)
    scaler._overflow_buf = own
    scaler._overfloat_buf = None  # DLE's typo when it "restores" the buffer: an attribute like any other
    assert amp._amp_state.loss_scalers[0]._overflow_buf is own


def test_a_set_flag_backs_the_scale_off_says_skip_and_is_cleared(half_dtype):
    _initialized(half_dtype)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._overflow_buf.fill_(1)
    assert scaler.update_scale() is True
    assert amp.loss_scale() == 2.0**15
    assert scaler._overflow_buf.tolist() == [0]
    assert amp.state_dict()["loss_scaler0"]["overflows"] == 1
    assert scaler.update_scale() is False  # cleared: the next update is a clean one
    assert amp.loss_scale() == 2.0**15 and scaler._unskipped == 1


def test_clean_updates_grow_the_scale_after_the_scale_window(half_dtype):
    _initialized(half_dtype, scale_window=3)
    scaler = amp._amp_state.loss_scalers[0]
    for _ in range(2):
        assert scaler.update_scale() is False
    assert amp.loss_scale() == 2.0**16
    assert scaler.update_scale() is False
    assert amp.loss_scale() == 2.0**17 and scaler._unskipped == 0


def test_update_scale_follows_the_same_rule_as_backward_passes(half_dtype):
    # The same sequence of clean and overflowing updates, once through checked backward passes
    # and once through update_scale(): the scale and its counters end equal.
    pattern = [0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    model, optimizer = _initialized(half_dtype, scale_window=2, hysteresis=2)
    for overflow in pattern:
        optimizer.zero_grad()
        loss = model(torch.randn(6, 4)).float().pow(2).mean() * (1e38 if overflow else 1.0)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    by_passes = amp.state_dict()["loss_scaler0"]
    _initialized(half_dtype, scale_window=2, hysteresis=2)
    scaler = amp._amp_state.loss_scalers[0]
    skips = []
    for overflow in pattern:
        scaler._overflow_buf.fill_(overflow)
        skips.append(scaler.update_scale())
    assert amp.state_dict()["loss_scaler0"] == by_passes
    assert skips == [bool(overflow) for overflow in pattern]


def test_a_scaler_that_checks_nothing_changes_nothing(half_dtype):
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O3", half_dtype=half_dtype, verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._overflow_buf.fill_(1)
    assert scaler.update_scale() is False
    assert amp.loss_scale() == 1.0 and scaler._overflow_buf.tolist() == [0]


def test_a_step_taken_after_update_scale_trains(half_dtype):
    model, optimizer = _initialized(half_dtype)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = amp._amp_state.loss_scalers[0]
    train_step(model, optimizer)
    assert scaler.update_scale() is False
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


def test_a_buffer_that_is_not_a_tensor_is_refused(half_dtype):
    _initialized(half_dtype)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._overflow_buf = 0
    with pytest.raises(TypeError, match="_overflow_buf must be a one-element int tensor"):
        scaler.update_scale()


def test_amp_init_exists_and_names_initialize_when_called():
    from apex_amp.amp import init  # bound at import, as old scripts do

    with pytest.raises(RuntimeError, match=r"amp\.initialize\(model, optimizer, opt_level='O1'\)"):
        init()
    with pytest.raises(RuntimeError, match="leave amp out"):
        init(enabled=False)


# ---- scale_loss(..., delay_overflow_check=True): the client's update_scale() updates the scale ----
def _fused_adam(model):
    from apex_amp.optimizers import FusedAdam
    return FusedAdam(model.parameters(), lr=0.01)


@pytest.fixture(params=[(level, kind) for level in ("O1", "O2") for kind in ("SGD", "FusedAdam")],
                ids=lambda param: "-".join(param))
def client_initialized(request, half_dtype):
    opt_level, kind = request.param
    model = small_model()
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if kind == "SGD"
                 else _fused_adam(model))
    amp.initialize(model, optimizer, opt_level=opt_level, half_dtype=half_dtype, loss_scale="dynamic", verbosity=0)
    return model, optimizer


def _unchecked_pass(model, optimizer, blow_up=1.0, delay_unscale=False, seed=0):
    loss = model(torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))).float().pow(2).mean()
    with amp.scale_loss(loss * blow_up, optimizer, delay_unscale=delay_unscale, delay_overflow_check=True) as scaled:
        scaled.backward()


def _weights(model, optimizer):
    return [p.detach().clone() for p in [*model.parameters(), *amp.master_params(optimizer)]]


def _changed(before, model, optimizer):
    return any(not torch.equal(b, p) for b, p in zip(before, [*model.parameters(), *amp.master_params(optimizer)]))


def test_an_overflowing_pass_with_delay_overflow_check_leaves_the_scale_to_update_scale(client_initialized):
    model, optimizer = client_initialized
    _unchecked_pass(model, optimizer, blow_up=1e38)
    assert amp.loss_scale() == 2.0**16
    assert amp.state_dict()["loss_scaler0"]["overflows"] == 0
    scaler = amp._amp_state.loss_scalers[0]
    scaler._overflow_buf.fill_(1)  # what the client's own amp_C check of the gradients found
    assert scaler.update_scale() is True
    assert amp.loss_scale() == 2.0**15 and amp.state_dict()["loss_scaler0"]["overflows"] == 1


def test_an_accumulation_with_delay_overflow_check_is_one_scale_update_per_step(client_initialized):
    # BERT: N micro-batches (the first N - 1 with delay_unscale), then update_scale() once.
    model, optimizer = client_initialized
    scaler = amp._amp_state.loss_scalers[0]
    for step in range(3):
        for micro in range(4):
            _unchecked_pass(model, optimizer, delay_unscale=micro < 3, seed=micro)
        assert scaler.update_scale() is False
        optimizer.step()
        optimizer.zero_grad()
        assert scaler._unskipped == step + 1 and amp.loss_scale() == 2.0**16


def test_a_step_after_an_overflowing_pass_with_delay_overflow_check_is_still_skipped(client_initialized):
    # The client decides the skip, but amp never applies gradients it saw non-finite.
    model, optimizer = client_initialized
    _unchecked_pass(model, optimizer, blow_up=1e38)
    before = _weights(model, optimizer)
    optimizer.step()
    assert not _changed(before, model, optimizer)
    assert all(torch.isfinite(p).all() for p in [*model.parameters(), *amp.master_params(optimizer)])


def test_a_step_the_client_skipped_by_dropping_its_gradients_does_not_skip_the_next(client_initialized):
    # NVIDIA's BERT on an overflow: no optimizer.step(), `param.grad = None` on masters and model.
    model, optimizer = client_initialized
    scaler = amp._amp_state.loss_scalers[0]
    _unchecked_pass(model, optimizer, blow_up=1e38)
    scaler._overflow_buf.fill_(1)
    assert scaler.update_scale() is True
    for param in [*optimizer._amp_stash.all_fp32_from_fp16_params, *model.parameters()]:
        param.grad = None
    _unchecked_pass(model, optimizer)
    assert scaler.update_scale() is False
    before = _weights(model, optimizer)
    optimizer.step()
    assert _changed(before, model, optimizer)
    assert amp.loss_scale() == 2.0**15 and amp.state_dict()["loss_scaler0"]["overflows"] == 1


def test_a_clear_after_an_overflowing_checked_pass_still_skips_the_step(client_initialized):
    # Without delay_overflow_check the skip is amp's (apex patched the step at the pass's exit).
    model, optimizer = client_initialized
    loss = model(torch.randn(6, 4)).float().pow(2).mean() * 1e38
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    for param in [*amp.master_params(optimizer), *model.parameters()]:
        param.grad = None
    _unchecked_pass(model, optimizer)
    before = _weights(model, optimizer)
    optimizer.step()
    assert not _changed(before, model, optimizer)


def _checked_pass(model, optimizer, seed=0):
    loss = model(torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))).float().pow(2).mean()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()


def test_a_client_skip_by_dropping_the_gradients_ends_after_a_checked_clean_pass_too(client_initialized):
    # Found by tests/test_call_order_state_machine.py: a clean pass that amp checks, then the client's
    # own overflowing one; the client skips by dropping every gradient, as NVIDIA's BERT does. The
    # clean pass's flag must not keep the client's overflow as amp's own skip past the drop.
    model, optimizer = client_initialized
    scaler = amp._amp_state.loss_scalers[0]
    _checked_pass(model, optimizer)
    _unchecked_pass(model, optimizer, blow_up=1e38, seed=1)
    scaler._overflow_buf.fill_(1)
    assert scaler.update_scale() is True
    for param in [*amp.master_params(optimizer), *model.parameters()]:
        param.grad = None
    _checked_pass(model, optimizer, seed=2)
    before = _weights(model, optimizer)
    optimizer.step()
    assert not amp.step_was_skipped(optimizer) and _changed(before, model, optimizer)
    assert amp.state_dict()["loss_scaler0"]["overflows"] == 1


@pytest.mark.parametrize("clear", ["by hand", "optimizer.zero_grad", "model.zero_grad"])
def test_a_client_skip_by_clearing_the_gradients_to_zero_does_not_skip_the_next(client_initialized, clear):
    # Found by tests/test_call_order_state_machine.py: a client that skips its step by clearing the
    # gradients to zero rather than to None. A clear that leaves a non-finite gradient (the model's
    # under O2, where the masters keep theirs) still keeps the step from applying it.
    model, optimizer = client_initialized
    scaler = amp._amp_state.loss_scalers[0]
    _unchecked_pass(model, optimizer, blow_up=1e38)
    scaler._overflow_buf.fill_(1)
    assert scaler.update_scale() is True
    if clear == "by hand":
        for param in [*amp.master_params(optimizer), *model.parameters()]:
            if param.grad is not None:
                param.grad.zero_()
    elif clear == "optimizer.zero_grad":
        optimizer.zero_grad(set_to_none=False)
    else:
        model.zero_grad(set_to_none=False)
    _unchecked_pass(model, optimizer, seed=1)
    assert scaler.update_scale() is False
    before = _weights(model, optimizer)
    optimizer.step()
    left_non_finite = clear == "model.zero_grad" and bool(optimizer._amp_stash.all_fp32_from_fp16_params)
    assert amp.step_was_skipped(optimizer) is left_non_finite
    assert _changed(before, model, optimizer) is not left_non_finite
    assert all(torch.isfinite(p).all() for p in [*model.parameters(), *amp.master_params(optimizer)])
