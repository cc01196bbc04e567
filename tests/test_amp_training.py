"""End-to-end training: every level x half dtype x optimizer learns; O1/O2 track O0 on real data."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdam


def make_optimizer(kind, params):
    if kind == "SGD":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9)
    if kind == "Adam":
        # eps=1e-4: O3 runs torch's Adam on half weights, where 1e-8 underflows to 0.
        return torch.optim.Adam(params, lr=2e-2, eps=1e-4)
    return FusedAdam(params, lr=2e-2)


@pytest.mark.parametrize("kind", ["SGD", "Adam", "FusedAdam"])
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_training_loss_falls(level, half, kind):
    # Tiny on purpose: CPU fp16 matmul is very slow.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = make_optimizer(kind, model.parameters())
    reference = copy.deepcopy(model)  # fp32, without amp: the first step's true gradient
    nn.functional.cross_entropy(reference(x), y).backward()
    true_norm = reference[0].weight.grad.norm()
    amp.initialize(model, optimizer, opt_level=level, half_dtype=half, verbosity=0)
    first_layer = []  # (output dtype, gradient norm the backward pass produced) per step
    model[0].register_forward_hook(lambda module, args, out: first_layer.append([out.dtype]))
    model[0].weight.register_hook(lambda grad: first_layer[-1].append(grad.float().norm()))
    losses, unscaled = [], []
    for _ in range(15):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        unscaled.append(next(iter(amp.master_params(optimizer))).grad.float().norm())
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.6 * losses[0], losses
    # amp did what the level says: the precision of the first layer, fp32 masters, and the scale
    # the backward pass ran at (apex's defaults: dynamic 65536 for fp16 at O1/O2, 1 otherwise).
    compute = torch.float32 if level == "O0" else half
    assert all(dtype == compute for dtype, _ in first_layer)
    assert all(p.dtype == torch.float32 for p in amp.master_params(optimizer)) == (level != "O3")
    scale = 65536.0 if level in ("O1", "O2") and half == torch.float16 else 1.0
    torch.testing.assert_close(first_layer[0][1], scale * true_norm, rtol=5e-2, atol=0)
    torch.testing.assert_close(unscaled[0], true_norm, rtol=5e-2, atol=0)
    for (_, raw), amp_norm in zip(first_layer, unscaled):
        torch.testing.assert_close(raw / amp_norm, torch.tensor(scale), rtol=1e-2, atol=0)


def digits_run(level, kind="FusedAdam", epochs=4):
    sklearn = pytest.importorskip("sklearn.datasets")
    digits = sklearn.load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = FusedAdam(model.parameters(), lr=1e-2) if kind == "FusedAdam" else torch.optim.Adam(
        model.parameters(), lr=1e-2)
    if level is not None:
        amp.initialize(model, optimizer, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(0))
    for _ in range(epochs):
        for batch in order.split(100):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
    with torch.no_grad():
        model.eval()
        train_loss = nn.functional.cross_entropy(model(x_train), y_train).item()
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return train_loss, accuracy


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["FusedAdam", "Adam"])
def test_o1_and_o2_reach_o0_loss_on_digits(kind):
    # Tolerance: bf16 keeps 8 mantissa bits, so after 56 steps the train loss
    # may differ from fp32's by a few hundredths; accuracy by a couple of points.
    o0_loss, o0_acc = digits_run("O0", kind)
    assert o0_loss < 0.25 and o0_acc > 0.85
    for level in ("O1", "O2"):
        loss, acc = digits_run(level, kind)
        assert abs(loss - o0_loss) < 0.03, (level, loss, o0_loss)
        assert abs(acc - o0_acc) < 0.02, (level, acc, o0_acc)
