"""apex.parallel.distributed's flat collectives: ``flat_dist_call``, its helpers, and ``Reducer``.

apex's way to run one collective over many tensors: group them by type (dtype and device),
flatten each group into one buffer (``apex_C.flatten``), call the collective on the buffer,
average after an all-reduce, and copy the result back. NVIDIA's BERT ``run_pretraining.py``
broadcasts its initial weights with ``flat_dist_call(params, dist.broadcast, (0,))`` when it
all-reduces by hand (``--allreduce_post_accumulation``). ``Reducer`` all-reduces a module's
gradients when told to, not during backward.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

import torch.distributed as dist
from torch import Tensor, is_tensor
from torch.nn import Module

# From the module, not the package: `import apex_C` imports apex (its guard) first, and so this file.
from apex_C._apex_amp_flatten import flatten, unflatten

__all__ = ["flatten", "unflatten", "apply_flat_dist_call", "split_half_float_double", "split_by_type",
           "flat_dist_call", "extract_tensors", "Reducer"]


def apply_flat_dist_call(bucket: Sequence[Tensor], call: Callable[..., Any],
                         extra_args: Optional[Sequence[Any]] = None) -> None:
    """``call`` on one flat copy of ``bucket`` (tensors of one type), then the result copied back.

    After ``torch.distributed.all_reduce`` the sum is divided by the world size (an average), as
    in apex; any other collective's result is copied back as it is.

    Example::

        >>> apply_flat_dist_call([p.grad for p in model.parameters()], torch.distributed.all_reduce)

    Args:
        bucket: tensors of one dtype on one device, changed in place.
        call: a collective taking the flat tensor first, e.g. ``torch.distributed.broadcast``.
        extra_args: its further positional arguments, e.g. ``(0,)`` for broadcast's source rank.
    """
    coalesced = flatten(bucket)
    call(coalesced, *(extra_args or ()))
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    for tensor, synced in zip(bucket, unflatten(coalesced, bucket)):
        tensor.copy_(synced)


def split_half_float_double(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    """apex's grouping of CUDA fp16, fp32 and fp64 tensors, in that order (others are left out, as in apex)."""
    tensors = list(tensors)
    buckets = []
    for type_name in ("torch.cuda.HalfTensor", "torch.cuda.FloatTensor", "torch.cuda.DoubleTensor"):
        bucket = [t for t in tensors if t.type() == type_name]
        if bucket:
            buckets.append(bucket)
    return buckets


def split_by_type(tensors: Iterable[Tensor]) -> "OrderedDict[str, list[Tensor]]":
    """The tensors grouped by ``tensor.type()`` (dtype and device kind), in order of first appearance."""
    buckets: OrderedDict[str, list[Tensor]] = OrderedDict()
    for tensor in tensors:
        buckets.setdefault(tensor.type(), []).append(tensor)
    return buckets


def flat_dist_call(tensors: Iterable[Tensor], call: Callable[..., Any],
                   extra_args: Optional[Sequence[Any]] = None) -> None:
    """``call`` on the tensors, one flat buffer per type (apex's ``flat_dist_call``), results copied back.

    Example::

        >>> flat_dist_call([p.data for p in model.parameters()], torch.distributed.broadcast, (0,))

    Args:
        tensors: the tensors, changed in place; any mix of dtypes.
        call: a collective taking the flat tensor first (``all_reduce`` results are averaged).
        extra_args: its further positional arguments.
    """
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)


def extract_tensors(maybe_tensor: Any, tensor_list: list[Tensor]) -> None:
    """Append every tensor found in ``maybe_tensor`` (a tensor or nested iterables) to ``tensor_list``."""
    if is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
        return
    try:
        items = iter(maybe_tensor)
    except TypeError:
        return
    for item in items:
        extract_tensors(item, tensor_list)


class Reducer:
    """apex's ``Reducer``: averages gradients over the ranks when :meth:`reduce` is called, not in backward.

    Given a module, it broadcasts the module's parameters from rank 0 at once (so every rank
    starts equal) and :meth:`reduce` averages the gradients the parameters have; given tensors
    (nested lists are searched), :meth:`reduce` averages those, and keeping the parameters equal
    is up to the caller. Every rank must call :meth:`reduce` together.

    Example::

        >>> reducer = apex.parallel.Reducer(model)
        >>> for step, (x, y) in enumerate(loader):
        ...     loss_fn(model(x), y).backward()
        ...     if step % 4 == 3:
        ...         reducer.reduce()
        ...         optimizer.step()
        ...         optimizer.zero_grad()

    Args:
        module_or_grads_list: a module, or the gradient tensors to reduce.
    """

    def __init__(self, module_or_grads_list: Union[Module, Iterable[Any]]) -> None:
        if isinstance(module_or_grads_list, Module):
            self.module: Optional[Module] = module_or_grads_list
            flat_dist_call([param.data for param in self.module.parameters()], dist.broadcast, (0,))
        else:
            self.module = None
            self.grads: list[Tensor] = []
            extract_tensors(module_or_grads_list, self.grads)

    def reduce(self) -> None:
        """All-reduce and average the gradients (the module's present ones, or the tensors given)."""
        if self.module is not None:
            grads = [param.grad.data for param in self.module.parameters() if param.grad is not None]
        else:
            grads = self.grads
        flat_dist_call(grads, dist.all_reduce)
