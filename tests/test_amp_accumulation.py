"""Gradient accumulation (delay_unscale, several scales), clipping on master_params."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apex_amp import amp
from apex_amp.amp import casting
from apex_amp.optimizers import FusedAdam


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def data(seed: int = 0, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def make_optimizer(kind, params):
    return torch.optim.SGD(params, lr=0.1) if kind == "SGD" else FusedAdam(params, lr=1e-2)


def fp32_reference_grads(x, y, chunks=1):
    model = tiny_model()
    for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
        (nn.functional.cross_entropy(model(xs), ys) / chunks).backward()
    return [p.grad.clone() for p in model.parameters()]


def master_grads(optimizer):
    return [p.grad.clone() for p in amp.master_params(optimizer)]


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
def test_delay_unscale_accumulation_equals_one_big_batch(kind):
    # O0 with a dynamic scale: scaling by a power of two is exact, so only the
    # summation order differs from the single big-batch pass.
    x, y = data()
    model = tiny_model()
    optimizer = make_optimizer(kind, model.parameters())
    amp.initialize(model, optimizer, opt_level="O0", loss_scale="dynamic", verbosity=0)
    for i, (xs, ys) in enumerate(zip(x.chunk(4), y.chunk(4))):
        loss = nn.functional.cross_entropy(model(xs), ys) / 4
        with amp.scale_loss(loss, optimizer, delay_unscale=i < 3) as scaled:
            scaled.backward()
    for got, want in zip(master_grads(optimizer), fp32_reference_grads(x, y)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
def test_o2_accumulation_matches_fp32_reference(kind, delay):
    x, y = data()
    model = tiny_model()
    optimizer = make_optimizer(kind, model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    for i, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
        loss = nn.functional.cross_entropy(model(xs), ys) / 2
        with amp.scale_loss(loss, optimizer, delay_unscale=delay and i == 0) as scaled:
            scaled.backward()
    for got, want in zip(master_grads(optimizer), fp32_reference_grads(x, y, chunks=2)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
def test_two_losses_with_different_scales_accumulate_correctly(kind):
    x, y = data()
    model = tiny_model()
    optimizer = make_optimizer(kind, model.parameters())
    amp.initialize(model, optimizer, opt_level="O0", num_losses=2, loss_scale="dynamic", verbosity=0)
    state = amp.state_dict()
    state["loss_scaler1"]["loss_scale"] = 8.0  # very different from loss 0's 65536
    amp.load_state_dict(state)
    for loss_id, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
        loss = nn.functional.cross_entropy(model(xs), ys) / 2
        with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
            scaled.backward()
    for got, want in zip(master_grads(optimizer), fp32_reference_grads(x, y, chunks=2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_delayed_passes_interrupted_by_another_loss_are_merged_correctly():
    x, y = data()
    model = tiny_model()
    optimizer = make_optimizer("FusedAdam", model.parameters())
    amp.initialize(model, optimizer, opt_level="O0", num_losses=2, loss_scale="dynamic", verbosity=0)
    chunks = list(zip(x.chunk(2), y.chunk(2)))
    with amp.scale_loss(nn.functional.cross_entropy(model(chunks[0][0]), chunks[0][1]) / 2, optimizer,
                        loss_id=0, delay_unscale=True) as scaled:
        scaled.backward()
    with amp.scale_loss(nn.functional.cross_entropy(model(chunks[1][0]), chunks[1][1]) / 2, optimizer,
                        loss_id=1) as scaled:
        scaled.backward()
    for got, want in zip(master_grads(optimizer), fp32_reference_grads(x, y, chunks=2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_existing_gradients_are_kept_and_added_to():
    x, y = data()
    model = tiny_model()
    optimizer = make_optimizer("SGD", model.parameters())
    amp.initialize(model, optimizer, opt_level="O1", half_dtype=torch.bfloat16, loss_scale="dynamic", verbosity=0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # e.g. zero_grad(set_to_none=False) leftovers, here ones
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), optimizer) as scaled:
        scaled.backward()
    casting.deactivate()
    for got, want in zip(master_grads(optimizer), fp32_reference_grads(x, y)):
        torch.testing.assert_close(got, want + 1, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
def test_clipping_master_params_matches_fp32_reference(kind):
    x, y = data(n=64)
    model = tiny_model()
    optimizer = make_optimizer(kind, model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), optimizer) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=0.05)
    reference = tiny_model()
    nn.functional.cross_entropy(reference(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.05)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-2, atol=0)
    for got, want in zip(master_grads(optimizer), [p.grad for p in reference.parameters()]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-4)
    # and the clipped gradients are what the step uses (and consumes)
    before = [p.detach().clone() for p in amp.master_params(optimizer)]
    clipped = master_grads(optimizer)
    optimizer.step()
    assert all(p.grad is None for p in amp.master_params(optimizer))
    if kind == "SGD":
        for b, a, g in zip(before, amp.master_params(optimizer), clipped):
            torch.testing.assert_close(a, b - 0.1 * g)
