"""Data-parallel training with apex_amp under torchrun, then a check that every rank agrees bit for bit.

    torchrun --nproc_per_node=2 examples/distributed.py                      # O2, bf16, FusedAdam
    torchrun --nproc_per_node=2 examples/distributed.py --opt-level O1 --steps 50
    torchrun --nproc_per_node=2 examples/distributed.py --accumulate 4 --inject-overflow 1:3
    torchrun --nproc_per_node=2 examples/distributed.py --unwrapped-head --sync-overflow --inject-overflow 1:3
    torchrun --nproc_per_node=2 examples/distributed.py --loss-scale dynamic --save-at 10 --checkpoint ckpt.pt
    torchrun --nproc_per_node=2 examples/distributed.py --loss-scale dynamic --resume ckpt.pt
    torchrun --nproc_per_node=2 examples/distributed.py --fsdp --opt-level O1 --inject-overflow 1:3

The order is ``amp.initialize`` first, then ``DistributedDataParallel`` around
the model it returns. Every rank builds the same seeded model and trains on
its own shard of a generated, seeded data set. The backend is gloo on CPU and
NCCL when CUDA is available.

With ``--accumulate K`` each optimizer step runs K micro-batches, the first
K-1 under ``ddp.no_sync()``; ``model=ddp`` is passed to ``amp.scale_loss`` so
those passes keep their gradients scaled and local until the synchronising
pass all-reduces them, and every rank then takes the same skip decision.
``--inject-overflow RANK:STEP`` multiplies the first micro-batch loss of that
step by inf on that rank only (``--no-model-arg`` drops ``model=ddp`` to show
the ranks drifting apart without it).

``--unwrapped-head`` adds a second model outside the DDP wrapper (a linear
head on its own optimizer, as a loss module with parameters would be), whose
gradients the script all-reduces itself after ``scale_loss``; the injected
overflow then reaches the head of one rank only. Each rank checks its own
head gradients, so without ``--sync-overflow`` (``amp.initialize(...,
sync_overflow=True)``, a MAX all-reduce of the found-inf flag) the ranks take
different skip decisions and drift apart.

``--unequal-init`` seeds each rank's model differently: DDP broadcasts rank
0's weights, and amp broadcasts rank 0's fp32 masters (made by ``initialize``
from each rank's own weights) the first time ``scale_loss`` runs after a
forward through the wrapper, with or without ``model=ddp``. With
``--no-model-arg --clear-through-model`` this is apex's own
``examples/simple/distributed`` pattern: initialize, wrap, train with plain
``scale_loss(loss, optimizer)``, clear gradients with ``model.zero_grad()``.

``--fsdp`` wraps the model in ``FullyShardedDataParallel(use_orig_params=True)``
instead (O0/O1; other levels raise), builds the optimizer over the sharded
parameters and compares the gathered full weights and optimizer state. Each
rank checks its own gradient shard, so amp synchronises found-inf by itself;
the injected overflow reaches the last bias only, which lies in one shard
(``--no-sync-overflow`` turns the sync off to show the ranks disagree).

Checkpoints: ``--save-at STEP --checkpoint PATH`` makes rank 0 save the
model, optimizer and ``amp.state_dict()`` after STEP steps (training goes
on); ``--resume PATH`` loads them on every rank (after ``amp.initialize``,
before DDP) and trains from that step to ``--steps``. ``--state-out PATH``
makes rank 0 save its final state and per-step losses, so two runs can be
compared bit for bit.

At the end every rank compares its master weights (``amp.master_params``),
model weights and buffers, optimizer state, amp state (loss scale and
counters) and its list of skipped steps with rank 0's, bitwise. Rank 0 prints
a summary; the exit code is 1 on any difference.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
from typing import Iterator, Optional

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
    parser.add_argument("--loss-scale", default=None, help="'dynamic' or a number (amp's default otherwise)")
    parser.add_argument("--scale-window", type=int, default=2000, help="clean steps before a dynamic scale grows")
    parser.add_argument("--unwrapped-head", action="store_true",
                        help="a second model outside DDP whose gradients the script all-reduces itself")
    parser.add_argument("--sync-overflow", action="store_true", help="amp.initialize(..., sync_overflow=True)")
    parser.add_argument("--unequal-init", action="store_true", help="seed each rank's model differently")
    parser.add_argument("--clear-through-model", action="store_true",
                        help="clear gradients with model.zero_grad() instead of optimizer.zero_grad()")
    parser.add_argument("--save-at", type=int, default=None, metavar="STEP",
                        help="rank 0 saves a checkpoint to --checkpoint after STEP steps")
    parser.add_argument("--checkpoint", default=None, metavar="PATH")
    parser.add_argument("--resume", default=None, metavar="PATH", help="load this checkpoint on every rank")
    parser.add_argument("--state-out", default=None, metavar="PATH",
                        help="rank 0 saves its final state and per-step losses here (torch.save)")
    parser.add_argument("--fsdp", action="store_true",
                        help="FullyShardedDataParallel(use_orig_params=True) instead of DDP (O0/O1 only)")
    parser.add_argument("--no-sync-overflow", action="store_true",
                        help="amp.initialize(..., sync_overflow=False): turn off FSDP's automatic sync")
    args = parser.parse_args(argv)
    if args.fsdp and (args.unwrapped_head or args.accumulate > 1 or args.resume or args.save_at is not None):
        parser.error("--fsdp trains one model without accumulation or checkpoints")
    if (args.save_at is None) != (args.checkpoint is None):
        parser.error("--save-at and --checkpoint go together")
    if args.save_at is not None and not 1 <= args.save_at <= args.steps:
        parser.error("--save-at must be in [1, --steps]")
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


@dataclasses.dataclass
class Job:
    """What this rank trains: the DDP-wrapped model and, with --unwrapped-head, a head outside DDP."""

    ddp: nn.Module
    optimizer: torch.optim.Optimizer
    head: Optional[nn.Module] = None
    head_optimizer: Optional[torch.optim.Optimizer] = None

    @property
    def models(self) -> list[nn.Module]:
        return [self.ddp.module] + ([self.head] if self.head is not None else [])

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer] + ([self.head_optimizer] if self.head_optimizer is not None else [])


def make_models(hidden: int, unwrapped_head: bool) -> tuple[nn.Module, Optional[nn.Module]]:
    body = [nn.Linear(NUM_FEATURES, hidden), nn.LayerNorm(hidden), nn.ReLU()]
    head = nn.Linear(hidden, NUM_CLASSES)
    if unwrapped_head:
        return nn.Sequential(*body), head
    return nn.Sequential(*body, head), None


def make_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    if args.optimizer == "FusedAdam":
        return FusedAdam(model.parameters(), lr=args.lr)
    return torch.optim.SGD(model.parameters(), lr=args.lr * 10, momentum=0.9)


def average_head_grads(head_optimizer: torch.optim.Optimizer) -> None:
    # DDP does not reduce the head's gradients: average them here, after amp checked and unscaled
    # them. Each rank checked only its own, hence sync_overflow for one skip decision.
    for param in amp.master_params(head_optimizer):
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad.div_(dist.get_world_size())


def train(args, job: Job, x: Tensor, y: Tensor, rank: int, start_step: int) -> tuple[list[bool], list[float]]:
    skipped, losses = [], []
    model_arg = None if args.no_model_arg else job.ddp
    for step in range(start_step, args.steps):
        if args.clear_through_model:  # never reaches O2's masters: amp's step consumes their gradients
            for model in job.models:
                model.zero_grad()
        else:
            for optimizer in job.optimizers:
                optimizer.zero_grad(set_to_none=True)
        for micro in range(args.accumulate):
            start = ((step * args.accumulate + micro) * args.batch_size) % (len(x) - args.batch_size + 1)
            xb, yb = x[start:start + args.batch_size], y[start:start + args.batch_size]
            synced = micro == args.accumulate - 1
            inject = args.overflow_at == (rank, step) and micro == 0
            with contextlib.nullcontext() if synced else job.ddp.no_sync():
                last_bias = capture_last_bias(job.ddp) if inject and args.fsdp else contextlib.nullcontext([])
                with last_bias as biases:
                    features = job.ddp(xb)
                logits = job.head(features) if job.head is not None else features
                loss = nn.functional.cross_entropy(logits, yb)
                if inject:
                    if args.fsdp:  # into the last bias only, which lies in one rank's gradient shard
                        loss = loss + biases[0].float().sum() * float("inf")
                    elif job.head is None:
                        loss = loss * float("inf")
                    else:  # an extra term on this rank only, reaching the head's gradients only
                        loss = loss + job.head.weight.float().sum() * float("inf")
                with amp.scale_loss(loss / args.accumulate, job.optimizers, model=model_arg) as scaled_loss:
                    scaled_loss.backward()
        if job.head_optimizer is not None:
            average_head_grads(job.head_optimizer)
        for optimizer in job.optimizers:
            optimizer.step()
        skipped.append(amp.step_was_skipped(job.optimizer))  # one host read per step: fine for an example
        losses.append(loss.item())
        if args.save_at == step + 1:
            save_checkpoint(args.checkpoint, job, steps_done=step + 1)
    return skipped, losses


@contextlib.contextmanager
def capture_last_bias(fsdp: nn.Module) -> Iterator[list[Tensor]]:
    # The last layer's bias as its forward sees it (FSDP's unsharded view, part of the graph).
    captured: list[Tensor] = []
    handle = fsdp.module[-1].register_forward_hook(lambda module, args, output: captured.append(module.bias))
    try:
        yield captured
    finally:
        handle.remove()


def save_checkpoint(path: str, job: Job, steps_done: int) -> None:
    # Under O2 model.state_dict() holds the fp32 masters, so the checkpoint is exact.
    if dist.get_rank() == 0:
        torch.save({
            "steps_done": steps_done,
            "models": [model.state_dict() for model in job.models],
            "optimizers": [optimizer.state_dict() for optimizer in job.optimizers],
            "amp": amp.state_dict(),
        }, path)
    dist.barrier()  # the file is complete before any rank could read it


def load_checkpoint(path: str, models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                    device: torch.device) -> int:
    # After amp.initialize (the model's load pre-hook fills the masters, torch rounds the half
    # weights) and before DDP (whose broadcast then finds equal weights everywhere).
    checkpoint = torch.load(path, map_location=device, weights_only=True)
    for model, state in zip(models, checkpoint["models"], strict=True):
        model.load_state_dict(state)
    for optimizer, state in zip(optimizers, checkpoint["optimizers"], strict=True):
        optimizer.load_state_dict(state)
    amp.load_state_dict(checkpoint["amp"])
    return checkpoint["steps_done"]


def named_state(job: Job) -> Iterator[tuple[str, Tensor]]:
    if isinstance(job.ddp, nn.parallel.DistributedDataParallel):
        yield from named_local_state(job)
    else:
        yield from named_fsdp_state(job)


def named_fsdp_state(job: Job) -> Iterator[tuple[str, Tensor]]:
    # Each rank holds shards: compare the gathered full weights and optimizer state.
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(job.ddp):
        for name, param in job.ddp.module.named_parameters():
            yield f"full param {name}", param.detach().clone()
    for key, state in sorted(FSDP.optim_state_dict(job.ddp, job.optimizer)["state"].items()):
        for name, value in sorted(state.items()):
            yield f"full optimizer state[{key}][{name}]", as_tensor(value)
    yield from named_amp_state()


def named_amp_state() -> Iterator[tuple[str, Tensor]]:
    for section, entries in amp.state_dict().items():  # loss scale and counters, and amp's config
        for key, value in sorted(entries.items()):
            yield f"amp {section}.{key}", as_tensor(value)


def named_local_state(job: Job) -> Iterator[tuple[str, Tensor]]:
    for which, optimizer in enumerate(job.optimizers):
        for index, param in enumerate(amp.master_params(optimizer)):
            yield f"optimizer{which} master[{index}]", param.detach()
        for index, state in sorted(optimizer.state_dict()["state"].items()):
            for key, value in sorted(state.items()):
                yield f"optimizer{which} state[{index}][{key}]", as_tensor(value)
    for which, model in enumerate(job.models):
        for name, tensor in model.state_dict(keep_vars=True).items():
            yield f"model{which} state_dict {name}", tensor.detach()
        for name, param in model.named_parameters():
            yield f"model{which} param {name}", param.detach()  # the half weights under O2
    yield from named_amp_state()


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

    # The same initial weights on every rank, unless --unequal-init (then DDP and amp broadcast rank 0's).
    torch.manual_seed(args.seed + (rank if args.unequal_init else 0))
    model, head = make_models(args.hidden, args.unwrapped_head)
    models = [model.to(device)] + ([head.to(device)] if head is not None else [])
    if args.fsdp:  # FSDP first: the optimizer and amp then see the sharded parameters
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        models = [FSDP(model, use_orig_params=True, device_id=device)]
    optimizers = [make_optimizer(args, m) for m in models]
    # None: amp's default (on for FSDP, off for DDP, whose all-reduced gradients already agree).
    sync_overflow = True if args.sync_overflow else (False if args.no_sync_overflow else None)
    amp.initialize(models, optimizers, opt_level=args.opt_level, half_dtype=getattr(torch, args.half_dtype),
                   loss_scale=args.loss_scale, scale_window=args.scale_window,
                   sync_overflow=sync_overflow, verbosity=0)
    start_step = 0 if args.resume is None else load_checkpoint(args.resume, models, optimizers, device)
    if args.fsdp:
        ddp = models[0]
    else:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    job = Job(ddp, optimizers[0], head, optimizers[1] if head is not None else None)

    samples = world_size * args.batch_size * args.accumulate * 4
    x, y = make_shard(rank, world_size, samples, args.seed, device)
    skipped, losses = train(args, job, x, y, rank, start_step)

    named = list(named_state(job))
    differing = compare_with_rank0(named, device)
    skipped_per_rank = [None] * world_size
    dist.all_gather_object(skipped_per_rank, skipped)
    differing_per_rank = [None] * world_size
    dist.all_gather_object(differing_per_rank, differing)
    same_skips = all(s == skipped_per_rank[0] for s in skipped_per_rank)
    all_identical = same_skips and not any(differing_per_rank)

    def skipped_steps(flags: list[bool]) -> list[int]:
        return [start_step + i for i, was_skipped in enumerate(flags) if was_skipped]

    if rank == 0:
        if args.state_out is not None:
            torch.save({"state": {name: tensor.cpu().clone() for name, tensor in named},
                        "losses": torch.tensor(losses, dtype=torch.float64), "first_step": start_step,
                        "skipped": skipped}, args.state_out)
        print(f"{args.opt_level} {args.half_dtype} {args.optimizer}: {world_size} ranks "
              f"({dist.get_backend()}), steps {start_step}..{args.steps - 1} x {args.accumulate} micro-batches, "
              f"last loss on rank 0 {losses[-1] if losses else float('nan'):.4f}, "
              f"loss scale {amp.loss_scale():g}, skipped steps {skipped_steps(skipped)}")
        if all_identical:
            print(f"RESULT: all {world_size} ranks identical: {len(named)} tensors (master weights, model "
                  "weights, optimizer state, loss scale) and the skip decisions")
        else:
            print("RESULT: ranks differ")
            if not same_skips:
                for other, other_skipped in enumerate(skipped_per_rank):
                    print(f"  rank {other} skipped steps {skipped_steps(other_skipped)}")
            for other, names in enumerate(differing_per_rank):
                if names:
                    print(f"  rank {other} differs from rank 0 in {len(names)} tensors, e.g. {names[:4]}")
    return all_identical


if __name__ == "__main__":
    exit_code = main()
    # Leave without finalising the interpreter. Even after destroy_process_group(), gloo's worker
    # threads (torch 2.14) can still drop a finished work item that holds Python tensors, and doing
    # so during finalisation aborts the process ("terminate called without an active exception",
    # seen in about 1 run in 50 even with the gc.collect() above). Nothing is left to clean up here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
