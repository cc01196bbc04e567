"""A run of O2 + fp8 for tests/test_fp8_training.py: ``save`` trains, checkpoints and goes on; ``resume``
starts a fresh process from the checkpoint. Both write what they ended with (weights, state, losses)."""

from __future__ import annotations

import sys

import torch
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdam

SAVE_AT, MORE = 5, 4


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(24, 32, generator=generator), torch.randint(16, (24,), generator=generator)


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 16))
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    recipe = amp.Fp8Recipe(amax_history_len=4, margin=1)
    return amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, fp8=recipe, verbosity=0)


def train(model, optimizer, steps) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main(mode: str, checkpoint: str, out: str) -> None:
    torch.set_num_threads(1)
    model, optimizer = build()
    if mode == "save":
        train(model, optimizer, range(SAVE_AT))
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()},
                   checkpoint)
    else:
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        amp.load_state_dict(saved["amp"])
    losses = train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE))
    torch.save({"losses": losses, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "amp": amp.state_dict()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
