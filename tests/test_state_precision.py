"""The fused optimizers' state precision (state_precision / state_block_size / min_quantized_numel).

The settings are constructor arguments and param-group keys of every fused optimizer; the state
is laid out by state_formats.state_layout from the global shape, fp8/int8 absmaxes live in the
state beside their codes and reach the op in the batches (and in the cached batch plans). The
numerics of the formats are state_formats' (tests/test_state_formats.py); here: that the
optimizers store, pass and keep what that module defines.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apex_amp.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad,
                                 FusedSGD)
from apex_amp.optimizers.fused_optimizer import AmpStepArgs
from apex_amp.optimizers.state_formats import dequantize, quantize

# name -> (factory, {state key: never negative})
FAMILY = {
    "FusedAdam": (lambda params, **kw: FusedAdam(params, lr=1e-2, **kw), {"exp_avg": False, "exp_avg_sq": True}),
    "FusedLAMB": (lambda params, **kw: FusedLAMB(params, lr=1e-2, **kw), {"exp_avg": False, "exp_avg_sq": True}),
    "FusedMixedPrecisionLamb": (lambda params, **kw: FusedMixedPrecisionLamb(params, lr=1e-2, **kw),
                                {"exp_avg": False, "exp_avg_sq": True}),
    "FusedSGD": (lambda params, **kw: FusedSGD(params, lr=0.05, momentum=0.9, **kw), {"momentum_buffer": False}),
    "FusedAdagrad": (lambda params, **kw: FusedAdagrad(params, lr=1e-2, **kw), {"sum": True}),
    "FusedNovoGrad": (lambda params, **kw: FusedNovoGrad(params, lr=1e-2, **kw), {"exp_avg": False}),
}
STORAGE = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
           "fp8": (torch.float8_e4m3fn, torch.float8_e4m3fn), "int8": (torch.int8, torch.uint8)}


def make_model(seed: int = 0) -> nn.Module:
    # model[0].weight: 64 rows of 128 (8192 elements): quantized, one 128-element block per row (blocks
    # never cross a row); the biases and model[2].weight (256 elements) keep fp32 (< min_quantized_numel).
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 4))


def run(optimizer, model, steps=3, seed=1, found_inf_at=()):
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(16, 128, generator=generator)
        model.zero_grad()
        model(x.to(next(model.parameters()).dtype)).float().pow(2).mean().backward()
        if step in found_inf_at:
            optimizer.step(amp=AmpStepArgs(found_inf=torch.ones(1)))
        else:
            optimizer.step()


# ---- the settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_every_fused_optimizer_takes_the_settings_as_arguments_and_group_keys(name):
    factory, _ = FAMILY[name]
    model = make_model()
    optimizer = factory([{"params": model[0].parameters(), "state_precision": "int8"},
                         {"params": model[2].parameters()}],
                        state_precision="bf16", state_block_size=128, min_quantized_numel=100)
    first, second = optimizer.param_groups
    assert (first["state_precision"], second["state_precision"]) == ("int8", "bf16")
    assert first["state_block_size"] == second["state_block_size"] == 128
    assert first["min_quantized_numel"] == 100
    assert optimizer.state_dict()["param_groups"][0]["state_precision"] == "int8"


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_default_is_fp32_state(name):
    factory, _ = FAMILY[name]
    group = factory(make_model().parameters()).param_groups[0]
    assert (group["state_precision"], group["state_block_size"], group["min_quantized_numel"]) == ("fp32", 256, 4096)


@pytest.mark.parametrize("setting, message", [
    (dict(state_precision="int4"), "state_precision must be one of 'fp32', 'bf16', 'fp8', 'int8'"),
    (dict(state_block_size=100), "state_block_size must be a power of two in \\[32, 4096\\]"),
    (dict(state_block_size=8192), "state_block_size must be a power of two"),
    (dict(min_quantized_numel=-1), "min_quantized_numel must be an int >= 0"),
])
@pytest.mark.parametrize("where", ["argument", "param group"])
def test_bad_settings_are_refused_with_what_is_allowed(setting, message, where):
    model = make_model()
    with pytest.raises(ValueError, match=message):
        if where == "argument":
            FusedAdam(model.parameters(), **setting)
        else:
            FusedAdam([{"params": model.parameters(), **setting}])


def test_a_group_added_later_is_validated_too():
    model = make_model()
    optimizer = FusedAdam(model[0].parameters())
    with pytest.raises(ValueError, match="state_precision must be one of"):
        optimizer.add_param_group({"params": model[2].parameters(), "state_precision": "fp4"})
