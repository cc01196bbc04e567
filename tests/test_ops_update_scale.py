"""update_scale_: the dynamic loss-scale rule on the device, on both backends.

Checked against three independent statements of the rule: hand-computed
steps, tests/_reference.py's plain-Python ScalerState (apex's
update_scale_hysteresis plus amp's floor and cap), apex's own hysteresis
scenarios (tests/L0/run_amp/test_update_scale_hysteresis.py: 72 cases,
restated here as closed-form expectations), and torch's
``torch._amp_update_scale_``, which is the same rule without hysteresis,
floor or cap.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _reference as ref
from _backends import BACKENDS, namespace_of

FLOAT32_MAX = torch.finfo(torch.float32).max
INF = float("inf")
# apex's kernel has neither a floor nor a cap.
APEX = ref.ScaleRule(min_scale=0.0, max_scale=INF, consecutive_hysteresis=True)
MEGATRON = dataclasses.replace(APEX, consecutive_hysteresis=False)


class DeviceScaler:
    """The op's three state tensors, stepped with found_inf values."""

    def __init__(self, amp_ops, scale, device="cpu", hysteresis_tracker=None, rule=ref.ScaleRule(growth_interval=3)):
        self.amp_ops = amp_ops
        self.rule = rule
        hysteresis_tracker = rule.hysteresis if hysteresis_tracker is None else hysteresis_tracker
        self.scale = torch.tensor([scale], dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self.hysteresis_tracker = torch.tensor([hysteresis_tracker], dtype=torch.int32, device=device)

    def step(self, found_inf: bool) -> None:
        flag = ref.flag(float(found_inf), self.scale.device)
        self.amp_ops.update_scale_(self.scale, self.growth_tracker, self.hysteresis_tracker, flag,
                                   *self.rule.op_args())

    def steps(self, found_inf: bool, count: int) -> None:
        for _ in range(count):
            self.step(found_inf)

    def state(self):
        return (self.scale.item(), self.growth_tracker.item(), self.hysteresis_tracker.item())


def rule(**changes) -> ref.ScaleRule:
    return dataclasses.replace(ref.ScaleRule(growth_interval=3), **changes)


def test_overflow_halves_the_scale_and_resets_the_growth_count(amp_ops, device):
    scaler = DeviceScaler(amp_ops, 65536.0, device)
    scaler.step(False)
    scaler.step(True)
    assert scaler.state() == (32768.0, 0, 0)


def test_scale_grows_after_growth_interval_clean_steps(amp_ops, device):
    scaler = DeviceScaler(amp_ops, 1024.0, device, rule=rule(growth_interval=3))
    scaler.step(False)
    scaler.step(False)
    assert scaler.state() == (1024.0, 2, 1)
    scaler.step(False)
    assert scaler.state() == (2048.0, 0, 1)


@pytest.mark.parametrize("consecutive", [True, False])
def test_hysteresis_tolerates_overflows_in_a_row_before_backing_off(amp_ops, device, consecutive):
    scaler = DeviceScaler(amp_ops, 1024.0, device, rule=rule(hysteresis=3, consecutive_hysteresis=consecutive))
    scaler.steps(True, 2)
    assert scaler.state() == (1024.0, 0, 1)
    scaler.step(True)
    assert scaler.state() == (512.0, 0, 0)
    scaler.step(True)  # hysteresis spent: every further overflow backs off
    assert scaler.state() == (256.0, 0, 0)


def test_consecutive_hysteresis_refills_after_every_clean_step(amp_ops, device):
    # apex's rule: overflows separated by clean steps are tolerated forever.
    scaler = DeviceScaler(amp_ops, 1024.0, device, rule=rule(hysteresis=2, growth_interval=100))
    for _ in range(5):
        scaler.step(True)
        assert scaler.state() == (1024.0, 0, 1)
        scaler.step(False)
        assert scaler.state() == (1024.0, 1, 2)


def test_refill_at_growth_spends_the_hysteresis_across_clean_steps(amp_ops, device):
    # Megatron's rule (DeepSpeed's default): the hysteresis comes back only when the scale grows.
    scaler = DeviceScaler(amp_ops, 1024.0, device, rule=rule(hysteresis=2, growth_interval=3,
                                                             consecutive_hysteresis=False))
    scaler.step(True)
    scaler.step(False)
    assert scaler.state() == (1024.0, 1, 1)
    scaler.step(True)
    assert scaler.state() == (512.0, 0, 0)
    scaler.steps(False, 3)
    assert scaler.state() == (1024.0, 0, 2)


def test_scale_never_goes_below_min_scale(amp_ops, device):
    scaler = DeviceScaler(amp_ops, 3.0, device, rule=rule(min_scale=2.0))
    scaler.step(True)
    assert scaler.state()[0] == 2.0
    scaler.step(True)
    assert scaler.state()[0] == 2.0


def test_scale_is_capped_at_max_scale(amp_ops, device):
    scaler = DeviceScaler(amp_ops, 3000.0, device, rule=rule(growth_interval=1, max_scale=4096.0))
    scaler.step(False)
    assert scaler.state()[0] == 4096.0
    scaler.step(False)
    assert scaler.state()[0] == 4096.0


@pytest.mark.parametrize("max_scale", [FLOAT32_MAX, INF])
def test_a_growth_to_inf_keeps_the_old_scale(amp_ops, device, max_scale):
    scaler = DeviceScaler(amp_ops, 2.0**127, device, rule=rule(growth_interval=1, max_scale=max_scale))
    scaler.step(False)  # 2^128 is inf in fp32: no scale at all, so the old one stays (apex, torch)
    assert scaler.state()[0] == 2.0**127
    scaler.step(True)
    assert scaler.state()[0] == 2.0**126


def test_min_scale_zero_lets_the_scale_underflow_to_zero_as_apex_does(amp_ops, device):
    scaler = DeviceScaler(amp_ops, 2.0**-148, device, rule=APEX)
    scaler.step(True)
    assert scaler.state()[0] == 2.0**-149  # the smallest denormal
    scaler.step(True)
    assert scaler.state()[0] == 0.0


def test_update_scale_accepts_zero_dim_state(amp_ops):
    scale = torch.tensor(8.0)
    growth, hysteresis = torch.tensor(0, dtype=torch.int32), torch.tensor(1, dtype=torch.int32)
    amp_ops.update_scale_(scale, growth, hysteresis, torch.tensor(1.0), *rule(growth_interval=10).op_args())
    assert (scale.item(), growth.item(), hysteresis.item()) == (4.0, 0, 0)


# ---- apex's hysteresis scenarios ------------------------------------------------------------
# apex's test runs these phases for every combination of its parameters (3 * 3 * 2 * 2 * 2 = 72),
# with random extra steps; the extras here are fixed, chosen to cross a growth interval.
APEX_CASES = list(itertools.product([1.0, 1024.0, 65536.0], [1.0, 2.0, 4.0], [0.5, 0.25], [10, 100], [10, 100]))


def _repeat_fp32(scale: float, factor: float, times: int) -> float:
    for _ in range(times):
        scale = ref._round_fp32(scale * factor)
    return scale


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("init", "growth", "backoff", "interval", "hysteresis"), APEX_CASES,
                         ids=[f"{int(c[0])}-g{c[1]:g}-b{c[2]:g}-i{c[3]}-h{c[4]}" for c in APEX_CASES])
def test_apex_hysteresis_scenario(one_thread, backend, init, growth, backoff, interval, hysteresis):
    apex_rule = dataclasses.replace(APEX, growth_factor=growth, backoff_factor=backoff, growth_interval=interval,
                                    hysteresis=hysteresis)
    scaler = DeviceScaler(namespace_of(backend), init, rule=apex_rule)
    scaler.steps(True, hysteresis - 1)  # tolerated: the scale holds
    assert scaler.state()[0] == init
    scaler.steps(False, interval - 1)  # clean, one short of a growth: holds, and the hysteresis is full again
    assert scaler.state()[0] == init
    extra_overflows = 7
    scaler.steps(True, hysteresis + extra_overflows)  # the hysteresis is spent, then every overflow backs off
    backed_off = _repeat_fp32(init, backoff, 1 + extra_overflows)
    assert scaler.state()[0] == backed_off
    extra_clean = 2 * interval + 3
    scaler.steps(False, interval + extra_clean)  # one growth per interval
    assert scaler.state()[0] == _repeat_fp32(backed_off, growth, 1 + extra_clean // interval)


def test_apex_scenario_needs_consecutive_hysteresis(amp_ops):
    # The same first phases under the refill-at-growth rule back off `hysteresis` times more.
    scaler = DeviceScaler(amp_ops, 1024.0, rule=dataclasses.replace(MEGATRON, growth_interval=10, hysteresis=10))
    scaler.steps(True, 9)
    scaler.steps(False, 9)
    scaler.steps(True, 10)
    assert scaler.state()[0] == 1024.0 * 0.5**10  # apex: 1024 * 0.5


# ---- properties ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(
    found_infs=st.lists(st.booleans(), min_size=1, max_size=40),
    initial_scale=st.sampled_from([2.0**-140, 1.0, 3.0, 2.0**16, 2.0**126]),
    growth_factor=st.sampled_from([1.0, 1.5, 2.0, 3.0, 10.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.9, 0.1]),
    growth_interval=st.integers(min_value=1, max_value=4),
)
def test_without_hysteresis_floor_or_cap_the_rule_is_torchs(
    backend, found_infs, initial_scale, growth_factor, backoff_factor, growth_interval
):
    torch_rule = dataclasses.replace(APEX, growth_factor=growth_factor, backoff_factor=backoff_factor,
                                     growth_interval=growth_interval, hysteresis=1)
    scaler = DeviceScaler(namespace_of(backend), initial_scale, rule=torch_rule)
    torch_scale = torch.tensor([initial_scale])
    torch_growth = torch.zeros(1, dtype=torch.int32)
    for k, found_inf in enumerate(found_infs):
        scaler.step(found_inf)
        torch._amp_update_scale_(torch_scale, torch_growth, ref.flag(float(found_inf)), growth_factor,
                                 backoff_factor, growth_interval)
        assert scaler.state()[:2] == (torch_scale.item(), torch_growth.item()), f"step {k}"


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=80, deadline=None)
@given(
    found_infs=st.lists(st.booleans(), min_size=1, max_size=40),
    initial_scale=st.sampled_from([1.0, 3.0, 2.0**16, 2.0**120]),
    growth_factor=st.sampled_from([1.0, 1.5, 2.0, 10.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.9]),
    growth_interval=st.integers(min_value=1, max_value=5),
    hysteresis=st.integers(min_value=1, max_value=3),
    min_scale=st.sampled_from([0.0, 1.0, 2.0**-10]),
    max_scale=st.sampled_from([2.0**24, 2.0**17, FLOAT32_MAX, INF]),
    consecutive_hysteresis=st.booleans(),
)
def test_update_scale_trajectory_matches_plain_python_rule(
    backend, found_infs, initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
    max_scale, consecutive_hysteresis,
):
    the_rule = ref.ScaleRule(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale,
                             consecutive_hysteresis)
    scaler = DeviceScaler(namespace_of(backend), initial_scale, rule=the_rule)
    model = ref.ScalerState(initial_scale, 0, the_rule.hysteresis)
    for k, found_inf in enumerate(found_infs):
        scaler.step(found_inf)
        model.update(found_inf, the_rule)
        assert scaler.state() == (model.scale, model.growth_tracker, model.hysteresis_tracker), f"step {k}"
