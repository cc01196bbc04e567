"""A channels_last conv net trains at O0-O3 to the weights it reaches in contiguous format.

The standard recipe for conv nets is ``model.to(memory_format=torch.channels_last)``
with channels_last inputs. Every fused op amp calls (check_finite, unscale_,
scale_, axpby_, fused_adam_) then sees channels_last gradients, masters and
moments; amp makes its masters and FusedAdam its moments in the parameters'
layout, so the fused step's lists share strides.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdam

CHANNELS_LAST = torch.channels_last
STEPS = 4
# The two formats run different conv algorithms, which round differently; in fp16 the difference is a
# few units in the last place of the weights after a few steps. O0 runs in fp32.
TOLERANCE = {"O0": {"rtol": 1e-5, "atol": 1e-6}}
HALF_TOLERANCE = {"rtol": 2e-2, "atol": 2e-3}


def conv_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # No bias before the batchnorm: its gradient is rounding noise, which Adam would scale up to +-lr.
    return nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3),
                         nn.Flatten(), nn.Linear(64, 3))


def batch(step: int, memory_format) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(4, 3, 8, 8, generator=g).contiguous(memory_format=memory_format)
    return x, torch.randint(0, 3, (4,), generator=g)


def train(level: str, kind: str, memory_format, accumulate: bool = False):
    model = conv_net().to(memory_format=memory_format)
    if kind == "SGD":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = FusedAdam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    for step in range(STEPS):
        optimizer.zero_grad()
        for part in range(2 if accumulate else 1):  # two backward passes: amp accumulates with axpby_/scale_
            x, y = batch(2 * step + part, memory_format)
            loss = nn.functional.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_channels_last_trains_to_the_weights_of_contiguous(one_thread, level, kind):
    contiguous_model, _ = train(level, kind, torch.contiguous_format, accumulate=level == "O2")
    channels_last_model, optimizer = train(level, kind, CHANNELS_LAST, accumulate=level == "O2")
    initial = conv_net().state_dict()
    contiguous, channels_last = contiguous_model.state_dict(), channels_last_model.state_dict()
    for name, weight in channels_last.items():
        if not weight.is_floating_point():
            continue
        assert not torch.equal(weight.float(), initial[name]), f"{name} did not train"
        torch.testing.assert_close(weight, contiguous[name], **TOLERANCE.get(level, HALF_TOLERANCE), msg=name)
    # The layout survives training: model weights, and what the optimizer updates (masters under O2).
    conv_weight = channels_last_model[0].weight
    assert conv_weight.is_contiguous(memory_format=CHANNELS_LAST)
    master = next(p for p in amp.master_params(optimizer) if p.dim() == 4)
    assert master.is_contiguous(memory_format=CHANNELS_LAST)
    if kind == "FusedAdam":
        assert optimizer.state[master]["exp_avg"].is_contiguous(memory_format=CHANNELS_LAST)


def test_fused_adam_lays_loaded_moments_out_like_its_params():
    # A checkpoint of a contiguous model, loaded into the channels_last one: the moments follow the params.
    saved_model = conv_net()
    saved = FusedAdam(saved_model.parameters(), lr=1e-2)
    saved_model(batch(0, torch.contiguous_format)[0]).sum().backward()
    saved.step()
    model = conv_net().to(memory_format=CHANNELS_LAST)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    optimizer.load_state_dict(saved.state_dict())
    weight = model[0].weight
    assert optimizer.state[weight]["exp_avg"].stride() == weight.stride()
    torch.testing.assert_close(optimizer.state[weight]["exp_avg"], saved.state[saved_model[0].weight]["exp_avg"],
                               rtol=0, atol=0)
    model(batch(0, CHANNELS_LAST)[0]).sum().backward()
    optimizer.step()  # the fused op accepts the lists: they share strides


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
def test_model_converted_to_channels_last_after_initialize_trains_like_before(kind):
    # timm-style scripts may call model.to(memory_format=...) after amp.initialize: the masters
    # (and any optimizer state) follow the model's layout at the first pass, values unchanged.
    def run(convert_after: bool):
        model = conv_net()
        if not convert_after:
            model = model.to(memory_format=CHANNELS_LAST)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if kind == "SGD" else FusedAdam(
            model.parameters(), lr=1e-2)
        amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
        if convert_after:
            model.to(memory_format=CHANNELS_LAST)
        for step in range(STEPS):
            optimizer.zero_grad()
            x, y = batch(step, CHANNELS_LAST)
            with amp.scale_loss(nn.functional.cross_entropy(model(x).float(), y), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
        return [p.detach().clone() for p in amp.master_params(optimizer)]

    for after, before in zip(run(True), run(False)):
        assert after.stride() == before.stride()
        assert torch.equal(after, before)
