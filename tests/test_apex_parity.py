"""Behaviours apex users rely on (from apex's own tests/L0/run_amp): error types, overrides,
O3 checkpoints, optimizer wrappers (LARC), Tensor.cpu under O1, the half dtype from the
environment, the chosen properties shown at verbosity 1, and checkpoints with another num_losses.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from apex_amp import amp
from apex_amp.amp import casting
from apex_amp.optimizers import LARC, FusedAdam

BF16, F16 = torch.bfloat16, torch.float16


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)


# ---- error types -------------------------------------------------------------------------------

def test_banned_function_and_inplace_fp32_op_on_half_raise_not_implemented_as_apex():
    model = small_model()
    amp.initialize(model, opt_level="O1", half_dtype=F16, verbosity=0)
    probabilities = torch.rand(3, dtype=F16)
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
        F.binary_cross_entropy(probabilities, torch.rand(3, dtype=F16))
    with pytest.raises(NotImplementedError, match="in-place op cannot change its tensor's dtype"):
        torch.ones(2, dtype=F16).exp_()
    # NotImplementedError is a RuntimeError: code catching RuntimeError still does.
    with pytest.raises(RuntimeError):
        torch.ones(2, dtype=F16).log_()


# ---- cast_model_type=False ----------------------------------------------------------------------

@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_cast_model_type_false_leaves_the_model_uncast(level):
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level=level, half_dtype=BF16, cast_model_type=False, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x, y = batch()
    with amp.scale_loss(F.cross_entropy(model(x).float(), y), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    assert all(p.dtype == torch.float32 for p in amp.master_params(optimizer))


def test_cast_model_type_float32_is_accepted_with_o1_as_apex():
    model = small_model()
    amp.initialize(model, opt_level="O1", half_dtype=BF16, cast_model_type=torch.float32, verbosity=0)
    assert model(batch()[0]).dtype == BF16  # O1's casts still apply per op


# ---- O3 checkpoints are fp32 ----------------------------------------------------------------------

def test_o3_state_dict_is_fp32_and_loads_back_into_the_half_model():
    model = small_model()
    amp.initialize(model, opt_level="O3", half_dtype=BF16, verbosity=0)
    state = model.state_dict()
    assert model[0].weight.dtype == BF16
    assert all(value.dtype == torch.float32 for key, value in state.items() if value.is_floating_point()), state
    fresh = small_model(1)
    fresh.load_state_dict(state)  # an fp32 model loads it as it is
    assert torch.equal(fresh[0].weight, model[0].weight.float())
    model[0].weight.data.zero_()
    model.load_state_dict(state)
    assert torch.equal(model[0].weight.float(), state["0.weight"])


# ---- optimizer wrappers: LARC ----------------------------------------------------------------------

def larc_reference(steps: int, trust: float = 0.02, lr: float = 0.1, weight_decay: float = 1e-2, skip=()):
    """LARC written out with plain tensors on an fp32 model (the algorithm, independently)."""
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)
    for step in range(steps):
        optimizer.zero_grad()
        x, y = batch(step)
        F.cross_entropy(model(x), y).backward()
        if step in skip:
            continue
        with torch.no_grad():
            for p in model.parameters():
                w, g = p.norm(), p.grad.norm()
                if w != 0 and g != 0:
                    rate = min(float(trust * w / (g + w * weight_decay + 1e-8)) / lr, 1.0)
                    p.grad.add_(p, alpha=weight_decay).mul_(rate)
        decay = [group["weight_decay"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["weight_decay"] = 0.0
        optimizer.step()
        for group, value in zip(optimizer.param_groups, decay):
            group["weight_decay"] = value
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("inner", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_initialize_accepts_larc_and_returns_the_same_wrapper(level, inner):
    model = small_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-2) if inner == "SGD" else FusedAdam(
        model.parameters(), lr=1e-3, weight_decay=1e-2)
    optimizer = LARC(base)
    returned_model, returned = amp.initialize(model, optimizer, opt_level=level, half_dtype=BF16,
                                              loss_scale="dynamic", verbosity=0)
    assert returned is optimizer and returned_model is model and optimizer.optim is base
    before = [p.detach().clone() for p in amp.master_params(optimizer)]
    for step in range(3):
        optimizer.zero_grad()
        x, y = batch(step)
        loss = F.cross_entropy(model(x).float(), y) * (float("inf") if step == 1 else 1.0)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        assert amp.step_was_skipped(optimizer) == (step == 1)
    after = list(amp.master_params(optimizer))
    assert all(torch.isfinite(p).all() for p in after)
    assert not all(torch.equal(a, b) for a, b in zip(before, after))


def test_larc_under_o2_follows_the_fp32_algorithm_on_true_gradients():
    # The gradients LARC scales must be the unscaled ones (amp settles them before LARC reads them).
    model = small_model()
    optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-2))
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=F16, verbosity=0)
    for step in range(3):
        optimizer.zero_grad()
        x, y = batch(step)
        loss = F.cross_entropy(model(x).float(), y) * (1e6 if step == 1 else 1.0)  # fp16 overflow at step 1
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    for got, want in zip(amp.master_params(optimizer), larc_reference(3, skip={1})):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_larc_with_fused_adam_under_o2_scales_true_gradients():
    # FusedAdam would otherwise take the gradients still scaled; LARC must see them unscaled first.
    def run(use_amp: bool):
        model = small_model()
        optimizer = LARC(FusedAdam(model.parameters(), lr=1e-2), trust_coefficient=0.001)
        if use_amp:
            amp.initialize(model, optimizer, opt_level="O2", half_dtype=F16, verbosity=0)
        for step in range(3):
            optimizer.zero_grad()
            x, y = batch(step)
            loss = F.cross_entropy(model(x).float(), y)
            if use_amp:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            optimizer.step()
        return [p.detach().clone() for p in (amp.master_params(optimizer) if use_amp else model.parameters())]

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_other_objects_are_still_refused_with_the_wrapper_named():
    model = small_model()
    with pytest.raises(TypeError, match=r"or a wrapper holding one in .optim, such as LARC"):
        amp.initialize(model, object(), opt_level="O1", verbosity=0)


# ---- Tensor.cpu under O1 ---------------------------------------------------------------------------

@pytest.mark.parametrize("half", [F16, BF16], ids=["fp16", "bf16"])
def test_o1_moves_half_tensors_to_the_cpu_as_fp32(half):
    model = small_model()
    amp.initialize(model, opt_level="O1", half_dtype=half, verbosity=0)
    out = model[0](torch.randn(2, 4))
    assert out.dtype == half
    moved = out.cpu()
    assert moved.dtype == torch.float32 and torch.equal(moved, out.float())
    moved.detach().numpy()  # numpy has no bf16: this is why apex did it
    assert torch.arange(3).cpu().dtype == torch.int64  # only half tensors are cast
    casting.deactivate()
    assert out.cpu().dtype == half  # outside O1, .cpu() is torch's own


# ---- the half dtype from the environment, and what initialize shows -------------------------------

def test_half_dtype_comes_from_the_environment_unless_passed(monkeypatch):
    monkeypatch.setenv("APEX_AMP_HALF_DTYPE", "bfloat16")
    model = small_model()
    amp.initialize(model, opt_level="O2", verbosity=0)
    assert model[0].weight.dtype == BF16
    model = small_model()
    amp.initialize(model, opt_level="O2", half_dtype=F16, verbosity=0)  # an explicit argument wins
    assert model[0].weight.dtype == F16
    monkeypatch.setenv("APEX_AMP_HALF_DTYPE", "float16")
    model = small_model()
    amp.initialize(model, opt_level="O3", verbosity=0)
    assert model[0].weight.dtype == F16


@pytest.mark.parametrize("bad", ["fp8", "half", "torch.bfloat16", "float32"])
def test_a_bad_half_dtype_in_the_environment_names_the_valid_ones(monkeypatch, bad):
    monkeypatch.setenv("APEX_AMP_HALF_DTYPE", bad)
    model = small_model()
    with pytest.raises(ValueError, match=r"APEX_AMP_HALF_DTYPE=.* is not a half dtype; set it to one of "
                                         r"\['bfloat16', 'float16'\]"):
        amp.initialize(model, opt_level="O2", verbosity=0)
    assert model[0].weight.dtype == torch.float32  # nothing was cast


SHOW = """
import torch
from apex_amp import amp
model = torch.nn.Linear(2, 2)
amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity={verbosity})
"""


@pytest.mark.parametrize("verbosity", [1, 0])
def test_verbosity_1_shows_the_chosen_level_and_properties_without_logging_set_up(verbosity):
    # A fresh interpreter, with logging left as Python starts it (nothing configured).
    env = dict(os.environ, APEX_AMP_HALF_DTYPE="bfloat16", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", SHOW.format(verbosity=verbosity)], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    shown = "apex_amp: optimization level O2 with half dtype torch.bfloat16" in result.stderr
    assert shown == (verbosity == 1), result.stderr
    if shown:
        assert "master_weights        : True" in result.stderr and "cast_model_type       : torch.bfloat16" in result.stderr


def test_verbosity_1_goes_through_configured_logging(caplog):
    model = small_model()
    with caplog.at_level(logging.INFO, logger="apex_amp"):
        amp.initialize(model, opt_level="O1", half_dtype=BF16, verbosity=1)
    assert any("optimization level O1" in record.getMessage() for record in caplog.records)


# ---- checkpoints saved with another num_losses ------------------------------------------------------

def test_a_state_with_more_loss_scalers_loads_what_fits_and_warns(caplog):
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, loss_scale="dynamic", num_losses=2,
                   verbosity=0)
    saved = amp.state_dict()
    saved["loss_scaler0"]["loss_scale"] = 512.0
    saved["loss_scaler1"]["loss_scale"] = 1024.0
    saved["loss_scaler2"] = dict(saved["loss_scaler1"], loss_scale=2048.0)
    with caplog.at_level(logging.WARNING, logger="apex_amp"):
        amp.load_state_dict(saved)
    assert (amp.loss_scale(0), amp.loss_scale(1)) == (512.0, 1024.0)
    assert "skipping ['loss_scaler2']" in caplog.text
    del saved["loss_scaler1"], saved["loss_scaler2"]
    saved["loss_scaler0"]["loss_scale"] = 8.0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="apex_amp"):
        amp.load_state_dict(saved)
    assert (amp.loss_scale(0), amp.loss_scale(1)) == (8.0, 1024.0)
    assert "['loss_scaler1'] keep their current state" in caplog.text
