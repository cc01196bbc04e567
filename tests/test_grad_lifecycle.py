"""The gradient lifecycle (apex_amp/amp/gradients.py): each transition, driven through amp's public calls.

Every transition of ``_TRANSITIONS`` has a scenario here; the last test runs
them all and checks that together they take each transition (and no other).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from apex_amp import amp
from apex_amp.amp.gradients import _TRANSITIONS, GradLifecycle, GradState
from apex_amp.amp.sessions import session_for
from apex_amp.optimizers import FusedAdam

S = GradState


def lifecycle(optimizer) -> GradLifecycle:
    return session_for(optimizer).lifecycle_of(optimizer)


def half_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def bn_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def setup(kind: str = "SGD", model_fn=half_model, **init):
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if kind == "SGD" else FusedAdam(model.parameters(), lr=1e-2)
    init = {"opt_level": "O2", "half_dtype": torch.bfloat16, "verbosity": 0, **init}
    return (*amp.initialize(model, optimizer, **init), torch.Generator().manual_seed(1))


def loss_of(model, generator, factor: float = 1.0):
    x = torch.randn(6, 4, generator=generator)
    return model(x).float().pow(2).mean() * factor


def backward(model, optimizer, generator, factor: float = 1.0, **kwargs):
    with amp.scale_loss(loss_of(model, generator, factor), optimizer, **kwargs) as scaled_loss:
        scaled_loss.backward()


def masters(optimizer):
    return [p.detach().clone() for p in amp.master_params(optimizer)]


# ---- scenarios: each returns nothing and asserts what its transitions do ------------------------


def scenario_pass_unscales_into_masters_then_step_consumes():
    # EMPTY -> IN_PASS -> UNSCALED -> IN_PASS -> UNSCALED -> IN_STEP -> EMPTY
    model, optimizer, g = setup("SGD")
    life = lifecycle(optimizer)
    assert life.state is S.EMPTY
    with amp.scale_loss(loss_of(model, g), optimizer) as scaled_loss:
        assert life.state is S.IN_PASS
        scaled_loss.backward()
    assert life.state is S.UNSCALED
    first = [p.grad.clone() for p in life.params.ordered]
    assert all(grad.dtype == torch.float32 for grad in first)
    assert all(p.grad is None for p in model.parameters())  # taken into the masters
    backward(model, optimizer, g)
    assert life.state is S.UNSCALED
    assert not any(torch.equal(a, p.grad) for a, p in zip(first, life.params.ordered))  # added up
    optimizer.step()
    assert life.state is S.EMPTY
    assert all(p.grad is None for p in life.params.ordered)  # consumed


def scenario_fused_pass_is_kept_scaled_off_the_model_then_step_consumes():
    # EMPTY -> IN_PASS -> SCALED -> IN_STEP -> EMPTY
    model, optimizer, g = setup("FusedAdam", half_dtype=torch.float16)
    life = lifecycle(optimizer)
    backward(model, optimizer, g)
    assert life.state is S.SCALED
    assert len(life.held) == 4 and all(grad.dtype == torch.float16 for grad in life.held.values())
    assert all(p.grad is None for p in model.parameters())  # held by amp, not on the model
    model.zero_grad()  # so this cannot clear them
    before = masters(optimizer)
    optimizer.step()
    assert life.state is S.EMPTY and not life.held
    assert not any(torch.equal(a, b) for a, b in zip(before, masters(optimizer)))


def scenario_fused_step_leaves_scaled_direct_grads_spent_then_settles():
    # SCALED -> IN_STEP -> SPENT -> EMPTY: batchnorm's fp32 params read their own .grad
    model, optimizer, g = setup("FusedAdam", model_fn=bn_model, half_dtype=torch.float16)
    life = lifecycle(optimizer)
    backward(model, optimizer, g)
    assert life.state is S.SCALED
    bn_weight = model[1].weight
    scaled = bn_weight.grad.clone()
    optimizer.step()
    assert life.state is S.SPENT
    amp.master_params(optimizer)  # what the user reads through amp is unscaled
    assert life.state is S.EMPTY
    torch.testing.assert_close(bn_weight.grad, scaled / 65536.0)


def scenario_master_params_settles_scaled_gradients():
    # SCALED -> UNSCALED (clipping needs the true values)
    model, optimizer, g = setup("FusedAdam", half_dtype=torch.float16)
    life = lifecycle(optimizer)
    backward(model, optimizer, g)
    held = {master: grad.float() / 65536.0 for master, grad in life.held.items()}
    params = list(amp.master_params(optimizer))
    assert life.state is S.UNSCALED and not life.held
    for param in params:
        torch.testing.assert_close(param.grad, held[param])


def scenario_delayed_passes_continue_in_place_then_settle():
    # IN_PASS -> DELAYED -> IN_PASS -> DELAYED -> (settle) UNSCALED
    model, optimizer, g = setup("SGD", half_dtype=torch.float16)
    life = lifecycle(optimizer)
    backward(model, optimizer, g, delay_unscale=True)
    assert life.state is S.DELAYED
    weight = model[0].weight
    first = weight.grad.clone()
    assert first.dtype == torch.float16  # still on the model, scaled
    backward(model, optimizer, g, delay_unscale=True)
    assert life.state is S.DELAYED and weight.grad is not None and not torch.equal(first, weight.grad)
    with pytest.raises(RuntimeError, match="delay_unscale=False"):
        optimizer.step()  # DELAYED has no step transition
    summed = weight.grad.float() / 65536.0
    master = life.params.links[0].master
    amp.master_params(optimizer)  # reads, as apex's: the accumulation stays scaled and unaccounted
    assert life.state is S.DELAYED and master.grad is None and torch.equal(weight.grad.float() / 65536.0, summed)
    life.settle()  # what a pass of another loss (or scale) does first
    assert life.state is S.UNSCALED
    torch.testing.assert_close(master.grad, summed)


def scenario_delayed_pass_of_another_loss_is_accounted_for_its_own_loss():
    # DELAYED -> UNSCALED by a pass of loss 1: loss 0's overflow counts for loss 0
    model, optimizer, g = setup("SGD", half_dtype=torch.float16, num_losses=2)
    life = lifecycle(optimizer)
    backward(model, optimizer, g, factor=float("inf"), delay_unscale=True, loss_id=0)
    assert amp.state_dict()["loss_scaler0"]["overflows"] == 0  # not checked yet
    backward(model, optimizer, g, loss_id=1)
    assert life.state is S.UNSCALED
    state = amp.state_dict()
    assert state["loss_scaler0"]["overflows"] == 1 and state["loss_scaler1"]["overflows"] == 0
    before = masters(optimizer)
    optimizer.step()
    assert amp.step_was_skipped(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, masters(optimizer)))


def scenario_block_that_raises_puts_the_old_gradients_back():
    # IN_PASS -> UNSCALED (aborted), and IN_PASS -> EMPTY (aborted)
    model, optimizer, g = setup("SGD", model_fn=bn_model)
    life = lifecycle(optimizer)
    with pytest.raises(ZeroDivisionError):
        with amp.scale_loss(loss_of(model, g), optimizer) as scaled_loss:
            scaled_loss.backward()
            1 / 0
    assert life.state is S.EMPTY
    assert all(p.grad is None for p in life.params.ordered) and all(p.grad is None for p in model.parameters())
    backward(model, optimizer, g)
    kept = [p.grad.clone() for p in life.params.ordered]
    with pytest.raises(ZeroDivisionError):
        with amp.scale_loss(loss_of(model, g), optimizer) as scaled_loss:
            scaled_loss.backward()
            1 / 0
    assert life.state is S.UNSCALED
    assert all(torch.equal(a, p.grad) for a, p in zip(kept, life.params.ordered))


def scenario_step_that_raises_is_undone_at_the_next_call():
    # IN_STEP -> UNSCALED (the step raised), then a normal step
    class FailingOnce(torch.optim.SGD):
        failed = False

        def step(self, closure=None):
            if not self.failed:
                self.failed = True
                raise RuntimeError("out of memory (simulated)")
            return super().step(closure)

    model = half_model()
    optimizer = FailingOnce(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    life = lifecycle(optimizer)
    g = torch.Generator().manual_seed(1)
    backward(model, optimizer, g)
    grads = [p.grad.clone() for p in life.params.ordered]
    before = masters(optimizer)
    with pytest.raises(RuntimeError, match="simulated"):
        optimizer.step()
    assert life.state is S.IN_STEP
    optimizer.step()  # the retry: the interrupted step is undone first, then this one runs
    assert life.state is S.EMPTY
    for b, a, grad in zip(before, masters(optimizer), grads):
        torch.testing.assert_close(a, b - 0.1 * grad)


def scenario_step_without_a_new_pass_changes_nothing():
    # EMPTY -> IN_STEP -> EMPTY: the step consumed the gradients, so a second one has none
    model, optimizer, g = setup("SGD")
    life = lifecycle(optimizer)
    before = masters(optimizer)
    optimizer.step()
    assert life.state is S.EMPTY and all(torch.equal(a, b) for a, b in zip(before, masters(optimizer)))
    backward(model, optimizer, g)
    optimizer.step()
    stepped = masters(optimizer)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(stepped, masters(optimizer)))


def scenario_fused_step_that_raises_keeps_its_gradients_held():
    # IN_STEP -> SCALED (the fused step raised): held gradients go back off the model
    class FailingOnce(FusedAdam):
        failed = False

        def step(self, closure=None, **kwargs):
            if not self.failed:
                self.failed = True
                raise RuntimeError("out of memory (simulated)")
            return super().step(closure, **kwargs)

    model = half_model()
    optimizer = FailingOnce(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.float16, verbosity=0)
    life = lifecycle(optimizer)
    backward(model, optimizer, torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="simulated"):
        optimizer.step()
    model.zero_grad()  # the recovery below must not depend on what the model holds
    amp.master_params(optimizer)  # the next call undoes the step, then settles the held gradients
    assert life.state is S.UNSCALED and all(p.grad is not None for p in life.params.ordered)
    assert all(p.grad is None for p in model.parameters())
    before = masters(optimizer)
    optimizer.step()
    assert life.state is S.EMPTY and life.steps == 1
    assert not any(torch.equal(a, b) for a, b in zip(before, masters(optimizer)))


def scenario_nested_step_calls_run_amps_part_once():
    # A subclass whose step calls super().step(): torch runs the hooks for both; amp acts once.
    class Wrapping(FusedAdam):
        def step(self, closure=None, **kwargs):
            return super().step(closure, **kwargs)

    model = half_model()
    optimizer = Wrapping(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.float16, verbosity=0)
    life = lifecycle(optimizer)
    g = torch.Generator().manual_seed(1)
    backward(model, optimizer, g, factor=float("inf"))
    before = masters(optimizer)
    optimizer.step()
    assert life.state is S.EMPTY and life.steps == 1 and amp.step_was_skipped(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, masters(optimizer)))


def scenario_calls_in_the_wrong_place_are_refused():
    model, optimizer, g = setup("SGD")
    life = lifecycle(optimizer)
    with pytest.raises(RuntimeError, match="inside an amp.scale_loss block"):
        with amp.scale_loss(loss_of(model, g), optimizer) as scaled_loss:
            scaled_loss.backward()
            optimizer.step()
    assert life.state is S.EMPTY
    with pytest.raises(RuntimeError, match="has not exited"):
        with amp.scale_loss(loss_of(model, g), optimizer):
            with amp.scale_loss(loss_of(model, g), optimizer):
                pass
    assert life.state is S.EMPTY
    with pytest.raises(RuntimeError, match="internal error.*EMPTY -> SPENT"):
        life._move(S.SPENT)


SCENARIOS = [value for name, value in sorted(globals().items()) if name.startswith("scenario_")]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__.removeprefix("scenario_") for s in SCENARIOS])
def test_transition(scenario):
    scenario()


def test_the_scenarios_take_every_transition_and_no_other(monkeypatch):
    taken = set()
    move = GradLifecycle._move

    def recording(self, to):
        before = self.state
        move(self, to)
        taken.add((before, to))

    monkeypatch.setattr(GradLifecycle, "_move", recording)
    for scenario in SCENARIOS:
        scenario()
    allowed = {(start, end) for start, ends in _TRANSITIONS.items() for end in ends}
    assert taken == allowed, f"never taken: {allowed - taken}"


# ---- clearing through the model between any two calls ------------------------------------------

# One accumulated step and the next: pass, pass, master_params, step, pass, step.
CALLS = ("pass", "pass", "master_params", "step", "pass", "step")


def run_calls(kind: str, clear_at: set, how: str = "model"):
    model, optimizer, g = setup(kind, half_dtype=torch.float16)
    for gap, call in enumerate(CALLS):
        if gap in clear_at:
            if how == "model":
                model.zero_grad()
            else:
                optimizer.zero_grad()
        if call == "pass":
            backward(model, optimizer, g)
        elif call == "master_params":
            amp.master_params(optimizer)
        else:
            optimizer.step()
    if len(CALLS) in clear_at:
        model.zero_grad()
    return masters(optimizer), lifecycle(optimizer).state


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("gap", range(len(CALLS) + 1))
def test_model_zero_grad_between_any_two_calls_changes_nothing_amp_took_in(kind, gap):
    # Under O2 the optimizer's parameters are the masters: what a scale_loss exit took in belongs to
    # the optimizer until its step (as in apex), so clearing the model's gradients at any point
    # leaves the training exactly as without it.
    untouched, _ = run_calls(kind, set())
    cleared, state = run_calls(kind, {gap})
    assert state is S.EMPTY
    assert all(torch.equal(a, b) for a, b in zip(untouched, cleared))


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
def test_optimizer_zero_grad_between_scale_loss_and_step_discards_the_pass(kind):
    # As in PyTorch: clearing after backward leaves the step nothing to apply, for a fused
    # optimizer (whose gradients amp holds off the params) as for any other.
    model, optimizer, g = setup(kind, half_dtype=torch.float16)
    backward(model, optimizer, g)
    optimizer.zero_grad()
    before = masters(optimizer)
    optimizer.step()
    assert not amp.step_was_skipped(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, masters(optimizer)))
    assert lifecycle(optimizer).state is S.EMPTY


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
def test_optimizer_zero_grad_without_set_to_none_leaves_zero_gradients(kind):
    model, optimizer, g = setup(kind, half_dtype=torch.float16)
    backward(model, optimizer, g)
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is None or not p.grad.any() for p in amp.master_params(optimizer))
    before = masters(optimizer)
    optimizer.step()
    after = masters(optimizer)
    if kind == "SGD":  # a zero gradient moves nothing without momentum or decay
        assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_every_ordering_of_two_losses_and_a_clear_gives_one_answer():
    # Two losses with their own scales, a model.zero_grad() anywhere: the step sees their sum.
    def run(order, clear_gap):
        model, optimizer, g = setup("SGD", half_dtype=torch.float16, num_losses=2)
        xs = {0: torch.randn(6, 4, generator=g), 1: torch.randn(6, 4, generator=g)}
        for gap, loss_id in enumerate(order):
            if gap == clear_gap:
                model.zero_grad()
            with amp.scale_loss(model(xs[loss_id]).float().pow(2).mean(), optimizer, loss_id=loss_id) as s:
                s.backward()
        return [p.grad.clone() for p in amp.master_params(optimizer)]

    results = [run(order, gap) for order, gap in itertools.product([(0, 1), (1, 0)], range(3))]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


def test_model_weights_changed_after_initialize_become_the_masters():
    # apex made its masters at the first backward: a change of the model's weights after
    # initialize (a user's init, a loaded embedding) is trained, not overwritten by the first step.
    model, optimizer, g = setup("SGD")
    with torch.no_grad():
        model[0].weight.fill_(0.5)
    backward(model, optimizer, g)
    master = lifecycle(optimizer).params.links[0].master
    assert torch.all(master.detach() == 0.5)
    optimizer.step()
    assert not torch.all(model[0].weight == 0.5)
    torch.testing.assert_close(model[0].weight.float(), master.detach(), rtol=1e-2, atol=0)
