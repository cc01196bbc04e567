"""DTensors as the local tensors the fused ops work on.

FSDP2 (``fully_shard``) holds each parameter, its gradient and the optimizer
state made from it as a ``DTensor`` whose local tensor is this rank's shard.
The ops are elementwise over a list, so running them on the local shards is
the whole sharded update: no gather, no communication. A DTensor would not
reach our kernels anyway (DTensor dispatches only ops it has sharding rules for).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["DTENSOR_TYPES", "is_dtensor", "local_tensor", "local_tensors", "sharded_like"]

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
