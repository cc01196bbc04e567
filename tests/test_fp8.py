"""fp8 training: the GEMMs really run in fp8, delayed scales follow the amax history, skips, errors.

Every check is against a hand computation in plain PyTorch: the same casts
(``tensor * scale``, saturated, rounded to e4m3/e5m2) and the same products in
fp32, with the scales amp recorded (``amp.state_dict()["fp8"]``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from apex_amp import amp
from apex_amp.fp8 import Fp8Linear
from apex_amp.optimizers import FusedAdam

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def randn(*shape):
    # Values bf16 holds exactly: O2 casts the model's inputs to bf16, and the amaxes must be the same.
    return torch.randn(*shape).bfloat16().float()


def cast(tensor, scale, dtype):
    top = torch.finfo(dtype).max
    return (tensor.float() * scale).clamp(-top, top).to(dtype)


def fp8_model(level="O2", half=torch.bfloat16, **fp8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    optimizer = FusedAdam(model.parameters(), lr=1e-3)
    recipe = amp.Fp8Recipe(**fp8) if fp8 else True
    return (*amp.initialize(model, optimizer, opt_level=level, half_dtype=half, fp8=recipe, verbosity=0),)


def fp8_state():
    return amp.state_dict()["fp8"]


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_the_three_gemms_equal_a_hand_quantised_fp8_product_and_differ_from_bf16(one_thread, level, scaling):
    model, optimizer = fp8_model(level, scaling=scaling)
    layer = model[0]
    x = randn(24, 32).requires_grad_()
    captured = {}
    out = layer(x)
    out.register_hook(lambda grad: captured.setdefault("grad_out", grad))
    loss = model[2](torch.relu(out)).float().pow(2).mean()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    state = fp8_state()
    assert state["tensors"][:3] == ["0.input", "0.weight", "0.grad_output"]
    weight = layer.weight.detach()
    x_amax, w_amax, g_amax = state["amax_history"][0, :3]
    assert x_amax == x.detach().abs().max() and w_amax == weight.float().abs().max()
    if scaling == "current":  # scaled just in time from each tensor's own amax
        s_x, s_w, s_g = E4M3_MAX / x_amax, E4M3_MAX / w_amax, E5M2_MAX / g_amax
    else:  # the scales this step used are the recorded ones (the history was empty: set just in time)
        s_x, s_w, s_g = state["scale"][:3]
        torch.testing.assert_close(torch.stack([s_x, s_w, s_g]),
                                   torch.stack([E4M3_MAX / x_amax, E4M3_MAX / w_amax, E5M2_MAX / g_amax]))
    with amp.disable_casts():  # the hand computation in plain fp32 (O1's casts would run it in bf16)
        x8, w8 = cast(x.detach(), s_x, E4M3), cast(weight, s_w, E4M3)
        g = captured["grad_out"].reshape(-1, 48)
        g8 = cast(g, s_g, E5M2)
        hand_out = (x8.float() @ w8.float().t()) * (1 / s_x) * (1 / s_w)
        expected = (hand_out.to(torch.bfloat16) + layer.bias.detach().to(torch.bfloat16))
        hand_dx = (g8.float() @ w8.float()) * (1 / s_g) * (1 / s_w)
        hand_dw = (g8.float().t() @ x8.float()) * (1 / s_g) * (1 / s_x)
        bf16_out = nn.functional.linear(x.detach().bfloat16(), weight.bfloat16(), layer.bias.detach().bfloat16())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.detach(), expected)
    # The gradient GEMMs read a transposed copy, so the fp32 sums may run in another order: equal to
    # fp32 rounding (then rounded to the input's dtype: fp32 at O1, bf16 at O2).
    tolerance = dict(rtol=1e-5, atol=1e-6 * float(hand_dx.abs().max()))
    if level == "O2":
        tolerance = dict(rtol=2**-7, atol=2**-7 * float(hand_dx.abs().max()))
    torch.testing.assert_close(x.grad, hand_dx, **tolerance)
    grad_w = layer.weight.grad if level == "O1" else optimizer.param_groups[0]["params"][0].grad
    if grad_w is None:  # FusedAdam holds the O2 gradients for its step: read them through master_params
        grad_w = next(iter(amp.master_params(optimizer))).grad
    tolerance = dict(rtol=1e-5, atol=1e-6 * float(hand_dw.abs().max()))
    if level == "O2":
        tolerance = dict(rtol=2**-7, atol=2**-7 * float(hand_dw.abs().max()))
    torch.testing.assert_close(grad_w.float(), hand_dw, **tolerance)
    with amp.disable_casts():
        bf16_dw = g.bfloat16().t().float() @ x.detach().bfloat16().float()
    assert (hand_dw - bf16_dw).norm() / bf16_dw.norm() > 1e-2
    # and not the bf16 product: fp8 rounds the inputs to 3 mantissa bits
    relative = (out.detach().float() - bf16_out.float()).norm() / bf16_out.float().norm()
    assert relative > 5e-3


def test_delayed_scales_follow_the_amax_history(one_thread):
    history_len, margin = 3, 1
    model, optimizer = fp8_model(amax_history_len=history_len, margin=margin)
    base = randn(16, 32)
    magnitudes = [1.0, 4.0, 2.0, 0.5, 0.25, 0.125]
    input_amaxes = []
    for step, magnitude in enumerate(magnitudes):
        x = base * magnitude
        input_amaxes.append(float(x.abs().max()))
        expected_scale = fp8_state()["scale"][0].clone()
        with amp.scale_loss(model(x).float().sum(), optimizer) as scaled_loss:
            scaled_loss.backward()
        used = fp8_state()["scale"][0]
        if step == 0:  # empty history: scaled just in time, from the step's own amax
            assert float(used) == pytest.approx(E4M3_MAX / input_amaxes[0] / 2**margin, rel=1e-6)
        else:  # the scale the previous step's end computed, unchanged by this step's casts
            assert torch.equal(used, expected_scale)
        optimizer.step()
        optimizer.zero_grad()
        state = fp8_state()
        window = input_amaxes[-history_len:]
        # rows 1.. hold the finished steps' amaxes, newest first; row 0 is the next step's
        assert state["amax_history"][0, 0] == 0
        recorded = state["amax_history"][1:, 0].tolist()
        assert recorded == pytest.approx(list(reversed(input_amaxes))[: history_len - 1] +
                                         [0.0] * (history_len - 1 - min(step + 1, history_len - 1)))
        assert float(state["scale"][0]) == pytest.approx(E4M3_MAX / max(window) / 2**margin, rel=1e-6)
    # the largest amax (4.0 at step 1) left the window of 3 steps: the scale grew back
    assert max(input_amaxes[-history_len:]) < input_amaxes[1]


def test_most_recent_uses_only_the_last_steps_amax(one_thread):
    model, optimizer = fp8_model(amax_compute_algo="most_recent")
    for magnitude in (8.0, 1.0):
        x = randn(16, 32) * magnitude
        with amp.scale_loss(model(x).float().sum(), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    assert float(fp8_state()["scale"][0]) == pytest.approx(E4M3_MAX / float(x.abs().max()), rel=1e-6)


def test_accumulated_micro_batches_share_one_scale_and_make_one_history_entry(one_thread):
    model, optimizer = fp8_model()
    small, large = randn(8, 32), randn(8, 32) * 4
    with amp.scale_loss(model(small).float().sum(), optimizer, delay_unscale=True) as scaled_loss:
        scaled_loss.backward()
    scale_after_first = fp8_state()["scale"].clone()
    with amp.scale_loss(model(large).float().sum(), optimizer) as scaled_loss:
        scaled_loss.backward()
    assert torch.equal(fp8_state()["scale"], scale_after_first)  # the second micro-batch used the same scales
    optimizer.step()
    history = fp8_state()["amax_history"]
    assert history[1, 0] == max(small.abs().max(), large.abs().max())  # the step's max over both
    assert torch.all(history[2:] == 0)  # one step, one entry


def test_a_skipped_step_drops_its_amaxes_and_keeps_the_scales(one_thread):
    model, optimizer = fp8_model()
    x = randn(8, 32)
    with amp.scale_loss(model(x).float().sum(), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    before = fp8_state()
    with amp.scale_loss(model(x * 100).float().sum() * float("inf"), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    assert amp.step_was_skipped(optimizer)
    after = fp8_state()
    assert torch.equal(after["scale"], before["scale"])
    assert torch.equal(after["amax_history"], before["amax_history"])


def test_an_inf_in_an_fp8_gemm_input_is_caught_skipped_and_backed_off(one_thread):
    model, optimizer = fp8_model(half=torch.float16, scaling="delayed")
    x = randn(8, 32)

    def step(inputs):
        with amp.scale_loss(model(inputs).float().mean(), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return amp.step_was_skipped(optimizer)

    for _ in range(3):
        assert not step(x)  # clean steps: the fp16 scale fits, the delayed scales are set
    masters = [p.detach().clone() for p in amp.master_params(optimizer)]
    scale = amp.loss_scale()
    poisoned = x.clone()
    poisoned[3, 5] = float("inf")  # the saturating e4m3 cast would turn it into 448: amp must still see it
    assert step(poisoned)
    assert amp.loss_scale() == scale / 2
    for before, after in zip(masters, amp.master_params(optimizer)):
        assert torch.equal(before, after)


def test_overflow_reports_name_the_fp8_layers_and_their_non_finite_inputs(one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    optimizer = FusedAdam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.float16, fp8=True,
                                      overflow_report=True, verbosity=0)
    x = randn(8, 32)
    x[0, 0] = float("nan")
    with amp.scale_loss(model(x).float().sum(), optimizer) as scaled_loss:
        scaled_loss.backward()
    report = amp.last_overflow()
    assert "0.input" in report.fp8_tensors
    assert report.params and all(param.fp8 for param in report.params)
    assert "(fp8 layer)" in str(report) and "0.input" in str(report)


def test_layers_keep_identity_parameters_and_checkpoint_keys(one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 10))
    keys = list(model.state_dict())
    first, weight = model[0], model[0].weight
    optimizer = FusedAdam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, fp8=True,
                                      verbosity=0)
    assert model[0] is first and model[0].weight is weight and isinstance(first, nn.Linear)
    assert type(model[0]) is Fp8Linear and type(model[2]) is nn.Linear  # 48->10: not a multiple of 16
    assert list(model.state_dict()) == keys
    assert all(value.dtype == torch.float32 for value in model.state_dict().values())


def test_dimensions_scaled_mm_cannot_take_stay_half_with_one_notice(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 10), nn.Linear(10, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="apex_amp"):
        amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, fp8=True)
    notices = [r.getMessage() for r in caplog.records if "apex_amp fp8:" in r.getMessage()]
    assert len(notices) == 1
    assert "1 nn.Linear layer(s) run in fp8; 2 stay in torch.bfloat16" in notices[0]
    assert "1 (48->10" in notices[0] and "2 (10->16" in notices[0]
    assert [type(m).__name__ for m in model] == ["Fp8Linear", "Linear", "Linear"]


def test_the_module_filter_chooses_the_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16))
    recipe = amp.Fp8Recipe(module_filter=lambda name, linear: name != "1")
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", fp8=recipe, verbosity=0)
    assert [type(m).__name__ for m in model] == ["Fp8Linear", "Linear"]


@pytest.mark.parametrize("level, reason", [("O0", "O0 is the fp32 baseline"), ("O3", "O3 has no fp32 master weights")])
def test_fp8_is_refused_at_o0_and_o3_with_the_reason_and_nothing_changes(level, reason):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48))
    with pytest.raises(ValueError, match=f"fp8=True is not valid with {level}: {reason}"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, fp8=True)
    assert type(model[0]) is nn.Linear and model[0].weight.dtype == torch.float32


@pytest.mark.parametrize("bad, message", [
    (dict(scaling="tensorwise"), "scaling must be one of"),
    (dict(amax_history_len=0), "amax_history_len must be an integer >= 1"),
    (dict(margin=-1), "margin must be an integer >= 0"),
    (dict(amax_compute_algo="mean"), "amax_compute_algo must be one of"),
    (dict(fp8_format="e5m2"), "fp8_format must be one of"),
])
def test_bad_recipes_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        amp.Fp8Recipe(**bad)


def test_fp8_needs_the_optimizer_and_an_fp8_argument_of_the_right_type():
    model = nn.Sequential(nn.Linear(32, 48))
    with pytest.raises(ValueError, match="fp8 training needs the optimizer"):
        amp.initialize(model, opt_level="O2", fp8=True, verbosity=0)
    with pytest.raises(TypeError, match="fp8 must be True, False, None or an amp.Fp8Recipe"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", fp8="yes")


def test_the_environment_turns_fp8_on_without_code_changes(monkeypatch, caplog):
    monkeypatch.setenv("APEX_AMP_FP8", "1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48))
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    assert type(model[0]) is Fp8Linear
    baseline = nn.Sequential(nn.Linear(32, 48))
    with caplog.at_level(logging.WARNING, logger="apex_amp"):
        amp.initialize(baseline, torch.optim.SGD(baseline.parameters(), lr=0.1), opt_level="O0", verbosity=0)
    assert type(baseline[0]) is nn.Linear and "APEX_AMP_FP8=1 is ignored at O0" in caplog.text
    monkeypatch.setenv("APEX_AMP_FP8", "current")
    model = nn.Sequential(nn.Linear(32, 48))
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    assert model[0].fp8_binding.scales.recipe.scaling == "current"
    monkeypatch.setenv("APEX_AMP_FP8", "maybe")
    with pytest.raises(ValueError, match="APEX_AMP_FP8='maybe' is not understood"):
        amp.initialize(nn.Linear(32, 48), opt_level="O2", verbosity=0)
    monkeypatch.setenv("APEX_AMP_FP8", "1")
    model = nn.Sequential(nn.Linear(32, 48))
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", fp8=False, verbosity=0)
    assert type(model[0]) is nn.Linear  # an explicit argument wins


def test_fp8_state_round_trips_and_refuses_mismatches(one_thread):
    model, optimizer = fp8_model()
    with amp.scale_loss(model(randn(8, 32)).float().sum(), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    saved = amp.state_dict()
    other, other_optimizer = fp8_model()
    amp.load_state_dict(saved)
    assert torch.equal(fp8_state()["amax_history"], saved["fp8"]["amax_history"])
    assert torch.equal(fp8_state()["scale"], saved["fp8"]["scale"])
    fp8_model(amax_history_len=4)
    with pytest.raises(ValueError, match="initialize with the saving run's amp.Fp8Recipe"):
        amp.load_state_dict(saved)
    plain = nn.Sequential(nn.Linear(32, 48))
    amp.initialize(plain, torch.optim.SGD(plain.parameters(), lr=0.1), opt_level="O2", half_dtype=torch.bfloat16,
                   verbosity=0)
    with pytest.raises(ValueError, match="this run has fp8 off"):
        amp.load_state_dict(saved)


def test_evaluation_under_no_grad_records_nothing(one_thread):
    model, optimizer = fp8_model()
    with amp.scale_loss(model(randn(8, 32)).float().sum(), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    before = fp8_state()
    with torch.no_grad():
        model(randn(8, 32) * 1000)
    after = fp8_state()
    assert torch.equal(before["amax_history"], after["amax_history"]) and torch.equal(before["scale"], after["scale"])


def test_the_report_names_fp8_support_of_the_visible_devices():
    from apex_amp import _build_report

    info = _build_report.collect()
    text = _build_report.format_report(info)
    assert "fp8 training (amp.initialize(..., fp8=True))" in text
    assert info["fp8"][0] == "cpu: torch._scaled_mm runs (fp8 numerics, no speed-up)"
    if not torch.cuda.is_available():
        assert "fp8 speed needs an sm_89+ GPU" in info["fp8"][1]
