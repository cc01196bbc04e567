"""Two gloo ranks train O2 bf16 with FusedAdam int8 state under DDP wrapped *after* amp.initialize (as the
HF Trainer and timm do), each on its half of every batch, and save what they hold after every step
(tests/test_state_precision_clients.py compares the ranks and a one-process run on the whole batch).

Usage: ``python _ddp_quantized_ranks.py OUT_DIR [--no-ddp]`` on each rank (``--no-ddp``: each rank
steps on its own half, the broken variant the comparison must catch).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdam
from apex_amp.optimizers.state_formats import dequantize

STEPS = 5
BATCH = 16  # the whole batch; each of two ranks takes half
# One process and two ranks differ by the rounding of DDP's reduction of the bf16 gradients (each
# half's gradient rounded to bf16, then averaged in bf16): about 2**-8 relative per element, which
# Adam's normalised update amplifies where a gradient is near zero, and which grows from step to
# step once the weights differ. Measured here: at most 1% (moments) and 5% (the masters' and
# weights' movement from their start) after the first step, 10% and 7% after the fifth. A rank that
# stepped on its own half of the batch instead is off by 40% or more.
RELATIVE_TOLERANCE = 0.15


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same weights on every rank (DDP would broadcast rank 0's anyway)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = FusedAdam(model.parameters(), lr=1e-2, state_precision="int8")
    return amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 64, generator=generator), torch.randn(BATCH, 8, generator=generator)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of the model's bf16 weights, amp's fp32 masters and their optimizer state (codes, absmaxes)."""
    held = {f"weight{i}": p.detach().clone() for i, p in enumerate(model.parameters())}
    for i, master in enumerate(amp.master_params(optimizer)):
        held[f"master{i}"] = master.detach().clone()
        for key, value in optimizer.state[master].items():
            held[f"master{i}.{key}"] = value.clone()
    return held


def dequantized(held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 values of a snapshot: codes dequantized with their absmaxes (which are then left out)."""
    values = {}
    for name, value in held.items():
        if name.endswith("_absmax"):
            continue
        absmax = held.get(f"{name}_absmax")
        values[name] = dequantize(value, absmax) if absmax is not None else value.float()
    return values


def relative_errors(held: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                    start: dict[str, torch.Tensor]) -> dict[str, float]:
    """||held - reference|| / ||reference|| per entry, dequantized; weights and masters compared by how
    far they moved from ``start`` (the snapshot before the first step)."""
    held, reference = dequantized(held), dequantized(reference)
    errors = {}
    for name, value in held.items():
        expected = reference[name]
        if name in start:  # a weight or a master: its movement
            value, expected = value - start[name], expected - start[name]
        errors[name] = float((value - expected).norm() / expected.norm().clamp_min(1e-30))
    return errors


def start() -> dict[str, torch.Tensor]:
    """The weights and masters before the first step (dequantized snapshot of a fresh build)."""
    model, optimizer = build()
    return dequantized(snapshot(model, optimizer))


def one_process(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x, y = batch(step)
    with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), optimizer) as scaled:
        scaled.backward()


def train(backward: Callable[[nn.Module, torch.optim.Optimizer, int], None]) -> list[dict[str, torch.Tensor]]:
    """STEPS steps of ``backward`` then ``optimizer.step()``; a snapshot after each."""
    model, optimizer = build()
    held = []
    for step in range(STEPS):
        optimizer.zero_grad()
        backward(model, optimizer, step)
        optimizer.step()
        held.append(snapshot(model, optimizer))
    return held


def main() -> None:
    torch.set_num_threads(1)
    out, use_ddp = Path(sys.argv[1]), "--no-ddp" not in sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    wrapped: dict[int, nn.Module] = {}

    def half_batch(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        if id(model) not in wrapped:  # wrapped after amp.initialize, as the HF Trainer and timm do
            wrapped[id(model)] = nn.parallel.DistributedDataParallel(model) if use_ddp else model
        x, y = batch(step)
        part = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
        loss = nn.functional.mse_loss(wrapped[id(model)](x[part]).float(), y[part])
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()

    torch.save(train(half_batch), out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
