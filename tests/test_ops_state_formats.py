"""The fused optimizer ops with low-precision states and remainder masters (issue 27's op contract).

Every op x state format x grad dtype x model copy x size, checked with the contract's bitwise
recipe (tests/_state_steps.py): the step with formatted states equals the fp32-state step on
their dequantized values, quantized again, bit for bit; a remainder master equals its joined
fp32 master's step, split again. On each backend against itself (both run the same recipe).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import _state_steps as steps
from _backends import namespace_of
from _errors import raises_naming
from apex_amp import _checks, ops
from apex_amp.optimizers import fused_adagrad, fused_adam, fused_lamb, fused_novograd, fused_sgd, state_formats

STATEFUL = ("adam", "sgd", "adagrad", "novograd", "lamb")
BACKENDS = ("fallback",)  # the CPU kernels take state formats in the next commit
BLOCK = 64
# (id, shapes): nothing, one block, several blocks, odd row counts, more than one 16384-element work unit.
SIZES = [
    ("empty", [(0, BLOCK)]),
    ("one-block", [(1, BLOCK)]),
    ("blocks-odd-rows", [(33, BLOCK), (7, 2 * BLOCK)]),
]
BIG = ("units", [(300, BLOCK)])  # 19200 elements: two units


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
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_formatted_states_over_more_than_one_work_unit(backend, rule, fmt):
    _run_recipe(_backend_ops(backend), steps.RULES[rule], BIG[1], fmt, seed=5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("rule", [*STATEFUL, "plain_sgd"])
def test_remainder_masters_step_as_their_joined_fp32_masters(backend, rule, fmt):
    _run_recipe(_backend_ops(backend), steps.RULES[rule], SIZES[2][1], fmt, grad_dtype=torch.bfloat16,
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
              "lamb": fused_lamb}[rule]
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
