"""The O1 weight-cast cache: reused within an iteration, never stale.

torch's own autocast cache, with autocast switched on outside a ``with`` block, keeps the
half copy of a weight after the weight changed in place; these tests fail for any cache
that does that.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from apex_amp.amp import casting
from apex_amp.amp.casting.policy import STATE


@pytest.fixture
def o1():
    casting.activate(torch.bfloat16)
    yield
    casting.deactivate()


def test_weight_cast_is_made_once_per_weight_across_time_steps(o1):
    cell = torch.nn.GRUCell(4, 4)
    h = torch.zeros(2, 4)
    for _ in range(5):
        h = cell(torch.randn(2, 4), h)
    assert len(STATE.cache) == 4  # w_ih, w_hh, b_ih, b_hh: one cast each, reused
    weight_cast = STATE.cache.cast(cell.weight_ih, torch.bfloat16)
    assert STATE.cache.cast(cell.weight_ih, torch.bfloat16) is weight_cast
    h.float().sum().backward()
    assert cell.weight_ih.grad.dtype == torch.float32


# GRUCell goes through apex_amp's half kernel and its cache; Linear through torch's own
# autocast kernel, whose cache O1 turns off. Neither may ever see an old weight.
MODULES = {"GRUCell": lambda: torch.nn.GRUCell(4, 4), "Linear": lambda: torch.nn.Linear(4, 4)}


def _reference(module, x):
    with casting.disable_casts():
        return copy.deepcopy(module).bfloat16()(x.bfloat16())


@pytest.mark.parametrize("kind", MODULES)
def test_inplace_weight_update_is_seen_without_clear_cache(o1, kind):
    module = MODULES[kind]()
    x = torch.randn(3, 4)
    before = module(x)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.mul_(2)  # what optimizer.step() does
    after = module(x)
    torch.testing.assert_close(after, _reference(module, x))
    assert not torch.allclose(after.float(), before.float())


@pytest.mark.parametrize("kind", MODULES)
def test_weight_storage_swap_is_seen(o1, kind):
    module = MODULES[kind]()
    x = torch.randn(3, 4)
    module(x)
    for parameter in module.parameters():
        parameter.data = torch.rand_like(parameter)  # swaps storage, no in-place op
    torch.testing.assert_close(module(x), _reference(module, x))


@pytest.mark.parametrize("kind", MODULES)
def test_load_state_dict_is_seen(o1, kind):
    module, other = MODULES[kind](), MODULES[kind]()
    x = torch.randn(3, 4)
    module(x)
    module.load_state_dict(other.state_dict())
    torch.testing.assert_close(module(x), other(x))


@pytest.mark.parametrize("kind", MODULES)
def test_cast_made_under_no_grad_is_not_reused_for_training(o1, kind):
    module = MODULES[kind]()
    x = torch.randn(3, 4)
    with torch.no_grad():
        module(x)
    module(x).float().sum().backward()
    assert all(parameter.grad is not None for parameter in module.parameters())


def test_clear_cache_empties_it(o1):
    torch.nn.GRUCell(4, 4)(torch.randn(1, 4))
    assert len(STATE.cache) == 4
    casting.clear_cache()
    assert len(STATE.cache) == 0


def test_weights_are_not_kept_alive_after_clear_cache(o1):
    import weakref

    cell = torch.nn.GRUCell(4, 4)
    with torch.no_grad():  # a cast without autograd history does not hold its weight
        cell(torch.randn(1, 4))
    assert len(STATE.cache) == 4
    weight = weakref.ref(cell.weight_ih)
    del cell
    assert len(STATE.cache) == 0 and weight() is None
    # a cast with history references its weight through the graph until the cache is cleared
    cell = torch.nn.GRUCell(4, 4)
    cell(torch.randn(1, 4))
    weight = weakref.ref(cell.weight_ih)
    del cell
    casting.clear_cache()
    assert weight() is None


def _mlp():
    torch.manual_seed(0)
    # the GRUCell's weights go through apex_amp's weight cache, the Linears' through torch
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.GRUCell(16, 16),
                               torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, torch.optim.Adam])
@pytest.mark.parametrize("call_clear_cache", [True, False], ids=["clear_cache", "version-guard-only"])
def test_train_eval_train_gradients_match_fp32_reference(optimizer_class, call_clear_cache):
    """Train, evaluate under no_grad, train again: every step's gradients match an fp32 run."""
    model = _mlp()
    reference = copy.deepcopy(model)
    lr = 0.5 if optimizer_class is torch.optim.SGD else 0.05  # large steps: stale weights would show
    optimizer = optimizer_class(model.parameters(), lr=lr)
    reference_optimizer = optimizer_class(reference.parameters(), lr=lr)
    torch.manual_seed(1)
    batches = [(torch.randn(16, 8), torch.randint(0, 4, (16,))) for _ in range(3)]

    def reference_step(x, y):
        reference_optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        grads = _grads(reference)
        reference_optimizer.step()
        return grads

    casting.activate(torch.bfloat16)
    try:
        for x, y in batches:
            # O1 stays active through the whole loop, as under amp.initialize
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads = _grads(model)
            with casting.disable_casts():
                optimizer.step()
                reference_grads = reference_step(x, y)
            if call_clear_cache:
                casting.clear_cache()
            for grad, reference_grad in zip(grads, reference_grads):
                torch.testing.assert_close(grad, reference_grad, rtol=0.05, atol=0.04)
            with torch.no_grad():  # evaluation between training steps
                evaluated = model(x)
                with casting.disable_casts():
                    expected = reference(x)
                torch.testing.assert_close(evaluated.float(), expected, rtol=0.05, atol=0.05)
    finally:
        casting.deactivate()
