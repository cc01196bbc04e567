"""amp.initialize: the opt-level table, validated overrides, identity, and every misuse error."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from apex_amp import amp
from apex_amp.amp.opt_levels import resolve_properties
from apex_amp.optimizers import FusedAdam


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# ---- the table ------------------------------------------------------------------
@pytest.mark.parametrize(
    "level, cast, patch, keep_bn, masters, dynamic, scale",
    [
        ("O0", torch.float32, False, None, False, False, 1.0),
        ("O1", None, True, None, False, True, 65536.0),
        ("O2", torch.float16, False, True, True, True, 65536.0),
        ("O3", torch.float16, False, False, False, False, 1.0),
    ],
)
def test_opt_level_table_matches_apex(level, cast, patch, keep_bn, masters, dynamic, scale):
    props = resolve_properties(level)
    assert (props.cast_model_type, props.patch_torch_functions, props.keep_batchnorm_fp32) == (cast, patch, keep_bn)
    assert (props.master_weights, props.dynamic_loss_scale, props.loss_scale) == (masters, dynamic, scale)
    # O1/O2 check gradients; the static levels do not, as in apex.
    assert props.check_finite == (level in ("O1", "O2"))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bf16_defaults_to_static_scale_one_with_checks_on(level):
    props = resolve_properties(level, half_dtype=torch.bfloat16)
    assert not props.dynamic_loss_scale and props.loss_scale == 1.0 and props.check_finite
    explicit = resolve_properties(level, half_dtype=torch.bfloat16, loss_scale="dynamic")
    assert explicit.dynamic_loss_scale


def test_bf16_casts_o2_model_to_bf16():
    assert resolve_properties("O2", half_dtype=torch.bfloat16).cast_model_type == torch.bfloat16


@pytest.mark.parametrize("value, expected", [("128", 128.0), (64, 64.0), ("dynamic", None)])
def test_loss_scale_accepts_numbers_and_strings(value, expected):
    props = resolve_properties("O2", loss_scale=value)
    if expected is None:
        assert props.dynamic_loss_scale
    else:
        assert not props.dynamic_loss_scale and props.loss_scale == expected


def test_skip_nonfinite_turns_checks_on_for_static_levels():
    assert resolve_properties("O3", skip_nonfinite=True).check_finite
    assert resolve_properties("O0", skip_nonfinite=True).check_finite


def test_string_booleans_are_accepted_as_in_apex():
    assert resolve_properties("O2", keep_batchnorm_fp32="False").keep_batchnorm_fp32 is False


# ---- overrides that make no sense -------------------------------------------------
@pytest.mark.parametrize(
    "level, overrides, message",
    [
        ("O1", dict(master_weights=True), "master_weights=True is not valid with O1"),
        ("O1", dict(cast_model_type=torch.float16), "cast_model_type=torch.float16 cannot be set with O1"),
        ("O2", dict(patch_torch_functions=True), "patch_torch_functions=True is only valid with O1"),
        ("O0", dict(patch_torch_functions=True), "patch_torch_functions=True is only valid with O1"),
        ("O2", dict(keep_batchnorm_fp32="yes"), "keep_batchnorm_fp32 must be True, False, None"),
        ("O1", dict(keep_batchnorm_fp32=True), "keep_batchnorm_fp32 must be None with O1"),
        ("O0", dict(master_weights=True), "master_weights=True needs a half model"),
        ("O2", dict(loss_scale="big"), "loss_scale must be 'dynamic' or a positive number"),
        ("O2", dict(loss_scale=-1.0), "loss_scale must be 'dynamic' or a positive finite number"),
        ("O2", dict(loss_scale=float("inf")), "positive finite number"),
        ("O2", dict(half_dtype=torch.float32), "half_dtype must be torch.float16 or torch.bfloat16"),
        ("O2", dict(cast_model_type=torch.bfloat16), "contradicts half_dtype"),
        ("O2", dict(cast_model_type=torch.int8), r"cast_model_type must be None or False \(do not cast\) or one of"),
        ("O2", dict(num_losses=0), "num_losses must be an integer >= 1"),
        ("O2", dict(min_loss_scale=8.0, max_loss_scale=4.0), "need 0 < min_loss_scale <= max_loss_scale"),
        ("O2", dict(hysteresis=0), "hysteresis must be an integer >= 1"),
    ],
)
def test_invalid_override_raises_with_reason(level, overrides, message):
    model = small_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=message):
        amp.initialize(model, sgd(model), opt_level=level, verbosity=0, **overrides)
    # nothing was touched
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("bad", ["O5", "0O", "o1", "01", "O", 2])
def test_unknown_opt_level_names_the_valid_ones(bad):
    model = small_model()
    with pytest.raises(ValueError, match=r"valid levels are 'O0', 'O1', 'O2', 'O3'"):
        amp.initialize(model, sgd(model), opt_level=bad)


def test_lowercase_level_gets_a_hint():
    model = small_model()
    with pytest.raises(ValueError, match=r"Did you mean 'O1'"):
        amp.initialize(model, sgd(model), opt_level="o1")


# ---- misuse of initialize / scale_loss --------------------------------------------
def test_non_module_model_raises():
    with pytest.raises(TypeError, match="models must be a torch.nn.Module"):
        amp.initialize(lambda x: x, opt_level="O0")
    with pytest.raises(TypeError, match=r"models\[1\] must be a torch.nn.Module"):
        amp.initialize([small_model(), "model"], opt_level="O0")


def test_non_optimizer_raises():
    model = small_model()
    with pytest.raises(TypeError, match="optimizers must be a torch.optim.Optimizer"):
        amp.initialize(model, {"lr": 0.1}, opt_level="O0")


def test_same_optimizer_twice_raises():
    model = small_model()
    optimizer = sgd(model)
    amp.initialize(model, optimizer, opt_level="O0", verbosity=0)
    with pytest.raises(RuntimeError, match="already passed to amp.initialize"):
        amp.initialize(small_model(), optimizer, opt_level="O0")
    other = small_model()
    opt2 = sgd(other)
    with pytest.raises(ValueError, match="appears twice"):
        amp.initialize(other, [opt2, opt2], opt_level="O0")


def test_wrapped_model_raises():
    with pytest.raises(ValueError, match="already wrapped in DataParallel; call amp.initialize on the bare model"):
        amp.initialize(nn.DataParallel(small_model()), opt_level="O2")


def test_half_parameters_raise():
    model = small_model().half()
    with pytest.raises(ValueError, match=r"parameter '0.weight' of model 0 is already torch.float16"):
        amp.initialize(model, sgd(model), opt_level="O2")


def test_scale_loss_with_unknown_optimizer_raises():
    model = small_model()
    amp.initialize(model, sgd(model), opt_level="O0", verbosity=0)
    stranger = sgd(small_model())
    with pytest.raises(RuntimeError, match="that amp.initialize never saw"):
        with amp.scale_loss(torch.ones(()), stranger):
            pass


def test_loss_id_out_of_range_raises():
    model = small_model()
    optimizer = sgd(model)
    amp.initialize(model, optimizer, opt_level="O2", num_losses=2, verbosity=0)
    with pytest.raises(ValueError, match=r"loss_id=2 is out of range.*num_losses=2"):
        with amp.scale_loss(torch.ones(()), optimizer, loss_id=2):
            pass


def test_closure_raises_before_anything_changes():
    model = small_model()
    optimizer = sgd(model)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"does not support optimizer.step\(closure\)"):
        optimizer.step(lambda: torch.zeros(()))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_step_with_delayed_grads_raises():
    model = small_model()
    optimizer = sgd(model)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    with amp.scale_loss(model(torch.randn(4, 4)).sum(), optimizer, delay_unscale=True) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="last backward pass before a step must use delay_unscale=False"):
        optimizer.step()


# ---- what initialize does ----------------------------------------------------------
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_initialize_returns_the_same_objects_in_the_same_shape(level):
    model, other = small_model(), small_model()
    optimizer = torch.optim.Adam(model.parameters())
    returned = amp.initialize([model, other], [optimizer], opt_level=level, verbosity=0)
    assert isinstance(returned, tuple) and isinstance(returned[0], list) and isinstance(returned[1], list)
    assert returned[0][0] is model and returned[0][1] is other and returned[1][0] is optimizer
    assert type(optimizer) is torch.optim.Adam and isinstance(optimizer, torch.optim.Optimizer)
    single = small_model()
    assert amp.initialize(single, opt_level=level, verbosity=0) is single


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_o2_casts_model_but_keeps_batchnorm_fp32(half):
    model = small_model()
    optimizer = sgd(model)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=half, verbosity=0)
    assert model[0].weight.dtype == half and model[3].weight.dtype == half
    assert model[1].weight.dtype == torch.float32 and model[1].running_mean.dtype == torch.float32
    # The optimizer updates fp32 masters of the half params, and BN's own fp32 params.
    masters = list(amp.master_params(optimizer))
    assert all(p.dtype == torch.float32 for p in masters)
    assert masters[0] is not model[0].weight and masters[2] is model[1].weight
    assert model(torch.randn(3, 4)).dtype == torch.float32


def test_o3_casts_batchnorm_too_and_outputs_fp32():
    model = small_model()
    amp.initialize(model, sgd(model), opt_level="O3", half_dtype=torch.bfloat16, verbosity=0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model[1].running_var.dtype == torch.bfloat16
    assert model(torch.randn(3, 4)).dtype == torch.float32


def test_enabled_false_touches_nothing_and_scale_loss_passes_through():
    model = small_model()
    optimizer = sgd(model)
    returned = amp.initialize(model, optimizer, enabled=False, opt_level="O2")
    assert returned == (model, optimizer)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not optimizer._optimizer_step_pre_hooks
    loss = model(torch.randn(3, 4)).sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled is loss


def test_properties_logged_once_with_verbosity(caplog):
    model = small_model()
    with caplog.at_level(logging.INFO, logger="apex_amp"):
        amp.initialize(model, sgd(model), opt_level="O2", verbosity=1)
    lines = [r.getMessage() for r in caplog.records if "optimization level O2" in r.getMessage()]
    assert len(lines) == 1 and "master_weights        : True" in lines[0]
    caplog.clear()
    other = small_model()
    with caplog.at_level(logging.INFO, logger="apex_amp"):
        amp.initialize(other, sgd(other), opt_level="O2", verbosity=0)
    assert not caplog.records


def test_inputs_cast_recursively_and_non_floats_untouched():
    seen = {}

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, pair, mapping, *, extra):
            seen.update(a=pair[0].dtype, b=pair[1].dtype, c=mapping["x"].dtype, d=mapping["ids"].dtype,
                        e=extra[0].dtype)
            return {"out": self.linear(pair[0]), "ids": mapping["ids"]}

    model = Probe()
    amp.initialize(model, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    out = model((torch.randn(1, 2), torch.randn(1)), {"x": torch.randn(1), "ids": torch.arange(3)},
                extra=[torch.randn(2)])
    assert seen == dict(a=torch.bfloat16, b=torch.bfloat16, c=torch.bfloat16, d=torch.int64, e=torch.bfloat16)
    assert out["out"].dtype == torch.float32 and out["ids"].dtype == torch.int64


def test_cast_model_outputs_override():
    model = small_model()
    amp.initialize(model, opt_level="O2", cast_model_outputs=torch.bfloat16, half_dtype=torch.bfloat16, verbosity=0)
    assert model(torch.randn(3, 4)).dtype == torch.bfloat16


def test_fused_adam_rejects_amsgrad():
    with pytest.raises(RuntimeError, match="FusedAdam does not support the AMSGrad variant."):
        FusedAdam(small_model().parameters(), amsgrad=True)
