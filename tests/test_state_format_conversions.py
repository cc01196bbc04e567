"""The CPU kernels' vector conversions of the state formats (csrc/cpu/state_formats_vec.h), bit for bit.

The formatted path converts whole blocks in vector registers (a table lookup to dequantize int8/uint8
and fp8 codes decoded from their bits; int8/uint8 quantized by an estimate from the maps' decades with
a branch-free search over the midpoints where the estimate is in doubt; c10's fp8 rounding restated in
32-bit lanes; the remainder masters' bit arithmetic). These tests drive fused_adam_ with blocks built
to hit every class of fp32 bit pattern the conversions meet -- random bit patterns, the maps' entries
and their midpoints exactly and one ulp either side, every midpoint's neighbourhood out to thousands
of ulps, fp8's rounding ties, +-0, denormals, +-1, +-inf and NaN -- and every code of every format,
and check the contract's recipe (tests/_state_steps.py): the
step equals the fp32-state step on the dequantized values, quantized again by the reference
(apex_amp.optimizers.state_formats, which the scalar C++ functions restate). Each instruction set's
variant runs in a process of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _state_steps as steps
from _backends import namespace_of, skip_unless_the_cpu_has
from apex_amp.optimizers import state_formats

BLOCK = 32
BLOCKS = 4


def _f32(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def _neighbours(values: torch.Tensor) -> torch.Tensor:
    """values, and one fp32 ulp below and above each."""
    up = torch.nextafter(values, torch.full_like(values, float("inf")))
    down = torch.nextafter(values, torch.full_like(values, float("-inf")))
    return torch.cat([values, up, down])


def _map_points(signed: bool) -> torch.Tensor:
    m = state_formats.dynamic_map(signed, torch.device("cpu"))
    midpoints = (m[:-1] + m[1:]) * 0.5
    return _neighbours(torch.cat([m, midpoints]))


def _fp8_ties() -> torch.Tensor:
    """x in [-1, 1] whose x * 448 is exactly halfway between two float8_e4m3fn values (and neighbours)."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = (codes[:-1] + codes[1:]) * 0.5
    x = ties / 448.0
    exact = x[(x * 448.0) == ties]
    return _neighbours(torch.cat([exact, -exact, codes / 448.0]))


SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1.1754942e-38, 1.1754944e-38, 2.0**-126, 1e-39,
           3.0e38, -3.0e38, float("inf"), float("-inf"), float("nan")]
POINTS = {"int8": _map_points(True), "uint8": _map_points(False), "fp8": _fp8_ties()}

# One element of a block, as fp32: any bit pattern, a special value, or a point the format rounds at.
_element = st.one_of(
    st.integers(0, 2**32 - 1).map(_f32),
    st.sampled_from(SPECIAL),
    st.sampled_from(sorted({float(v) for p in POINTS.values() for v in p})),
)
# A block: its elements; the largest magnitude forced to 1 (so the reference scales by exactly 1 and
# the map's points are met as they are) unless the block is left as drawn.
_block = st.tuples(st.lists(_element, min_size=BLOCK, max_size=BLOCK), st.sampled_from(["unit", "as-drawn"]),
                   st.integers(0, BLOCK - 1), st.sampled_from([1.0, -1.0]))


def _block_values(block) -> list[float]:
    values, kind, where, one = block
    if kind == "unit":
        values = [v if v != v or abs(v) <= 1.0 else 0.5 for v in values]  # NaN stays: it poisons the block
        values[where] = one
    return values


def _grads_reaching_the_states(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _adam(ns, t: steps.Step, beta1: float, beta2: float) -> None:
    ns.fused_adam_(t.params, t.grads, t.states[0], t.states[1], t.model, t.remainders, t.absmaxes, t.step,
                   1e-2, beta1, beta2, 1e-8, 0.01, True, True, t.inv_scale, t.found_inf)


def _check(formatted: steps.Step, beta1: float, beta2: float) -> None:
    before, twin = formatted.clone(), steps.fp32_twin(formatted)
    ns = namespace_of("extension")  # the compiled kernels (a skip saying why when they are not built)
    _adam(ns, formatted, beta1, beta2)
    _adam(ns, twin, beta1, beta2)
    steps.assert_bitwise_equal(formatted, steps.expected_from_twin(before, twin))


def _step(fmt: str, remainder: bool = False) -> steps.Step:
    return steps.make_step(steps.RULES["adam"], [(BLOCKS, BLOCK)], fmt, BLOCK, seed=5, inv_scale=None,
                           remainder=remainder)


@settings(max_examples=60, deadline=None)
@given(blocks=st.lists(_block, min_size=BLOCKS, max_size=BLOCKS), fmt=st.sampled_from(["fp8", "int8", "bf16"]))
def test_quantizing_any_fp32_bit_pattern_matches_the_reference(blocks, fmt):
    # beta1 = beta2 = 0: exp_avg becomes the gradient itself and exp_avg_sq its square, so the drawn
    # values reach the quantizers unchanged (the first moment; the second sees their squares).
    formatted = _step(fmt)
    values = [v for block in blocks for v in _block_values(block)]
    formatted.grads[0].copy_(_grads_reaching_the_states(values).reshape(BLOCKS, BLOCK))
    _check(formatted, 0.0, 0.0)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_every_code_dequantizes_as_the_reference(fmt):
    # Zero gradients and betas of 1/2: each moment becomes half its dequantized value (exact in fp32),
    # which also moves the params, so a code read differently from the reference shows in both; every
    # byte (int8's never-written -128 included) in blocks of several absmaxes, a zero one among them.
    formatted = _step(fmt)
    formatted.grads[0].zero_()
    for k, state in enumerate(formatted.states):
        codes = torch.arange(256, dtype=torch.int64).remainder(256).to(torch.uint8)
        codes = codes[torch.randperm(256, generator=torch.Generator().manual_seed(k))][: BLOCKS * BLOCK]
        state[0].view(torch.uint8).copy_(codes.reshape(BLOCKS, BLOCK))
        formatted.absmaxes[k].copy_(torch.tensor([1.0, 0.0, 3.5e-3, 2.0e30]))
    _check(formatted, 0.5, 0.5)


def _ulp_steps(values: torch.Tensor, offsets) -> torch.Tensor:
    """values moved by each of ``offsets`` fp32 ulps (values > 0)."""
    bits = values.view(torch.int32).to(torch.int64)
    moved = torch.cat([bits + k for k in offsets]).to(torch.int32).view(torch.float32)
    return moved[moved.isfinite()]


# Around every midpoint: one ulp (the rounding itself), then out to where the zone estimate stops
# doubting its own t (kZoneDoubt of a step, tens to thousands of ulps), and past it.
_MIDPOINT_OFFSETS = sorted({s * k for s in (1, -1) for k in (0, 1, 2, 3, 5, 8, 16, 40, 100, 250, 600, 1500, 4000,
                                                            10000, 30000)})


def _positive_midpoints(signed: bool) -> torch.Tensor:
    m = state_formats.dynamic_map(signed, torch.device("cpu"))
    midpoints = (m[:-1] + m[1:]) * 0.5
    return midpoints[midpoints > 0]


def _binade_edges() -> torch.Tensor:
    """2^-30 .. 2^0 and their neighbours: where the zone lookup changes binade."""
    return _ulp_steps(torch.tensor([2.0 ** -e for e in range(31)]), (-2, -1, 0, 1, 2))


@pytest.mark.parametrize("signed", [True, False], ids=["int8", "uint8"])
def test_int8_codes_near_every_midpoint_and_binade_edge_match_the_reference(signed):
    # The vector quantizer estimates a value's code from its map's decade structure and falls back to
    # the exact search only where the estimate is in doubt: sweep both sides of that line at every
    # midpoint of the map (and the binade edges its zone lookup uses), both signs. beta1 = beta2 = 0:
    # exp_avg (int8, signed map) becomes the gradient and exp_avg_sq (uint8, unsigned map) its
    # square, so the unsigned map's points are fed as square roots. Each block holds a 1 (scale 1).
    points = torch.cat([_ulp_steps(_positive_midpoints(signed), _MIDPOINT_OFFSETS), _binade_edges()])
    points = points[points < 1.0]
    if not signed:
        points = points.sqrt()
    values = torch.cat([points, -points]) if signed else points
    per_block = BLOCK - 1
    blocks = -(-values.numel() // per_block)
    padded = torch.cat([values, torch.full((blocks * per_block - values.numel(),), 0.25)]).reshape(blocks, per_block)
    grads = torch.cat([padded, torch.ones(blocks, 1)], dim=1)
    formatted = steps.make_step(steps.RULES["adam"], [(blocks, BLOCK)], "int8", BLOCK, seed=7, inv_scale=None)
    formatted.grads[0].copy_(grads)
    _check(formatted, 0.0, 0.0)


@settings(max_examples=30, deadline=None)
@given(weights=st.lists(st.integers(0, 2**16 - 1), min_size=BLOCKS * BLOCK + 5, max_size=BLOCKS * BLOCK + 5),
       remainders=st.lists(st.integers(-2**15, 2**15 - 1), min_size=BLOCKS * BLOCK + 5,
                           max_size=BLOCKS * BLOCK + 5))
def test_remainder_masters_of_any_bits_join_and_split_as_the_reference(weights, remainders):
    # An odd element count: the vector loop and its scalar tail both run.
    formatted = steps.make_step(steps.RULES["adam"], [(BLOCKS * BLOCK + 5,)], "fp32", BLOCK, seed=3,
                                inv_scale=None, remainder=True)
    formatted.params[0].view(torch.int16).copy_(torch.tensor(weights, dtype=torch.int32).to(torch.int16))
    formatted.remainders[0].copy_(torch.tensor(remainders, dtype=torch.int16))
    _check(formatted, 0.9, 0.999)


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_every_cpu_instruction_set_converts_bit_for_bit(capability):
    skip_unless_the_cpu_has(capability)
    # One process per instruction set (the extension picks its kernels once per process).
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": str(root)}
    env.pop("APEX_AMP_FORCE_FALLBACK", None)
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-m", "not slow"],
        env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
