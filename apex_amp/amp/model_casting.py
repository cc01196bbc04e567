"""O0/O2/O3 model casting: weights, forward inputs and outputs, fp32 state_dict of half models.

Everything here uses torch's own module extension points, so the model keeps
its identity and type and can be wrapped (DDP, torch.compile) afterwards:

* weights and buffers are cast in place (``param.data``), as ``Module.to``
  does, so every ``Parameter`` object the optimizer holds stays the same;
  parameters sharded by FSDP2 (DTensors) are cast by ``Module._apply``, which
  ``fully_shard``'s modules override to re-register the shards they all-gather
  from (remainder masters under FSDP2 store the shards in bf16);
* inputs and outputs are cast by forward pre/post hooks;
* for a half model (O2, O3) a ``state_dict`` post-hook reports fp32 values (the
  fp32 master weights where there are masters, so an O2 checkpoint is exact),
  and a ``load_state_dict`` pre-hook copies loaded fp32 values into the masters
  before torch rounds them into the model.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from .._dtensor import is_dtensor
from .._dtypes import HALF_DTYPES, map_tensors

__all__ = ["cast_model_", "cast_floating_tensors", "add_cast_hooks", "add_fp32_state_dict_hooks"]

class MasterStore(Protocol):
    """Where a half model's masters are found (the session)."""

    def master_of(self, param: Tensor) -> Optional[Tensor]:
        """The fp32 master of a model parameter, or None when it has none."""

    def before_model_load(self) -> None:
        """Called before a ``load_state_dict`` of the model copies anything."""

    def loaded_without_master(self, param: Tensor, value: Tensor) -> None:
        """The fp32 ``value`` loaded into a half ``param`` that has no master."""


def cast_model_(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool, cast_params: bool = True) -> None:
    """Cast the floating parameters (unless not ``cast_params``), grads and buffers of ``model`` to ``dtype``, in place."""
    params = []
    for module in model.modules():
        if keep_batchnorm_fp32 and isinstance(module, _BatchNorm):
            continue
        if cast_params:
            params.extend(p for p in module.parameters(recurse=False) if p.is_floating_point() and p.dtype != dtype)
        with torch.no_grad():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.is_floating_point() and buffer.dtype != dtype:
                    setattr(module, name, buffer.to(dtype))
    if any(is_dtensor(param) for param in params):
        _cast_sharded_params(model, params, dtype)
        return
    with torch.no_grad():
        for param in params:
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad = param.grad.to(dtype)


def _cast_sharded_params(model: nn.Module, params: list[Tensor], dtype: torch.dtype) -> None:
    # FSDP2 all-gathers from storage of its own behind each sharded parameter; Module._apply, which
    # fully_shard's modules override, re-registers it after the cast (the Parameter objects stay
    # the same: DTensors are swapped in place). The dtype FSDP2 reduces gradients back into is
    # read at its first forward (amp.initialize refuses a model that ran one: fsdp2.py).
    chosen = {id(param) for param in params} | {id(param.grad) for param in params if param.grad is not None}
    # The swap also swaps the objects' __dict__: attributes set on a parameter (a user's tags, as
    # Megatron's) would go with the discarded one. They are put back.
    attributes = [(param, dict(vars(param))) for param in model.parameters()]
    model._apply(lambda tensor: tensor.to(dtype) if id(tensor) in chosen else tensor)
    for param, saved in attributes:
        for name, value in saved.items():
            vars(param).setdefault(name, value)


def cast_floating_tensors(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor cast to ``dtype``, through lists, tuples and mappings.

    apex's protocol for custom batch types: any other object with a ``to``
    method (not a module) is replaced by ``obj.to(dtype)``, so a batch class
    casts its own floating fields. Non-floating tensors and other objects are
    returned as they are (the same object when nothing in it changed).
    """
    if isinstance(value, Tensor):  # the common single-tensor argument: no walk
        return _cast_tensor(value, dtype)
    return map_tensors(value, functools.partial(_cast_tensor, dtype=dtype),
                       on_object=functools.partial(_cast_custom_batch, dtype=dtype))


def _cast_tensor(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if tensor.dtype != dtype and tensor.is_floating_point() else tensor


def _cast_custom_batch(obj: Any, dtype: torch.dtype) -> Any:
    # A module passed to forward is not data: .to(dtype) would cast its weights in place.
    if isinstance(obj, nn.Module) or not callable(getattr(obj, "to", None)):
        return obj
    return obj.to(dtype)


def add_cast_hooks(
    model: nn.Module, input_dtype: Optional[torch.dtype], output_dtype: Optional[torch.dtype]
) -> list[RemovableHandle]:
    """Forward hooks casting ``model``'s inputs to ``input_dtype`` and outputs to ``output_dtype``."""
    handles = []
    if input_dtype is not None:

        def cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            if not kwargs:
                # The usual call (O0's fp32 batch): plain tensors (not subclasses, not containers) that
                # need no cast (the dtype already, or not floating): nothing to cast, no walk. A loop
                # in the hook, not all() over a generator: this runs on every forward.
                for arg in args:
                    if type(arg) is not Tensor or (arg.dtype is not input_dtype and arg.is_floating_point()):
                        break
                else:
                    return None
            new_kwargs = cast_floating_tensors(kwargs, input_dtype) if kwargs else kwargs
            return cast_floating_tensors(args, input_dtype), new_kwargs

        handles.append(model.register_forward_pre_hook(cast_inputs, with_kwargs=True))
    if output_dtype is not None:

        def cast_outputs(module: nn.Module, args: tuple, output: Any) -> Any:
            return cast_floating_tensors(output, output_dtype)

        handles.append(model.register_forward_hook(cast_outputs))
    return handles


def _named_params_under(module: nn.Module, prefix: str) -> dict[str, Tensor]:
    # state_dict keys of the module's parameters (shared ones under every name).
    base = prefix[:-1] if prefix.endswith(".") else prefix
    return dict(module.named_parameters(prefix=base, remove_duplicate=False))


def add_fp32_state_dict_hooks(model: nn.Module, masters: MasterStore) -> list[RemovableHandle]:
    """Make ``model.state_dict()`` fp32 (masters for mastered params) and loads refresh the masters.

    For every model cast to half (O2 and O3, as apex did): a checkpoint holds fp32 values, so
    it loads into an fp32 model, and a half model rounds them when it loads them.
    """
    master_of = masters.master_of

    def fp32_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        params = _named_params_under(module, prefix)
        for key, value in list(state_dict.items()):
            if not key.startswith(prefix) or isinstance(value, nn.Parameter):
                continue  # another module's entry, or keep_vars=True: hand back the real Parameter
            param = params.get(key)
            master = master_of(param) if param is not None else None
            if master is not None:
                state_dict[key] = master.detach()
            elif isinstance(value, Tensor) and value.dtype in HALF_DTYPES:
                state_dict[key] = value.float()

    def load_into_masters(module: nn.Module, state_dict: dict, prefix: str, *unused: Any) -> None:
        # Runs before torch copies the values into the (half) parameters, so the
        # masters get the exact fp32 values and the model their rounding.
        masters.before_model_load()
        with torch.no_grad():
            for key, param in _named_params_under(module, prefix).items():
                master = master_of(param)
                value = state_dict.get(key)
                if not isinstance(value, Tensor):
                    continue  # torch reports missing or mismatched entries itself
                if master is None:
                    masters.loaded_without_master(param, value)
                elif value.shape == master.shape:
                    master.copy_(value)

    return [
        model.register_state_dict_post_hook(fp32_state_dict),
        model.register_load_state_dict_pre_hook(load_into_masters),
    ]
