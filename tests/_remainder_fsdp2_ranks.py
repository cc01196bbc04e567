"""Ranks training bf16 FSDP2 shards with remainder masters (tests/test_remainder_fsdp2.py, ...state_precision_fsdp2.py).

Launched on 1 or 2 gloo ranks by tests/_launch.py. Every rank builds the same seeded model and
shards it with ``fully_shard(..., MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))``:
a 64x64 hidden Linear sharded on its own (4096 elements: quantized by int8/fp8 state, in 64-element
blocks, 32 rows per rank on 2 ranks), the rest by the root (the 3-row output Linear unevenly).

``direct OPTIMIZERS PRECISIONS STEPS``: two bf16 models sharded alike (cast before ``fully_shard``),
one with ``master_weights=True`` (fp32 master shards in the state), one with ``"remainder"``; the
second gets the first one's gradient shards, an inf or a NaN is written into one rank's own shard
on some steps, the ranks agree on the skip (MAX all-reduce) and both optimizers step. After every
step each rank checks bitwise: remainder + weight == fp32 master, weight == the master rounded to
nearest, state codes (and absmaxes) equal.

``amp OPTIMIZERS PRECISIONS STEPS``: the same under ``amp.initialize``: O2 (fp32 shards, the
masters) against O2 with ``master_weights="remainder"`` (amp casts the shards to bf16 and keeps the
low halves), the same bf16-valued gradients fed to both inside ``amp.scale_loss``, overflows
injected into one rank's shard (amp's check and found-inf all-reduce skip them).

``whole OPTIMIZERS PRECISIONS STEPS``: an fp32 model sharded by ``fully_shard`` against the same model
unsharded on every rank, the whole batch on each (so the gradients agree): the sharded steps of the
optimizers with per-tensor norms (FusedLAMB, FusedNovoGrad) combine their shards' norms over the
ranks, so the weights follow the unsharded run's to rounding; rank 0 prints the largest
difference, relative to the largest weight. ``--local-norms`` takes that combination out (each
rank's norms of its own shards, as without it): the check must then fail.

OPTIMIZERS and PRECISIONS are comma-separated lists: every pair is a case, run one after the other in
the one process group (a launch costs a few seconds of start-up, more than most cases), each with
its own ``RESULT`` line naming it.

``run``: O2 with remainder masters and FusedAdam; ``--train A:B`` steps, ``--load``/``--save`` a DCP
checkpoint (``amp.checkpoint_state``), ``--out`` the full (gathered) state, ``--then N --then-out``
N more steps and their state. ``--same-data`` gives every rank the whole batch (the gradients are
then those of one rank: 1- and 2-rank runs compare bitwise).

Rank 0 prints ``RESULT: ...`` per case; the exit code is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from _launch import CASE_PREFIXES  # (tests/, this script's folder, is on sys.path)
from apex_amp import amp, memory_report
from apex_amp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from apex_amp.optimizers.fused_optimizer import AmpStepArgs
from apex_amp.optimizers.state_formats import join_master, split_master

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
OPTIMIZERS = {
    "FusedAdam": lambda params, **kw: FusedAdam(params, lr=1e-2, weight_decay=0.01, **kw),
    "FusedSGD": lambda params, **kw: FusedSGD(params, lr=0.05, momentum=0.9, **kw),
    "FusedAdagrad": lambda params, **kw: FusedAdagrad(params, lr=1e-2, **kw),
    # Per-tensor norms: LAMB's trust ratios and clip, NovoGrad's second moments (L2 and L-infinity).
    "FusedLAMB": lambda params, **kw: FusedLAMB(params, lr=1e-2, weight_decay=0.01, max_grad_norm=0.5, **kw),
    "FusedNovoGrad": lambda params, **kw: FusedNovoGrad(params, lr=1e-2, betas=(0.95, 0.98), weight_decay=1e-3,
                                                        **kw),
    "FusedNovoGrad-linf": lambda params, **kw: FusedNovoGrad(params, lr=1e-2, norm_type=0, **kw),
}


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    # 3 outputs: the last Linear's rows do not split evenly over 2 ranks (FSDP2 pads rank 1's shard).
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 3))
    return model.to(dtype)


def shard(model: nn.Module) -> nn.Module:
    fully_shard(model[3], mp_policy=BF16)
    fully_shard(model, mp_policy=BF16)
    return model


def batch(step: int, same_data: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch: the global one split between the ranks, or all of it on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 16, generator=generator), torch.randint(3, (8,), generator=generator)
    if same_data:
        return x, y
    rank, world = dist.get_rank(), dist.get_world_size()
    return x[rank::world], y[rank::world]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def poisoned(step: int, steps: int) -> bool:
    return step % 17 == 3 or step == steps - 2


def poison_own_shard(model: nn.Module, step: int) -> None:
    # inf and NaN in turn, into the shard of the rank whose turn it is: no other rank holds it.
    if dist.get_rank() != step % dist.get_world_size():
        return
    for param in model.parameters():
        shard_of_grad = local(param.grad)
        if shard_of_grad.numel():
            shard_of_grad.view(-1)[step % shard_of_grad.numel()] = float("inf") if step % 2 else float("nan")
            return


def agreed_found_inf(model: nn.Module) -> torch.Tensor:
    found = torch.zeros(1)
    for param in model.parameters():
        if not torch.isfinite(local(param.grad)).all():
            found.fill_(1.0)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return found


def bits(tensor: torch.Tensor) -> torch.Tensor:
    tensor = local(tensor).detach()
    return tensor.contiguous().view(torch.uint8) if tensor.dtype != torch.bool else tensor


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def mismatches(masters: list[torch.Tensor], weights: list[torch.Tensor], remainders: list[torch.Tensor]) -> int:
    """Elements where weight + remainder is not the master, or the weight not the master rounded."""
    count = 0
    for master, weight, remainder in zip(masters, weights, remainders):
        master, weight = local(master).detach(), local(weight).detach()
        joined = join_master(weight, local(remainder))
        count += int((joined.view(torch.int32) != master.view(torch.int32)).sum())
        count += int((split_master(master)[0].view(torch.int16) != weight.view(torch.int16)).sum())
    return count


def state_mismatches(first: torch.optim.Optimizer, second: torch.optim.Optimizer, params) -> int:
    count = 0
    for p, q in params:
        a, b = first.state[p], second.state[q]
        for key in a.keys() - {"master_param"}:
            count += not same_bits(a[key], b[key])
        count += (b.keys() - {"master_remainder"}) != (a.keys() - {"master_param"})
    return count


def report(ok: bool, message: str, agreed: str = "bitwise") -> bool:
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, ok)
    if dist.get_rank() == 0:
        print(f"RESULT: {agreed if all(verdicts) else 'differ'} on {len(verdicts)} rank(s): {message}", flush=True)
    return all(verdicts)


def total(count: int) -> int:
    summed = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(summed)
    return int(summed)


# ---- direct: the fused optimizers on a bf16 model sharded by fully_shard -------------------------
def direct(args: argparse.Namespace, optimizer: str, precision: str) -> bool:
    build = OPTIMIZERS[optimizer]
    reference, model = shard(make_model(torch.bfloat16)), shard(make_model(torch.bfloat16))
    pairs = list(zip(reference.parameters(), model.parameters()))
    with_masters = build(reference.parameters(), master_weights=True, state_precision=precision)
    with_remainders = build(model.parameters(), master_weights="remainder", state_precision=precision)
    wrong, skipped = 0, []
    for step in range(args.steps):
        loss_of(reference, *batch(step, same_data=False)).backward()
        if poisoned(step, args.steps):
            poison_own_shard(reference, step)
        for p, q in pairs:
            q.grad = p.grad.detach().clone()  # a DTensor: the same shards
        found_inf = agreed_found_inf(reference)
        if found_inf.item():
            skipped.append(step)
        for stepped in (with_masters, with_remainders):
            stepped.step(amp=AmpStepArgs(found_inf=found_inf))
            stepped.zero_grad()
        wrong += mismatches([with_masters.state[p]["master_param"] for p, _ in pairs], [q for _, q in pairs],
                            [with_remainders.state[q]["master_remainder"] for _, q in pairs])
        wrong += state_mismatches(with_masters, with_remainders, pairs)
    formats = sorted({str(local(v).dtype) for s in with_remainders.state.values() for v in s.values()})
    shards = [local(q).numel() for _, q in pairs]
    return report(total(wrong) == 0, f"{CASE_PREFIXES['direct']}{optimizer} {precision}: {args.steps} steps, "
                                     f"skipped {skipped}, {total(wrong)} mismatches, state formats {formats}, "
                                     f"local numels {shards}")


# ---- amp: O2 with fp32 shards against O2 with remainder masters ------------------------------------
def amp_pair(args: argparse.Namespace, optimizer: str, precision: str) -> bool:
    fp32_shards, bf16_shards = shard(make_model()), shard(make_model())
    build = OPTIMIZERS[optimizer]
    with_masters = build(fp32_shards.parameters(), state_precision=precision)
    with_remainders = build(bf16_shards.parameters(), state_precision=precision)
    amp.initialize(fp32_shards, with_masters, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    amp.initialize(bf16_shards, with_remainders, opt_level="O2", half_dtype=torch.bfloat16,
                   master_weights="remainder", verbosity=0)
    pairs = list(zip(fp32_shards.parameters(), bf16_shards.parameters()))
    dtypes = sorted({str(q.dtype) for _, q in pairs})

    def remainders():
        return [with_remainders.state[q]["master_remainder"] for _, q in pairs]

    wrong = mismatches([p for p, _ in pairs], [q for _, q in pairs], remainders())  # from the fp32 weights
    skipped = []
    for step in range(args.steps):
        x, y = batch(step, same_data=False)
        with amp.scale_loss(loss_of(fp32_shards, x, y), with_masters) as scaled_loss:
            scaled_loss.backward()
            # FSDP2 rounds the bf16 shards' reduced gradients to bf16: feed both runs those values.
            for p, _ in pairs:
                local(p.grad).copy_(local(p.grad).bfloat16())
            if poisoned(step, args.steps):
                poison_own_shard(fp32_shards, step)
        with amp.scale_loss(loss_of(bf16_shards, x, y), with_remainders) as scaled_loss:
            scaled_loss.backward()
            for p, q in pairs:
                local(q.grad).copy_(local(p.grad))  # bf16 values: exact
        for stepped in (with_masters, with_remainders):
            stepped.step()
            stepped.zero_grad()
        if amp.step_was_skipped(with_masters) != amp.step_was_skipped(with_remainders):
            wrong += 1
        if amp.step_was_skipped(with_remainders):
            skipped.append(step)
        wrong += mismatches([p for p, _ in pairs], [q for _, q in pairs], remainders())
        wrong += state_mismatches(with_masters, with_remainders, pairs)
    return report(total(wrong) == 0, f"{CASE_PREFIXES['amp']}{optimizer} {precision}: {args.steps} steps, skipped "
                                     f"{skipped}, {total(wrong)} mismatches, remainder run's params {dtypes}")


# ---- whole: sharded against unsharded, for the optimizers with per-tensor norms ---------------------
def whole(args: argparse.Namespace, optimizer: str, precision: str) -> bool:
    build = OPTIMIZERS[optimizer]
    if args.local_norms:
        from apex_amp.optimizers import fused_lamb, fused_novograd

        for module in (fused_lamb, fused_novograd):
            module.reduce_over_shards = lambda values, owners, op="sum": values
    sharded, plain = make_model(), make_model()
    fully_shard(sharded[3])
    fully_shard(sharded)
    pairs = list(zip(sharded.parameters(), plain.parameters()))
    optimizers = [build(sharded.parameters(), state_precision=precision),
                  build(plain.parameters(), state_precision=precision)]
    largest_difference = 0.0
    for step in range(args.steps):
        x, y = batch(step, same_data=True)
        for model in (sharded, plain):
            loss_of(model, x, y).backward()
        for stepped in optimizers:
            stepped.step()
            stepped.zero_grad()
        for p, q in pairs:
            difference = float((p.full_tensor() - q).abs().max() / q.abs().max())
            largest_difference = max(largest_difference, difference)
    steps = {float(full_group_step(o)) for o in optimizers}
    tolerance = args.tolerance[precision]
    return report(largest_difference < tolerance and steps == {float(args.steps)},
                  f"{CASE_PREFIXES['whole']}{optimizer} {precision}: {args.steps} steps, sharded against "
                  f"unsharded: largest difference {largest_difference:.2e} of the largest weight "
                  f"(tolerance {tolerance:g}), "
                  f"step counts {sorted(steps)}", agreed="close")


def full_group_step(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    return optimizer.param_groups[0]["step"]


# ---- run: one O2 remainder run, with checkpoints -------------------------------------------------
# gloo's collectives take neither int16 (remainders) nor float8 (fp8 state codes).
GATHERED_AS = {torch.int16: torch.bfloat16, torch.float8_e4m3fn: torch.uint8}


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Weights, optimizer state and step counts gathered whole (collectives: every rank calls it)."""
    def full(value):
        if isinstance(value, DTensor) and value.dtype in GATHERED_AS:  # gathered as bytes of a dtype gloo takes
            carrier = GATHERED_AS[value.dtype]
            as_carrier = DTensor.from_local(value.to_local().view(carrier), value.device_mesh, value.placements,
                                            shape=value.shape, stride=value.stride())
            return as_carrier.full_tensor().view(value.dtype)
        value = value.full_tensor() if isinstance(value, DTensor) else value
        return value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)

    names = {param: name for name, param in model.named_parameters()}
    state = {f"weight {name}": full(param) for name, param in model.named_parameters()}
    for param, entries in optimizer.state.items():
        for key, value in sorted(entries.items()):
            state[f"state {names[param]}.{key}"] = full(value)
    for index, group in enumerate(optimizer.param_groups):
        state[f"group {index} step"] = full(group["step"])
    return state


def save_state(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    state = full_state(model, optimizer)
    if dist.get_rank() == 0:
        torch.save({"state": state, "amp": amp.state_dict()}, path)


def train(model, optimizer, steps: range, same_data: bool, last: int) -> list[int]:
    skipped = []
    for step in steps:
        x, y = batch(step, same_data)
        with amp.scale_loss(loss_of(model, x, y), optimizer) as scaled_loss:
            scaled_loss.backward()
            if poisoned(step, last):
                poison_own_shard(model, step)
        optimizer.step()
        if amp.step_was_skipped(optimizer):
            skipped.append(step)
        optimizer.zero_grad()
    return skipped


def run(args: argparse.Namespace) -> bool:
    model = shard(make_model())
    optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01, state_precision=args.precision)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
                   master_weights="remainder" if args.remainder else None)
    if args.load:
        dcp.load({"train": amp.checkpoint_state(model, optimizer)}, checkpoint_id=args.load)
    start, stop = (int(part) for part in args.train.split(":"))
    last = stop + args.then
    skipped = train(model, optimizer, range(start, stop), args.same_data, last)
    if args.memory and stop > start:
        x, y = batch(stop, args.same_data)  # between backward and step, with the state: the peak
        with amp.scale_loss(loss_of(model, x, y), optimizer) as scaled_loss:
            scaled_loss.backward()
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, str(memory_report(model, optimizer)))
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            for rank, row in enumerate(rows):
                print(f"memory_report on rank {rank}:\n{row}", flush=True)
    if args.save:
        dcp.save({"train": amp.checkpoint_state(model, optimizer)}, checkpoint_id=args.save)
    if args.out:
        save_state(args.out, model, optimizer)
    if args.then:
        skipped += train(model, optimizer, range(stop, stop + args.then), args.same_data, last)
        save_state(args.then_out, model, optimizer)
    return report(True, f"run: steps {start}..{stop + args.then - 1}, skipped {skipped}, params "
                        f"{sorted({str(p.dtype) for p in model.parameters()})}")


PRECISIONS = ("fp32", "bf16", "fp8", "int8")


def names_from(choices):
    """An argparse type: a comma-separated list of ``choices``."""
    def parse(text: str) -> list[str]:
        names = text.split(",")
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"{unknown} not among {sorted(choices)}")
        return names
    return parse


def tolerances(text: str) -> dict[str, float]:
    """``1e-5`` for every precision, or ``fp32=1e-5,int8=5e-3`` (the others: 1e-5)."""
    if "=" not in text:
        return dict.fromkeys(PRECISIONS, float(text))
    given = {name: float(value) for name, value in (part.split("=") for part in text.split(","))}
    return {name: given.get(name, 1e-5) for name in PRECISIONS}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    modes = parser.add_subparsers(dest="mode", required=True)
    cases = {name: modes.add_parser(name) for name in ("direct", "amp", "whole")}
    for mode in cases.values():
        mode.add_argument("optimizers", type=names_from(OPTIMIZERS), help="e.g. FusedAdam,FusedSGD")
        mode.add_argument("precisions", type=names_from(PRECISIONS), help="e.g. fp32,int8")
        mode.add_argument("steps", type=int)
    cases["whole"].add_argument("--tolerance", type=tolerances, default=tolerances("1e-5"))
    cases["whole"].add_argument("--local-norms", action="store_true", help="without combining the shards' norms")
    mode = modes.add_parser("run")
    mode.add_argument("--precision", default="int8")
    mode.add_argument("--remainder", action="store_true", help="master_weights='remainder' (else O2's fp32 shards)")
    mode.add_argument("--train", default="0:0", metavar="A:B", help="steps A..B-1")
    mode.add_argument("--same-data", action="store_true")
    mode.add_argument("--load")
    mode.add_argument("--save")
    mode.add_argument("--out")
    mode.add_argument("--then", type=int, default=0)
    mode.add_argument("--then-out")
    mode.add_argument("--memory", action="store_true", help="print each rank's memory_report")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if args.mode == "run":
            ok = run(args)
        else:
            case = {"direct": direct, "amp": amp_pair, "whole": whole}[args.mode]
            # Every case runs, so that one failure does not hide how the others went.
            ok = all([case(args, optimizer, precision) for optimizer in args.optimizers
                      for precision in args.precisions])
    finally:
        gc.collect()  # as examples/fsdp.py: destroy the group while Python is alive
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    os._exit(main())
