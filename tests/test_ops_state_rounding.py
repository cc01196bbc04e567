"""Stochastic rounding of bf16 states in the fused optimizer ops (their ``state_rounding`` argument).

The recipe of tests/_state_steps.py with one change: a bf16 state of an fp32 or remainder master,
given ``state_rounding`` rows (stream key, index of the tensor's first element in the whole
parameter), must hold ``state_formats.round_bf16_stochastic`` of the fp32-state step's value, bit
for bit, on each backend: the CPU kernels and the pure-PyTorch fallback draw the reference's bits.
"""

from __future__ import annotations

import pytest
import torch

import _state_steps as steps
from _backends import BACKENDS, namespace_of
from _errors import raises_naming
from apex_amp import ops
from apex_amp.optimizers.state_formats import round_bf16_stochastic, rounding_key

STATEFUL = ("adam", "sgd", "adagrad", "novograd", "lamb")
BLOCK = 64
SHAPES = [(33, BLOCK), (7, 2 * BLOCK), (0, BLOCK)]
BIG = [(1100, BLOCK)]  # 70400 elements: five work units, shared among the threads


def rounding_rows(count: int, seed: int = 3, counter: int = 7, offsets=None) -> torch.Tensor:
    offsets = offsets or [1000 * i for i in range(count)]  # as if each tensor were a shard
    return torch.tensor([[rounding_key(seed, counter, i), offsets[i]] for i in range(count)], dtype=torch.int64)


def stochastic_step(ns, rule, shapes, rows, **kwargs):
    """The recipe: (the step run with rounding rows, what it must hold)."""
    formatted = steps.make_step(rule, shapes, "bf16", BLOCK, **kwargs)
    twin = steps.fp32_twin(formatted)
    rule.call(steps.WithRounding(ns, rows), formatted)
    rule.call(ns, twin)
    want = steps.expected_from_twin(steps.make_step(rule, shapes, "bf16", BLOCK, **kwargs), twin)
    for k, state in enumerate(want.states):
        for i, s in enumerate(state):
            if s.dtype == torch.bfloat16 and s.numel() > 0:
                state[i] = round_bf16_stochastic(twin.states[k][i], rows[i, 0], k, rows[i, 1])
    return formatted, want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("remainder", [False, True], ids=["fp32-masters", "remainders"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_bf16_states_round_as_the_reference_stochastic_rounding(backend, rule, remainder):
    ns = namespace_of(backend)
    got, want = stochastic_step(ns, steps.RULES[rule], SHAPES, rounding_rows(len(SHAPES)),
                                grad_dtype=torch.bfloat16, remainder=remainder, seed=21)
    steps.assert_bitwise_equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["adam", "sgd"])
def test_stochastic_rounding_is_not_round_to_nearest_even(backend, rule):
    # The recipe above cannot pass by rounding to nearest: a good share of the states differ from it.
    ns, rule = namespace_of(backend), steps.RULES[rule]
    got, _ = stochastic_step(ns, rule, SHAPES, rounding_rows(len(SHAPES)), seed=22)
    nearest = steps.make_step(rule, SHAPES, "bf16", BLOCK, seed=22)
    rule.call(ns, nearest)
    differing = sum(int((a != b).sum()) for a, b in zip(got.states[0], nearest.states[0]))
    assert differing > 0.2 * sum(s.numel() for s in got.states[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_bits_follow_the_global_element_index_so_a_shard_rounds_as_the_whole(backend):
    # One (8, 64) parameter, whole, against its two 4-row shards with their first-element offsets.
    ns = namespace_of(backend)
    rule = steps.RULES["adam"]
    whole, _ = stochastic_step(ns, rule, [(8, BLOCK)], rounding_rows(1, offsets=[0]), seed=23)
    full = steps.make_step(rule, [(8, BLOCK)], "bf16", BLOCK, seed=23)
    for first in (0, 4):
        shard = steps.Step([p[first:first + 4].clone() for p in full.params],
                           [g[first:first + 4].clone() for g in full.grads],
                           [[s[first:first + 4].clone() for s in state] for state in full.states],
                           [], [], [], full.step.clone(), [m.clone() for m in full.moments], full.inv_scale,
                           full.found_inf)
        rule.call(steps.WithRounding(ns, rounding_rows(1, offsets=[first * BLOCK])), shard)
        for k in range(2):
            assert torch.equal(shard.states[k][0].view(torch.int16),
                               whole.states[k][0][first:first + 4].view(torch.int16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_skipped_step_writes_no_stochastically_rounded_state(backend):
    ns = namespace_of(backend)
    formatted = steps.make_step(steps.RULES["adam"], SHAPES, "bf16", BLOCK, found_inf=1.0, seed=24)
    before = formatted.clone()
    steps.RULES["adam"].call(steps.WithRounding(ns, rounding_rows(len(SHAPES))), formatted)
    steps.assert_bitwise_equal(formatted, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_states_in_their_params_dtype_ignore_the_rounding_rows(backend):
    # bf16 params without a master keep bf16 state in their own dtype: rounded to nearest, as before.
    ns = namespace_of(backend)
    params = [torch.randn(4, BLOCK).bfloat16()]
    grads = [torch.randn(4, BLOCK).bfloat16()]
    states = [[torch.randn(4, BLOCK).bfloat16() * 0.1], [torch.rand(4, BLOCK).bfloat16() * 0.1]]
    plain = [[t.clone() for t in params], [t.clone() for t in grads], [[s.clone() for s in k] for k in states]]
    ns.fused_adam_(params, grads, *states, [], [], [], torch.zeros(1), 1e-2, 0.9, 0.999, 1e-8, 0.0, True, True,
                   state_rounding=rounding_rows(1))
    ns.fused_adam_(plain[0], plain[1], *plain[2], [], [], [], torch.zeros(1), 1e-2, 0.9, 0.999, 1e-8, 0.0, True,
                   True)
    assert all(torch.equal(a, b) for a, b in zip([*params, *states[0], *states[1]],
                                                  [*plain[0], *plain[2][0], *plain[2][1]]))


@pytest.mark.slow
@pytest.mark.parametrize("rule", STATEFUL)
def test_the_kernels_draw_the_same_bits_on_any_thread_count(rule):
    ns = namespace_of("extension")
    results = []
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got, want = stochastic_step(ns, steps.RULES[rule], BIG, rounding_rows(1), seed=25)
        finally:
            torch.set_num_threads(previous)
        steps.assert_bitwise_equal(got, want)
        results.append(got)
    steps.assert_bitwise_equal(*results)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows, why", [
    (torch.zeros(2, 2, dtype=torch.int32), "int32"),
    (torch.zeros(3, 2, dtype=torch.int64), "one row too many"),
    (torch.zeros(2, 3, dtype=torch.int64), "three columns"),
    (None, "not contiguous"),
], ids=["int32", "rows", "columns", "strided"])
def test_malformed_rounding_rows_are_refused_naming_state_rounding(backend, rows, why):
    ns = namespace_of(backend)
    params, grads = [torch.ones(64), torch.ones(64)], [torch.ones(64), torch.ones(64)]
    states = [[torch.zeros(64, dtype=torch.bfloat16) for _ in range(2)] for _ in range(2)]
    rows = rows if rows is not None else torch.zeros(2, 4, dtype=torch.int64)[:, ::2]
    with raises_naming("fused_adam_", "state_rounding"):
        ns.fused_adam_(params, grads, *states, [], [], [], torch.zeros(1), 1e-2, 0.9, 0.999, 1e-8, 0.0, True, True,
                       state_rounding=rows)


def test_the_public_adam_wrapper_hands_state_rounding_to_the_op():
    with raises_naming("fused_adam_", "state_rounding"):
        ops.fused_adam_([torch.ones(64)], [torch.ones(64)], [torch.zeros(64, dtype=torch.bfloat16)],
                        [torch.zeros(64, dtype=torch.bfloat16)], torch.zeros(1), lr=0.1, beta1=0.9, beta2=0.99,
                        eps=1e-8, state_rounding=torch.zeros(3, 2, dtype=torch.int64))


class _Recorder:
    """Stands in for an ops namespace: records the op and arguments a call would pass."""

    def __getattr__(self, op_name):
        def record(*args):
            self.op_name, self.args = op_name, list(args)
        return record


def _rounding_samples():
    for rule in STATEFUL:
        for remainder in (False, True):
            step = steps.make_step(steps.RULES[rule], [(3, BLOCK), (2, 2 * BLOCK)], "bf16", BLOCK,
                                   grad_dtype=torch.bfloat16, remainder=remainder, seed=90)
            recorder = _Recorder()
            steps.RULES[rule].call(recorder, step)
            yield recorder.op_name, f"{rule}{'-remainder' if remainder else ''}", [*recorder.args, rounding_rows(2)]


ROUNDING_SAMPLES = list(_rounding_samples())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("op_name", "args"), [s[::2] for s in ROUNDING_SAMPLES],
                         ids=[f"{s[0]}-{s[1]}" for s in ROUNDING_SAMPLES])
def test_opcheck_with_state_rounding(backend, op_name, args):
    torch.library.opcheck(getattr(namespace_of(backend), op_name).default, args)
