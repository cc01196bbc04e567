"""Whole O1 training runs against the same runs in fp32 (O0)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from apex_amp.amp import casting


class SmallNet(torch.nn.Module):
    """Exercises half (linear, conv), fp32 (layer_norm, softmax, loss) and promote (residual add)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 4, 3, padding=1)
        self.fc1 = torch.nn.Linear(32, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = F.relu(self.conv(x.unsqueeze(1))).flatten(1)
        h = self.norm(F.gelu(self.fc1(h)))
        h = h + self.fc2(h)  # fp32 + half: promote
        attention = torch.softmax(h @ h.t() / 4.0, dim=-1)
        return self.head(attention @ h)


def _problem():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return x, y


def _train(model, half_dtype, steps):
    """(losses, {module name: output dtypes seen}) of ``steps`` Adam steps under O1 (None: fp32)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _problem()
    losses = []
    seen = {name: set() for name in ("conv", "fc1", "norm", "head")}
    for name in seen:
        getattr(model, name).register_forward_hook(
            lambda module, args, output, name=name: seen[name].add(output.dtype))
    if half_dtype is not None:
        casting.activate(half_dtype)
    try:
        for step in range(steps):
            batch = slice(16 * (step % 4), 16 * (step % 4 + 1))
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[batch]), y[batch])
            assert loss.dtype == torch.float32
            loss.backward()
            with casting.disable_casts():
                optimizer.step()
            casting.clear_cache()
            losses.append(loss.item())
    finally:
        if half_dtype is not None:
            casting.deactivate()
    return losses, seen


@pytest.mark.slow
@pytest.mark.parametrize("half_dtype,steps", [(torch.bfloat16, 40), (torch.float16, 16)], ids=["bf16", "fp16"])
def test_o1_training_matches_o0(half_dtype, steps):
    torch.manual_seed(0)
    model = SmallNet()
    reference = copy.deepcopy(model)
    o1_losses, o1_dtypes = _train(model, half_dtype, steps)
    o0_losses, o0_dtypes = _train(reference, None, steps)
    # O1 really ran: convolution and matmuls in half, layer_norm in fp32, and other losses than fp32's.
    assert o1_dtypes == {"conv": {half_dtype}, "fc1": {half_dtype}, "norm": {torch.float32}, "head": {half_dtype}}
    assert set().union(*o0_dtypes.values()) == {torch.float32}
    assert o1_losses != o0_losses
    assert o0_losses[-1] < 0.7 * o0_losses[0]  # the problem is learnable
    tolerance = 0.05 if half_dtype is torch.float16 else 0.1
    for o1_loss, o0_loss in zip(o1_losses, o0_losses):
        assert abs(o1_loss - o0_loss) <= tolerance * max(1.0, o0_loss)
    for parameter, reference_parameter in zip(model.parameters(), reference.parameters()):
        assert parameter.dtype == torch.float32
        torch.testing.assert_close(parameter, reference_parameter, rtol=0.1, atol=0.05)


@pytest.mark.parametrize("half_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_recurrent_forward_and_backward_in_half_match_fp32(kind, half_dtype):
    torch.manual_seed(0)
    rnn = getattr(torch.nn, kind)(4, 6, num_layers=2)
    x = torch.randn(5, 2, 4)
    reference = copy.deepcopy(rnn)
    casting.activate(half_dtype)
    try:
        output = rnn(x)[0]
        assert output.dtype == half_dtype
        output.float().pow(2).sum().backward()
    finally:
        casting.deactivate()
    reference_output = reference(x)[0]
    reference_output.pow(2).sum().backward()
    tolerance = 1e-2 if half_dtype is torch.float16 else 5e-2
    torch.testing.assert_close(output.float(), reference_output, rtol=tolerance, atol=tolerance)
    for parameter, reference_parameter in zip(rnn.parameters(), reference.parameters()):
        assert parameter.grad.dtype == torch.float32
        torch.testing.assert_close(parameter.grad, reference_parameter.grad, rtol=0.1, atol=4 * tolerance)
