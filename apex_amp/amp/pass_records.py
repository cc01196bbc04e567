"""The records a backward pass leaves: the scale its gradients carry, and the checked pass to account.

Accounting runs one way: ``scale_loss`` (``backward_pass.py``) makes a
``PassScale`` for the gradient lifecycles (``gradients.py``) and a
``PassRecord`` of the lifecycles that checked the pass for the session
(``AmpSession.account``), which never calls back into a lifecycle's transitions.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["PassScale", "PassRecord"]


# The records of a pass are made on every pass: named tuples, which cost a fraction of a
# dataclass to build.
class PassScale(NamedTuple):
    """The scale the gradients of one backward pass carry."""

    loss_id: int
    epoch: int  # the loss scaler's scale epoch: passes of one loss in one epoch carry the same scale
    inv_scale: Tensor  # one-element float32 device tensor
    unit: bool  # the static scale 1.0: nothing to multiply
    checked: bool  # check for inf/NaN (and skip the step on overflow)
    # delay_overflow_check=True: the client updates the scale itself (update_scale()), once per step
    client_checks: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.loss_id, self.epoch)


class PassRecord(NamedTuple):
    """A checked backward pass for the session to account (agree across ranks, update the scale, log).

    ``scale_loss`` makes one for the lifecycles ``end_pass`` checked, the session one per DELAYED
    accumulation it takes in (``AmpSession.take_in_accumulation``: one record for every optimizer
    the accumulation covers); the lifecycle never accounts a pass itself.
    """

    loss_id: int
    found_inf: Tensor
    lifecycles: tuple  # the GradLifecycles (gradients.py, which imports this module) the pass covers
    inv_scale: Tensor
    # delay_overflow_check=True: the session leaves the scale update to the client's update_scale(), and
    # the flag only keeps the step from applying these gradients (StepSkip.note)
    client_checks: bool = False
