"""fused_adam_: the emulated CUDA launcher gives the CPU kernel's params,
moments, model copy and step bit for bit (both run amp_math.h's adam_update
in fp32), for every dtype combination the op admits, and skips the whole
step, step count included, when found_inf is set.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from _twins import (CPU, DTYPES, EMULATED, Entry, assert_bitwise_equal, assert_lists_equal,
                    dtype_id, entries_for, flag, twin_lists)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (param, grad) combinations validate_fused_adam admits without a model copy;
# with one, params are fp32 and the model copy is any of the three dtypes.
PARAM_GRAD = [(F32, F32), (F32, F16), (F32, BF16), (F16, F16), (BF16, BF16)]
MASTER_COPIES = list(itertools.product(DTYPES, DTYPES))  # (grad, model copy), fp32 params

ADAMW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
             bias_correction=True)


def combos(with_model_copy):
    if with_model_copy:
        return [(F32, grad, F32, F32, model) for grad, model in MASTER_COPIES]
    return [(param, grad, param, param) for param, grad in PARAM_GRAD]


class Twins:
    """The same optimizer state twice: .emulated and .cpu, each a dict of lists."""

    def __init__(self, entries, seed, grad_scale=1.0):
        depth = len(entries[0].dtypes)
        names = ["params", "grads", "exp_avgs", "exp_avg_sqs", "model_params"][:depth]
        self.entries = entries
        self.emulated, self.cpu = {"model_params": []}, {"model_params": []}
        for index, name in enumerate(names):
            scale = grad_scale if name == "grads" else 1.0
            emu, cpu = twin_lists(entries, index, seed + index, scale=scale,
                                  positive=name == "exp_avg_sqs")
            self.emulated[name], self.cpu[name] = emu, cpu
        self.emulated["step"], self.cpu["step"] = flag(3.0), flag(3.0)

    def step(self, hyper, inv_scale=None, found_inf=None):
        for ops, state in ((EMULATED, self.emulated), (CPU, self.cpu)):
            ops.fused_adam_(
                state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"],
                state["model_params"], [], [], state["step"], hyper["lr"], hyper["beta1"], hyper["beta2"],
                hyper["eps"], hyper["weight_decay"], hyper["adamw_mode"], hyper["bias_correction"],
                None if inv_scale is None else flag(inv_scale),
                None if found_inf is None else flag(found_inf))

    def assert_equal(self):
        for name in ("params", "exp_avgs", "exp_avg_sqs", "model_params"):
            assert_lists_equal(self.emulated[name], self.cpu[name], name, self.entries)
        assert_bitwise_equal(self.emulated["step"], self.cpu["step"], "step")


def test_adamw_with_model_copy_and_inv_scale_on_list_crossing_launches(limits):
    state = Twins(entries_for(limits, combos(with_model_copy=True)), seed=1, grad_scale=2.0**10)
    state.step(ADAMW, inv_scale=2.0**-10)
    state.step(ADAMW, inv_scale=2.0**-10)
    state.assert_equal()
    assert state.emulated["step"].item() == 5.0


def test_adam_without_model_copy_on_list_crossing_launches(limits):
    state = Twins(entries_for(limits, combos(with_model_copy=False)), seed=2)
    state.step(dict(ADAMW, adamw_mode=False))
    state.assert_equal()


@pytest.mark.parametrize("found_inf", [1.0, float("nan")], ids=["one", "nan"])
def test_found_inf_skips_the_whole_step(limits, found_inf):
    entries = entries_for(limits, combos(with_model_copy=True), many=False)
    state = Twins(entries, seed=3)
    before = {name: [t.clone() for t in tensors] for name, tensors in state.emulated.items()
              if name != "step"}
    state.step(ADAMW, inv_scale=0.5, found_inf=found_inf)
    state.assert_equal()
    for name, tensors in before.items():
        assert_lists_equal(state.emulated[name], tensors, f"{name} after a skipped step", entries)
    assert state.emulated["step"].item() == 3.0


@pytest.mark.slow
@pytest.mark.parametrize("with_model_copy", [False, True], ids=["no-copy", "model-copy"])
@pytest.mark.parametrize(
    "hyper",
    [ADAMW, dict(ADAMW, weight_decay=0.0), dict(ADAMW, adamw_mode=False),
     dict(ADAMW, adamw_mode=False, weight_decay=0.0, bias_correction=False),
     dict(ADAMW, lr=0.0), dict(ADAMW, eps=0.0, beta1=0.0, beta2=0.0)],
    ids=["adamw", "adamw-no-decay", "adam-l2", "adam-no-bias-correction", "lr-zero", "betas-zero"])
def test_every_configuration_and_dtype_combination(limits, with_model_copy, hyper):
    state = Twins(entries_for(limits, combos(with_model_copy), many=False), seed=4)
    for _ in range(2):
        state.step(hyper)
    state.assert_equal()


@pytest.mark.slow
@pytest.mark.parametrize("combo", combos(with_model_copy=False),
                         ids=lambda c: f"{dtype_id(c[0])}-params-{dtype_id(c[1])}-grads")
def test_one_dtype_combination_at_a_time(limits, combo):
    state = Twins(entries_for(limits, [combo]), seed=5, grad_scale=2.0**8)
    state.step(ADAMW, inv_scale=2.0**-8, found_inf=0.0)
    state.assert_equal()


@pytest.mark.slow
def test_fp32_model_copy_may_be_the_params_themselves(limits):
    entries = [Entry(n, (F32,) * 5, (1,) * 5) for n in (1, 7, limits.chunk_size + 3)]
    state = Twins([Entry(e.numel, e.dtypes[:4], e.offsets[:4]) for e in entries], seed=6)
    state.emulated["model_params"] = state.emulated["params"]
    state.cpu["model_params"] = state.cpu["params"]
    state.step(ADAMW)
    state.assert_equal()


@pytest.mark.slow
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=str)
def test_nonfinite_gradients_propagate_alike(limits, value):
    # Without found_inf the step runs, and inf/NaN flow into params and moments the same way.
    entries = [Entry(n, (F32, F16, F32, F32), (1, 1, 0, 0)) for n in (3, limits.chunk_size + 1)]
    state = Twins(entries, seed=7)
    for grads in (state.emulated["grads"], state.cpu["grads"]):
        grads[0][0], grads[1][-1] = value, value
    state.step(ADAMW)
    state.assert_equal()


@pytest.mark.slow
def test_empty_lists_still_count_the_step(limits):
    entries = [Entry(0, (F32,) * 4, (0,) * 4)] * 3
    state = Twins(entries, seed=8)
    state.step(ADAMW)
    state.assert_equal()
    assert state.emulated["step"].item() == 4.0
