"""How a fused optimizer stores its per-element state: a group's precision settings and the tensors they give.

A param group's ``state_precision``, ``state_block_size`` and ``min_quantized_numel`` (constructor
arguments of every fused optimizer, and param-group keys that override them) decide, through
:func:`state_formats.state_layout` on the parameter's *global* shape, how each per-element state
tensor is stored (apex_amp/optimizers/state_formats.py defines the formats):

* ``state[p][key]``: the codes, with the shape and strides of what is updated (the param or its
  master), in :func:`state_formats.storage_dtype` (uint8 for the keys an optimizer declares never
  negative, ``exp_avg_sq`` and Adagrad's ``sum``, under int8);
* ``state[p][key + "_absmax"]``: for fp8 and int8, one fp32 absmax per block, shaped
  (rows, blocks per row); under FSDP2 a DTensor sharded on dim 0 like the param, so DCP reshards
  it with the codes (blocks never cross a row, and FSDP2 cuts only between rows).

The precision applies where the state is fp32 today: fp32 params, fp32 masters and bf16 params
with remainder masters; an fp16/bf16 param updated in place keeps its state in its own dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from .._dtensor import is_dtensor, local_tensor, sharded_like
from .state_formats import (DEFAULT_BLOCK_SIZE, DEFAULT_MIN_QUANTIZED_NUMEL, StateLayout, StatePrecision,
                            check_block_size, state_layout, storage_dtype)

__all__ = ["PRECISION_KEYS", "StateSettings", "absmax_key", "layout_of", "new_state", "check_group"]

# The param-group keys of the state's precision (saved in state_dict()'s param_groups).
PRECISION_KEYS = ("state_precision", "state_block_size", "min_quantized_numel")
PRECISION_DEFAULTS = {"state_precision": StatePrecision.FP32.value, "state_block_size": DEFAULT_BLOCK_SIZE,
                      "min_quantized_numel": DEFAULT_MIN_QUANTIZED_NUMEL}


def absmax_key(key: str) -> str:
    """The state key of the per-block absmaxes of state ``key`` (fp8 and int8 only)."""
    return f"{key}_absmax"


@dataclasses.dataclass(frozen=True)
class StateSettings:
    """A param group's state precision settings, validated."""

    precision: StatePrecision = StatePrecision.FP32
    block_size: int = DEFAULT_BLOCK_SIZE
    min_quantized_numel: int = DEFAULT_MIN_QUANTIZED_NUMEL

    @classmethod
    def of(cls, group: Mapping[str, Any]) -> "StateSettings":
        """The settings of ``group`` (its keys, else the defaults), validated."""
        precision = StatePrecision.parse(group.get("state_precision", StatePrecision.FP32.value))
        block_size = group.get("state_block_size", DEFAULT_BLOCK_SIZE)
        check_block_size(block_size)
        minimum = group.get("min_quantized_numel", DEFAULT_MIN_QUANTIZED_NUMEL)
        if not isinstance(minimum, int) or isinstance(minimum, bool) or minimum < 0:
            raise ValueError(f"min_quantized_numel must be an int >= 0 (tensors with fewer elements keep fp32 "
                             f"state), got {minimum!r}")
        return cls(precision, block_size, minimum)


def check_group(group: dict[str, Any]) -> None:
    """Validate ``group``'s precision keys and store the precision by its name (``"int8"``), in place."""
    settings = StateSettings.of(group)
    if "state_precision" in group:
        group["state_precision"] = settings.precision.value


def layout_of(param: Tensor, target: Tensor, group: Mapping[str, Any], remainder: bool) -> Optional[StateLayout]:
    """The layout of the state of ``param`` updated through ``target``; None: the state has ``target``'s dtype.

    Decided from ``param.shape``: a DTensor's global shape, the same on every mesh.
    """
    if target.dtype != torch.float32 and not remainder:
        return None  # a half param updated in place: its state keeps its dtype, as before
    settings = StateSettings.of(group)
    layout = state_layout(tuple(param.shape), settings.precision, settings.block_size, settings.min_quantized_numel)
    if layout.block is not None and not _rows_lead_in_memory(target):
        # Blocks run in memory order and must not cross a row (a dim-0 index): they would,
        # were dim 0 not the outermost dimension in memory (a transposed weight).
        return StateLayout(StatePrecision.FP32, None)
    if layout.block is not None and is_dtensor(param):
        _check_row_sharding(param)
    return layout


def new_state(target: Tensor, keys: tuple[str, ...], nonnegative: frozenset[str],
              layout: Optional[StateLayout]) -> dict[str, Tensor]:
    """Zero state for ``keys``, stored by ``layout`` (codes shaped like ``target``, absmaxes beside them)."""
    state: dict[str, Tensor] = {}
    for key in keys:
        dtype = target.dtype if layout is None else storage_dtype(layout.precision, key in nonnegative)
        state[key] = torch.zeros_like(target, dtype=dtype, memory_format=torch.preserve_format)
        if layout is not None and layout.block is not None:
            state[absmax_key(key)] = _zero_absmax(target, layout.block)
    return state


def _rows_lead_in_memory(tensor: Tensor) -> bool:
    local = local_tensor(tensor)
    return local.dim() < 2 or local.shape[0] <= 1 or local.stride(0) == max(local.stride())


def _check_row_sharding(param: Tensor) -> None:
    from torch.distributed.tensor import Replicate, Shard

    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in param.placements):
        raise ValueError(
            f"fp8/int8 optimizer state needs parameters sharded on dim 0 only (FSDP2's fully_shard), so that "
            f"no block of {param.shape} crosses a shard; this one is placed {param.placements}. Use "
            "state_precision='bf16' or 'fp32' for it (a param group of its own)")


def _zero_absmax(target: Tensor, block: int) -> Tensor:
    # (rows, blocks per row), as state_formats.quantize returns it; a DTensor shards it like the param.
    rows = target.shape[0]
    per_row = target.numel() // rows // block
    local = local_tensor(target)
    zeros = torch.zeros((local.shape[0], per_row), dtype=torch.float32, device=local.device)
    return sharded_like(zeros, target, shape=(rows, per_row), stride=(per_row, 1))
