"""One step of each fused optimizer op with its states in any format, and the spec's bitwise recipe.

The recipe (issue 27's contract): run the op with blocked (or bf16) states; run it again on
copies whose states are ``dequantize(codes, absmax)`` in fp32 (the op's fp32-state path); then
``quantize(fp32 result, dtype, B)`` must equal the first run's codes and absmaxes exactly, and
the params (and model copies, step counts, NovoGrad's norms) must be equal exactly. Remainder
masters likewise: a bf16 weight with its remainder against ``join_master`` of them as an fp32
master, whose updated value ``split_master`` must give back the weight and remainder.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import Tensor

from apex_amp.optimizers.state_formats import dequantize, join_master, quantize, split_master

FORMATS = ("fp32", "bf16", "fp8", "int8")
BLOCKED = (torch.float8_e4m3fn, torch.int8, torch.uint8)


def storage(fmt: str, nonnegative: bool) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
            "int8": torch.uint8 if nonnegative else torch.int8}[fmt]


@dataclasses.dataclass
class Step:
    """The tensors of one fused step; ``states[k][i]`` is state list k of param i."""

    params: list[Tensor]
    grads: list[Tensor]
    states: list[list[Tensor]]
    model: list[Tensor]
    remainders: list[Tensor]
    absmaxes: list[Tensor]
    step: Tensor
    moments: list[Tensor]  # NovoGrad's per-tensor norms
    inv_scale: Optional[Tensor]
    found_inf: Optional[Tensor]

    def outputs(self) -> list[Tensor]:
        return [*self.params, *(s for state in self.states for s in state), *self.model, *self.remainders,
                *self.absmaxes, self.step, *self.moments]

    def clone(self) -> "Step":
        def c(ts):
            return [t.clone() for t in ts]
        return Step(c(self.params), c(self.grads), [c(s) for s in self.states], c(self.model), c(self.remainders),
                    c(self.absmaxes), self.step.clone(), c(self.moments),
                    None if self.inv_scale is None else self.inv_scale.clone(),
                    None if self.found_inf is None else self.found_inf.clone())


@dataclasses.dataclass(frozen=True)
class Rule:
    """An op: which of its state lists are never negative, and how to call it."""

    name: str
    nonnegative: tuple[bool, ...]
    call: Callable[[object, Step], None]


def _adam(ns, t: Step) -> None:
    ns.fused_adam_(t.params, t.grads, t.states[0], t.states[1], t.model, t.remainders, t.absmaxes, t.step,
                   1e-2, 0.9, 0.999, 1e-8, 0.01, True, True, t.inv_scale, t.found_inf)


def _sgd(ns, t: Step) -> None:
    ns.fused_sgd_(t.params, t.grads, t.states[0], t.model, t.remainders, t.absmaxes, 0.1, 0.9, 0.1, 0.01, False,
                  False, False, t.inv_scale, t.found_inf)


def _plain_sgd(ns, t: Step) -> None:
    ns.fused_sgd_(t.params, t.grads, [], t.model, t.remainders, t.absmaxes, 0.1, 0.0, 0.0, 0.01, False, False,
                  False, t.inv_scale, t.found_inf)


def _adagrad(ns, t: Step) -> None:
    ns.fused_adagrad_(t.params, t.grads, t.states[0], t.model, t.remainders, t.absmaxes, 0.1, 1e-10, 0.01, False,
                      t.inv_scale, t.found_inf)


def _novograd(ns, t: Step) -> None:
    ns.fused_novograd_(t.params, t.grads, t.states[0], t.moments, t.model, t.remainders, t.absmaxes, t.step, 1e-2,
                       0.95, 0.98, 1e-8, 0.01, True, True, False, 2, t.inv_scale, t.found_inf)


def _lamb(ns, t: Step) -> None:
    grad_norm = torch.stack([g.float().norm() for g in t.grads]).norm().reshape(1) if t.grads else torch.ones(1)
    ns.fused_lamb_(t.params, t.grads, t.states[0], t.states[1], t.model, t.remainders, t.absmaxes, t.step,
                   grad_norm, 1e-2, 0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0, False, t.inv_scale, t.found_inf)


def _lamb_passes(ns, t: Step) -> None:
    # fused_lamb_ as FSDP2 runs it: the first pass's squared norms handed to the second.
    grad_norm = torch.stack([g.float().norm() for g in t.grads]).norm().reshape(1) if t.grads else torch.ones(1)
    lists = (t.params, t.grads, t.states[0], t.states[1], t.model, t.remainders, t.absmaxes, t.step, grad_norm)
    moments = (0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0)
    norm_squares = ns.fused_lamb_moments_(*lists, *moments, t.inv_scale, t.found_inf)
    ns.fused_lamb_update_(*lists, norm_squares, 1e-2, *moments, False, t.inv_scale, t.found_inf)


RULES = {
    "adam": Rule("adam", (False, True), _adam),
    "sgd": Rule("sgd", (False,), _sgd),
    "plain_sgd": Rule("plain_sgd", (), _plain_sgd),
    "adagrad": Rule("adagrad", (True,), _adagrad),
    "novograd": Rule("novograd", (False,), _novograd),
    "lamb": Rule("lamb", (False, True), _lamb),
    "lamb-passes": Rule("lamb-passes", (False, True), _lamb_passes),
}


def make_step(rule: Rule, shapes, fmt: str, block: int, *, grad_dtype=torch.float32, model_dtype=None,
              remainder=False, seed=0, inv_scale=0.5, found_inf=None, poison=None) -> Step:
    """A step whose states hold random values already in ``fmt`` (so that the fp32 twin holds them exactly).

    poison: (param index, element) whose gradient is NaN.
    """
    g = torch.Generator().manual_seed(seed)
    masters = [torch.randn(shape, generator=g) for shape in shapes]
    grads = [(torch.randn(shape, generator=g) * 2.0).to(grad_dtype) for shape in shapes]
    if poison is not None:
        grads[poison[0]].view(-1)[poison[1]] = float("nan")
    states, absmaxes = [], []
    for k, nonnegative in enumerate(rule.nonnegative):
        dtype = storage(fmt, nonnegative)
        state, maxes = [], []
        for shape in shapes:
            values = torch.randn(shape, generator=g) * 0.1 * (k + 1)
            values = values.abs() if nonnegative else values
            if values.numel() == 0:  # (state_formats.quantize cannot shape the absmax of 0 rows)
                codes, absmax = values.to(dtype), torch.zeros(0)
            else:
                codes, absmax = quantize(values, dtype, block if dtype in BLOCKED else None)
            state.append(codes)
            maxes.append(absmax.reshape(-1) if absmax is not None else torch.zeros(0))
        states.append(state)
        absmaxes.append(maxes)
    any_blocked = any(s.dtype in BLOCKED for state in states for s in state)
    flat_absmaxes = [a for maxes in absmaxes for a in maxes] if any_blocked else []
    if remainder:
        pairs = [split_master(m) for m in masters]
        params, remainders = [w for w, _ in pairs], [r for _, r in pairs]
    else:
        params, remainders = masters, []
    model = [m.to(model_dtype) for m in masters] if model_dtype is not None else []
    moments = [torch.full((1,), -1.0) for _ in shapes]
    return Step(params, grads, states, model, remainders, flat_absmaxes, torch.zeros(1), moments,
                None if inv_scale is None else torch.full((1,), inv_scale),
                None if found_inf is None else torch.full((1,), found_inf))


def fp32_twin(t: Step) -> Step:
    """The same step with fp32 masters and states: the values the formats hold, read by dequantize/join."""
    twin = t.clone()
    count = len(t.params)
    for k, state in enumerate(twin.states):
        for i, s in enumerate(state):
            if s.dtype in BLOCKED and s.numel() > 0:
                twin.states[k][i] = dequantize(s, t.absmaxes[k * count + i])
            else:
                twin.states[k][i] = s.float()
    if t.remainders:
        twin.params = [join_master(w, r) for w, r in zip(t.params, t.remainders)]
        twin.remainders = []
    twin.absmaxes = []
    return twin


def expected_from_twin(t: Step, twin: Step) -> Step:
    """What the formatted step must hold after the op, from the fp32 twin's result (the recipe)."""
    want = t.clone()
    count = len(t.params)
    for k, state in enumerate(t.states):
        for i, s in enumerate(state):
            if s.numel() == 0:
                continue
            if s.dtype in BLOCKED:
                absmax = t.absmaxes[k * count + i]
                codes, new_absmax = quantize(twin.states[k][i], s.dtype, s.numel() // absmax.numel())
                want.states[k][i], want.absmaxes[k * count + i] = codes, new_absmax.reshape(-1)
            else:
                want.states[k][i] = twin.states[k][i].to(s.dtype)
    if t.remainders:
        pairs = [split_master(m) for m in twin.params]
        want.params, want.remainders = [w for w, _ in pairs], [r for _, r in pairs]
    else:
        want.params = twin.params
    want.model, want.step, want.moments = twin.model, twin.step, twin.moments
    return want


def bits(t: Tensor) -> Tensor:
    """The bit pattern of each element (NaNs compare by their bits)."""
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    return t


def assert_bitwise_equal(got: Step, want: Step) -> None:
    """Every output equal bit for bit (a NaN of fp32 or bf16 may differ from another NaN in its payload)."""
    for a, b in zip(got.outputs(), want.outputs(), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        differ = bits(a) != bits(b)
        if a.dtype in (torch.float32, torch.bfloat16):
            differ &= ~(a.isnan() & b.isnan())
        if bool(differ.any()):
            differs = differ.nonzero()
            raise AssertionError(f"{a.dtype} {tuple(a.shape)}: {differs.shape[0]} elements differ, first at "
                                 f"{differs[0].tolist()}: {a[tuple(differs[0])]} vs {b[tuple(differs[0])]}")


class WithRounding:
    """An ops namespace whose fused ops receive ``state_rounding=rows`` (stochastic rounding's op argument)."""

    def __init__(self, namespace, rows):
        self.namespace, self.rows = namespace, rows

    def __getattr__(self, name):
        op = getattr(self.namespace, name)
        return lambda *args: op(*args, state_rounding=self.rows)
