"""Low-precision optimizer states and remainder masters (issue 27): the emulated CUDA launchers
against the CPU kernels, bit for bit.

Both sides read each state in fp32 (csrc/state_formats.h, restated for the device in
csrc/cuda/state_formats.cuh), run the rule's amp_math.h arithmetic and quantize each block from
its largest magnitude, so codes, absmaxes, params, remainders and model copies agree exactly: for
Adam, SGD (with and without momentum), Adagrad and NovoGrad (with the infinity norm: its L2 norm
is a sum whose order differs between the backends, test_fused_optimizers.py) x every state
format (bf16, fp8, int8 with the signed map or uint8 with the unsigned one, mixed within a
param) x remainder masters x grad dtypes x model copies x sizes (empty, one block, several
blocks, more than one chunk, block sizes 32 to 4096 in one launch, more tensors than a launch
takes), skipped steps, and blocks poisoned by inf/NaN or flushed below the smallest normal.
LAMB and NovoGrad with the L2 norm: see test_norm_based_rules_step_as_their_fp32_values_quantized_again.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from _twins import CPU, EMULATED, assert_bitwise_equal, flag, placed
from apex_amp.optimizers.state_formats import quantize, split_master

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the contract's recipe
import _state_steps as recipe  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
BLOCKED = (torch.float8_e4m3fn, torch.int8, torch.uint8)


def storage(fmt: str, nonnegative: bool) -> torch.dtype:
    return {"fp32": F32, "bf16": BF16, "fp8": torch.float8_e4m3fn,
            "int8": torch.uint8 if nonnegative else torch.int8}[fmt]


@dataclasses.dataclass
class Rule:
    name: str
    nonnegative: tuple[bool, ...]  # per state list: kept with the unsigned map

    def call(self, ops, t: "Step") -> None:
        s = t.states
        if self.name == "adam":
            ops.fused_adam_(t.params, t.grads, s[0], s[1], t.model, t.remainders, t.absmaxes, t.step, 1e-2, 0.9,
                            0.999, 1e-8, 0.01, True, True, t.inv_scale, t.found_inf)
        elif self.name == "adam-l2":
            ops.fused_adam_(t.params, t.grads, s[0], s[1], t.model, t.remainders, t.absmaxes, t.step, 1e-2, 0.9,
                            0.999, 1e-8, 0.01, False, True, t.inv_scale, t.found_inf)
        elif self.name == "sgd":
            ops.fused_sgd_(t.params, t.grads, s[0], t.model, t.remainders, t.absmaxes, 0.1, 0.9, 0.1, 0.01, False,
                           False, False, t.inv_scale, t.found_inf)
        elif self.name == "plain-sgd":
            ops.fused_sgd_(t.params, t.grads, [], t.model, t.remainders, t.absmaxes, 0.1, 0.0, 0.0, 0.01, False,
                           False, False, t.inv_scale, t.found_inf)
        elif self.name == "adagrad":
            ops.fused_adagrad_(t.params, t.grads, s[0], t.model, t.remainders, t.absmaxes, 0.1, 1e-10, 0.01, True,
                               t.inv_scale, t.found_inf)
        elif self.name == "novograd":
            ops.fused_novograd_(t.params, t.grads, s[0], t.moments, t.model, t.remainders, t.absmaxes, t.step,
                                1e-2, 0.95, 0.98, 1e-8, 0.01, True, True, False, 0, t.inv_scale, t.found_inf)
        else:
            raise AssertionError(self.name)


RULES = {r.name: r for r in (Rule("adam", (False, True)), Rule("adam-l2", (False, True)), Rule("sgd", (False,)),
                             Rule("plain-sgd", ()), Rule("adagrad", (True,)), Rule("novograd", (False,)))}
STATEFUL = ["adam", "sgd", "adagrad", "novograd"]


@dataclasses.dataclass
class Step:
    params: list[Tensor]
    grads: list[Tensor]
    states: list[list[Tensor]]
    model: list[Tensor]
    remainders: list[Tensor]
    absmaxes: list[Tensor]
    step: Tensor
    moments: list[Tensor]
    inv_scale: Tensor | None
    found_inf: Tensor | None

    def outputs(self) -> dict[str, list[Tensor]]:
        return {"params": self.params, **{f"state{k}": s for k, s in enumerate(self.states)}, "model": self.model,
                "remainders": self.remainders, "absmaxes": self.absmaxes, "step": [self.step],
                "moments": self.moments}


def _placed(t: Tensor, offset: int) -> Tensor:
    """A copy of t in an allocation that ends where it ends (AddressSanitizer sees any access past it)."""
    return placed(t.reshape(-1), offset).view(t.shape)


def make_step(rule: Rule, shapes, formats, *, blocks=None, grad_dtype=F32, model_dtype=None, remainder=False,
              seed=0, inv_scale=0.5, found_inf=None, offset=0, edit=None) -> Step:
    """One step's tensors, built alike for both backends: `formats[k]` the format of state list k,
    `blocks[i]` the block size of param i's blocked states (its rows' length by default); `edit`
    may change the fp32 values (masters, grads, states) before they are stored."""
    g = torch.Generator().manual_seed(seed)
    blocks = blocks or [shape[-1] for shape in shapes]
    masters = [torch.randn(shape, generator=g) for shape in shapes]
    grads = [torch.randn(shape, generator=g) * 2.0 for shape in shapes]
    values = [[(torch.randn(shape, generator=g) * 0.1 * (k + 1)) for shape in shapes]
              for k in range(len(rule.nonnegative))]
    values = [[v.abs() if rule.nonnegative[k] else v for v in vs] for k, vs in enumerate(values)]
    if edit is not None:
        edit(masters, grads, values)
    states, absmaxes = [], []
    for k, nonnegative in enumerate(rule.nonnegative):
        dtype = storage(formats[k], nonnegative)
        state, maxes = [], []
        for i, v in enumerate(values[k]):
            if v.numel() == 0 or dtype not in BLOCKED:
                codes, absmax = v.to(dtype), torch.zeros(0)
            else:
                codes, absmax = quantize(v, dtype, blocks[i])
            state.append(_placed(codes, offset))
            maxes.append(_placed(absmax.reshape(-1), offset) if absmax.numel() else absmax.reshape(-1))
        states.append(state)
        absmaxes.append(maxes)
    blocked = any(s.dtype in BLOCKED for state in states for s in state)
    if remainder:
        pairs = [split_master(m) for m in masters]
        params = [_placed(w, offset) for w, _ in pairs]
        remainders = [_placed(r, offset) for _, r in pairs]
    else:
        params, remainders = [_placed(m, offset) for m in masters], []
    return Step(params, [_placed(x.to(grad_dtype), offset) for x in grads], states,
                [_placed(m.to(model_dtype), offset) for m in masters] if model_dtype else [], remainders,
                [a for maxes in absmaxes for a in maxes] if blocked else [], flag(3.0),
                [torch.full((1,), 0.25) for _ in shapes],
                None if inv_scale is None else flag(inv_scale), None if found_inf is None else flag(found_inf))


def run_both(rule: Rule, steps: int = 2, **kwargs) -> tuple[Step, Step]:
    emulated, cpu = make_step(rule, **kwargs), make_step(rule, **kwargs)
    for _ in range(steps):
        rule.call(EMULATED, emulated)
        rule.call(CPU, cpu)
    assert_steps_equal(emulated, cpu)
    return emulated, cpu


def assert_steps_equal(emulated: Step, cpu: Step, what: str = "") -> None:
    for name, tensors in emulated.outputs().items():
        expected = cpu.outputs()[name]
        assert len(tensors) == len(expected), name
        for i, (a, b) in enumerate(zip(tensors, expected)):
            if a.dtype in BLOCKED or a.dtype == torch.int16:
                assert a.dtype == b.dtype and a.shape == b.shape
                differ = a.view(torch.uint8 if a.element_size() == 1 else torch.int16) != \
                    b.view(torch.uint8 if b.element_size() == 1 else torch.int16)
                assert not bool(differ.any()), (
                    f"{what}{name}[{i}]: {int(differ.sum())} of {a.numel()} codes differ, first at "
                    f"{int(differ.reshape(-1).nonzero()[0])}")
            else:
                assert_bitwise_equal(a, b, f"{what}{name}[{i}]")


BLOCK = 64
# One launch: nothing, one block, several blocks, more than one 4096-element chunk of the emulation.
SHAPES = [(0, BLOCK), (1, BLOCK), (3, BLOCK), (2 * 4096 // BLOCK + 3, BLOCK)]
FORMAT_PAIRS = {  # Adam's (exp_avg, exp_avg_sq)
    "bf16": ("bf16", "bf16"), "fp8": ("fp8", "fp8"), "int8": ("int8", "int8"),
    "fp8-int8": ("fp8", "int8"), "int8-bf16": ("int8", "bf16"), "fp32-int8": ("fp32", "int8"),
}


def formats_of(rule: Rule, name: str) -> tuple[str, ...]:
    return FORMAT_PAIRS[name][:len(rule.nonnegative)]


@pytest.mark.parametrize("fmt", list(FORMAT_PAIRS))
@pytest.mark.parametrize("rule", ["adam", "adam-l2"])
def test_adam_with_every_state_format_matches_bit_for_bit(rule, fmt):
    run_both(RULES[rule], shapes=SHAPES, formats=FORMAT_PAIRS[fmt], inv_scale=0.25)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("rule", ["sgd", "adagrad", "novograd"])
def test_single_state_rules_with_every_format_match_bit_for_bit(rule, fmt):
    run_both(RULES[rule], shapes=SHAPES, formats=formats_of(RULES[rule], fmt), inv_scale=0.25)


@pytest.mark.parametrize("grad_dtype", [F32, F16, BF16], ids=["f32-grads", "f16-grads", "bf16-grads"])
@pytest.mark.parametrize("model_dtype", [None, F32, F16, BF16], ids=["no-copy", "f32-copy", "f16-copy", "bf16-copy"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_grad_dtypes_and_model_copies_with_formatted_states(rule, model_dtype, grad_dtype):
    run_both(RULES[rule], shapes=[(1, 32), (5, 32)], formats=formats_of(RULES[rule], "fp8-int8"),
             grad_dtype=grad_dtype, model_dtype=model_dtype, seed=3)


@pytest.mark.parametrize("grad_dtype", [F32, F16, BF16], ids=["f32-grads", "f16-grads", "bf16-grads"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "fp8-int8"])
@pytest.mark.parametrize("rule", STATEFUL + ["plain-sgd"])
def test_remainder_masters_match_bit_for_bit(rule, fmt, grad_dtype):
    formats = ("fp32", "fp32") if fmt == "fp32" else FORMAT_PAIRS[fmt]
    run_both(RULES[rule], shapes=SHAPES, formats=formats[:len(RULES[rule].nonnegative)], remainder=True,
             grad_dtype=grad_dtype, seed=4)


def test_block_sizes_from_32_to_4096_in_one_launch_and_misaligned_tensors():
    shapes = [(2, 32), (3, 128), (2, 256), (1, 1024), (2, 4096), (3, 4096)]
    for offset in (0, 1, 3):
        run_both(RULES["adam"], shapes=shapes, formats=("int8", "fp8"), offset=offset, seed=5)


def test_more_tensors_than_one_launch_takes(limits):
    shapes = [(1 + k % 3, 32) for k in range(limits.tensors_per_launch(5) + 8)]
    run_both(RULES["adam"], shapes=shapes, formats=("fp8", "int8"), remainder=True, seed=6)


@pytest.mark.parametrize("remainder", [False, True], ids=["fp32-masters", "remainders"])
@pytest.mark.parametrize("found_inf", [1.0, float("nan")], ids=["one", "nan"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_a_skipped_step_writes_nothing(rule, found_inf, remainder):
    kwargs = dict(shapes=[(3, BLOCK), (70, BLOCK)], formats=formats_of(RULES[rule], "fp8-int8"),
                  remainder=remainder, found_inf=found_inf, seed=7)
    emulated, before = make_step(RULES[rule], **kwargs), make_step(RULES[rule], **kwargs)
    RULES[rule].call(EMULATED, emulated)
    assert_steps_equal(emulated, before, "after a skipped step: ")
    cpu = make_step(RULES[rule], **kwargs)
    RULES[rule].call(CPU, cpu)
    assert_steps_equal(emulated, cpu)


def _poison(masters, grads, values):
    """Tensor 1: an inf gradient in block 0, a NaN one in block 2; tensor 0: its first block's
    states and gradients all zero (flushed: absmax 0) and its second block's far below the
    smallest normal fp32 (flushed too)."""
    grads[1].view(-1)[5] = float("inf")
    grads[1].view(-1)[2 * BLOCK + 7] = float("nan")
    grads[0].view(-1)[:BLOCK] = 0.0
    grads[0].view(-1)[BLOCK:2 * BLOCK] = 1e-41
    for v in values:
        v[0].view(-1)[:BLOCK] = 0.0
        v[0].view(-1)[BLOCK:2 * BLOCK] = 3e-40


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("rule", STATEFUL)
def test_poisoned_and_flushed_blocks_match_bit_for_bit(rule, fmt):
    emulated, _ = run_both(RULES[rule], steps=1, shapes=[(3, BLOCK), (4, BLOCK)],
                           formats=formats_of(RULES[rule], fmt), edit=_poison, inv_scale=1.0, seed=8)
    if fmt != "bf16" and rule != "novograd":  # (NovoGrad's norm spreads a non-finite gradient over its tensor)
        # The poisoned blocks' absmax is inf (block 0) or NaN (block 2), the block between them finite.
        absmax = emulated.absmaxes[1]
        assert not bool(absmax[0].isfinite()) and bool(absmax[2].isnan()) and bool(absmax[1].isfinite())


# NovoGrad's L2 norm and LAMB's norms are sums whose order differs between the backends: there the
# contract's own recipe (tests/_state_steps.py) runs on the emulated launchers, against themselves:
# formatted states step as their dequantized fp32 values quantized again, remainder masters as their
# joined fp32 masters split again, bit for bit; and the params stay within the sums' rounding of the
# CPU kernels'.
@pytest.mark.parametrize("remainder", [False, True], ids=["fp32-masters", "remainders"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("rule", ["lamb", "lamb-passes", "novograd"], ids=["lamb", "lamb-passes", "novograd-l2"])
def test_norm_based_rules_step_as_their_fp32_values_quantized_again(rule, fmt, remainder):
    shapes = [(0, BLOCK), (1, BLOCK), (3, BLOCK), (2 * 4096 // BLOCK + 3, BLOCK)]
    op = recipe.RULES[rule]
    formatted = recipe.make_step(op, shapes, fmt, BLOCK, remainder=remainder, seed=9)
    twin = recipe.fp32_twin(formatted)
    op.call(EMULATED, formatted)
    op.call(EMULATED, twin)
    recipe.assert_bitwise_equal(
        formatted, recipe.expected_from_twin(recipe.make_step(op, shapes, fmt, BLOCK, remainder=remainder, seed=9),
                                             twin))
    cpu = recipe.make_step(op, shapes, fmt, BLOCK, remainder=remainder, seed=9)
    op.call(CPU, cpu)
    for a, b in zip(recipe.fp32_twin(formatted).params, recipe.fp32_twin(cpu).params, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("rule", ["lamb", "lamb-passes"])
@pytest.mark.parametrize("remainder", [False, True], ids=["fp32-masters", "remainders"])
@pytest.mark.parametrize("found_inf", [1.0, float("nan")], ids=["one", "nan"])
def test_a_skipped_lamb_step_writes_nothing(found_inf, remainder, rule):
    op = recipe.RULES[rule]
    kwargs = dict(remainder=remainder, found_inf=found_inf, seed=10)
    stepped = recipe.make_step(op, [(3, BLOCK), (70, BLOCK)], "int8", BLOCK, **kwargs)
    op.call(EMULATED, stepped)
    recipe.assert_bitwise_equal(stepped, recipe.make_step(op, [(3, BLOCK), (70, BLOCK)], "int8", BLOCK, **kwargs))
