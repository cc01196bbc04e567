"""O1 state and the casts each rule applies, shared by the dispatcher kernels and the Python wrappers.

The O1 state is a single object because what it controls is process-wide by nature: the
kernels registered with torch's dispatcher and the wrapped module attributes are seen by
every thread. Whether casting happens on a given thread is the thread-local switch of
:mod:`.carrier` (O1's own dispatch key, not torch's autocast flags), which is what
:func:`disable_casts` flips.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from ..._dtypes import HALF_DTYPES, map_tensors
from ..._torch_compat import autocast_disabled
from . import carrier
from .cache import WeightCastCache
from .rules import Rule

__all__ = ["disable_casts"]


class O1State:
    def __init__(self) -> None:
        self.active = False
        self.half_dtype = torch.float16
        self.allow_banned = False
        self.cache = WeightCastCache()
        self.lock = threading.RLock()
        # the calling thread's autocast settings before activate(), restored by deactivate()
        self.saved_autocast: dict | None = None


STATE = O1State()

# -1 outside a backward pass. Autograd runs backward with the autocast state of the caller,
# so rule kernels see backward calls too; those keep the dtypes autograd chose.
_graph_task_id = torch._C._current_graph_task_id
_is_compiling = torch.compiler.is_compiling


def in_backward() -> bool:
    return _graph_task_id() != -1


def casting_enabled() -> bool:
    """True when O1 is active, its casts are on on this thread and we are not in backward."""
    if not (STATE.active and carrier.is_on()):
        return False
    # torch.compile traces forward code, and cannot trace the graph-task query (an int
    # result would break the graph at every O1-wrapped function).
    return _is_compiling() or _graph_task_id() == -1


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Context manager: no O1 casting on this thread inside the block (nestable).

    Ops run in the precision of their inputs, as without amp; the frontend runs
    ``optimizer.step()`` this way so weights update in fp32. This is the way out of O1's
    casts: ``torch.autocast(device, enabled=False)`` leaves them in force, as under apex.

    Example::

        >>> from apex_amp.amp.casting import disable_casts
        >>> with disable_casts():
        ...     y = torch.softmax(torch.randn(2, 3), dim=-1)  # no casts here
    """
    with autocast_disabled(carrier.DEVICE):  # the carrier's switch, traced by torch.compile on every release
        yield


# -- casts per rule --------------------------------------------------------------------
# Arguments arrive as the dispatcher (or a Python caller) passes them: tensors, lists of
# tensors (cat, RNN weights, index_put indices, possibly with None), and everything else,
# which is returned untouched. Only floating tensors are cast; float64 is left alone, as
# torch's autocast does.

_CASTABLE_TO_HALF = {torch.float16: frozenset({torch.float32, torch.bfloat16}),
                     torch.bfloat16: frozenset({torch.float32, torch.float16})}


def _half_caster(dtype: torch.dtype):
    castable = _CASTABLE_TO_HALF[dtype]

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return STATE.cache.cast(tensor, dtype) if tensor.dtype in castable else tensor

    return cast


_HALF_CASTERS = {dtype: _half_caster(dtype) for dtype in HALF_DTYPES}


def _fp32_cast(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in HALF_DTYPES else tensor


def to_half(value: Any, dtype: torch.dtype) -> Any:
    return map_tensors(value, _HALF_CASTERS[dtype])


def to_fp32(value: Any) -> Any:
    return map_tensors(value, _fp32_cast)


def _floating_dtypes(values, found: set) -> set:
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                found.add(value.dtype)
        elif isinstance(value, (list, tuple)):
            _floating_dtypes(value, found)
    return found


def _to_dtype(value: Any, dtype: torch.dtype) -> Any:
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype is not dtype else t)


def widest_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The widest floating dtype among the tensors, or None when they already agree."""
    found = _floating_dtypes(kwargs.values(), _floating_dtypes(args, set()))
    if len(found) < 2:
        return None
    widest = found.pop()
    for dtype in found:
        widest = torch.promote_types(widest, dtype)
    return widest


def cast_call(rule: Rule, args: tuple, kwargs: dict, half_dtype: torch.dtype) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` cast as ``rule`` says (BANNED casts like FP32: callers check first)."""
    if rule is Rule.HALF:
        return (tuple(to_half(a, half_dtype) for a in args),
                {k: to_half(v, half_dtype) for k, v in kwargs.items()})
    if rule is Rule.PROMOTE:
        widest = widest_dtype(args, kwargs)
        if widest is None:
            return args, kwargs
        return (tuple(_to_dtype(a, widest) for a in args),
                {k: _to_dtype(v, widest) for k, v in kwargs.items()})
    return tuple(to_fp32(a) for a in args), {k: to_fp32(v) for k, v in kwargs.items()}


def banned_message(op_name: str) -> str:
    return (f"{op_name} is banned under apex_amp O1: binary cross entropy on probabilities is "
            "numerically unsafe once the sigmoid before it ran in half precision. Use "
            "torch.nn.BCEWithLogitsLoss (or F.binary_cross_entropy_with_logits) on the logits "
            "instead; it fuses the sigmoid and runs in fp32 under O1. If you really need it, "
            "allow it with allow_banned=True (it then runs in fp32), or register it with "
            "amp.register_float_function(torch.nn.functional, 'binary_cross_entropy').")


def inplace_message(op_name: str, dtype: torch.dtype) -> str:
    return (f"{op_name} got a {dtype} tensor under apex_amp O1, whose rules run this op in "
            "float32; an in-place op cannot change its tensor's dtype, so it would silently run "
            f"in {dtype}. Use the out-of-place form (e.g. torch.exp(x) instead of x.exp_()), "
            "cast first (x = x.float()), or run it under amp.disable_casts().")
