"""What a fused optimizer's step is handed: amp's :class:`AmpStepArgs`, or what ``torch.amp.GradScaler`` gives.

amp's gradient lifecycle passes :class:`AmpStepArgs` to ``step(amp=...)``. ``torch.amp.GradScaler``
drives the same step through torch's protocol (``_step_supports_amp_scaling``: it sets
``grad_scale`` and ``found_inf`` on the optimizer and calls ``step()``), and apex's
``step(grad_scaler=...)`` hands the scaler itself. :func:`resolve` turns each into the one
``AmpStepArgs`` the ops take (and refuses apex's dropped ``step()`` arguments as apex did);
:func:`leave_grads_unscaled` leaves a GradScaler's gradients unscaled after the step, as torch's
fused optimizers do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from ._batch_plan import FusedBatch

__all__ = ["AmpStepArgs", "resolve", "leave_grads_unscaled"]

# apex's optimizers once took these step() arguments; apex raised on them, with this message.
_APEX_LEGACY_ARGUMENTS = ("grads", "output_params", "scale", "grad_norms")


@dataclasses.dataclass(frozen=True)
class AmpStepArgs:
    """What amp hands a fused optimizer's step.

    Args:
        found_inf: one-element float32 flag; non-zero makes the whole step a no-op (on the device).
        inv_scale: one-element float32 factor of gradients left scaled (unscaled as they are read).
        model_params: ``{fp32 master: half model param}``; a master without ``.grad`` takes its
            model param's gradient, and the model param is rewritten in the same pass.
    """

    found_inf: Optional[Tensor] = None
    inv_scale: Optional[Tensor] = None
    model_params: Mapping[Tensor, Tensor] = dataclasses.field(default_factory=dict)


def resolve(optimizer: torch.optim.Optimizer, amp: Optional[AmpStepArgs],
            apex_arguments: dict[str, Any]) -> AmpStepArgs:
    """The step's :class:`AmpStepArgs`: amp's, or those of a ``torch.amp.GradScaler`` driving the
    step (``grad_scale`` and ``found_inf`` set on the optimizer, or apex's ``step(grad_scaler=...)``),
    or none; apex's dropped ``step()`` arguments raise, as in apex."""
    legacy = [name for name in _APEX_LEGACY_ARGUMENTS if apex_arguments.get(name) is not None]
    if legacy:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() got {legacy}: apex's optimizers dropped these arguments. "
            "Initialize it identically to the torch.optim optimizer and call step() with no arguments")
    unknown = set(apex_arguments) - set(_APEX_LEGACY_ARGUMENTS) - {"grad_scaler"}
    if unknown:
        raise TypeError(f"{type(optimizer).__name__}.step() got unexpected keyword arguments {sorted(unknown)}")
    grad_scaler = apex_arguments.get("grad_scaler")
    # torch.amp.GradScaler.step sets these two attributes for an optimizer that scales itself.
    grad_scale, found_inf = getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)
    from_scaler = grad_scaler is not None or found_inf is not None
    if amp is not None and from_scaler:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() was driven by amp and by a torch.amp.GradScaler at once; "
            "use one of them: amp.initialize with amp.scale_loss, or GradScaler without amp")
    if amp is not None:
        return amp
    if grad_scaler is not None:
        scale = grad_scaler._get_scale_async()
        found = grad_scaler._check_inf_per_device(optimizer)
        found_inf = sum(flag.to(scale.device) for flag in found.values()) if found else None
        grad_scale = scale
    if not from_scaler:
        return AmpStepArgs()
    inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float().reshape(1)
    return AmpStepArgs(found_inf=None if found_inf is None else found_inf.float().reshape(1),
                       inv_scale=inv_scale)


def leave_grads_unscaled(batches: list[tuple[dict[str, Any], FusedBatch]], amp: AmpStepArgs) -> None:
    # After torch.amp.GradScaler's step, torch's fused optimizers (and apex's) leave the gradients
    # unscaled for whoever reads them next (a grad-norm logger); an overflowed step leaves them as
    # they were. Ours unscale as they read without writing back: this pass does it.
    for _, batch in batches:
        if not batch.grads:
            continue
        factor = amp.inv_scale.to(batch.device).reshape(())
        if amp.found_inf is not None:
            factor = torch.where(amp.found_inf.to(batch.device).reshape(()) > 0, torch.ones_like(factor), factor)
        torch._foreach_mul_(batch.grads, factor)
