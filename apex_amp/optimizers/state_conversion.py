"""Optimizer state between storage formats: checkpoints saved with one ``state_precision`` loaded with another.

A fused optimizer's ``state_dict()`` holds its state as stored (codes, ``<key>_absmax`` and
``master_remainder`` included), so saving and loading with the same settings is bitwise.
``load_state_dict`` converts a state stored in another format to the optimizer's own
(:func:`convert_state`): dequantize (exact: the values the optimizer was using), then quantize
in the new layout, which rounds as one quantization step of the new format does:

* to fp32: exact;
* to bf16: half a bf16 ulp, a relative error <= 2**-9;
* to fp8: <= 1/14 of the block's absmax per element (half an e4m3 step at the top of the range);
* to int8: <= 1/64 of the block's absmax per element (the top decade of the dynamic map).

Two helpers convert whole ``state_dict()`` results for other optimizers:
:func:`fp32_state_dict` (every state in fp32, absmaxes dropped) and
:func:`torch_adamw_state_dict` (loadable by ``torch.optim.AdamW``).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import Tensor

from .._dtensor import is_dtensor, local_tensor
from . import _state_storage as storage
from .state_formats import StateLayout, dequantize, join_master, quantize, split_master, storage_dtype

__all__ = ["convert_state", "fp32_state_dict", "torch_adamw_state_dict"]

_ABSMAX = "_absmax"
_QUANTIZED = (torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.uint8)


def convert_state(codes: Tensor, absmax: Optional[Tensor], layout: Optional[StateLayout], nonnegative: bool,
                  like: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """A state (``codes`` and its ``absmax``, or None) stored by ``layout`` (None: in ``like``'s dtype).

    Returns ``(codes, absmax)`` unchanged when they are already stored so (a bitwise round
    trip); else dequantized and quantized anew, with ``like``'s layout in memory (under FSDP2
    shard by shard, which is exact: blocks never cross a row).

    Example::

        >>> from apex_amp.optimizers.state_formats import state_layout
        >>> state = torch.randn(64, 128)
        >>> codes, absmax = convert_state(state, None, state_layout((64, 128), "int8"), False, state)
        >>> codes.dtype, tuple(absmax.shape)
        (torch.int8, (64, 1))
    """
    dtype = like.dtype if layout is None else storage_dtype(layout.precision, nonnegative)
    block = None if layout is None else layout.block
    have_block = None if absmax is None else codes.numel() // max(absmax.numel(), 1)
    if codes.dtype == dtype and have_block == block and codes.shape == like.shape:
        return codes, absmax
    local_codes, local_like = local_tensor(codes), local_tensor(like)
    values = dequantize(local_codes, None if absmax is None else local_tensor(absmax))
    values = torch.empty_like(local_like, dtype=torch.float32).copy_(values.reshape(local_like.shape))
    new_codes, new_absmax = quantize(values, dtype, block)
    if not is_dtensor(like):
        return new_codes, new_absmax
    from torch.distributed.tensor import DTensor

    wrapped = DTensor.from_local(new_codes, like.device_mesh, like.placements, run_check=False,
                                 shape=like.shape, stride=like.stride())
    if new_absmax is not None:
        per_row = new_absmax.shape[1]
        new_absmax = DTensor.from_local(new_absmax, like.device_mesh, like.placements, run_check=False,
                                        shape=torch.Size((like.shape[0], per_row)), stride=(per_row, 1))
    return wrapped, new_absmax


def fp32_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of a fused optimizer's ``state_dict()`` with every per-element state in fp32 (new tensors).

    bf16, fp8 and int8 states are dequantized (exactly the values the optimizer used) and their
    ``<key>_absmax`` entries dropped; the param groups say ``state_precision="fp32"``. Any fused
    optimizer loads the result; so does the matching ``torch.optim`` optimizer after
    :func:`torch_adamw_state_dict` (for Adam/AdamW).

    Example::

        >>> model = torch.nn.Linear(128, 64)
        >>> optimizer = FusedAdam(model.parameters(), state_precision="int8")
        >>> model(torch.randn(4, 128)).sum().backward(); optimizer.step()
        >>> fp32_state_dict(optimizer.state_dict())["state"][0]["exp_avg_sq"].dtype
        torch.float32
    """
    converted = {"state": {}, "param_groups": copy.deepcopy(state_dict["param_groups"])}
    for group in converted["param_groups"]:
        if "state_precision" in group:
            group["state_precision"] = "fp32"
        if "state_rounding" in group:
            group["state_rounding"] = "nearest"  # fp32 state is not rounded
    for index, state in state_dict["state"].items():
        new = {}
        for key, value in state.items():
            if key.endswith(_ABSMAX) and key[:-len(_ABSMAX)] in state:
                continue
            if isinstance(value, Tensor) and value.dtype in _QUANTIZED:
                value = _dequantized(value, state.get(key + _ABSMAX))
            elif isinstance(value, Tensor):
                value = value.detach().clone()  # a copy: loading it must not alias the source's live state
            new[key] = value
        converted["state"][index] = new
    return converted


def torch_adamw_state_dict(state_dict: dict[str, Any], *, decoupled_weight_decay: bool = True) -> dict[str, Any]:
    """A FusedAdam ``state_dict()`` (any ``state_precision``) as ``torch.optim.AdamW`` loads it.

    The states in fp32 (:func:`fp32_state_dict`), the group's step count copied into each
    param's state (torch keeps one per param), ``decoupled_weight_decay`` in each group, and the
    fp32 masters and remainders dropped (torch.optim keeps none: the model's weights are what it
    updates).

    Args:
        state_dict: a FusedAdam's ``state_dict()``.
        decoupled_weight_decay: FusedAdam's ``adam_w_mode``, which its state_dict does not hold
            (False for ``adam_w_mode=False``, to load into ``torch.optim.Adam``).

    Example::

        >>> model = torch.nn.Linear(128, 64)
        >>> fused = FusedAdam(model.parameters(), lr=1e-3, state_precision="int8")
        >>> model(torch.randn(4, 128)).sum().backward(); fused.step()
        >>> adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> adamw.load_state_dict(torch_adamw_state_dict(fused.state_dict()))
    """
    converted = fp32_state_dict(state_dict)
    for group in converted["param_groups"]:
        step = group.pop("step", None)
        group["decoupled_weight_decay"] = bool(decoupled_weight_decay)
        for index in group["params"]:
            state = converted["state"].get(index)
            if state is None:
                continue
            state.pop("master_param", None)
            state.pop("master_remainder", None)
            if step is not None and "step" not in state:
                state["step"] = torch.as_tensor(step, dtype=torch.float32).detach().clone().reshape(()).cpu()
    return converted


def adopt_loaded_state(state: dict[str, Any], param: Tensor, group: dict[str, Any], stored: dict[str, Tensor], *,
                       keys: tuple[str, ...], nonnegative: frozenset[str], keeps_master: bool,
                       keeps_remainder: bool) -> None:
    """``param``'s loaded ``state`` in the formats its group asks for (FusedOptimizer.load_state_dict).

    ``stored``: the loaded tensors as saved (torch's load cast them to the param's dtype).
    """
    for key, value in stored.items():
        state[key] = value.to(param.device)
    with torch.no_grad():
        _convert_masters(state, param, keeps_master, keeps_remainder)
    target = state.get("master_param", param)
    if keeps_master or param.dtype == torch.float32:
        target = target if target.dtype == torch.float32 else param.detach().float()
    target = _laid_out_like(target, param)
    layout: Any = _UNDECIDED
    for key in keys:
        if key not in state:
            continue
        if layout is _UNDECIDED:
            layout = storage.layout_of(param, target, group, keeps_remainder)
        codes, absmax = convert_state(_laid_out_like(state[key], param), state.pop(storage.absmax_key(key), None),
                                      layout, key in nonnegative, target)
        state[key] = codes
        if absmax is not None:
            state[storage.absmax_key(key)] = absmax
    if "master_param" in state:
        state["master_param"] = _laid_out_like(state["master_param"], param)


_UNDECIDED = object()


def _convert_masters(state: dict[str, Any], param: Tensor, keeps_master: bool, keeps_remainder: bool) -> None:
    # A checkpoint of master_weights=True loaded with "remainder" (and back): the same exact master.
    if keeps_remainder and "master_param" in state:
        weight, remainder = split_master(state.pop("master_param").float())
        param.copy_(weight)
        state["master_remainder"] = remainder
    elif keeps_master and "master_remainder" in state and param.dtype == torch.bfloat16:
        state["master_param"] = join_master(param.detach(), state.pop("master_remainder"))


def _laid_out_like(value: Tensor, param: Tensor) -> Tensor:
    # The ops walk a param and its state in memory order, so they must share strides; a
    # checkpoint saved from a contiguous model may be loaded into a channels_last one (once, at load).
    if value.shape == param.shape and value.stride() != param.stride() and not is_dtensor(value):
        return torch.empty_like(param, dtype=value.dtype).copy_(value)
    return value


def _dequantized(codes: Tensor, absmax: Optional[Tensor]) -> Tensor:
    if not is_dtensor(codes):
        return dequantize(codes, absmax)
    from torch.distributed.tensor import DTensor

    local = dequantize(local_tensor(codes), None if absmax is None else local_tensor(absmax))
    return DTensor.from_local(local, codes.device_mesh, codes.placements, run_check=False, shape=codes.shape,
                              stride=codes.stride())
