"""Data-parallel training with apex_amp under torchrun, then a check that every rank agrees bit for bit.

    torchrun --nproc_per_node=2 examples/distributed.py                      # O2, bf16, FusedAdam
    torchrun --nproc_per_node=2 examples/distributed.py --opt-level O1 --steps 50
    torchrun --nproc_per_node=2 examples/distributed.py --accumulate 4 --inject-overflow 1:3

The order is ``amp.initialize`` first, then ``DistributedDataParallel`` around
the model it returns. Every rank builds the same seeded model (the fp32 master
weights are made by ``initialize`` before DDP broadcasts rank 0's weights, so
the ranks must start equal) and trains on its own shard of a generated,
seeded data set. The backend is gloo on CPU and NCCL when CUDA is available.

With ``--accumulate K`` each optimizer step runs K micro-batches, the first
K-1 under ``ddp.no_sync()``; ``model=ddp`` is passed to ``amp.scale_loss`` so
those passes keep their gradients scaled and local until the synchronising
pass all-reduces them, and every rank then takes the same skip decision.
``--inject-overflow RANK:STEP`` multiplies the first micro-batch loss of that
step by inf on that rank only (``--no-model-arg`` drops ``model=ddp`` to show
the ranks drifting apart without it).

At the end every rank compares its master weights (``amp.master_params``),
model weights and buffers, optimizer state, amp state (loss scale and
counters) and its list of skipped steps with rank 0's, bitwise. Rank 0 prints
a summary; the exit code is 1 on any difference.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdam

NUM_FEATURES = 32
NUM_CLASSES = 4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=amp.OPT_LEVELS)
    parser.add_argument("--half-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--optimizer", default="FusedAdam", choices=["FusedAdam", "SGD"])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (K-1 under no_sync)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank and micro-batch")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inject-overflow", default=None, metavar="RANK:STEP",
                        help="multiply the first micro-batch loss of STEP by inf on RANK only")
    parser.add_argument("--no-model-arg", action="store_true",
                        help="do not pass model=ddp to amp.scale_loss (no_sync passes then diverge)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.accumulate < 1:
        parser.error("--steps and --accumulate must be >= 1")
    args.overflow_at = None
    if args.inject_overflow is not None:
        try:
            rank, step = (int(part) for part in args.inject_overflow.split(":"))
        except ValueError:
            parser.error(f"--inject-overflow expects RANK:STEP, got {args.inject_overflow!r}")
        args.overflow_at = (rank, step)
    return args


def make_shard(rank: int, world_size: int, num_samples: int, seed: int, device: torch.device):
    # Every rank draws the same data set and keeps every world_size-th sample.
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(NUM_CLASSES, NUM_FEATURES, generator=generator) * 2
    y = torch.randint(NUM_CLASSES, (num_samples,), generator=generator)
    x = centers[y] + torch.randn(num_samples, NUM_FEATURES, generator=generator)
    return x[rank::world_size].to(device), y[rank::world_size].to(device)


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(NUM_FEATURES, hidden), nn.LayerNorm(hidden), nn.ReLU(),
                         nn.Linear(hidden, NUM_CLASSES))


def train(args, ddp: nn.Module, optimizer, x: Tensor, y: Tensor, rank: int) -> tuple[list[bool], float]:
    skipped, loss_value = [], float("nan")
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(args.accumulate):
            start = ((step * args.accumulate + micro) * args.batch_size) % (len(x) - args.batch_size + 1)
            xb, yb = x[start:start + args.batch_size], y[start:start + args.batch_size]
            synced = micro == args.accumulate - 1
            with contextlib.nullcontext() if synced else ddp.no_sync():
                loss = nn.functional.cross_entropy(ddp(xb), yb)
                if args.overflow_at == (rank, step) and micro == 0:
                    loss = loss * float("inf")
                model_arg = None if args.no_model_arg else ddp
                with amp.scale_loss(loss / args.accumulate, optimizer, model=model_arg) as scaled_loss:
                    scaled_loss.backward()
        optimizer.step()
        skipped.append(amp.step_was_skipped(optimizer))  # one host read per step: fine for an example
        loss_value = loss.item()
    return skipped, loss_value


def named_state(ddp: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, Tensor]]:
    for index, param in enumerate(amp.master_params(optimizer)):
        yield f"master[{index}]", param.detach()
    for name, tensor in ddp.module.state_dict(keep_vars=True).items():
        yield f"model state_dict {name}", tensor.detach()
    for name, param in ddp.module.named_parameters():
        yield f"model param {name}", param.detach()  # the half weights under O2 (state_dict holds masters)
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            yield f"optimizer state[{index}][{key}]", as_tensor(value)
    for section, entries in amp.state_dict().items():  # loss scale and counters, and amp's config
        for key, value in sorted(entries.items()):
            yield f"amp {section}.{key}", as_tensor(value)


def as_tensor(value) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, (bool, int, float)):
        return torch.tensor(float(value), dtype=torch.float64)
    return torch.tensor(list(repr(value).encode()), dtype=torch.uint8)


def compare_with_rank0(named: list[tuple[str, Tensor]], device: torch.device) -> list[str]:
    """Names whose bytes differ from rank 0's (or a layout mismatch), as seen by this rank."""
    layout = [(name, str(t.dtype), tuple(t.shape)) for name, t in named]
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, layout)
    if layout != layouts[0]:
        return [f"tensor layout differs from rank 0 ({len(layout)} vs {len(layouts[0])} tensors)"]
    chunks = [t.cpu().contiguous().reshape(-1).view(torch.uint8) for _, t in named]
    local = torch.cat(chunks).to(device)
    reference = local.clone()
    dist.broadcast(reference, src=0)
    local, reference = local.cpu(), reference.cpu()
    differing, offset = [], 0
    for (name, _), chunk in zip(named, chunks):
        end = offset + chunk.numel()
        if not torch.equal(local[offset:end], reference[offset:end]):
            differing.append(name)
        offset = end
    return differing


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("run me under torchrun, e.g. `torchrun --nproc_per_node=2 examples/distributed.py`")
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        all_identical = train_and_compare(args, use_cuda)
    finally:
        # DDP's reducer keeps the process group alive past destroy_process_group(), and gloo's
        # worker threads may then release their last work item (holding Python tensors) while
        # the interpreter shuts down, which aborts the process ("terminate called without an
        # active exception", about one run in ten with torch 2.14). Collecting the dropped DDP
        # wrapper first lets the process group join its threads here, while Python is alive.
        gc.collect()
        dist.destroy_process_group()
    return 0 if all_identical else 1


def train_and_compare(args: argparse.Namespace, use_cuda: bool) -> bool:
    """Train on this rank's shard, compare everything with rank 0; True when all ranks agree."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)  # the same initial weights on every rank (see the module docstring)
    model = make_model(args.hidden).to(device)
    if args.optimizer == "FusedAdam":
        optimizer = FusedAdam(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * 10, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      half_dtype=getattr(torch, args.half_dtype), verbosity=0)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)

    samples = world_size * args.batch_size * args.accumulate * 4
    x, y = make_shard(rank, world_size, samples, args.seed, device)
    skipped, last_loss = train(args, ddp, optimizer, x, y, rank)

    named = list(named_state(ddp, optimizer))
    differing = compare_with_rank0(named, device)
    skipped_per_rank = [None] * world_size
    dist.all_gather_object(skipped_per_rank, skipped)
    differing_per_rank = [None] * world_size
    dist.all_gather_object(differing_per_rank, differing)
    same_skips = all(s == skipped_per_rank[0] for s in skipped_per_rank)
    all_identical = same_skips and not any(differing_per_rank)

    if rank == 0:
        skipped_steps = [step for step, was_skipped in enumerate(skipped) if was_skipped]
        print(f"{args.opt_level} {args.half_dtype} {args.optimizer}: {world_size} ranks "
              f"({dist.get_backend()}), {args.steps} steps x {args.accumulate} micro-batches, "
              f"last loss on rank 0 {last_loss:.4f}, loss scale {amp.loss_scale():g}, "
              f"skipped steps {skipped_steps}")
        if all_identical:
            print(f"RESULT: all {world_size} ranks identical: {len(named)} tensors (master weights, model "
                  "weights, optimizer state, loss scale) and the skip decisions")
        else:
            print("RESULT: ranks differ")
            if not same_skips:
                for other, other_skipped in enumerate(skipped_per_rank):
                    steps = [step for step, was_skipped in enumerate(other_skipped) if was_skipped]
                    print(f"  rank {other} skipped steps {steps}")
            for other, names in enumerate(differing_per_rank):
                if names:
                    print(f"  rank {other} differs from rank 0 in {len(names)} tensors, e.g. {names[:4]}")
    return all_identical


if __name__ == "__main__":
    sys.exit(main())
