"""DTensors as the local tensors the fused ops work on.

FSDP2 (``fully_shard``) holds each parameter, its gradient and the optimizer
state made from it as a ``DTensor`` whose local tensor is this rank's shard.
The ops are elementwise over a list, so running them on the local shards is
the whole sharded update: no gather, no communication. A DTensor would not
reach our kernels anyway (DTensor dispatches only ops it has sharding rules for).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

__all__ = ["DTENSOR_TYPES", "is_dtensor", "local_tensor", "local_tensors"]

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor

    DTENSOR_TYPES: tuple[type, ...] = (DTensor,)  # for isinstance() in hot loops
else:  # a torch built without distributed has no DTensors
    DTENSOR_TYPES = ()


def is_dtensor(tensor: object) -> bool:
    return isinstance(tensor, DTENSOR_TYPES)


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor (the same storage), or ``tensor`` itself."""
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():  # without autograd, to_local() returns the shard itself, not a view
        return tensor.to_local()


def local_tensors(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [local_tensor(tensor) for tensor in tensors]
