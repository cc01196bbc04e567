"""The fused list ops, split per device.

A model may span devices; each op runs on one. These helpers group the lists
by the device of their first list, move the one-element scalars there (a
device-to-device copy, never a host sync) and fold each device's flag back
into the caller's ``found_inf``. With one device they make exactly one op call.
DTensors (FSDP2's sharded parameters and gradients) are replaced by this
rank's shards: every op here is elementwise, so the shards are all it needs.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from .. import ops
from .._dtensor import local_tensors

__all__ = ["check_finite", "unscale_", "scale_", "axpby_"]


def _per_device(lists: Sequence[Sequence[Tensor]], found_inf: Tensor, call: Callable[..., None]) -> None:
    # call(device, flag, *lists_on_device)
    lists = [local_tensors(lst) for lst in lists]
    first = lists[0]
    if not first:
        return
    devices = {t.device for t in first}
    if len(devices) == 1 and found_inf.device in devices:
        call(found_inf.device, found_inf, *lists)
        return
    for device in devices:
        picked = [i for i, t in enumerate(first) if t.device == device]
        local_flag = found_inf if found_inf.device == device else torch.zeros(1, device=device)
        call(device, local_flag, *[[lst[i] for i in picked] for lst in lists])
        if local_flag is not found_inf:
            torch.maximum(found_inf, local_flag.to(found_inf.device), out=found_inf)


def check_finite(tensors: Sequence[Tensor], found_inf: Tensor) -> None:
    _per_device([tensors], found_inf, lambda device, flag, ts: ops.check_finite(ts, flag))


def unscale_(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    _per_device([grads], found_inf, lambda device, flag, gs: ops.unscale_(gs, flag, inv_scale.to(device)))


def scale_(src: Sequence[Tensor], dst: Sequence[Tensor], scale: Tensor, found_inf: Tensor) -> None:
    _per_device([src, dst], found_inf, lambda device, flag, s, d: ops.scale_(s, d, scale.to(device), flag))


def axpby_(x: Sequence[Tensor], y: Sequence[Tensor], a: Tensor, b: float, found_inf: Tensor) -> None:
    _per_device([x, y], found_inf, lambda device, flag, xs, ys: ops.axpby_(xs, ys, a.to(device), b, flag))
