"""Fault-injection fuzz: random inf/NaN in gradients, losses and input data over 2 models, 2 optimizers, 2 losses.

Every step of a seeded random run trains two models with two optimizers and
two losses:

* loss 0 runs through model A only (optimizer A, ``loss_id=0``);
* loss 1 runs through models A and B (optimizers A and B, ``loss_id=1``),
  so its gradients are accumulated onto loss 0's in model A, at another scale.

At random steps a fault is planted in one loss: an inf/-inf/NaN written into
one element of one parameter's gradient while its backward runs (a tensor
hook), the loss itself multiplied by inf/NaN, or a NaN/inf placed in that
loss's input batch. The test keeps its own books of what it planted and
checks after every step:

* no weight, master weight or optimizer state holds a non-finite value;
* an optimizer's step is skipped exactly when a loss that reaches it was
  faulty (A: loss 0 or loss 1; B: loss 1), and a skipped step changes none of
  its weights, masters or state (bit for bit);
* each loss's scale equals a plain-Python rendition of the scaling rules.

The models are tiny (fp16 matrix products are very slow on CPU), and the
scales are capped low (``max_loss_scale=2**10``) so that a real gradient can
never overflow fp16: every non-finite value is one the test planted.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Optional

import pytest
import torch
from torch import nn

import _reference as ref
from apex_amp import amp
from apex_amp.optimizers import FusedAdam

BAD_VALUES = (math.inf, -math.inf, math.nan)
FAULT_KINDS = ("grad", "loss", "data")
FAULT_PROBABILITY = 0.15  # per loss and step
# Bursts of faults drive a dynamic scale down to its floor: one starts at a step with this probability.
BURST_PROBABILITY, BURST_FAULT_PROBABILITY, BURST_LENGTH = 0.01, 0.95, (15, 30)
MIN_SCALE, MAX_SCALE, WINDOW = 2.0**-3, 2.0**10, 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@dataclasses.dataclass(frozen=True)
class Config:
    level: str
    half: torch.dtype
    extra: tuple = ()  # more initialize() keywords, as (name, value) pairs

    @property
    def dynamic(self) -> bool:
        # The level table's rule: fp16 O1/O2 scale dynamically; bf16 and O3 keep a static 1.0
        # unless loss_scale="dynamic" is asked for explicitly.
        options = dict(self.extra)
        if "loss_scale" in options:
            return options["loss_scale"] == "dynamic"
        return self.level in ("O1", "O2") and self.half == torch.float16

    @property
    def hysteresis(self) -> int:
        return dict(self.extra).get("hysteresis", 1)

    def __str__(self) -> str:
        options = ",".join(f"{k}={v}" for k, v in self.extra)
        return f"{self.level}-{str(self.half).split('.')[-1]}" + (f"-{options}" if options else "")


CONFIGS = [
    Config("O1", torch.float16),
    Config("O1", torch.bfloat16),
    Config("O2", torch.float16, (("hysteresis", 2),)),
    Config("O2", torch.bfloat16, (("loss_scale", "dynamic"),)),
    Config("O3", torch.float16, (("skip_nonfinite", True),)),
    Config("O3", torch.bfloat16, (("skip_nonfinite", True),)),
]


def reference_scales(overflows: list[bool], dynamic: bool, hysteresis: int) -> list[float]:
    """The scale after each step: tests/_reference.py's rule with this file's constants."""
    if not dynamic:
        return [1.0] * len(overflows)
    rule = ref.ScaleRule(growth_interval=WINDOW, hysteresis=hysteresis, min_scale=MIN_SCALE, max_scale=MAX_SCALE)
    return ref.scale_trajectory(overflows, min(2.0**16, MAX_SCALE), rule)


@dataclasses.dataclass
class Fault:
    kind: str  # one of FAULT_KINDS
    value: float
    param_index: int = 0  # "grad": which parameter the loss reaches
    flat_index: int = 0  # "grad": which element (modulo the size); "data": which input element


class GradientInjector:
    """Tensor hooks on every parameter that plant the current fault into the gradient being computed."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.target: Optional[tuple[torch.Tensor, int, float]] = None
        self.fired = 0
        self.handles = [p.register_hook(self._hook_for(p)) for p in params]

    def _hook_for(self, param: torch.Tensor):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if self.target is None or self.target[0] is not param:
                return grad
            _, flat_index, value = self.target
            grad = grad.clone()
            grad.view(-1)[flat_index % grad.numel()] = value
            self.fired += 1
            return grad

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def make_models(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    # Tanh, not ReLU: ReLU's backward would zero a planted inf instead of passing it on.
    model_a = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    model_b = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    return model_a, model_b


def snapshot(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in params]
    for state in optimizer.state.values():
        tensors += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    # A skipped first step may create FusedAdam's state lazily: it must still hold its initial zeros.
    return bitwise_equal(before, after[: len(before)]) and all(not t.any() for t in after[len(before):])


def non_finite_tensors(named: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, t in named.items() if t.is_floating_point() and not torch.isfinite(t).all()]


def plan_faults(rng: random.Random, steps: int, reach: list[int]) -> list[dict[int, Fault]]:
    """For each step, the faults of each loss (loss_id -> Fault); ``reach[i]``: parameters loss i reaches."""
    plan, burst_left = [], 0
    first_burst = rng.randrange(steps // 2)  # at least one, so that short runs reach the floor too
    for step in range(steps):
        if step == first_burst or (burst_left == 0 and rng.random() < BURST_PROBABILITY):
            burst_left = rng.randint(*BURST_LENGTH)
        probability = BURST_FAULT_PROBABILITY if burst_left else FAULT_PROBABILITY
        burst_left = max(burst_left - 1, 0)
        faults = {}
        for loss_id, num_params in enumerate(reach):
            if rng.random() < probability:
                faults[loss_id] = Fault(
                    kind=rng.choice(FAULT_KINDS),
                    value=rng.choice(BAD_VALUES),
                    param_index=rng.randrange(num_params),
                    flat_index=rng.randrange(1 << 16),
                )
        plan.append(faults)
    return plan


def run_fuzz(config: Config, steps: int, seed: int) -> dict[str, int]:
    model_a, model_b = make_models(seed)
    opt_a = FusedAdam(model_a.parameters(), lr=1e-3, weight_decay=1e-3)
    opt_b = (
        torch.optim.SGD(model_b.parameters(), lr=1e-2, momentum=0.9)
        if config.level == "O3"  # torch Adam's eps underflows in an fp16 state: SGD for a half model
        else torch.optim.Adam(model_b.parameters(), lr=1e-3)
    )
    amp.initialize(
        [model_a, model_b], [opt_a, opt_b], opt_level=config.level, half_dtype=config.half, num_losses=2,
        verbosity=0, min_loss_scale=MIN_SCALE, max_loss_scale=MAX_SCALE, scale_window=WINDOW,
        **dict(config.extra),
    )
    # Taken once: master_params() must not be what changes the gradients between steps.
    masters_a, masters_b = list(amp.master_params(opt_a)), list(amp.master_params(opt_b))
    weights_a, weights_b = list(model_a.parameters()), list(model_b.parameters())
    own_a, own_b = weights_a + masters_a, weights_b + masters_b
    reach = [weights_a, weights_a + weights_b]  # the parameters each loss's backward reaches
    injector = GradientInjector(weights_a + weights_b)
    rng = random.Random(seed)
    plan = plan_faults(rng, steps, [len(r) for r in reach])
    data = torch.Generator().manual_seed(seed)
    # Per loss: the scale after each step, from whether that step's gradients were made non-finite.
    expected_scales = [
        reference_scales([loss_id in faults for faults in plan], config.dynamic, config.hysteresis)
        for loss_id in (0, 1)
    ]
    counts = {"steps": steps, "skipped_a": 0, "skipped_b": 0, "faults": 0, "at_floor": 0, "at_cap": 0}

    try:
        for step, faults in enumerate(plan):
            before_a, before_b = snapshot(own_a, opt_a), snapshot(own_b, opt_b)
            opt_a.zero_grad()
            opt_b.zero_grad()
            inputs = [torch.randn(8, 5, generator=data) for _ in range(2)]
            targets = torch.randint(0, 3, (8,), generator=data), torch.randn(8, 3, generator=data)
            for loss_id, fault in faults.items():
                if fault.kind == "data":
                    inputs[loss_id].view(-1)[fault.flat_index % inputs[loss_id].numel()] = fault.value
            for loss_id in (0, 1):
                if loss_id == 0:
                    loss = nn.functional.cross_entropy(model_a(inputs[0]).float(), targets[0])
                    optimizers = opt_a
                else:
                    out = model_a(inputs[1]).float() + model_b(inputs[1]).float()
                    loss = nn.functional.mse_loss(out, targets[1])
                    optimizers = [opt_a, opt_b]
                fault = faults.get(loss_id)
                if fault is not None and fault.kind == "loss":
                    loss = loss * fault.value
                injector.target = None
                if fault is not None and fault.kind == "grad":
                    injector.target = (reach[loss_id][fault.param_index], fault.flat_index, fault.value)
                fired_before = injector.fired
                with amp.scale_loss(loss, optimizers, loss_id=loss_id) as scaled_loss:
                    scaled_loss.backward()
                injector.target = None
                if fault is not None and fault.kind == "grad":
                    assert injector.fired == fired_before + 1, "the planted gradient fault never fired"
            opt_a.step()
            opt_b.step()

            where = f"{config} seed {seed} step {step} faults {faults}"
            bad_a, bad_b = 0 in faults or 1 in faults, 1 in faults
            assert amp.step_was_skipped(opt_a) == bad_a, where
            assert amp.step_was_skipped(opt_b) == bad_b, where
            after_a, after_b = snapshot(own_a, opt_a), snapshot(own_b, opt_b)
            for name, skipped, before, after in (("A", bad_a, before_a, after_a), ("B", bad_b, before_b, after_b)):
                assert unchanged(before, after) == skipped, f"optimizer {name} skipped={skipped}: {where}"
            state = {f"opt_a.{i}.{k}": v for i, s in enumerate(opt_a.state.values()) for k, v in s.items()
                     if isinstance(v, torch.Tensor)}
            state |= {f"opt_b.{i}.{k}": v for i, s in enumerate(opt_b.state.values()) for k, v in s.items()
                      if isinstance(v, torch.Tensor)}
            state |= {f"weight_a{i}": p for i, p in enumerate(weights_a)}
            state |= {f"weight_b{i}": p for i, p in enumerate(weights_b)}
            state |= {f"master_a{i}": p for i, p in enumerate(masters_a)}
            state |= {f"master_b{i}": p for i, p in enumerate(masters_b)}
            assert not non_finite_tensors(state), f"non-finite {non_finite_tensors(state)}: {where}"
            for loss_id in (0, 1):
                expected = expected_scales[loss_id][step]
                assert amp.loss_scale(loss_id) == expected, f"loss {loss_id}: {where}"
                counts["at_floor"] += expected == MIN_SCALE
                counts["at_cap"] += expected == MAX_SCALE
            counts["skipped_a"] += bad_a
            counts["skipped_b"] += bad_b
            counts["faults"] += len(faults)
    finally:
        injector.remove()
    saved = amp.state_dict()
    for loss_id in (0, 1):
        assert saved[f"loss_scaler{loss_id}"]["overflows"] == sum(loss_id in faults for faults in plan)
    return counts


def test_reference_scale_rules_by_hand():
    overflows = [False, False, False, True, True, False, False, False]
    # Hand-computed: start at MAX_SCALE=1024; grows are capped; two overflows halve twice; 3 clean steps double.
    assert reference_scales(overflows, True, 1) == [
        1024, 1024, 1024, 512, 256, 256, 256, 512,
    ]
    # hysteresis 2: the first overflow is tolerated, the second halves.
    assert reference_scales(overflows, True, 2) == [
        1024, 1024, 1024, 1024, 512, 512, 512, 1024,
    ]
    assert reference_scales([True] * 20, True, 1)[-1] == MIN_SCALE


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_fault_injection_fuzz(config):
    counts = run_fuzz(config, steps=50, seed=1234 + CONFIGS.index(config))
    assert_run_covered_the_rules(config, counts)


def assert_run_covered_the_rules(config: Config, counts: dict[str, int]) -> None:
    # The seeds give skipped and clean steps for both optimizers, and a dynamic scale at its floor and cap.
    assert 0 < counts["skipped_b"] < counts["skipped_a"] < counts["steps"], counts
    if config.dynamic:
        assert counts["at_floor"] > 0 and counts["at_cap"] > 0, counts


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_fault_injection_fuzz_long(config):
    counts = run_fuzz(config, steps=1000, seed=98765 + CONFIGS.index(config))
    assert_run_covered_the_rules(config, counts)


@pytest.mark.parametrize("level, half", [("O1", torch.float16), ("O2", torch.float16), ("O2", torch.bfloat16)])
def test_a_faulty_loss_does_not_blame_the_next_loss_that_accumulates_onto_its_gradients(level, half):
    # Found by the fuzz: loss 1's gradients were merged onto loss 0's non-finite ones, and the
    # merge's flag (which covers the sum) was charged to loss 1: its scale backed off and its
    # other optimizer (B, which loss 0 never reaches) skipped a clean step.
    model_a, model_b = make_models(0)
    opt_a = FusedAdam(model_a.parameters(), lr=1e-3)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=1e-2)
    amp.initialize([model_a, model_b], [opt_a, opt_b], opt_level=level, half_dtype=half, num_losses=2,
                   loss_scale="dynamic", verbosity=0)
    x = torch.randn(8, 5)
    loss0 = model_a(x).float().sum() * math.nan
    with amp.scale_loss(loss0, opt_a, loss_id=0) as scaled_loss:
        scaled_loss.backward()
    loss1 = (model_a(x).float() + model_b(x).float()).pow(2).mean()
    with amp.scale_loss(loss1, [opt_a, opt_b], loss_id=1) as scaled_loss:
        scaled_loss.backward()
    weights_b = [p.detach().clone() for p in model_b.parameters()]
    opt_a.step()
    opt_b.step()
    assert amp.step_was_skipped(opt_a)  # its accumulated gradients hold loss 0's NaN
    assert not amp.step_was_skipped(opt_b)
    assert not all(torch.equal(a, b) for a, b in zip(weights_b, model_b.parameters()))
    assert (amp.loss_scale(0), amp.loss_scale(1)) == (32768.0, 65536.0)
    assert all(torch.isfinite(p).all() for p in list(model_a.parameters()) + list(amp.master_params(opt_a)))
