"""update_scale_: the dynamic loss-scale rule on the device, on both backends."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _reference as ref
from _backends import BACKENDS, namespace_of

FLOAT32_MAX = torch.finfo(torch.float32).max
# In the order of the schema's arguments after found_inf.
DEFAULTS = {
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 3,
    "hysteresis": 1,
    "min_scale": 1.0,
    "max_scale": 2.0**24,
}


class DeviceScaler:
    """The op's three state tensors, stepped with found_inf values."""

    def __init__(self, amp_ops, scale, device="cpu", hysteresis_tracker=1, **rule):
        self.amp_ops = amp_ops
        self.scale = torch.tensor([scale], dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self.hysteresis_tracker = torch.tensor([hysteresis_tracker], dtype=torch.int32, device=device)
        self.rule = {**DEFAULTS, **rule}

    def step(self, found_inf: bool) -> None:
        found_inf_flag = ref.flag(float(found_inf), self.scale.device)
        state = (self.scale, self.growth_tracker, self.hysteresis_tracker, found_inf_flag)
        self.amp_ops.update_scale_(*state, *(self.rule[name] for name in DEFAULTS))

    def state(self):
        return (self.scale.item(), self.growth_tracker.item(), self.hysteresis_tracker.item())


def test_overflow_halves_the_scale_and_resets_the_growth_count(amp_ops, device):
    scaler = DeviceScaler(amp_ops, 65536.0, device)
    scaler.step(False)
    scaler.step(True)
    assert scaler.state() == (32768.0, 0, 0)


def test_scale_grows_after_growth_interval_clean_steps(amp_ops, device):
    scaler = DeviceScaler(amp_ops, 1024.0, device, growth_interval=3)
    scaler.step(False)
    scaler.step(False)
    assert scaler.state() == (1024.0, 2, 1)
    scaler.step(False)
    assert scaler.state() == (2048.0, 0, 1)


def test_hysteresis_tolerates_overflows_before_backing_off(amp_ops, device):
    scaler = DeviceScaler(amp_ops, 1024.0, device, hysteresis_tracker=3, hysteresis=3)
    scaler.step(True)
    scaler.step(True)
    assert scaler.state() == (1024.0, 0, 1)
    scaler.step(True)
    assert scaler.state() == (512.0, 0, 0)
    scaler.step(True)  # hysteresis spent: every further overflow backs off
    assert scaler.state() == (256.0, 0, 0)


def test_growth_refills_the_hysteresis(amp_ops, device):
    scaler = DeviceScaler(amp_ops, 1024.0, device, hysteresis_tracker=0, hysteresis=2, growth_interval=1)
    scaler.step(False)
    assert scaler.state() == (2048.0, 0, 2)


def test_scale_never_goes_below_min_scale(amp_ops, device):
    scaler = DeviceScaler(amp_ops, 3.0, device, min_scale=2.0)
    scaler.step(True)
    assert scaler.state()[0] == 2.0
    scaler.step(True)
    assert scaler.state()[0] == 2.0


def test_scale_is_capped_at_max_scale(amp_ops, device):
    scaler = DeviceScaler(amp_ops, 3000.0, device, growth_interval=1, max_scale=4096.0)
    scaler.step(False)
    assert scaler.state()[0] == 4096.0
    scaler.step(False)
    assert scaler.state()[0] == 4096.0


def test_a_grown_scale_that_overflows_float32_is_never_used(amp_ops, device):
    scaler = DeviceScaler(amp_ops, 2.0**127, device, growth_interval=1, max_scale=FLOAT32_MAX)
    scaler.step(False)  # 2^128 is inf in fp32: the scale goes to the cap instead
    assert scaler.state()[0] == FLOAT32_MAX
    scaler.step(False)
    assert scaler.state()[0] == FLOAT32_MAX


def test_update_scale_accepts_zero_dim_state(amp_ops):
    scale = torch.tensor(8.0)
    growth, hysteresis = torch.tensor(0, dtype=torch.int32), torch.tensor(1, dtype=torch.int32)
    amp_ops.update_scale_(scale, growth, hysteresis, torch.tensor(1.0), 2.0, 0.5, 10, 1, 1.0, 2.0**24)
    assert (scale.item(), growth.item(), hysteresis.item()) == (4.0, 0, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=80, deadline=None)
@given(
    found_infs=st.lists(st.booleans(), min_size=1, max_size=40),
    initial_scale=st.sampled_from([1.0, 3.0, 2.0**16, 2.0**120]),
    growth_factor=st.sampled_from([1.0, 1.5, 2.0, 10.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.9]),
    growth_interval=st.integers(min_value=1, max_value=5),
    hysteresis=st.integers(min_value=1, max_value=3),
    min_scale=st.sampled_from([1.0, 2.0**-10]),
    max_scale=st.sampled_from([2.0**24, 2.0**17, FLOAT32_MAX]),
)
def test_update_scale_trajectory_matches_plain_python_rule(
    backend, found_infs, initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale
):
    rule = {
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": growth_interval,
        "hysteresis": hysteresis,
        "min_scale": min_scale,
        "max_scale": max_scale,
    }
    scaler = DeviceScaler(namespace_of(backend), initial_scale, hysteresis_tracker=hysteresis, **rule)
    model = ref.ScalerState(initial_scale, 0, hysteresis)
    for k, found_inf in enumerate(found_infs):
        scaler.step(found_inf)
        model.update(found_inf, **rule)
        assert scaler.state() == (model.scale, model.growth_tracker, model.hysteresis_tracker), f"step {k}"
