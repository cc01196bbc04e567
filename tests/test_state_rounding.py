"""Stochastic rounding of bf16 optimizer state: the reference's numerics and the optimizers' option.

The reference is apex_amp/optimizers/state_formats.py (round_bf16_stochastic, rounding_bits,
rounding_key); the option is ``state_rounding="stochastic"`` of every fused optimizer
(apex_amp/optimizers/_state_rounding.py). The ops' bits are pinned against the reference in
tests/test_ops_state_rounding.py.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apex_amp.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad,
                                 FusedSGD)
from apex_amp.optimizers.state_formats import round_bf16_stochastic, rounding_bits, rounding_key

KEY = rounding_key(1234, 5, 0)
BF16_MAX = torch.finfo(torch.bfloat16).max


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


# ---- the reference --------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [1.0 + 2.0 ** -10, -3.0e-3, 7.7e4, 1.1e-40, -2.5e-39])
def test_the_mean_of_many_roundings_is_the_value_itself(value):
    # 200k roundings of one value (denormals included): the mean is within a few standard errors.
    x = torch.full((200_000,), value)
    rounded = round_bf16_stochastic(x, KEY, 0).double()
    low, high = sorted({float(v) for v in rounded.unique()})
    assert low <= value <= high and high > low  # exactly the two neighbours
    standard_error = (high - low) / 2 / len(x) ** 0.5
    assert abs(rounded.mean().item() - value) < 5 * standard_error


def test_the_chance_of_rounding_up_is_the_distance_from_the_lower_neighbour():
    ulp = 2.0 ** -7
    for fraction in (1 / 16, 1 / 4, 3 / 4):
        x = torch.full((100_000,), 1.0 + fraction * ulp)
        up = (round_bf16_stochastic(x, rounding_key(7, 1, 0), 0).float() > 1.0).double().mean().item()
        assert abs(up - fraction) < 0.01


def test_values_that_bf16_holds_are_unchanged():
    exact = torch.randn(10_000).bfloat16()
    exact = torch.cat([exact, torch.tensor([0.0, -0.0, BF16_MAX, -BF16_MAX, 2.0 ** -133]).bfloat16()])
    rounded = round_bf16_stochastic(exact.float(), KEY, 1)
    assert torch.equal(_bits(rounded), _bits(exact))


def test_nan_and_inf_stay_and_no_finite_value_overflows_beyond_round_to_nearest():
    fp32_max = torch.finfo(torch.float32).max
    below_boundary = torch.tensor(0x7F7F7FFF, dtype=torch.int32).view(torch.float32).item()  # < RNE's inf
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), fp32_max, -fp32_max] + [below_boundary] * 1000
                          + [-below_boundary] * 1000)
    rounded = round_bf16_stochastic(values, KEY, 0)
    assert rounded[0].isnan() and rounded[1] == float("inf") and rounded[2] == -float("inf")
    # RNE sends fp32's largest to inf; so does stochastic rounding, and nothing more.
    assert torch.equal(_bits(rounded[3:5]), _bits(values[3:5].bfloat16()))
    assert torch.equal(rounded[5:].float().abs(), torch.full((2000,), BF16_MAX))


def test_the_bits_are_a_pure_function_of_key_state_and_index():
    index = torch.arange(1 << 16)
    bits = rounding_bits(KEY, 0, index)
    assert torch.equal(bits, rounding_bits(KEY, 0, index))
    assert bool(((bits >= 0) & (bits < 1 << 16)).all())
    for other in (rounding_bits(rounding_key(1235, 5, 0), 0, index), rounding_bits(rounding_key(1234, 6, 0), 0, index),
                  rounding_bits(rounding_key(1234, 5, 1), 0, index), rounding_bits(KEY, 1, index)):
        assert (bits == other).double().mean() < 0.001  # seed, step, tensor and state each change them
    # Uniform: each of the 16 bits set about half the time, and the bits of neighbours unrelated.
    for b in range(16):
        assert abs(((bits >> b) & 1).double().mean().item() - 0.5) < 0.01
    assert abs(torch.corrcoef(torch.stack([bits[:-1], bits[1:]]).double())[0, 1].item()) < 0.02


def test_the_keys_of_a_step_counter_tensor_equal_those_of_the_int():
    counter = torch.tensor(9)
    assert int(rounding_key(3, counter, 4)) == rounding_key(3, 9, 4)
    assert torch.equal(rounding_bits(rounding_key(3, counter, 4), 1, torch.arange(50)),
                       rounding_bits(rounding_key(3, 9, 4), 1, torch.arange(50)))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 40), st.integers(1, 300), st.integers(0, 299))
def test_a_slice_rounds_as_the_whole_given_its_offset(offset, n, cut):
    cut = min(cut, n)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    whole = round_bf16_stochastic(x, KEY, 0, offset)
    assert torch.equal(_bits(round_bf16_stochastic(x[cut:], KEY, 0, offset + cut)), _bits(whole[cut:]))


def test_elements_are_indexed_in_memory_order():
    x = torch.randn(6, 5)
    channels_last = x.t().contiguous().t()  # the same values, stored column by column
    rounded = round_bf16_stochastic(channels_last, KEY, 0)
    assert rounded.stride() == channels_last.stride()
    assert torch.equal(_bits(rounded.t().reshape(-1)), _bits(round_bf16_stochastic(x.t().reshape(-1), KEY, 0)))


# ---- the optimizers' option ---------------------------------------------------------------------
OPTIMIZERS = {
    "adam": lambda params, **kw: FusedAdam(params, lr=1e-3, **kw),
    "lamb": lambda params, **kw: FusedLAMB(params, lr=1e-3, **kw),
    "mixed_lamb": lambda params, **kw: FusedMixedPrecisionLamb(params, lr=1e-3, **kw),
    "sgd": lambda params, **kw: FusedSGD(params, lr=1e-2, momentum=0.9, **kw),
    "adagrad": lambda params, **kw: FusedAdagrad(params, lr=1e-2, **kw),
    "novograd": lambda params, **kw: FusedNovoGrad(params, lr=1e-2, **kw),
}
BF16_STOCHASTIC = dict(state_precision="bf16", min_quantized_numel=0, state_rounding="stochastic")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8))


def _train(model, optimizer, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        data = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(32, 64, generator=data), torch.randn(32, 8, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _state_bits(optimizer) -> list[torch.Tensor]:
    return [_bits(v) if v.is_floating_point() else v for state in optimizer.state.values()
            for v in state.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_fused_optimizer_rounds_its_bf16_state_stochastically(name):
    runs = {}
    for rounding in ("nearest", "stochastic"):
        model = _model()
        optimizer = OPTIMIZERS[name](model.parameters(), state_precision="bf16", min_quantized_numel=0,
                                     state_rounding=rounding, state_rounding_seed=5)
        _train(model, optimizer, 3)
        runs[rounding] = _state_bits(optimizer)
    bf16 = [(a, b) for a, b in zip(runs["nearest"], runs["stochastic"]) if a.dtype == torch.int16]
    assert bf16 and any(not torch.equal(a, b) for a, b in bf16)


def test_the_default_passes_no_rounding_rows_to_the_ops():
    model = _model()
    optimizer = FusedAdam(model.parameters(), state_precision="bf16", min_quantized_numel=0)
    assert optimizer.param_groups[0]["state_rounding"] == "nearest"
    _train(model, optimizer, 1)
    plans = list(optimizer._batch_plans.values())
    assert plans and all(batch.state_rounding() is None for plan in plans for batch in plan.batches)
    assert "state_rounding_step" not in optimizer.param_groups[0]


def test_one_seed_gives_one_run_and_another_seed_another():
    def run(seed):
        model = _model()
        optimizer = FusedAdam(model.parameters(), **BF16_STOCHASTIC, state_rounding_seed=seed)
        _train(model, optimizer, 4)
        return _state_bits(optimizer)

    first, again, other = run(11), run(11), run(12)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert any(not torch.equal(a, b) for a, b in zip(first, other))


def test_the_seed_comes_from_a_generator_or_from_torch_manual_seed():
    def seed_of(**kw):
        return FusedAdam(_model().parameters(), **BF16_STOCHASTIC, **kw).param_groups[0]["state_rounding_seed"]

    assert seed_of(state_rounding_seed=torch.Generator().manual_seed(3)) == \
        seed_of(state_rounding_seed=torch.Generator().manual_seed(3))
    torch.manual_seed(8)
    drawn = FusedAdam(torch.nn.Linear(4, 4).parameters(), **BF16_STOCHASTIC).param_groups[0]["state_rounding_seed"]
    torch.manual_seed(8)
    assert FusedAdam(torch.nn.Linear(4, 4).parameters(), **BF16_STOCHASTIC).param_groups[0][
        "state_rounding_seed"] == drawn


def test_a_resumed_run_rounds_bitwise_as_the_uninterrupted_one():
    model = _model()
    optimizer = FusedAdam(model.parameters(), **BF16_STOCHASTIC, state_rounding_seed=21)
    _train(model, optimizer, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    _train(model, optimizer, 3, first=3)

    buffer.seek(0)
    saved = torch.load(buffer)
    resumed_model = _model(seed=99)
    resumed_model.load_state_dict(saved["model"])
    # Another seed at construction: the checkpoint's seed and step counter win.
    resumed = FusedAdam(resumed_model.parameters(), **BF16_STOCHASTIC, state_rounding_seed=22)
    resumed.load_state_dict(saved["optimizer"])
    _train(resumed_model, resumed, 3, first=3)
    assert all(torch.equal(a, b) for a, b in zip(_state_bits(optimizer), _state_bits(resumed)))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))
    assert int(resumed.param_groups[0]["state_rounding_step"]) == 6


def test_a_state_dict_keeps_the_step_it_was_taken_at():
    model = _model()
    optimizer = FusedAdam(model.parameters(), **BF16_STOCHASTIC)
    _train(model, optimizer, 2)
    saved = optimizer.state_dict()
    _train(model, optimizer, 1, first=2)
    assert int(saved["param_groups"][0]["state_rounding_step"]) == 2


def test_a_group_overrides_the_rounding():
    model = _model()
    optimizer = FusedAdam([{"params": model[0].parameters()},
                           {"params": model[2].parameters(), "state_rounding": "nearest"}],
                          **BF16_STOCHASTIC, state_rounding_seed=1)
    assert [g["state_rounding"] for g in optimizer.param_groups] == ["stochastic", "nearest"]
    copy.deepcopy(optimizer)  # the settings are plain values


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(state_rounding="up"), ValueError, "state_rounding must be one of"),
    (dict(state_rounding="stochastic"), ValueError, "state_precision='bf16'"),
    (dict(state_rounding="stochastic", state_precision="int8"), ValueError, "'int8'"),
    (dict(state_rounding="stochastic", state_precision="bf16", state_rounding_seed=1.5), TypeError, "an int"),
])
def test_bad_rounding_settings_are_refused_with_the_fix(kwargs, error, words):
    with pytest.raises(error, match=words):
        FusedAdam(_model().parameters(), **kwargs)


def test_stochastic_rounding_keeps_tracking_where_round_to_nearest_stalls():
    # exp_avg_sq under a constant gradient of 1 climbs as 1 - 0.999**t by steps of 0.001 * (1 - v):
    # below half a bf16 step of v from v = 0.25 on, so round-to-nearest stops there; the
    # stochastic rounding's mean follows fp32 state.
    def exp_avg_sq_after(steps, **kw):
        param = torch.nn.Parameter(torch.zeros(1 << 12))
        optimizer = FusedAdam([param], lr=1e-3, min_quantized_numel=0, **kw)
        for _ in range(steps):
            param.grad = torch.ones_like(param)
            optimizer.step()
        return optimizer.state[param]["exp_avg_sq"].float().mean().item()

    exact = exp_avg_sq_after(600)
    stochastic = exp_avg_sq_after(600, state_precision="bf16", state_rounding="stochastic", state_rounding_seed=4)
    nearest = exp_avg_sq_after(600, state_precision="bf16")
    assert abs(stochastic - exact) < 0.005 * exact
    assert abs(nearest - exact) > 0.05 * exact


def test_a_model_trains_with_stochastically_rounded_state_as_with_fp32_state():
    def losses(**kw):  # (the loss before, the loss after 150 full-batch steps)
        model = _model()
        optimizer = FusedAdam(model.parameters(), lr=3e-3, min_quantized_numel=0, **kw)
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
        y = torch.sin(x[:, :8] * 2)
        history = []
        for _ in range(150):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            history.append(loss.item())
        return history[0], history[-1]

    _, fp32 = losses()
    initial, stochastic = losses(state_precision="bf16", state_rounding="stochastic", state_rounding_seed=0)
    assert stochastic < 0.3 * initial
    assert abs(stochastic - fp32) < 0.1 * fp32


def test_a_compiled_step_rounds_as_the_eager_one_without_recompiling():
    from torch._dynamo.testing import CompileCounter

    def run(compile_with):
        model = _model()
        optimizer = FusedAdam(model.parameters(), **BF16_STOCHASTIC, state_rounding_seed=3)
        step = optimizer.step if compile_with is None else torch.compile(optimizer.step, backend=compile_with,
                                                                          fullgraph=True)
        for i in range(3):
            data = torch.Generator().manual_seed(i)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=data)
            step()
        return _state_bits(optimizer)

    counter = CompileCounter()
    assert all(torch.equal(a, b) for a, b in zip(run(None), run(counter)))
    assert counter.frame_count <= 2  # the first step creates the state and the counter: one retrace


def test_init_state_makes_the_counter_that_a_distributed_checkpoint_loads_into():
    # amp.checkpoint_state calls init_state before DCP loads in place: without the counter there, a
    # resumed run would start counting again from 0 and draw the first steps' bits once more.
    optimizer = FusedAdam(_model().parameters(), **BF16_STOCHASTIC)
    optimizer.init_state()
    counter = optimizer.param_groups[0]["state_rounding_step"]
    assert counter.dtype == torch.int64 and counter.dim() == 0 and int(counter) == 0
