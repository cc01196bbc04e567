"""Whether one optimizer's next step is skipped, and whether its last one was: the step's overflow flag.

The flag of a checked pass covers everything the next step will consume (the
new gradients, and the sums they were added to unless an earlier pass since
the last step already reported those: ``grad_accumulation.py``). A step is
skipped when a pass since the previous step reported an overflow, and that
pass's scaler backed off and logged it, or when the gradients a skipped step
left on direct parameters are still not finite: ``found_inf`` is the OR of
those flags, on the device; only a non-fused optimizer's step reads it on the
host (``skips_on_host``), a fused one decides on the device.

A pass with ``delay_overflow_check=True`` leaves its skip and its scale
update to the client (apex's ``update_scale()``, once per step): its flag
(``guard``, kept apart from amp's own) only keeps a step from applying its
gradients: it ends when the client has set them all to None instead of
stepping (the gradient lifecycle calls ``end_guard`` then), and the step
checks again what it would apply (``recheck_guard``: a client may clear to
zero instead). amp's own flag stands until the step, as apex's patched step
did.

What a step that may have been skipped left on direct parameters (their
``.grad`` stays after a step, as in PyTorch) is checked again by the first
event after it, a pass or another step (``carry_leftovers``), so no step
applies a gradient amp saw non-finite until a clear or new gradients replace
it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _multi_tensor as mt

__all__ = ["StepSkip"]


class StepSkip:
    """The overflow flags of one optimizer's steps (kept by its ``GradLifecycle``).

    ``found_inf`` is what the next step gets (None: no checked pass since the last step); it is
    the OR of amp's own flag and the client's guard, made when one of them changes, not when the
    step reads it (every step does).

    Args:
        device: where the flags live (the session's device).
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        # OR of the flags of the passes amp checked since the last step, and of what
        # carry_leftovers found: it stands until the step.
        self._own: Optional[Tensor] = None
        # OR of the flags of passes whose skip is the client's (delay_overflow_check) since the last
        # step: it guards their gradients only, and ends when they are all cleared (end_guard).
        self.guard: Optional[Tensor] = None
        self.found_inf: Optional[Tensor] = None  # the next step's flag: _own and guard together
        self.last_found_inf: Optional[Tensor] = None  # the flag the last step had
        # A step that may have been skipped left gradients on direct params: the next event checks them.
        self.leftovers_suspect = False
        # A zero flag standing for clean passes known on the host; never written (note).
        self.clean = torch.zeros(1, device=device)

    def _combine(self) -> None:
        own, guard = self._own, self.guard
        if guard is None or guard is self.clean and own is not None:
            self.found_inf = own
        elif own is None or own is self.clean:
            self.found_inf = guard
        else:
            self.found_inf = torch.maximum(own, guard.to(own.device))

    def note(self, found_inf: Tensor, overflowed: Optional[bool] = None, guards_only: bool = False) -> None:
        """Add an accounted pass's flag to the next step's (no host sync).

        ``overflowed``: the flag's value when the host knows it already (a CPU flag). A clean
        pass then adds nothing, and needs no copy: the shared zero flag stands for it.
        ``guards_only``: the pass left its skip to the client (``delay_overflow_check=True``, apex's
        ``update_scale()`` flow): the flag keeps a step from applying its gradients, and ends when
        the client clears them all instead of stepping (``end_guard``).
        """
        if guards_only:
            self.guard = self._or(self.guard, found_inf, overflowed)
        else:
            self._own = self._or(self._own, found_inf, overflowed)
        self._combine()

    def _or(self, flag: Optional[Tensor], found_inf: Tensor, overflowed: Optional[bool]) -> Tensor:
        if overflowed is False:
            return self.clean if flag is None else flag
        if flag is None or flag is self.clean:
            return found_inf.clone()  # private: the scaler reuses its flag buffer
        return torch.maximum(flag, found_inf.to(flag.device), out=flag)

    def end_guard(self) -> None:
        """The client dropped every gradient its own check guarded: its flag must not skip the next step."""
        self.guard = None
        self._combine()

    def recheck_guard(self, grads: list[Tensor]) -> None:
        """The client's guard becomes the check of ``grads``, what the step would apply now (no host sync).

        A client that skips by clearing its gradients to zero, not to None, leaves nothing the guard
        was for: the step applies what the passes since the clear produced, as under apex.
        """
        if self.guard is None or self.guard is self.clean:
            return  # nothing to guard, or passes the host knows were clean
        self.guard = torch.zeros(1, device=self._device)
        mt.check_finite(grads, self.guard)
        self._combine()

    def carry_leftovers(self, grads: list[Tensor]) -> None:
        """The first event after a step that may have been skipped: check the direct gradients it left.

        The next step is skipped while they are not finite (a clear to zero, to None or a
        replacement ends it). Their pass was accounted already: the flag is the step's only, no
        pass reports it a second time.
        """
        if not self.leftovers_suspect or self.found_inf is not None:
            return
        self.leftovers_suspect = False
        if grads and self.last_found_inf is not self.clean:  # (the host's clean flag: taken)
            self._own = torch.zeros(1, device=self._device)
            mt.check_finite(grads, self._own)
            self._combine()

    def skips_on_host(self) -> bool:
        """Whether a non-fused step must be skipped (its one host sync, unless the passes were clean on the host)."""
        found_inf = self.found_inf
        return found_inf is not None and found_inf is not self.clean and bool(found_inf.item())

    def step_done(self, may_have_skipped: bool) -> None:
        """A step consumed the gradients: its flag becomes the last step's.

        ``may_have_skipped``: a fused step (whose flag is looked at by the next event, not in the
        step's hooks, which torch.compile traces: a tensor compared there would be one more guard)
        or a step skipped on the host; what it left on direct params is then checked again.
        """
        flag = self.last_found_inf = self.found_inf
        self.found_inf = self._own = self.guard = None
        self.leftovers_suspect = flag is not None and may_have_skipped

    def last_was_skipped(self) -> bool:
        """Whether the last step was skipped (a host read)."""
        flag = self.last_found_inf
        return flag is not None and bool(flag.item())
