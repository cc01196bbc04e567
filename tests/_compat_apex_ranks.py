"""One rank of the 2-process check of apex.parallel (run by tests/test_compat_apex.py on gloo).

Each rank holds half of a batch that both ranks can rebuild from the seed, so the expected
results are computed locally, without communication, and compared with what apex.parallel gives.
Prints one JSON object: the largest absolute difference of each check (0 means bitwise equal).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import apex
from apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

torch.set_num_threads(1)
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world_size)
generator = torch.Generator().manual_seed(0)
batches = torch.randn(world_size, 6, 5, generator=generator)  # one (6, 5) batch per rank
errors: dict[str, float] = {}


def linear(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(5, 3).to(dtype)


def local_grads(batch: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    model = linear(dtype)
    model(batch.to(dtype)).pow(2).sum().backward()
    return [p.grad.float() for p in model.parameters()]


def ddp_grads(dtype: torch.dtype = torch.float32, **apex_arguments) -> list[torch.Tensor]:
    model = DistributedDataParallel(linear(dtype), **apex_arguments)
    model(batches[rank].to(dtype)).pow(2).sum().backward()
    return [p.grad.float() for p in model.module.parameters()]


def max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


per_rank = [local_grads(batches[r], torch.float32) for r in range(world_size)]
summed = [sum(grads) for grads in zip(*per_rank)]
averaged = [total / world_size for total in summed]
errors["ddp_average"] = max_error(ddp_grads(), averaged)
errors["ddp_average_delay_allreduce"] = max_error(ddp_grads(delay_allreduce=True), averaged)
errors["ddp_predivide_4"] = max_error(ddp_grads(gradient_predivide_factor=4.0), averaged)
errors["ddp_sum"] = max_error(ddp_grads(gradient_average=False), summed)
errors["ddp_sum_predivide_2"] = max_error(ddp_grads(gradient_average=False, gradient_predivide_factor=2.0),
                                          [total / 2 for total in summed])
half_per_rank = [local_grads(batches[r], torch.float16) for r in range(world_size)]
# Summed in fp32, rounded to fp16 once at the end: what an fp32 reduction of fp16 gradients gives.
half_averaged = [(sum(grads) / world_size).half().float() for grads in zip(*half_per_rank)]
fp32_model = DistributedDataParallel(linear(torch.float16), allreduce_always_fp32=True)
fp32_model(batches[rank].half()).pow(2).sum().backward()
errors["ddp_fp32_reduce_of_half_grads"] = max_error([p.grad.float() for p in fp32_model.module.parameters()],
                                                    half_averaged)
errors["ddp_fp32_reduce_keeps_half_grads"] = float(any(p.grad.dtype != torch.float16
                                                       for p in fp32_model.module.parameters()))

# SyncBatchNorm on CPU against one BatchNorm over the whole batch (both ranks' halves).
images = torch.randn(world_size * 4, 3, 5, 5, generator=generator)
weights = torch.randn(images.shape, generator=generator)  # a loss that weighs every output differently
reference = nn.BatchNorm2d(3)
with torch.no_grad():
    reference.weight.uniform_(0.5, 1.5, generator=generator)
    reference.bias.uniform_(-0.5, 0.5, generator=generator)
full = images.clone().requires_grad_()
expected_out = reference(full)
(expected_out * weights).sum().backward()
own = slice(rank * 4, (rank + 1) * 4)

for channel_last in (False, True):
    model = convert_syncbn_model(nn.Sequential(nn.BatchNorm2d(3)), channel_last=channel_last)
    with torch.no_grad():
        model[0].weight.copy_(reference.weight)
        model[0].bias.copy_(reference.bias)
    # channel_last layers take (N, H, W, C): hand them that, and turn the output back.
    to_layer, from_layer = ((lambda t: t.movedim(1, -1)), (lambda t: t.movedim(-1, 1))) if channel_last else (
        (lambda t: t), (lambda t: t))
    mine = images[own].clone().requires_grad_()
    out = from_layer(model(to_layer(mine)))
    (out * weights[own]).sum().backward()
    name = "syncbn_channel_last" if channel_last else "syncbn"
    errors[f"{name}_output"] = float((out - expected_out[own]).detach().abs().max())
    errors[f"{name}_input_grad"] = float((mine.grad - full.grad[own]).abs().max())
    # Weight gradients are per rank (DDP averages them later): the ranks' sum is the whole batch's.
    weight_grad = model[0].weight.grad.clone()
    dist.all_reduce(weight_grad)
    errors[f"{name}_weight_grad_sum"] = float((weight_grad - reference.weight.grad).abs().max())
    errors[f"{name}_running_mean"] = float((model[0].running_mean - reference.running_mean).abs().max())
    errors[f"{name}_running_var"] = float((model[0].running_var - reference.running_var).abs().max())

whole = create_syncbn_process_group(world_size)
singles = create_syncbn_process_group(1)
errors["syncbn_group_sizes"] = float(abs(dist.get_world_size(whole) - world_size) + abs(dist.get_world_size(singles) - 1))
errors["syncbn_group_zero_is_world"] = float(create_syncbn_process_group(0) is not None)
errors["syncbn_is_apex"] = float(not isinstance(model[0], SyncBatchNorm))

# Rank 0 hosts the store every rank talks to: nobody leaves before all are done with it.
dist.barrier()
print(json.dumps({"rank": rank, "apex": apex.__file__, "errors": errors}))
sys.stdout.flush()
dist.destroy_process_group()
os._exit(0)
