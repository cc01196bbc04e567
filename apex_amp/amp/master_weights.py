"""fp32 master weights for a half model (O2): the optimizer updates the masters.

The optimizer's ``param_groups`` are edited in place so that each half model
parameter is replaced by its fp32 master, and any state the optimizer already
holds for the model parameter moves to the master (cast to fp32, the step
count untouched). Parameters that are already fp32 (batchnorm under
keep_batchnorm_fp32, layers outside the models) are their own masters.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch
from torch import Tensor, nn

from .opt_levels import HALF_DTYPES

__all__ = ["MasterLink", "attach_masters"]


@dataclasses.dataclass(frozen=True, eq=False)
class MasterLink:
    """A half model parameter and the fp32 master the optimizer updates in its place."""

    model_param: nn.Parameter
    master: nn.Parameter


def _move_state(optimizer: torch.optim.Optimizer, old: Tensor, new: Tensor) -> None:
    if old not in optimizer.state:
        return
    state = optimizer.state.pop(old)
    optimizer.state[new] = {
        key: value.to(new.dtype) if key != "step" and isinstance(value, Tensor) and value.is_floating_point() else value
        for key, value in state.items()
    }


def attach_masters(
    optimizer: torch.optim.Optimizer,
    first_group: int = 0,
    fp32_values: Optional[Mapping[int, Tensor]] = None,
) -> list[MasterLink]:
    """Replace the half params of ``optimizer.param_groups[first_group:]`` by fp32 masters.

    Args:
        optimizer: the user's optimizer, edited in place.
        first_group: index of the first param group to process (later add_param_group calls).
        fp32_values: fp32 values of parameters taken before the model was cast,
            keyed by ``id(param)``, so masters start from the user's exact weights
            rather than from their half rounding.

    Returns:
        The new links, in param-group order.
    """
    links = []
    fp32_values = fp32_values or {}
    for group in optimizer.param_groups[first_group:]:
        params = group["params"]
        for index, param in enumerate(params):
            if param.dtype not in HALF_DTYPES:
                continue
            source = fp32_values.get(id(param))
            # The snapshot is already a private fp32 copy; otherwise upcast the half values.
            data = source if source is not None else param.detach().to(torch.float32)
            master = nn.Parameter(data, requires_grad=param.requires_grad)
            params[index] = master
            _move_state(optimizer, param, master)
            links.append(MasterLink(param, master))
    return links
