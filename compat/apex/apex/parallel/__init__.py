"""apex.parallel: apex's DistributedDataParallel and SyncBatchNorm names, on torch's.

timm's ``train.py`` imports ``DistributedDataParallel`` and ``convert_syncbn_model`` from here
in the same ``try`` block as ``from apex import amp``, so these must import and behave as
apex's did. ``apex.parallel.LARC`` is apex_amp's :class:`~apex_amp.optimizers.LARC`;
``Reducer`` and ``apex.parallel.distributed.flat_dist_call`` are apex's flat collectives on
torch.distributed. ``multiproc`` is not provided: importing it raises an ImportError that names
its replacement (torchrun).

Example::

    >>> from apex.parallel import DistributedDataParallel, convert_syncbn_model
    >>> model = DistributedDataParallel(convert_syncbn_model(model), delay_allreduce=True)
"""

from __future__ import annotations

import torch.distributed as dist

from .._unavailable import missing_attribute
from .distributed import DistributedDataParallel, Reducer
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model

ReduceOp = dist.ReduceOp

__all__ = ["DistributedDataParallel", "Reducer", "SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group",
           "ReduceOp"]


def create_syncbn_process_group(group_size: int):
    """Split the ranks into consecutive groups of ``group_size`` for SyncBatchNorm; return this rank's group.

    As in apex: ``group_size`` 0 means the whole world (returns None); it must divide the world
    size. Every rank must call this, since every rank takes part in creating every group.

    Example::

        >>> group = apex.parallel.create_syncbn_process_group(4)
        >>> model = apex.parallel.convert_syncbn_model(model, process_group=group)

    Args:
        group_size: ranks per group (0: all ranks in one group).
    """
    if group_size == 0:
        return None
    world_size = dist.get_world_size()
    if group_size < 0 or world_size % group_size != 0:
        raise ValueError(f"group_size must divide the world size {world_size}, got {group_size}")
    rank = dist.get_rank()
    own_group = None
    for first in range(0, world_size, group_size):
        group = dist.new_group(ranks=list(range(first, first + group_size)))
        if first <= rank < first + group_size:
            own_group = group
    return own_group


def __getattr__(name: str):
    raise missing_attribute(__name__, name)
