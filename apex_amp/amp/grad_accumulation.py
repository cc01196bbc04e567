"""Where a pass's gradients go and how they add up: the arithmetic the gradient lifecycle's transitions call.

The lifecycle (``gradients.py``) decides *when*; these functions do the work
on one optimizer's parameters (``OptimizerParams``): *direct* parameters,
whose own ``.grad`` the optimizer reads (every parameter at O0/O1/O3, fp32
batchnorm under O2), and half model parameters linked to the fp32 masters the
optimizer holds under O2.

* ``absorb``: a pass's new gradients, still scaled, become true values: the
  direct ones in place, the half model ones into their masters' ``.grad``
  (the model's gradient is dropped), each added to what an earlier pass since
  the last step left there (the direct parameters' earlier gradients were
  stashed by ``begin_pass`` so the backward wrote fresh ones). The pass's
  flag covers the new gradients, and the sums too unless an earlier pass
  since the last step reported them (``_accumulate``).
* The gradients held for a fused step (``held``: master -> its model
  parameter's scaled gradient) and under O2 a ``delay_unscale``
  accumulation on the half model are kept where ``optimizer.zero_grad()``
  cannot reach them: ``follow_clears`` applies its clears to them
  (``grad_clears.py``), ending where PyTorch's gradients would.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _multi_tensor as mt
from .grad_clears import Cleared
from .master_weights import OptimizerParams
from .pass_records import PassScale

__all__ = [
    "new_grads", "step_grads", "holds_grads", "pending_grads", "absorb", "unscale_direct", "follow_clears", "has_old_grads",
    "stash_for_pass", "restore_stash", "hold_new_grads", "return_held", "hide_grads", "drop_consumed",
]


def new_grads(params: OptimizerParams) -> list[Tensor]:
    """The gradients a backward pass wrote: the direct params' and the half model params' ``.grad``."""
    grads = [p.grad for p in params.direct if p.grad is not None]
    grads += [link.model_param.grad for link in params.links if link.model_param.grad is not None]
    return grads


def step_grads(params: OptimizerParams) -> list[Tensor]:
    """The gradients a step reads when none is held: the direct params' and the masters' ``.grad``."""
    grads = [p.grad for p in params.direct if p.grad is not None]
    grads += [link.master.grad for link in params.links if link.master.grad is not None]
    return grads


def holds_grads(params: OptimizerParams, held: dict[Tensor, Tensor]) -> bool:
    """Whether any gradient the next step would consume is there (held, direct, or on a master)."""
    return (
        bool(held)
        or any(p.grad is not None for p in params.direct)
        or any(link.master.grad is not None for link in params.links)
    )


def pending_grads(params: OptimizerParams, held: dict[Tensor, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """(parameter as the model knows it, gradient) of every gradient the next step consumes, in optimizer order.

    Masters are named by their model parameter; a held gradient (or one on the half model) is still scaled.
    """
    found = []
    for param in params.ordered:
        model_param = params.model_param_of.get(param)
        grad = param.grad
        if grad is None and model_param is not None:
            grad = held.get(param, model_param.grad)
        if grad is not None:
            found.append((param if model_param is None else model_param, grad))
    return found


def unscale_direct(params: OptimizerParams, scale: PassScale, found_inf: Tensor) -> None:
    """Unscale in place the scaled gradients a fused step left on direct params (checked by their own pass)."""
    grads = [p.grad for p in params.direct if p.grad is not None]
    if grads and not scale.unit:
        mt.unscale_(grads, found_inf, scale.inv_scale)


def absorb(
    params: OptimizerParams, stash: Sequence[Optional[Tensor]], scale: PassScale, found_inf: Tensor,
    earlier: Optional[Tensor],
) -> None:
    """The new gradients (direct params' and half model params' ``.grad``) become true values.

    They are added to the ``stash`` (the direct params' gradients from before the pass, one per
    direct param, None where there was none) and to the masters' ``.grad``; ``found_inf`` is the
    pass's flag, ``earlier`` the flag the passes since the last step reported (None: no checked pass).
    """
    fresh, new, old = [], [], []
    for p, stashed in zip(params.direct, stash):
        grad = p.grad
        if grad is None:
            p.grad = stashed
        elif stashed is None:
            fresh.append(grad)
        else:
            new.append(grad)
            old.append(stashed)
            p.grad = stashed
    if fresh:
        if not scale.unit:
            mt.unscale_(fresh, found_inf, scale.inv_scale)
        elif scale.checked:
            mt.check_finite(fresh, found_inf)  # read-only: half the traffic of an unscale by 1
    src, dst = [], []
    for link in params.links:
        grad = link.model_param.grad
        if grad is None:
            continue
        if link.master.grad is None:
            # A sparse gradient gets a sparse master gradient of the same stored elements.
            link.master.grad = grad.to(torch.float32) if grad.is_sparse else torch.empty_like(link.master)
            src.append(grad)
            dst.append(link.master.grad)
        else:
            new.append(grad)
            old.append(link.master.grad)
        link.model_param.grad = None
    if src:
        mt.scale_(src, dst, scale.inv_scale, found_inf)
    if new:
        _accumulate(new, old, scale, found_inf, earlier)


def _accumulate(
    new: list[Tensor], old: list[Tensor], scale: PassScale, found_inf: Tensor, earlier: Optional[Tensor],
) -> None:
    # old += inv_scale * new. The pass's flag covers the new gradients, and the sums too unless an
    # earlier pass since the last step reported them (its inf would otherwise back off every later
    # loss's scale as well). Without an earlier checked pass, one axpby_ flags both.
    if not scale.checked or earlier is None:
        mt.axpby_(new, old, scale.inv_scale, 1.0, found_inf)
        return
    mt.check_finite(new, found_inf)
    sum_found_inf = torch.zeros(1, device=found_inf.device)
    mt.axpby_(new, old, scale.inv_scale, 1.0, sum_found_inf)
    unreported = sum_found_inf * (1.0 - earlier.to(sum_found_inf.device))
    torch.maximum(found_inf, unreported.to(found_inf.device), out=found_inf)


def follow_clears(
    cleared: Optional[Cleared], params: OptimizerParams, held: dict[Tensor, Tensor], delayed: bool,
) -> dict[Tensor, Tensor]:
    """Apply ``optimizer.zero_grad()``'s clears to what amp keeps off the optimizer's params; returns ``held``.

    ``optimizer.zero_grad()`` between ``scale_loss`` and the step clears the gradients amp took in
    (the masters' ``.grad`` of a torch optimizer) itself. What amp keeps off the optimizer's params,
    the gradients ``held`` for a fused step and, when ``delayed``, a ``delay_unscale`` accumulation
    on the half model under O2, follows the clears as PyTorch's gradients would.
    """
    if cleared is None:
        return held
    if delayed:
        for link in params.links:
            if cleared is Cleared.TO_NONE:
                link.model_param.grad = None
            elif link.model_param.grad is not None:
                link.model_param.grad.zero_()
    elif cleared is Cleared.TO_NONE:
        return {}
    else:
        for grad in held.values():
            grad.zero_()
    return held


# ---- where the gradients sit between a pass and a step ------------------------------------
def has_old_grads(params: OptimizerParams, stash: Sequence[Optional[Tensor]]) -> bool:
    """Whether a pass's new gradients must be added to earlier ones (stashed, or on a master)."""
    return any(s is not None for s in stash) or any(link.master.grad is not None for link in params.links)


def stash_for_pass(params: OptimizerParams) -> list[Optional[Tensor]]:
    """Before a pass's backward: take the direct params' gradients off (returned) so it writes fresh ones."""
    stash = [p.grad for p in params.direct]
    for p in params.direct:
        p.grad = None
    for link in params.links:
        # Half gradients left by a backward outside this optimizer's passes (another loss through
        # the same layers): not this optimizer's; the masters hold what its passes produced.
        link.model_param.grad = None
    return stash


def restore_stash(params: OptimizerParams, stash: Sequence[Optional[Tensor]]) -> None:
    """A pass raised: drop its partial new gradients and put the stashed ones back."""
    for p, old in zip(params.direct, stash):
        p.grad = old
    for link in params.links:
        link.model_param.grad = None


def hold_new_grads(params: OptimizerParams, scale: PassScale, found_inf: Tensor) -> dict[Tensor, Tensor]:
    """Check a pass's new gradients and move the half model ones off the model, still scaled (master -> grad)."""
    if scale.checked:
        mt.check_finite(new_grads(params), found_inf)
    held = {}
    for link in params.links:
        if link.model_param.grad is not None:
            held[link.master] = link.model_param.grad
            link.model_param.grad = None
    return held


def return_held(params: OptimizerParams, held: dict[Tensor, Tensor]) -> None:
    """Put held gradients back on their model params (where a fused step reads them)."""
    for master, grad in held.items():
        params.model_param_of[master].grad = grad


def hide_grads(params: OptimizerParams) -> list[tuple[Tensor, Tensor]]:
    """Take every gradient off the optimizer's params for a skipped step; returns (param, grad) to put back.

    torch optimizers skip parameters without a gradient: weights, moments, step counts untouched.
    """
    hidden = []
    for p in params.ordered:
        if p.grad is not None:
            hidden.append((p, p.grad))
            p.grad = None
    return hidden


def drop_consumed(params: OptimizerParams) -> None:
    """After a step: the masters' gradients (and any half one left on the model) are spent."""
    for link in params.links:
        link.master.grad = None
        link.model_param.grad = None
