"""Two gloo ranks train O2 + fp8 under DDP on different data; each prints its fp8 state (tests/test_fp8_training.py)."""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdam


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, fp8=True,
                                      verbosity=0)
    ddp = nn.parallel.DistributedDataParallel(model)
    generator = torch.Generator().manual_seed(10 + rank)  # each rank its own data, of its own magnitude
    local_amaxes = []
    for step in range(3):
        x = torch.randn(16, 32, generator=generator) * (1 + 3 * rank)
        local_amaxes.append(float(x.bfloat16().abs().max()))
        with amp.scale_loss(ddp(x).float().pow(2).mean(), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = amp.state_dict()["fp8"]
    digest = hashlib.sha256(state["amax_history"].numpy().tobytes() + state["scale"].numpy().tobytes()).hexdigest()
    gathered = [None, None]
    dist.all_gather_object(gathered, local_amaxes)
    # The agreed input amax of the last step is the larger rank's.
    agreed = float(state["amax_history"][1, 0])
    print(f"rank {rank} FP8STATE {digest} {agreed == max(gathered[0][-1], gathered[1][-1])}", flush=True)
    if rank == 0:
        print(f"LOCAL-AMAX-DIFFER {gathered[0] != gathered[1]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
