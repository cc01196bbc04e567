"""apex.parallel.SyncBatchNorm and convert_syncbn_model on torch's SyncBatchNorm, plus a CPU path.

torch's SyncBatchNorm synchronises CUDA inputs only and raises for CPU ones once a process group
is up; apex's Python SyncBatchNorm worked wherever ``torch.distributed.all_reduce`` did. apex_amp
trains on CPU too, so a CPU input in training is normalised here with batch statistics summed
over the process group (gloo), differentiably, and everything else goes to torch's own forward.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["SyncBatchNorm", "convert_syncbn_model"]


class _SumOverRanks(torch.autograd.Function):
    # all_reduce(SUM) with its gradient: every rank's loss depends on the sum, so the gradient of
    # the sum is the sum of the ranks' gradients (torch.distributed.nn's version is deprecated).
    @staticmethod
    def forward(ctx, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def _synced_cpu_batch_norm(bn: "SyncBatchNorm", input: Tensor, momentum: float, group: Any) -> Tensor:
    # Batch statistics over every rank's batch: mean first, then the variance around it (more
    # accurate than E[x^2] - E[x]^2). The sums are differentiable (_SumOverRanks), so autograd
    # gives the same gradients as torch's CUDA kernels.
    channel_dims = [0, *range(2, input.dim())]
    shape = [1, -1] + [1] * (input.dim() - 2)
    x = input.float()
    local_count = x.new_tensor([input.numel() // input.size(1)])
    sums = _SumOverRanks.apply(torch.cat([x.sum(channel_dims), local_count]), group)
    count = sums[-1].detach()
    if count.item() <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(input.shape)} "
                         "summed over the process group")
    mean = sums[:-1] / count
    centered = x - mean.view(shape)
    var = _SumOverRanks.apply((centered * centered).sum(channel_dims), group) / count
    out = centered * torch.rsqrt(var + bn.eps).view(shape)
    if bn.weight is not None:
        out = out * bn.weight.view(shape)
    if bn.bias is not None:
        out = out + bn.bias.view(shape)
    if bn.track_running_stats:
        with torch.no_grad():
            # As torch: the running variance is the unbiased one.
            bn.running_mean.lerp_(mean.to(bn.running_mean.dtype), momentum)
            bn.running_var.lerp_((var * count / (count - 1)).to(bn.running_var.dtype), momentum)
    return out.to(input.dtype)


class SyncBatchNorm(nn.SyncBatchNorm):
    """apex.parallel.SyncBatchNorm's signature, on ``torch.nn.SyncBatchNorm``.

    Normalises with batch statistics taken over all ranks of ``process_group`` in training.
    CUDA inputs go through torch's own SyncBatchNorm; CPU inputs (gloo) through an equivalent
    Python path, as apex's Python SyncBatchNorm did. It is a ``torch.nn.SyncBatchNorm``.

    Example::

        >>> sbn = apex.parallel.SyncBatchNorm(100)
        >>> out = sbn(torch.randn(10, 100, 14, 14))

    Args:
        num_features: C, the number of channels.
        eps: added to the variance. Default 1e-5.
        momentum: running statistics' update factor (None: cumulative average). Default 0.1.
        affine: learnable weight and bias. Default True.
        track_running_stats: keep running mean and variance. Default True.
        process_group: the ranks to synchronise over (None: all).
        channel_last: the channels are the input's *last* dimension (N, ..., C), as in apex.
        fuse_relu: apply ReLU to the output (after adding ``z``), as apex's fused kernel did.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Optional[Any] = None,
        channel_last: bool = False,
        fuse_relu: bool = False,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, process_group)
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def forward(self, input: Tensor, z: Optional[Tensor] = None) -> Tensor:
        """Normalise ``input``; add ``z`` (a residual of the same shape) and apply ReLU if ``fuse_relu``."""
        if self.channel_last:
            # (N, ..., C) -> (N, C, ...) as a view: torch's batch norm handles the strides.
            input = input.movedim(-1, 1)
        if input.device.type == "cpu" and self._syncs():
            self._check_input_dim(input)
            out = _synced_cpu_batch_norm(self, input, self._momentum_for_this_step(), self._group())
        else:
            out = super().forward(input)
        if self.channel_last:
            out = out.movedim(1, -1)
        if z is not None:
            out = out + z
        if self.fuse_relu:
            out = F.relu(out)
        return out

    def _group(self) -> Any:
        return self.process_group or dist.group.WORLD

    def _syncs(self) -> bool:
        # torch's rule: batch statistics are synchronised in training, when a process group is up.
        return self.training and dist.is_available() and dist.is_initialized()

    def _momentum_for_this_step(self) -> float:
        # torch's bookkeeping (count the batch; momentum None means a cumulative average).
        if not self.track_running_stats:
            return 0.0
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum


def convert_syncbn_model(module: nn.Module, process_group: Optional[Any] = None,
                         channel_last: bool = False) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` by :class:`SyncBatchNorm`, as apex's function did.

    The new layers share the old ones' parameters and running statistics (apex copied the
    parameters into new ones; sharing also keeps an optimizer made before the conversion
    working). A BatchNorm ``module`` itself is returned converted; InstanceNorm is left alone.

    Example::

        >>> model = apex.parallel.convert_syncbn_model(model)
        >>> model = apex.parallel.DistributedDataParallel(model)

    Args:
        module: the model (or a single BatchNorm layer).
        process_group: the ranks to synchronise over (None: all).
        channel_last: the converted layers take channels-last-dimension input (see SyncBatchNorm).
    """
    converted = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group, channel_last=channel_last)
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return converted
