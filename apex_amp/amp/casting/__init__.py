"""O1: automatic per-op precision (half / fp32 / promote / banned), the same on every device.

The rule table is :data:`rules.RULES`; :func:`activate` applies it to every op reached
through ``torch.*``, ``torch.nn.functional.*``, ``Tensor`` methods and operators, on CPU
and CUDA, until :func:`deactivate`. The amp frontend (``amp.initialize(opt_level="O1")``)
drives this module; it can also be used directly.

Example::

    >>> import torch
    >>> from apex_amp.amp import casting
    >>> model = torch.nn.Linear(8, 8)
    >>> casting.activate(torch.bfloat16)
    >>> y = model(torch.randn(4, 8))
    >>> y.dtype, torch.softmax(y, -1).dtype
    (torch.bfloat16, torch.float32)
    >>> with casting.disable_casts():
    ...     model(torch.randn(4, 8)).dtype
    torch.float32
    >>> casting.deactivate()
"""
from .dispatch import activate, clear_cache, deactivate, disable_casts, is_active
from .registry import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
    unregister_function,
)
from .rules import RULES, OpRule, Rule, render_markdown_table

__all__ = [
    "activate",
    "deactivate",
    "is_active",
    "disable_casts",
    "clear_cache",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "unregister_function",
    "half_function",
    "float_function",
    "promote_function",
    "RULES",
    "OpRule",
    "Rule",
    "render_markdown_table",
]
