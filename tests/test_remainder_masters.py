"""master_weights="remainder": a bf16 param plus an int16 remainder in the state is the exact fp32 master.

The fused optimizers with remainders train bitwise like master_weights=True (same masters, through
skipped steps); amp's O2 with master_weights="remainder" makes no fp32 copies and matches O2 with
them; fp16 weights and non-fused optimizers are refused with the reason. Under FSDP2:
tests/test_remainder_fsdp2.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from apex_amp.optimizers.fused_optimizer import AmpStepArgs
from apex_amp.optimizers.state_formats import join_master, split_master

FAMILY = {
    "FusedAdam": lambda params, **kw: FusedAdam(params, lr=1e-2, weight_decay=0.01, **kw),
    "FusedSGD": lambda params, **kw: FusedSGD(params, lr=0.05, momentum=0.9, **kw),
    "FusedAdagrad": lambda params, **kw: FusedAdagrad(params, lr=1e-2, **kw),
    "FusedNovoGrad": lambda params, **kw: FusedNovoGrad(params, lr=1e-2, **kw),
    "FusedLAMB": lambda params, **kw: FusedLAMB(params, lr=1e-2, **kw),
}
SKIPPED = (3, 4, 11)


def make_model(dtype=torch.bfloat16, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 4)).to(dtype)


def step_together(first, first_model, second, second_model, steps, skipped=SKIPPED, seed=1):
    """Steps both optimizers with the same gradients (``first_model``'s), skipping the steps in ``skipped``.

    The same gradients: the weights the two forwards would use differ where a master lies exactly
    halfway between two bf16 numbers (the weight of a remainder master rounds such a tie away from
    zero, an fp32 master's copy to even), so the comparison is of the updates, as the contract says.
    """
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        first_model.zero_grad()
        x = torch.randn(16, 128, generator=generator).to(first_model[0].weight.dtype)
        first_model(x).float().pow(2).mean().backward()
        for p, q in zip(first_model.parameters(), second_model.parameters()):
            q.grad = p.grad.clone()
        for optimizer in (first, second):
            if step in skipped:  # an overflowed step: amp's flag, which skips on the device
                optimizer.step(amp=AmpStepArgs(found_inf=torch.ones(1)))
            else:
                optimizer.step()
        yield step


@pytest.mark.parametrize("steps, skipped", [
    (16, SKIPPED),
    pytest.param(200, tuple(range(3, 200, 17)), marks=pytest.mark.slow),
])
@pytest.mark.parametrize("precision", ["fp32", "fp8", "int8"])
@pytest.mark.parametrize("name", sorted(FAMILY))
def test_remainder_masters_update_bitwise_like_fp32_masters_through_skipped_steps(name, precision, steps, skipped):
    with_masters, with_remainders = make_model(), make_model()
    first = FAMILY[name](with_masters.parameters(), master_weights=True, state_precision=precision)
    second = FAMILY[name](with_remainders.parameters(), master_weights="remainder", state_precision=precision)
    for _ in step_together(first, with_masters, second, with_remainders, steps, skipped):
        for p, q in zip(with_masters.parameters(), with_remainders.parameters()):
            master = first.state[p]["master_param"]
            assert "master_param" not in second.state[q]
            assert torch.equal(join_master(q.detach(), second.state[q]["master_remainder"]).view(torch.int32),
                               master.view(torch.int32))
            assert torch.equal(q.detach(), split_master(master)[0])  # the master rounded to nearest bf16


def test_fp16_params_are_refused_with_the_reason():
    model = make_model(torch.float16)
    with pytest.raises(ValueError, match="fp16 is not the high half of fp32"):
        FusedAdam(model.parameters(), master_weights="remainder")


def test_master_weights_takes_only_true_false_or_remainder():
    with pytest.raises(ValueError, match="master_weights must be True, False or 'remainder'"):
        FusedAdam(make_model().parameters(), master_weights="fp32")


def test_fp32_params_beside_remainder_params_are_updated_in_place():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(64, 128).to(torch.bfloat16))
    scale = nn.Parameter(torch.ones(64))  # fp32: its own master
    optimizer = FusedAdam([weight, scale], lr=1e-2, master_weights="remainder")
    ((torch.randn(16, 128, dtype=torch.bfloat16) @ weight.t()).float() * scale).pow(2).mean().backward()
    before = scale.detach().clone()
    optimizer.step()
    assert optimizer.state[weight]["master_remainder"].dtype == torch.int16
    assert "master_remainder" not in optimizer.state[scale] and not torch.equal(scale, before)


def test_a_cached_plan_follows_a_remainder_replaced_in_the_state():
    model = make_model()
    optimizer = FusedSGD(model.parameters(), lr=0.05, momentum=0.9, master_weights="remainder")
    for _ in range(2):  # the second step reuses the first one's batches
        model(torch.randn(16, 128, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        optimizer.step()
    replaced = optimizer.state[model[0].weight]["master_remainder"] = \
        optimizer.state[model[0].weight]["master_remainder"].clone()
    before = replaced.clone()
    model(torch.randn(16, 128, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    optimizer.step()
    assert not torch.equal(replaced, before)


# ---- under amp ---------------------------------------------------------------------------------------


def amp_run(master_weights, steps=12, state_precision="fp32"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 4))
    fp32_weights = [p.detach().clone() for p in model.parameters()]
    optimizer = FusedAdam(model.parameters(), lr=1e-2, state_precision=state_precision)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                      master_weights=master_weights, verbosity=0)
    start = [join_master(p.detach(), optimizer.state[p]["master_remainder"]) if "master_remainder" in
             optimizer.state.get(p, {}) else None for p in model.parameters()]
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        optimizer.zero_grad()
        x = torch.randn(16, 128, generator=generator)
        loss = model(x).float().pow(2).mean() * (float("inf") if step in SKIPPED else 1.0)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    return model, optimizer, fp32_weights, start


def test_o2_with_remainder_masters_keeps_no_fp32_copy_and_trains_like_o2_with_masters():
    _, optimizer, _, _ = amp_run(True)
    with_masters_state = amp.state_dict()
    model, remainder_optimizer, fp32_weights, start = amp_run("remainder")
    assert amp.state_dict() == with_masters_state  # amp's own state: the loss scalers, unchanged
    # The masters start exactly at the fp32 weights (split when initialize cast the model)...
    for weight, param, joined in zip(fp32_weights, model.parameters(), start):
        if param.dtype == torch.bfloat16:
            assert torch.equal(joined.view(torch.int32), weight.view(torch.int32))
    params = [p for g in remainder_optimizer.param_groups for p in g["params"]]
    assert all(p.dtype == torch.bfloat16 for p in params[:2])  # the Linear: bf16, no fp32 copy
    assert not any("master_param" in s for s in remainder_optimizer.state.values())
    # ...and train as fp32 masters do (the forwards differ only where a master is a bf16 tie).
    for master, param in zip(amp.master_params(optimizer), params):
        state = remainder_optimizer.state[param]
        joined = join_master(param.detach(), state["master_remainder"]) if "master_remainder" in state else param
        torch.testing.assert_close(joined.float(), master.detach().float(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("setting, message", [
    (dict(opt_level="O2", half_dtype=torch.float16), "fp16 is not the high half of fp32"),
    (dict(opt_level="O1", half_dtype=torch.bfloat16), "not valid with O1"),
])
def test_amp_refuses_remainders_without_a_bf16_o2_model(setting, message):
    model = nn.Linear(8, 8)
    with pytest.raises(ValueError, match=message):
        amp.initialize(model, FusedAdam(model.parameters()), master_weights="remainder", verbosity=0, **setting)


def test_amp_refuses_remainders_for_an_optimizer_that_is_not_fused():
    model = nn.Linear(8, 8)
    with pytest.raises(ValueError, match="needs apex_amp's fused optimizers"):
        amp.initialize(model, torch.optim.AdamW(model.parameters()), opt_level="O2", half_dtype=torch.bfloat16,
                       master_weights="remainder", verbosity=0)
    assert model.weight.dtype == torch.float32  # refused before the model was cast
