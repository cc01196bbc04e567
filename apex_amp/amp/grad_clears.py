"""How amp notices ``optimizer.zero_grad()`` for the gradients it keeps where that call cannot reach them.

Two kinds of gradients the next step consumes are not on the optimizer's
parameters (``gradients.py``): under O2 the half model gradients of a
``delay_unscale=True`` accumulation (the optimizer holds the fp32 masters),
and the scaled gradients held off the model for a fused step. A clear through
the optimizer must discard them as it discards everything else, as apex's O2
``zero_grad`` (which zeroed the model's gradients too) and PyTorch do.

``ClearWatch`` says whether the optimizer's ``zero_grad`` ran since ``arm()``
and what the sequence of clears left: nothing (any clear to None: a gradient
that is None stays None under a later clear to zero, as in PyTorch) or zeros.

* A :class:`~apex_amp.optimizers.FusedOptimizer` counts its clears
  (``grad_clears`` and ``clears_to_none``, its part of the contract).
* ``torch.optim.Optimizer`` has no ``zero_grad`` hook. Its ``zero_grad``
  re-creates the instance attribute ``_zero_grad_profile_name`` (the
  profiler's label) when it is missing: ``arm()`` removes it, so finding it
  again means ``zero_grad`` ran (whether to None or to zero is not known:
  taken as to None, torch's default). ``load_state_dict`` re-creates it too:
  hooks around it put back what was there before. ``tests/test_call_order_state_machine.py``
  checks that torch still does both. An optimizer whose ``zero_grad`` does not
  call ``torch.optim.Optimizer.zero_grad`` is not followed.
"""

from __future__ import annotations

import enum
import weakref
from typing import Optional

import torch

from ..optimizers.fused_optimizer import FusedOptimizer

__all__ = ["Cleared", "ClearWatch"]

# The attribute torch.optim.Optimizer.zero_grad sets on the instance when it is missing (torch 2.x).
TORCH_ZERO_GRAD_MARK = "_zero_grad_profile_name"


class Cleared(enum.Enum):
    TO_NONE = "a clear set the gradients to None"
    TO_ZERO = "every clear zeroed the gradients in place"


class ClearWatch:
    """Follows the ``zero_grad`` calls of one optimizer from ``arm()`` on."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._counts: Optional[tuple[int, int]] = None  # FusedOptimizer: (grad_clears, clears_to_none) at arm()
        self._marked_before_load = True
        if not isinstance(optimizer, FusedOptimizer):
            # Kept alive by the hooks (the optimizer is only weakly referenced here).
            optimizer.register_load_state_dict_pre_hook(self._before_load)
            optimizer.register_load_state_dict_post_hook(self._after_load)

    def _before_load(self, optimizer: torch.optim.Optimizer, _state_dict: dict) -> None:
        self._marked_before_load = TORCH_ZERO_GRAD_MARK in vars(optimizer)

    def _after_load(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._marked_before_load:  # re-created by the load, not by a zero_grad
            vars(optimizer).pop(TORCH_ZERO_GRAD_MARK, None)

    def arm(self) -> None:
        """Watch from now: what the optimizer's clears did so far does not count."""
        optimizer = self._optimizer()
        if isinstance(optimizer, FusedOptimizer):
            self._counts = (optimizer.grad_clears, optimizer.clears_to_none)
        else:
            vars(optimizer).pop(TORCH_ZERO_GRAD_MARK, None)

    def cleared(self) -> Optional[Cleared]:
        """What the clears since ``arm()`` left (None: no clear), and watch again from now."""
        optimizer = self._optimizer()
        if isinstance(optimizer, FusedOptimizer):
            armed, self._counts = self._counts, (optimizer.grad_clears, optimizer.clears_to_none)
            if armed is None or armed == self._counts:
                return None
            return Cleared.TO_NONE if optimizer.clears_to_none != armed[1] else Cleared.TO_ZERO
        if TORCH_ZERO_GRAD_MARK not in vars(optimizer):
            return None
        del vars(optimizer)[TORCH_ZERO_GRAD_MARK]
        return Cleared.TO_NONE
