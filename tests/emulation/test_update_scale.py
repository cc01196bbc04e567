"""update_scale_: the emulated single-thread kernel follows the CPU kernel's
scale, growth tracker and hysteresis tracker bit for bit, step by step
(both run amp_math.h's update_scale_math).
"""

from __future__ import annotations

import pytest
import torch

from _twins import CPU, EMULATED, assert_bitwise_equal, flag

RULES = {
    "apex": dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=1,
                 min_scale=1.0, max_scale=2.0**24, consecutive_hysteresis=True),
    "megatron-hysteresis": dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2,
                                hysteresis=3, min_scale=2.0**-4, max_scale=2.0**10,
                                consecutive_hysteresis=False),
    "apex-hysteresis": dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2, hysteresis=3,
                            min_scale=2.0**-4, max_scale=2.0**10, consecutive_hysteresis=True),
    "odd-factors": dict(growth_factor=1.7, backoff_factor=0.3, growth_interval=1, hysteresis=2,
                        min_scale=0.01, max_scale=3e38, consecutive_hysteresis=False),
    # torch's rule: no floor, no cap; growth until the scale would be inf.
    "torch": dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=1, hysteresis=1,
                  min_scale=0.0, max_scale=float("inf"), consecutive_hysteresis=True),
}


def state(scale):
    return [flag(scale), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)]


@pytest.mark.parametrize("rule", RULES.values(), ids=RULES.keys())
def test_scale_trajectory_matches_step_by_step(rule):
    generator = torch.Generator().manual_seed(1)
    overflows = (torch.rand(300, generator=generator) < 0.3).tolist()
    # A run of clean steps up to max_scale (or, uncapped, to where the next
    # growth would be inf), and a run of overflows down to min_scale.
    overflows += [False] * 140 + [True] * 160 + [False] * 5
    emulated, cpu = state(2.0**16), state(2.0**16)
    for step, overflow in enumerate(overflows):
        found_inf = flag(float("nan") if overflow and step % 5 == 0 else float(overflow))
        EMULATED.update_scale_(*emulated, found_inf, *rule.values())
        CPU.update_scale_(*cpu, found_inf, *rule.values())
        for name, e, c in zip(("scale", "growth_tracker", "hysteresis_tracker"), emulated, cpu):
            if e.is_floating_point():
                assert_bitwise_equal(e, c, f"{name} after step {step}")
            else:
                assert torch.equal(e, c), f"{name} after step {step}: {e.item()} vs {c.item()}"
