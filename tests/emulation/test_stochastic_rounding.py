"""Stochastic rounding of bf16 states (the ops' ``state_rounding``): the emulated CUDA launchers
against the CPU kernels, bit for bit, and against the reference (state_formats.round_bf16_stochastic).

Both sides call csrc/state_formats.h's rounding_stream, rounding_bits and round_bf16_stochastic
(host-device functions), with each element's index in the whole parameter: the tensor's row
offset plus its index in the tensor, so chunks and launches do not change the bits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from _twins import CPU, EMULATED
from apex_amp.optimizers.state_formats import round_bf16_stochastic, rounding_key
from test_formatted_states import BLOCK, RULES, SHAPES, STATEFUL, assert_steps_equal, make_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the contract's recipe
import _state_steps as recipe  # noqa: E402


def _rows(count: int, counter: int = 3) -> torch.Tensor:
    # Offsets far beyond 2**32: the index's high half takes part in the bits.
    return torch.tensor([[rounding_key(17, counter, i), (5 << 32) + 999 * i] for i in range(count)],
                        dtype=torch.int64)


@pytest.mark.parametrize("remainder", [False, True], ids=["fp32-masters", "remainders"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_stochastically_rounded_bf16_states_match_bit_for_bit(rule, remainder):
    formats = ("bf16", "bf16")[:len(RULES[rule].nonnegative)]
    kwargs = dict(shapes=SHAPES, formats=formats, remainder=remainder, inv_scale=0.25, seed=31)
    emulated, cpu, nearest = (make_step(RULES[rule], **kwargs) for _ in range(3))
    for counter in (3, 4):  # two steps, each with its own bits
        rows = _rows(len(SHAPES), counter)
        RULES[rule].call(recipe.WithRounding(EMULATED, rows), emulated)
        RULES[rule].call(recipe.WithRounding(CPU, rows), cpu)
        RULES[rule].call(EMULATED, nearest)
    assert_steps_equal(emulated, cpu)
    differing = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum())
                    for a, b in zip(emulated.states[0], nearest.states[0]))
    assert differing > 0.2 * sum(s.numel() for s in emulated.states[0])


@pytest.mark.parametrize("rule", ["adam", "lamb"])
def test_the_emulated_bits_are_the_reference_bits(rule):
    # The contract's recipe on the emulated launchers: the fp32-state step, rounded by the reference.
    op, shapes = recipe.RULES[rule], [(0, BLOCK), (3, BLOCK), (2 * 4096 // BLOCK + 3, BLOCK)]
    rows = _rows(len(shapes))
    formatted = recipe.make_step(op, shapes, "bf16", BLOCK, seed=32)
    twin = recipe.fp32_twin(formatted)
    op.call(recipe.WithRounding(EMULATED, rows), formatted)
    op.call(EMULATED, twin)
    want = recipe.expected_from_twin(recipe.make_step(op, shapes, "bf16", BLOCK, seed=32), twin)
    for k, state in enumerate(want.states):
        for i, s in enumerate(state):
            if s.numel() > 0:
                state[i] = round_bf16_stochastic(twin.states[k][i], rows[i, 0], k, rows[i, 1])
    recipe.assert_bitwise_equal(formatted, want)
