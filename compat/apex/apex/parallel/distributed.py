"""apex.parallel.distributed: apex's DistributedDataParallel arguments on torch's, and apex's flat collectives.

``flat_dist_call``, ``Reducer`` and their helpers (apex's module-level names here) live in
``_flat_calls.py``.
"""

import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ._flat_calls import (Reducer, apply_flat_dist_call, extract_tensors, flat_dist_call, flatten,
                          split_by_type, split_half_float_double, unflatten)
from .sync_batchnorm import SyncBatchNorm

__all__ = ["DistributedDataParallel", "Reducer", "flat_dist_call", "apply_flat_dist_call", "split_by_type",
           "split_half_float_double", "flatten", "unflatten", "extract_tensors"]

# apex counts its bucket size in elements, torch in MiB. fp32 gradients (4 bytes) are what apex's
# default of 1e7 elements was sized for; fp16 buckets come out twice as large, which changes only
# how the reduction is grouped, never its result.
_BYTES_PER_ELEMENT = 4
_APEX_MESSAGE_SIZE = 10_000_000


# (No `from __future__ import annotations` here: torch checks the hook's annotations as objects.)

# apex never synchronised buffers in forward. torch 2.14 renamed that switch to
# forward_sync_buffers (broadcast_buffers warns); older torch only has broadcast_buffers.
_NO_BUFFER_SYNC_ARGUMENT = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


@dataclass(frozen=True)
class _ReduceOptions:
    process_group: Any
    always_fp32: bool
    predivide_factor: float
    average: bool


def _apex_allreduce_hook(options: _ReduceOptions, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # apex's arithmetic: divide by gradient_predivide_factor before the sum, by
    # world_size / gradient_predivide_factor after it (only when averaging), in fp32 if asked.
    buffer = bucket.buffer()
    reduced = buffer.float() if options.always_fp32 else buffer  # in place, as torch's own hook
    if options.predivide_factor != 1.0:
        reduced.div_(options.predivide_factor)
    world_size = dist.get_world_size(options.process_group)
    work = dist.all_reduce(reduced, group=options.process_group, async_op=True)

    def finish(future: torch.futures.Future) -> torch.Tensor:
        total = future.value()[0]
        if options.average:
            total.mul_(options.predivide_factor / world_size)
        if total is not buffer:
            buffer.copy_(total)
        return buffer

    return work.get_future().then(finish)


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """apex.parallel.DistributedDataParallel's signature, on torch's DistributedDataParallel.

    It *is* a ``torch.nn.parallel.DistributedDataParallel`` (``isinstance`` holds, ``.module``,
    ``no_sync()`` and the ``module.``-prefixed state_dict work as usual); apex's arguments are
    translated to torch's, and any of torch's own keyword arguments (``find_unused_parameters``,
    ``process_group``, ``static_graph``, ...) may be given too. Like apex's, it broadcasts the
    parameters from rank 0 when wrapping and averages the gradients during ``backward()``; like
    apex's, it does not copy rank 0's buffers (BatchNorm statistics) to the other ranks on every
    forward: torch's ``forward_sync_buffers`` (``broadcast_buffers`` before torch 2.14) defaults
    to False here. On torch 2.14 the buffers are still copied once, when wrapping (apex copied
    only the parameters); pass ``forward_sync_buffers=True`` for torch's default. The
    SyncBatchNorm layers of :func:`apex.parallel.convert_syncbn_model` work in CPU models too.

    Example::

        >>> torch.distributed.init_process_group("nccl")  # or "gloo" on CPU
        >>> model = apex.parallel.DistributedDataParallel(model, delay_allreduce=True)

    Args:
        module: the model to wrap, already on its device.
        message_size: apex's bucket size in elements; becomes torch's ``bucket_cap_mb`` at 4 bytes
            per element. Changes the grouping of the reduction only.
        delay_allreduce: apex's "reduce everything after backward". torch always overlaps the
            reduction with the backward pass; the averaged gradients are the same. Accepted.
        shared_param: no longer supported by apex; anything but None raises ValueError, as in apex.
        allreduce_trigger_params: apex's custom bucket boundaries; torch's buckets decide when a
            reduction starts. Accepted and ignored (timing only); with ``delay_allreduce`` it raises
            ValueError, as in apex.
        retain_allreduce_buffers: gradients kept as views into the reduction buffers; becomes
            torch's ``gradient_as_bucket_view``.
        allreduce_always_fp32: reduce half gradients in fp32 (a DDP communication hook).
        num_allreduce_streams: apex's concurrent CUDA streams for reductions; timing only, accepted.
            More than 1 with ``delay_allreduce`` raises ValueError, as in apex.
        allreduce_communicators: apex's own process groups and streams per bucket. Raises
            ValueError: torch reduces over one group; pass ``process_group=`` instead.
        gradient_average: False sums the gradients over the ranks instead of averaging them.
        gradient_predivide_factor: divide the gradients by this before the sum and by
            ``world_size / gradient_predivide_factor`` after it, as apex did (fp16 range).
        gradient_average_split_factor: ignored, as in apex's last release.
        prof: apex's NVTX ranges; ignored.
        **torch_ddp_kwargs: passed to ``torch.nn.parallel.DistributedDataParallel``.

    .. note::
        ``disable_allreduce()`` / ``enable_allreduce()`` work like torch's ``no_sync()``: torch
        decides at the forward pass whether its backward reduces, so call them before the
        forward, not between forward and backward as apex allowed.
    """

    def __init__(
        self,
        module: nn.Module,
        message_size: int = _APEX_MESSAGE_SIZE,
        delay_allreduce: bool = False,
        shared_param: Optional[Any] = None,
        allreduce_trigger_params: Optional[Any] = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: Optional[Any] = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: Optional[float] = None,
        prof: bool = False,
        **torch_ddp_kwargs: Any,
    ) -> None:
        if shared_param is not None:
            raise ValueError(
                "shared_param is not supported (apex dropped it too: overlapping the reduction works "
                "with shared parameters). Remove the argument."
            )
        if allreduce_communicators is not None:
            raise ValueError(
                "allreduce_communicators has no torch equivalent: torch's DistributedDataParallel reduces "
                "over one process group. Pass process_group=<group> instead."
            )
        if delay_allreduce and allreduce_trigger_params is not None:
            raise ValueError("allreduce_trigger_params only applies without delay_allreduce (as in apex): drop one.")
        if delay_allreduce and num_allreduce_streams > 1:
            raise ValueError("num_allreduce_streams > 1 only applies without delay_allreduce (as in apex): drop one.")
        if gradient_predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
        torch_ddp_kwargs.setdefault("bucket_cap_mb", message_size * _BYTES_PER_ELEMENT / 2**20)
        torch_ddp_kwargs.setdefault("gradient_as_bucket_view", retain_allreduce_buffers)
        if not {"broadcast_buffers", "forward_sync_buffers"} & torch_ddp_kwargs.keys():
            torch_ddp_kwargs[_NO_BUFFER_SYNC_ARGUMENT] = False
        super().__init__(module, **torch_ddp_kwargs)
        if allreduce_always_fp32 or gradient_predivide_factor != 1.0 or not gradient_average:
            # Only then: the default path stays torch's built-in reduction, the fastest one.
            options = _ReduceOptions(self.process_group, allreduce_always_fp32, float(gradient_predivide_factor),
                                     gradient_average)
            self.register_comm_hook(options, _apex_allreduce_hook)

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        # torch refuses SyncBatchNorm in a CPU model because its own kernels are CUDA-only;
        # apex.parallel.SyncBatchNorm has a CPU path, so only torch's own layers are checked.
        if self.device_type != "cpu":
            return
        for layer in module.modules():
            if isinstance(layer, nn.SyncBatchNorm) and not isinstance(layer, SyncBatchNorm):
                raise ValueError("torch.nn.SyncBatchNorm layers only work with GPU modules: convert the model "
                                 "with apex.parallel.convert_syncbn_model, whose SyncBatchNorm also runs on CPU")

    def disable_allreduce(self) -> None:
        """Skip the gradient reduction in the backward of every following forward (apex's ``no_sync``)."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self) -> None:
        """Reduce the gradients again from the next forward on (after :meth:`disable_allreduce`)."""
        self.require_backward_grad_sync = True
