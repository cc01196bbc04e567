"""LARC: layer-wise adaptive rate clipping (or scaling) around any optimizer, as apex.parallel.LARC.

For each parameter the learning rate is scaled by a trust ratio,
``trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)``: with
``clip=True`` (LARC) the effective rate becomes ``min(ratio, lr)``, with
``clip=False`` (LARS) ``ratio * lr``. The wrapped optimizer's weight decay is
folded into the gradient first, as apex did, and its own decay is switched off
for that step.

Like apex's, LARC is a wrapper, not a ``torch.optim.Optimizer``: it holds the
optimizer in ``.optim`` and forwards ``param_groups``, ``state``,
``state_dict`` and ``zero_grad`` to it. ``amp.initialize(model, LARC(opt))``
returns the same LARC object; amp's hooks sit on the wrapped optimizer, and amp
unscales the gradients before ``LARC.step`` reads them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["LARC"]


class LARC:
    """Layer-wise adaptive rate clipping around ``optimizer`` (apex.parallel.LARC's signature).

    Args:
        optimizer: the optimizer to wrap (its ``lr`` and ``weight_decay`` are used per group).
        trust_coefficient: the trust coefficient (``eta`` of the LARS paper).
        clip: True for LARC (the rate is ``min(trust ratio, lr)``), False for LARS (``trust ratio * lr``).
        eps: added to the denominator of the trust ratio.

    Example::

        >>> optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), trust_coefficient=0.02)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True,
                 eps: float = 1e-8) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LARC wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not trust_coefficient > 0:
            raise ValueError(f"trust_coefficient must be > 0, got {trust_coefficient!r}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        self.optim = optimizer
        self.trust_coefficient = float(trust_coefficient)
        self.clip = bool(clip)
        self.eps = float(eps)

    def __repr__(self) -> str:
        return f"LARC(trust_coefficient={self.trust_coefficient}, clip={self.clip}, eps={self.eps}, {self.optim!r})"

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Any:
        """Scale each gradient by its layer's trust ratio, then step the wrapped optimizer."""
        weight_decays = []
        for group in self.optim.param_groups:
            weight_decay = group.get("weight_decay", 0.0)
            weight_decays.append(weight_decay)
            group["weight_decay"] = 0.0
            for param in group["params"]:
                if param.grad is None:
                    continue
                param_norm = torch.linalg.vector_norm(param)
                grad_norm = torch.linalg.vector_norm(param.grad)
                ratio = self.trust_coefficient * param_norm / (grad_norm + param_norm * weight_decay + self.eps)
                if self.clip:
                    ratio = torch.clamp(ratio / group["lr"], max=1.0)  # times lr: min(ratio, lr)
                # A zero weight or gradient is left as it is, without decay (as apex), decided on the device.
                usable = (param_norm != 0) & (grad_norm != 0)
                decay = torch.where(usable, weight_decay, 0.0).to(param.grad.dtype)
                param.grad.addcmul_(param, decay).mul_(torch.where(usable, ratio, 1.0).to(param.grad.dtype))
        try:
            return self.optim.step(closure) if closure is not None else self.optim.step()
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = weight_decay
