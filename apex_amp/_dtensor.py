"""DTensors as the local tensors the fused ops work on.

FSDP2 (``fully_shard``) holds each parameter, its gradient and the optimizer
state made from it as a ``DTensor`` whose local tensor is this rank's shard.
The elementwise ops run on the local shards as they are: that is the whole
sharded update, with no gather and no communication. A rule that needs a
per-tensor reduction (LAMB's norms, NovoGrad's gradient norms) computes it on
each rank's shards and combines the partial values over the ranks that hold
the other shards (:func:`reduce_over_shards`): one small all-reduce per step,
never a gather of the tensors. A DTensor would not reach our kernels anyway
(DTensor dispatches only ops it has sharding rules for).
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["DTENSOR_TYPES", "any_dtensor", "is_dtensor", "local_tensor", "local_tensors", "reduce_over_shards",
           "sharded_like"]

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor

    DTENSOR_TYPES: tuple[type, ...] = (DTensor,)  # for isinstance() in hot loops
else:  # a torch built without distributed has no DTensors
    DTENSOR_TYPES = ()


def is_dtensor(tensor: object) -> bool:
    return isinstance(tensor, DTENSOR_TYPES)


def any_dtensor(tensors: Sequence[Tensor]) -> bool:
    return any(isinstance(tensor, DTENSOR_TYPES) for tensor in tensors)


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor (the same storage), or ``tensor`` itself."""
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():  # without autograd, to_local() returns the shard itself, not a view
        return tensor.to_local()


def local_tensors(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [local_tensor(tensor) for tensor in tensors]


def sharded_like(local: Tensor, reference: Tensor, shape: Optional[Sequence[int]] = None,
                 stride: Optional[Sequence[int]] = None) -> Tensor:
    """``local`` as this rank's shard of a DTensor placed like ``reference`` (``local`` itself when
    ``reference`` is no DTensor), of global ``shape`` and ``stride`` (default: ``reference``'s).

    State made from a sharded parameter's shard (a remainder, absmaxes) is sharded like it, so
    ``state_dict()`` and torch.distributed.checkpoint see (and reshard) it as they do the parameter.
    """
    if not is_dtensor(reference):
        return local
    return DTensor.from_local(local, reference.device_mesh, reference.placements, run_check=False,
                              shape=torch.Size(reference.shape if shape is None else shape),
                              stride=tuple(reference.stride() if stride is None else stride))


def reduce_over_shards(values: Tensor, owners: Sequence[Tensor], op: Literal["sum", "max"] = "sum") -> Tensor:
    """Per-tensor values of whole tensors from those of this rank's shards, in place.

    ``values[..., j]`` was computed on this rank's shard of ``owners[j]`` (a sum of squares, a
    largest magnitude); it is summed (``op="sum"``) or maxed (``op="max"``, NaN wins, as a
    kernel's own maximum) over the ranks of every mesh dimension on which ``owners[j]`` is
    sharded, so each rank then holds the whole tensor's value. Columns of owners that are no
    DTensor, or are replicated only, are left as they are. Every rank must call it with the
    same owners in the same order (a collective, as the sharded step itself).

    Example::

        >>> squares = torch.stack([local_tensor(g).float().square().sum() for g in grads])
        >>> norms = reduce_over_shards(squares, params).sqrt()   # the norms of the whole gradients
    """
    columns: dict[tuple, list[int]] = {}  # (mesh, its sharded dims) -> the owners' positions
    for j, owner in enumerate(owners):
        if not is_dtensor(owner):
            continue
        if any(placement.is_partial() for placement in owner.placements):
            raise RuntimeError(
                f"a per-tensor reduction over shards got a DTensor of shape {tuple(owner.shape)} with a Partial "
                f"placement ({owner.placements}): its local values are partial sums, not a shard; redistribute "
                "it to Shard or Replicate placements (FSDP2's parameters and gradients are Shard(0))")
        dims = tuple(d for d, placement in enumerate(owner.placements) if placement.is_shard())
        if dims:
            columns.setdefault((owner.device_mesh, dims), []).append(j)
    for (mesh, dims), positions in columns.items():
        whole = len(positions) == values.shape[-1]
        part = values if whole and values.is_contiguous() else values[..., positions].contiguous()
        carrier = _nan_flagged(part) if op == "max" else part
        for dim in dims:
            torch.distributed.all_reduce(carrier, op=_REDUCE_OPS[op], group=mesh.get_group(dim))
        if op == "max":
            part.copy_(_nan_restored(carrier, part.shape[0]))
        if part is not values:
            values[..., positions] = part
    return values


_REDUCE_OPS = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX} \
    if torch.distributed.is_available() else {}


# A collective's maximum need not propagate NaN (gloo's and NCCL's do not promise it): the values go
# with NaN as -inf plus a row of NaN flags, maxed alike, and a flag restores NaN afterwards.
def _nan_flagged(part: Tensor) -> Tensor:
    nan = torch.isnan(part)
    return torch.cat([part.masked_fill(nan, float("-inf")), nan.to(part.dtype)])


def _nan_restored(carrier: Tensor, rows: int) -> Tensor:
    values, flags = carrier[:rows], carrier[rows:]
    return torch.where(flags > 0, torch.full_like(values, float("nan")), values)
