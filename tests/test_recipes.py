"""Precision recipes: each opt level is one frozen object owning its decisions; a new level is one recipe."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from apex_amp import amp
from apex_amp.amp import opt_levels
from apex_amp.amp.recipe import OpCategory, Recipe
from apex_amp.optimizers import FusedSGD

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def test_each_level_is_a_frozen_recipe():
    assert opt_levels.OPT_LEVELS == ("O0", "O1", "O2", "O3")
    for name, recipe in opt_levels.LEVELS.items():
        assert isinstance(recipe, Recipe) and recipe.opt_level == name
        with pytest.raises(dataclasses.FrozenInstanceError):
            recipe.master_weights = True


@pytest.mark.parametrize("level, matmul, fp32_op, batchnorm", [
    ("O0", FP32, FP32, FP32),
    ("O1", BF16, FP32, FP32),
    ("O2", BF16, BF16, FP32),
    ("O3", BF16, BF16, BF16),
])
def test_the_compute_dtype_per_op_category(level, matmul, fp32_op, batchnorm):
    recipe = opt_levels.resolve_properties(level, half_dtype=BF16)
    assert recipe.compute_dtype(OpCategory.MATMUL) == matmul
    assert recipe.compute_dtype(OpCategory.FP32_OP) == fp32_op
    assert recipe.compute_dtype(OpCategory.BATCHNORM) == batchnorm
    assert recipe.compute_dtype(OpCategory.FP8_LINEAR) == matmul  # no fp8: a Linear is a matmul


def test_fp8_is_the_compute_dtype_of_fp8_linears_only():
    recipe = opt_levels.resolve_properties("O2", half_dtype=BF16, fp8=True)
    assert recipe.compute_dtype(OpCategory.FP8_LINEAR) == torch.float8_e4m3fn
    assert recipe.compute_dtype(OpCategory.MATMUL) == BF16
    assert "fp8 GEMMs (e4m3fn forward, e5m2 gradients), delayed scaling" in recipe.describe()


def test_the_half_dtype_replacement_moves_every_field_that_follows_it():
    o2 = opt_levels.resolve_properties("O2", half_dtype=BF16)
    assert (o2.cast_model_type, o2.dynamic_loss_scale, o2.loss_scale, o2.check_finite) == (BF16, False, 1.0, True)
    assert o2.fsdp2_param_dtype(batchnorm=False) == BF16 and o2.fsdp2_param_dtype(batchnorm=True) == FP32
    o0 = opt_levels.resolve_properties("O0", half_dtype=BF16)
    assert o0.cast_model_type == FP32 and o0.fsdp2_param_dtype(batchnorm=False) == FP32


def test_apex_options_are_apexs():
    assert opt_levels.resolve_properties("O2").apex_options() == {
        "enabled": True, "opt_level": "O2", "cast_model_type": FP16, "patch_torch_functions": False,
        "keep_batchnorm_fp32": True, "master_weights": True, "loss_scale": "dynamic"}


def test_a_level_of_your_own_is_one_recipe(one_thread):
    # "O2 with half batchnorm and a static scale of 128", written once as a recipe, trains exactly
    # like O2 with the same overrides: every part of amp read it through the recipe.
    o2_half_bn = dataclasses.replace(opt_levels.O2, opt_level="O2-half-bn", keep_batchnorm_fp32=False,
                                     dynamic_loss_scale=False, loss_scale=128.0)

    def run(opt_level, **overrides):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **overrides)
        assert model[1].weight.dtype == FP16 and amp.loss_scale() == 128.0
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(8, 8, generator=generator)
            with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in amp.master_params(optimizer)]

    mine = run(o2_half_bn)
    reference = run("O2", keep_batchnorm_fp32=False, loss_scale=128.0)
    assert all(torch.equal(a, b) for a, b in zip(mine, reference))


# A value for each Recipe field that differs from O2's and still makes a recipe initialize accepts.
# A new field without an entry here fails the test below: add the field's other value.
_NOT_O2 = {
    "opt_level": "O2-every-field", "summary": "O2 with every field changed", "half_dtype": BF16,
    "cast_model_type": BF16, "patch_torch_functions": True, "keep_batchnorm_fp32": False,
    "master_weights": False, "dynamic_loss_scale": False, "loss_scale": 8.0, "check_finite": False,
    "cast_model_outputs": FP16, "min_loss_scale": 0.5, "max_loss_scale": 2.0**20, "scale_window": 7,
    "hysteresis": 3, "num_losses": 2, "allow_banned": True, "collapse_warn_steps": 4,
    "collapse_raise_steps": 9, "consecutive_hysteresis": False, "fp8": "an Fp8Recipe",
    "fp8_refusal": "a refusal of its own", "remainder_masters": True,
}


def test_every_field_of_a_custom_recipe_survives_initialize():
    from apex_amp.amp import sessions
    from apex_amp.fp8 import Fp8Recipe

    fields = [field.name for field in dataclasses.fields(Recipe)]
    assert set(fields) == set(_NOT_O2), "give each new Recipe field a value that differs from O2's in _NOT_O2"
    values = dict(_NOT_O2, fp8=Fp8Recipe(amax_history_len=4))
    custom = dataclasses.replace(opt_levels.O2, **values)
    assert all(getattr(custom, name) != getattr(opt_levels.O2, name) for name in fields)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    optimizer = FusedSGD(model.parameters(), lr=0.1)  # remainder masters need a fused optimizer
    try:
        amp.initialize(model, optimizer, opt_level=custom, verbosity=0)
        kept = sessions.session_for(optimizer).properties
        changed = {name: (getattr(kept, name), getattr(custom, name))
                   for name in fields if getattr(kept, name) != getattr(custom, name)}
        assert changed == {}, f"initialize replaced these fields (kept, given): {changed}"
    finally:
        amp.initialize(nn.Linear(1, 1), opt_level="O0", verbosity=0)  # O1's casting off again


def test_only_the_arguments_passed_replace_a_custom_recipes_fields():
    custom = dataclasses.replace(opt_levels.O2, opt_level="mine", scale_window=7, hysteresis=3, num_losses=2)
    recipe = opt_levels.resolve_properties(custom, hysteresis=5)
    assert (recipe.scale_window, recipe.hysteresis, recipe.num_losses) == (7, 5, 2)


def test_the_environments_half_dtype_does_not_rewrite_a_custom_recipe(monkeypatch):
    monkeypatch.setenv("APEX_AMP_HALF_DTYPE", "bfloat16")
    custom = dataclasses.replace(opt_levels.O2, opt_level="mine", scale_window=7)
    for opt_level, dtype in ((custom, FP16), ("O2", BF16)):  # a named level still takes it
        model = nn.Linear(4, 4)
        model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level,
                                  verbosity=0)
        assert model.weight.dtype == dtype


def test_a_custom_bf16_recipe_trains_in_bf16(one_thread):
    bf16_o2 = dataclasses.replace(opt_levels.O2, opt_level="O2-bf16", half_dtype=BF16, cast_model_type=BF16,
                                  dynamic_loss_scale=False, loss_scale=1.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(model, optimizer, opt_level=bf16_o2, verbosity=0)
    assert {p.dtype for p in model.parameters()} == {BF16} and amp.loss_scale() == 1.0
    computed = set()
    model[0].register_forward_hook(lambda module, inputs, output: computed.add(output.dtype))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=generator)
    y = x[:, :1] * 2 - x[:, 1:2]
    losses = []
    for _ in range(30):
        out = model(x)
        loss = (out - y).pow(2).mean()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert computed == {BF16} and {p.dtype for p in amp.master_params(optimizer)} == {FP32}


def test_a_recipe_whose_model_dtype_contradicts_its_half_dtype_is_refused_with_the_fix():
    # dataclasses.replace moves one field: O2's "half" model dtype stays float16 here.
    contradictory = dataclasses.replace(opt_levels.O2, half_dtype=BF16, dynamic_loss_scale=False, loss_scale=1.0)
    with pytest.raises(ValueError, match="cast_model_type=torch.bfloat16"):
        amp.initialize(nn.Linear(4, 4), opt_level=contradictory, verbosity=0)
