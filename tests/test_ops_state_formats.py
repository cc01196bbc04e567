"""The fused optimizer ops with low-precision states and remainder masters (issue 27's op contract).

Every op x state format x grad dtype x model copy x size, checked with the contract's bitwise
recipe (tests/_state_steps.py): the step with formatted states equals the fp32-state step on
their dequantized values, quantized again, bit for bit; a remainder master equals its joined
fp32 master's step, split again. On each backend against itself (both run the same recipe).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _state_steps as steps
from _backends import BACKENDS, namespace_of, skip_unless_the_cpu_has
from _errors import raises_naming
from apex_amp import _checks, ops
from apex_amp.optimizers import _lamb_ops, fused_adagrad, fused_adam, fused_novograd, fused_sgd, state_formats

# "lamb-passes": fused_lamb_ as its two passes (fused_lamb_moments_, fused_lamb_update_), as under FSDP2.
STATEFUL = ("adam", "sgd", "adagrad", "novograd", "lamb", "lamb-passes")
BLOCK = 64
# (id, shapes): nothing, one block, several blocks, odd row counts, more than one 16384-element work unit.
SIZES = [
    ("empty", [(0, BLOCK)]),
    ("one-block", [(1, BLOCK)]),
    ("blocks-odd-rows", [(33, BLOCK), (7, 2 * BLOCK)]),
]
BIG = [("units", [(300, BLOCK)]),     # 19200 elements: two units
       ("threads", [(1100, BLOCK)])]  # 70400 elements: five units, shared among the threads


def _backend_ops(backend: str):
    return namespace_of(backend)


def _run_recipe(ns, rule, shapes, fmt, **kwargs):
    formatted = steps.make_step(rule, shapes, fmt, BLOCK, **kwargs)
    twin = steps.fp32_twin(formatted)
    rule.call(ns, formatted)
    rule.call(ns, twin)
    steps.assert_bitwise_equal(formatted, steps.expected_from_twin(steps.make_step(rule, shapes, fmt, BLOCK,
                                                                                   **kwargs), twin))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", SIZES, ids=[s[0] for s in SIZES])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_formatted_states_step_as_their_fp32_values_quantized_again(backend, rule, fmt, size):
    ns = _backend_ops(backend)
    _run_recipe(ns, steps.RULES[rule], size[1], fmt, grad_dtype=torch.bfloat16, model_dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("model_dtype", [None, torch.bfloat16], ids=["no-copy", "bf16-copy"])
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_every_grad_dtype_and_model_copy_with_formatted_states(backend, rule, fmt, model_dtype, grad_dtype):
    ns = _backend_ops(backend)
    _run_recipe(ns, steps.RULES[rule], SIZES[2][1], fmt, grad_dtype=grad_dtype, model_dtype=model_dtype, seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", BIG, ids=[s[0] for s in BIG])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_formatted_states_over_more_than_one_work_unit(backend, rule, fmt, size):
    _run_recipe(_backend_ops(backend), steps.RULES[rule], size[1], fmt, seed=5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", [*STATEFUL, "plain_sgd"])
def test_remainder_masters_over_units_and_threads(backend, rule):
    _run_recipe(_backend_ops(backend), steps.RULES[rule], BIG[1][1], "int8", remainder=True, seed=6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8", "int8"])
@pytest.mark.parametrize("rule", [*STATEFUL, "plain_sgd"])
def test_remainder_masters_step_as_their_joined_fp32_masters(backend, rule, fmt, grad_dtype):
    _run_recipe(_backend_ops(backend), steps.RULES[rule], SIZES[2][1], fmt, grad_dtype=grad_dtype,
                remainder=True, seed=7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_a_nan_gradient_poisons_only_its_blocks(backend, rule, fmt):
    # No found_inf: the NaN reaches its element's states, and quantize's rule makes the whole block
    # read NaN (absmax NaN, zero codes); the other blocks are untouched by it.
    ns = _backend_ops(backend)
    _run_recipe(ns, steps.RULES[rule], [(4, BLOCK)], fmt, poison=(0, BLOCK + 3), seed=9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("remainder", [False, True], ids=["fp32-masters", "remainders"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_a_skipped_step_writes_nothing_codes_absmaxes_and_remainders_included(backend, rule, remainder):
    ns = _backend_ops(backend)
    formatted = steps.make_step(steps.RULES[rule], [(4, BLOCK)], "int8", BLOCK, remainder=remainder,
                                found_inf=1.0, poison=(0, 5), seed=11)
    before = formatted.clone()
    steps.RULES[rule].call(ns, formatted)
    steps.assert_bitwise_equal(formatted, before)


def test_the_block_limits_of_the_checks_are_those_of_the_formats():
    assert (_checks.MIN_STATE_BLOCK, _checks.MAX_STATE_BLOCK) == (state_formats.MIN_BLOCK_SIZE,
                                                                   state_formats.MAX_BLOCK_SIZE)


@pytest.mark.parametrize("name", ["fused_sgd_", "fused_adagrad_", "fused_novograd_", "fused_lamb_"])
def test_the_derived_wrappers_take_the_state_operands_as_keywords(name):
    parameters = inspect.signature(getattr(ops, name)).parameters
    for operand in ("master_remainders", "state_absmaxes"):
        assert parameters[operand].kind is inspect.Parameter.KEYWORD_ONLY and parameters[operand].default == ()
    assert list(parameters).index("model_params") == (3 if name in ("fused_sgd_", "fused_adagrad_") else 4)


def test_the_public_wrappers_hand_the_state_operands_to_the_op():
    # An absmax for an fp32 state is refused by the op, naming it: the keyword reached the op.
    params, grads, buffers = [torch.ones(64)], [torch.ones(64)], [torch.zeros(64)]
    with raises_naming("fused_sgd_", "state_absmaxes[0]"):
        ops.fused_sgd_(params, grads, buffers, [], 0.1, 0.9, 0.0, 0.0, False, False, False,
                       state_absmaxes=[torch.zeros(2)])
    with raises_naming("fused_adam_", "master_remainders[0]"):
        ops.fused_adam_(params, grads, buffers, [torch.zeros(64)], torch.zeros(1), lr=0.1, beta1=0.9, beta2=0.99,
                        eps=1e-8, master_remainders=[torch.zeros(64, dtype=torch.int16)])


@pytest.mark.parametrize("found_inf", [0.0, 1.0], ids=["taken", "skipped"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_fallback_skip_decided_on_the_device_masks_codes_absmaxes_and_remainders(monkeypatch, rule, found_inf):
    # On CUDA the fallback cannot read found_inf without a sync: every write is masked on the device.
    # Forced on CPU: a taken step equals the step without found_inf, a skipped one writes nothing.
    module = {"adam": fused_adam, "sgd": fused_sgd, "adagrad": fused_adagrad, "novograd": fused_novograd,
              "lamb": _lamb_ops, "lamb-passes": _lamb_ops}[rule]
    ns = namespace_of("fallback")
    kwargs = dict(remainder=True, grad_dtype=torch.bfloat16, seed=17)
    masked = steps.make_step(steps.RULES[rule], [(3, BLOCK)], "int8", BLOCK, found_inf=found_inf, **kwargs)
    plain = steps.make_step(steps.RULES[rule], [(3, BLOCK)], "int8", BLOCK, **kwargs)
    before = masked.clone()
    monkeypatch.setattr(module, "step_taken", lambda flag: flag.reshape(()) == 0)
    steps.RULES[rule].call(ns, masked)
    monkeypatch.undo()
    if found_inf:
        steps.assert_bitwise_equal(masked, before)
    else:
        steps.RULES[rule].call(ns, plain)
        steps.assert_bitwise_equal(masked, plain)


# Special values in the states and grads: zeros (flushed blocks), numbers far apart in one block,
# denormals, values at the maps' edges.
_SPECIAL = st.sampled_from([0.0, -0.0, 1e-39, -1e-39, 1e-30, 3.0e38, -3.0e38, 1e-7, 0.5, -1.0, 448.0])
_FINITE = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, width=32)


@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.one_of(_SPECIAL, _FINITE), min_size=64, max_size=64),
       grads=st.lists(st.one_of(_SPECIAL, _FINITE), min_size=64, max_size=64),
       fmt=st.sampled_from(["fp8", "int8", "bf16"]), rule=st.sampled_from(STATEFUL))
def test_any_values_step_as_their_fp32_values_quantized_again(values, grads, fmt, rule):
    for backend in BACKENDS:
        ns = _backend_ops(backend)
        formatted = steps.make_step(steps.RULES[rule], [(2, 32)], fmt, 32, seed=19)
        for k, state in enumerate(formatted.states):
            nonnegative = steps.RULES[rule].nonnegative[k]
            raw = torch.tensor(values).reshape(2, 32)
            codes, absmax = state_formats.quantize(raw.abs() if nonnegative else raw, state[0].dtype,
                                                   32 if state[0].dtype in steps.BLOCKED else None)
            state[0].copy_(codes)
            if absmax is not None:
                formatted.absmaxes[k].copy_(absmax.reshape(-1))
        formatted.grads[0].copy_(torch.tensor(grads).reshape(2, 32))
        before, twin = formatted.clone(), steps.fp32_twin(formatted)
        rule_of = steps.RULES[rule]
        rule_of.call(ns, formatted)
        rule_of.call(ns, twin)
        steps.assert_bitwise_equal(formatted, steps.expected_from_twin(before, twin))


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_every_cpu_instruction_set_runs_the_formats_bit_for_bit(capability):
    skip_unless_the_cpu_has(capability)
    # One process per instruction set (the extension picks its kernels once per process).
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": str(root)}
    env.pop("APEX_AMP_FORCE_FALLBACK", None)
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-m", "not slow",
         "-k", "extension and (quantized_again or remainder or poisons)"],
        env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]


# Units of many segments (the CPU kernels convert the states of one segment while the rule runs
# over the next: kernels.inc), with blocks of each kind among them: zeros, tiny (flushed), huge,
# NaN, NaN gradients, and plain values; the smallest block (16 per segment), the default, the
# largest (one per segment); the first shape has two units, the last unit ending mid-segment.
_SEGMENTED = [(32, [(600, 32)]), (256, [(20, 256), (5, 256)]), (4096, [(3, 4096)])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block,shapes", _SEGMENTED, ids=[f"block{b}" for b, _ in _SEGMENTED])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_special_blocks_over_many_segments_step_as_their_fp32_values_quantized_again(backend, rule, fmt,
                                                                                       block, shapes):
    ns = _backend_ops(backend)
    formatted = steps.make_step(steps.RULES[rule], shapes, fmt, block, grad_dtype=torch.bfloat16,
                                model_dtype=torch.bfloat16, seed=23)
    g = torch.Generator().manual_seed(29)
    special = torch.tensor([0.0, -0.0, 1e-39, 1e-30, 3.0e38, -3.0e38, 1e-7, 0.5, -1.0, 448.0])
    count = len(shapes)
    for k, state in enumerate(formatted.states):
        nonnegative = steps.RULES[rule].nonnegative[k]
        for i, codes in enumerate(state):
            if codes.dtype not in steps.BLOCKED:
                continue
            raw = torch.randn(codes.shape, generator=g) * 0.1
            sprinkled = torch.rand(codes.shape, generator=g) < 0.02
            raw = torch.where(sprinkled, special[torch.randint(0, len(special), codes.shape, generator=g)], raw)
            rows = raw.shape[0]
            raw[rows // 3].zero_()            # a block of zeros
            raw[rows // 2].fill_(1e-39)       # a block flushed to zero codes
            raw[-1, ::7] = 3.0e38             # a block whose other values round to zero
            raw[rows // 4, 5] = float("nan")  # a NaN block (fp8: a NaN code among zeros)
            new_codes, absmax = state_formats.quantize(raw.abs() if nonnegative else raw, codes.dtype, block)
            codes.copy_(new_codes)
            formatted.absmaxes[k * count + i].copy_(absmax.reshape(-1))
    for grad in formatted.grads:
        flat = grad.view(-1)
        flat[torch.randint(0, flat.numel(), (5,), generator=g)] = float("nan")
        flat[flat.numel() // 2 + 3] = float("inf")
    before, twin = formatted.clone(), steps.fp32_twin(formatted)
    steps.RULES[rule].call(ns, formatted)
    steps.RULES[rule].call(ns, twin)
    steps.assert_bitwise_equal(formatted, steps.expected_from_twin(before, twin))


def _code_steps(a, b):
    """How many codes apart two blocked states are, element by element."""
    if a.dtype == torch.float8_e4m3fn:  # sign and magnitude: the low 7 bits order the magnitudes
        a, b = a.view(torch.uint8).int(), b.view(torch.uint8).int()
        signed_a = torch.where(a >= 128, -(a - 128), a)
        signed_b = torch.where(b >= 128, -(b - 128), b)
        return (signed_a - signed_b).abs()
    return (a.int() - b.int()).abs()


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_the_fallback_agrees_with_the_kernels_within_one_code_step(rule, fmt):
    # Their fp32 arithmetic agrees to a few ulp, so a value may round to the neighbouring code.
    kernels, fallback = (steps.make_step(steps.RULES[rule], [(33, BLOCK)], fmt, BLOCK, grad_dtype=torch.bfloat16,
                                         seed=23) for _ in range(2))
    steps.RULES[rule].call(namespace_of("extension"), kernels)
    steps.RULES[rule].call(namespace_of("fallback"), fallback)
    torch.testing.assert_close(kernels.params, fallback.params, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernels.absmaxes, fallback.absmaxes, rtol=1e-5, atol=0)
    for got, want in zip(kernels.states, fallback.states):
        assert int(max(_code_steps(a, b).max() for a, b in zip(got, want))) <= 1
