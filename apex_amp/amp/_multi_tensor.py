"""The fused list ops, split per device.

A model may span devices; each op runs on one. These helpers group the lists
by the device of their first list, move the one-element scalars there (a
device-to-device copy, never a host sync) and fold each device's flag back
into the caller's ``found_inf``. With one device they make exactly one op call.
DTensors (FSDP2's sharded parameters and gradients) are replaced by this
rank's shards: every op here is elementwise, so the shards are all it needs.
Sparse COO gradients (``nn.Embedding(sparse=True)``) are replaced by their
values, which is all a check, an unscale or a copy between two tensors of
the same sparsity needs; adding sparse gradients with different indices
(``axpby_``) goes through torch's sparse addition.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from .. import ops
from .._dtensor import DTENSOR_TYPES, local_tensor

__all__ = ["check_finite", "unscale_", "scale_", "axpby_"]


def _dense(tensors: Sequence[Tensor]) -> list[Tensor]:
    # One comprehension with no call for a plain tensor: this runs on every pass's gradients.
    return [_dense_local(t) if t.is_sparse or isinstance(t, DTENSOR_TYPES) else t for t in tensors]


def _dense_local(tensor: Tensor) -> Tensor:
    # The values of a sparse COO tensor are a dense view of its stored elements.
    tensor = local_tensor(tensor)
    return tensor._values() if tensor.is_sparse else tensor


def _per_device(lists: Sequence[Sequence[Tensor]], found_inf: Tensor, call: Callable[..., None]) -> None:
    # call(device, flag, *lists_on_device)
    lists = [_dense(lst) for lst in lists]
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
    sparse = [i for i, (xi, yi) in enumerate(zip(x, y)) if xi.is_sparse or yi.is_sparse]
    if sparse:
        for i in sparse:
            _sparse_axpby_(x[i], y[i], a, b, found_inf)
        dense = [i for i in range(len(x)) if i not in set(sparse)]
        x, y = [x[i] for i in dense], [y[i] for i in dense]
    _per_device([x, y], found_inf, lambda device, flag, xs, ys: ops.axpby_(xs, ys, a.to(device), b, flag))


def _sparse_axpby_(x: Tensor, y: Tensor, a: Tensor, b: float, found_inf: Tensor) -> None:
    # y = a * x + b * y where the two may store different elements; the check covers both, as axpby_'s.
    if y.is_sparse and not x.is_sparse:
        raise RuntimeError(
            "amp cannot add a dense gradient to a sparse one in place (a parameter whose backward "
            "passes produced a sparse and then a dense gradient); make every backward pass of it "
            "produce the same kind (e.g. nn.Embedding(sparse=...) the same for every loss)"
        )
    scaled_x = x.to(y.dtype, copy=True)
    unscale_([scaled_x], found_inf, a.to(torch.float32))
    if b != 1.0:
        unscale_([y], found_inf, torch.full((1,), b, device=y.device))
    else:
        check_finite([y], found_inf)
    y.add_(scaled_x)
