"""apex_amp.amp: apex.amp's API (initialize, scale_loss, state_dict, master_params, ...).

An apex.amp script migrates by changing its import to ``from apex_amp import amp``.

Example::

    >>> from apex_amp import amp
    >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16)
    >>> for x, y in loader:
    ...     optimizer.zero_grad()
    ...     loss = criterion(model(x), y)
    ...     with amp.scale_loss(loss, optimizer) as scaled_loss:
    ...         scaled_loss.backward()
    ...     optimizer.step()
"""

from .casting import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from .diagnostics import inspect, last_overflow, overflow_reports, save_histogram, underflow_report
from .backward_pass import scale_loss
from .frontend import initialize
from .run_state import load_state_dict, loss_scale, master_params, state_dict, step_was_skipped, sync_masters
from .sharded_checkpoint import checkpoint_state
from .opt_levels import OPT_LEVELS
from ..fp8 import Fp8Recipe
from . import _amp_state  # noqa: F401  apex's private state object, which clients read and set (not in __all__)
from .apex_private import init  # noqa: F401  apex's first API: exists for scripts that bind it, raises when called

__all__ = [
    "initialize",
    "scale_loss",
    "state_dict",
    "load_state_dict",
    "master_params",
    "step_was_skipped",
    "loss_scale",
    "sync_masters",
    "checkpoint_state",
    "disable_casts",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "half_function",
    "float_function",
    "promote_function",
    "OPT_LEVELS",
    "Fp8Recipe",
    "last_overflow",
    "overflow_reports",
    "underflow_report",
    "save_histogram",
    "inspect",
]
