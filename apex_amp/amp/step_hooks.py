"""amp's part of ``optimizer.step()``: the optimizer's own step pre- and post-hooks.

Skipping a step, the fused path and master weights are driven from the hooks
torch gives every optimizer (``register_step_pre_hook``), not from a replaced
``step`` or a generated subclass, because:

* the optimizer keeps its exact type and identity, so pickling, DDP and
  ``isinstance`` see nothing new;
* an LR scheduler created *before* ``initialize`` wraps ``optimizer.step`` on
  the instance and calls the class's original ``step``, which would bypass a
  generated subclass; the hooks run inside that original ``step`` whoever
  wraps it;
* ``step()`` is always called, so a scheduler never sees a "missing" optimizer
  step and never warns about the call order when a step is skipped.

What the step gets and when it is skipped is the gradient lifecycle's
(``gradients.py``): a fused optimizer (``apex_amp.optimizers.FusedOptimizer``)
receives ``AmpStepArgs`` and decides on the device; any other optimizer has its
gradients hidden for a skipped step (one host read per step, as with
``torch.amp.GradScaler``). The hooks add what is not about gradients: O1's
casts are off during the step, the overflow log is flushed, and under O2 the
half model copy is refreshed from the masters after a non-fused step.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Optional, Sequence

import torch

from . import _multi_tensor as mt
from . import casting
from .gradients import GradLifecycle
from .overflow_log import OverflowLog

__all__ = ["StepHooks"]

_is_compiling = torch.compiler.is_compiling


def _on_stack(frame: FrameType) -> bool:
    current = sys._getframe(1)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


class StepHooks:
    """Registers amp's step pre/post hooks on one optimizer.

    Args:
        lifecycle: the optimizer's gradient lifecycle.
        logs: the session's overflow logs, whose messages that are due are logged before each step.
        casts_off_in_step: O1: turn the per-op casts off while the step runs.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, lifecycle: GradLifecycle, *, logs: Sequence[OverflowLog],
        casts_off_in_step: bool,
    ) -> None:
        self.lifecycle = lifecycle
        self._logs = tuple(logs)
        self._casts_off_in_step = casts_off_in_step
        self._casts_off: Any = None
        # The step in progress: whether there is one, the frame of torch's step wrapper that ran our
        # pre-hook (None under torch.compile), and how many nested step calls it made (a subclass's
        # step calling super().step() runs the hooks again).
        self._in_step = False
        self._step_frame: Optional[FrameType] = None
        self._nested = 0
        self._step_kwargs: Optional[dict] = None
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)

    def _end_step(self) -> None:
        # After the step, or undone because it raised (called by the lifecycle's recovery).
        self._in_step, self._step_frame, self._nested, self._step_kwargs = False, None, 0, None
        if self._casts_off is not None:
            self._casts_off.__exit__(None, None, None)
            self._casts_off = None

    def _step_running(self) -> bool:
        # A step still "in progress" whose frame has left the stack raised: the lifecycle undoes it.
        # Compiled code has no frames to look at: there, a step in progress is taken as running.
        return self._in_step and (self._step_frame is None or _on_stack(self._step_frame))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Optional[tuple]:
        if self._in_step and self._step_running():
            self._nested += 1  # super().step() inside a subclass's step: amp's part is done already
            return None if self._step_kwargs is None else (args, {**kwargs, **self._step_kwargs})
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is not None:
            raise RuntimeError(
                "apex_amp does not support optimizer.step(closure) for an optimizer passed to amp.initialize: "
                "the closure's backward would run outside amp.scale_loss. Compute the loss and call "
                "backward inside `with amp.scale_loss(loss, optimizer) as scaled_loss:`, then optimizer.step()"
            )
        for log in self._logs:  # (records are queued on CUDA only: a look, not a call, on every step)
            if log.pending:
                log.flush()
        # Recovers a step that raised.
        step_kwargs = self.lifecycle.before_step(self._end_step, self._step_running)
        frame = None if _is_compiling() else sys._getframe(1)
        self._in_step, self._step_frame, self._nested, self._step_kwargs = True, frame, 0, step_kwargs
        if self._casts_off_in_step:
            self._casts_off = casting.disable_casts()
            self._casts_off.__enter__()
        if step_kwargs is None:
            return None
        return args, {**kwargs, **step_kwargs}

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._nested:
            self._nested -= 1
            return
        skipped = self.lifecycle.after_step()
        links = self.lifecycle.params.links
        if links and not skipped and not self.lifecycle.fused:
            # A torch optimizer updated only the masters: refresh the half model copy.
            masters = [link.master.data for link in links]
            models = [link.model_param.data for link in links]
            device = masters[0].device
            mt.scale_(masters, models, torch.ones(1, device=device), torch.zeros(1, device=device))
        self._end_step()
        if self._casts_off_in_step:
            casting.clear_cache()
