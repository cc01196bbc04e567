"""apex_C's ``flatten`` and ``unflatten`` on torch's own flatten helpers.

This file is also the compat package's mark on ``apex_C`` (``COMPAT_MODULE_MARKERS`` in
``apex/_apex_amp_guard.py``): a folder ``apex_C`` that holds it is this package, not NVIDIA
apex's compiled module, and the import guard lets it through.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["flatten", "unflatten"]


def _tensor_list(name: str, argument: str, tensors: Sequence[Tensor]) -> list[Tensor]:
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"apex_C.{name}: {argument} must be a list of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"apex_C.{name}: {argument} is empty; pass at least one tensor (apex's kernel needs one)")
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"apex_C.{name}: {argument}[{index}] is a {type(tensor).__name__}, not a tensor")
        if tensor.is_sparse:
            raise TypeError(f"apex_C.{name}: {argument}[{index}] is sparse; flatten takes dense tensors "
                            "(torch._utils._flatten_sparse_tensors handles sparse ones)")
    return tensors


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One new 1-D tensor holding every tensor's elements in order (apex's ``apex_C.flatten``).

    The tensors must share a dtype and a device, as torch's ``cat`` requires.

    Example::

        >>> flat = apex_C.flatten([p.grad for p in model.parameters()])

    Args:
        tensors: dense tensors of one dtype, on one device.
    """
    return _flatten_dense_tensors(_tensor_list("flatten", "tensors", tensors))


def unflatten(flat: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``flat`` shaped like ``tensors``, in order (apex's ``apex_C.unflatten``).

    The views share memory with ``flat``: writing into them writes into ``flat`` (apex's
    clients unflatten an empty buffer, fill the views and all-reduce the buffer).

    Example::

        >>> flat_raw = torch.empty(sum(g.numel() for g in grads))
        >>> views = apex_C.unflatten(flat_raw, grads)

    Args:
        flat: a 1-D tensor with at least as many elements as ``tensors`` together.
        tensors: the tensors whose shapes the views take.
    """
    tensors = _tensor_list("unflatten", "tensors", tensors)
    if not isinstance(flat, Tensor):
        raise TypeError(f"apex_C.unflatten: flat must be a tensor, got {type(flat).__name__}")
    needed = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() < needed:
        raise ValueError(f"apex_C.unflatten: flat must be a 1-D tensor of at least {needed} elements (the tensors' "
                         f"total), got shape {tuple(flat.shape)}; make it with apex_C.flatten(tensors) or "
                         f"torch.empty({needed})")
    return list(_unflatten_dense_tensors(flat, tensors))
