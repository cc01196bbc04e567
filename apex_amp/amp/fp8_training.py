"""fp8 training in a session: which Linears convert, their scales, and the update at each optimizer step.

``amp.initialize(..., fp8=...)`` plans the conversion before the masters are
made (:func:`plan_fp8`: each eligible ``nn.Linear`` and the optimizer that
trains it), then starts it (:func:`start_fp8`): one
:class:`~apex_amp.fp8.scaling.Fp8Scales` for the session, the layers turned
into ``Fp8Linear`` bound to their columns (ordered by optimizer, so each
optimizer's layers are one slice), and a step post-hook on each optimizer,
registered after amp's own, that ends the fp8 step of its layers with the
step's overflow flag: a skipped step drops its amaxes and keeps its scales.
The layers' GEMM outputs are in the recipe's compute dtype for matmuls.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from ..fp8 import Fp8Binding, Fp8Scales, convert_, eligibility
from .gradients import GradLifecycle
from .recipe import OpCategory, Recipe

__all__ = ["Fp8Plan", "Fp8Training", "plan_fp8", "start_fp8"]

logger = logging.getLogger("apex_amp")


@dataclasses.dataclass
class Fp8Plan:
    """The Linears that convert (name, module, index of the optimizer that trains it) and those that stay."""

    layers: list[tuple[str, nn.Linear, int]]
    skipped: list[tuple[str, str]]  # (name, reason)

    def notice(self, half: str) -> Optional[str]:
        """The one message about the Linears that stay in the half dtype, or None when every one converts."""
        if not self.skipped:
            return None
        listed = "; ".join(f"{name} ({reason})" for name, reason in self.skipped)
        return (f"apex_amp fp8: {len(self.layers)} nn.Linear layer(s) run in fp8; {len(self.skipped)} stay in "
                f"{half}: {listed}")


def plan_fp8(recipe: Recipe, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> Fp8Plan:
    """Which ``nn.Linear`` layers of ``models`` convert (call before the optimizers get masters)."""
    if not optimizers:
        raise ValueError(
            "fp8 training needs the optimizer(s): the fp8 scales advance at each optimizer step. Pass them, "
            "e.g. amp.initialize(model, optimizer, opt_level='O2', fp8=True)"
        )
    owner = {p: index for index, optimizer in enumerate(optimizers)
             for group in optimizer.param_groups for p in group["params"]}
    layers, skipped = [], []
    for model_index, model in enumerate(models):
        prefix = f"model{model_index}." if len(models) > 1 else ""
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            if type(module) is not nn.Linear:
                # A subclass may compute something else (MultiheadAttention's out_proj is never even called).
                skipped.append((prefix + name, f"a {type(module).__name__}: only nn.Linear itself converts"))
                continue
            reason = eligibility(name, module, recipe.fp8)
            if reason is None:
                layers.append((prefix + name, module, owner.get(module.weight, 0)))
            else:
                skipped.append((prefix + name, reason))
    layers.sort(key=lambda layer: layer[2])  # stable: each optimizer's layers are one run of columns
    return Fp8Plan(layers, skipped)


class Fp8Training:
    """The session's fp8 state: the scales, the converted layers, and the step hooks that advance them."""

    def __init__(self, scales: Fp8Scales, layers: Sequence[nn.Linear], process_group: Any) -> None:
        self.scales = scales
        self.process_group = process_group
        self.param_ids = {id(p) for layer in layers for p in layer.parameters(recurse=False)}
        self._last_step: dict[int, int] = {}

    def attach(self, optimizer: torch.optim.Optimizer, columns: slice, lifecycle: GradLifecycle) -> None:
        """End the fp8 step of ``columns`` after each ``optimizer.step()`` (amp's own hooks ran first)."""
        key = id(optimizer)
        self._last_step[key] = lifecycle.steps

        def after_step(_optimizer: torch.optim.Optimizer, _args: tuple, _kwargs: dict) -> None:
            if lifecycle.steps == self._last_step[key]:
                return  # a nested step (a subclass calling super().step()): amp counted one step
            self._last_step[key] = lifecycle.steps
            self.scales.end_step(columns, lifecycle.skip.last_found_inf, self.process_group)

        optimizer.register_step_post_hook(after_step)

    def holds_param(self, param: Tensor) -> bool:
        """Whether ``param`` is a weight or bias of an fp8 layer."""
        return id(param) in self.param_ids

    def nonfinite_tensors(self) -> list[str]:
        return self.scales.nonfinite_tensors()

    def state_dict(self) -> dict[str, Any]:
        return self.scales.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scales.load_state_dict(state)


def start_fp8(
    plan: Fp8Plan, recipe: Recipe, optimizers: Sequence[torch.optim.Optimizer],
    lifecycle_of: Callable[[torch.optim.Optimizer], GradLifecycle], device: torch.device, process_group: Any,
) -> Fp8Training:
    """Convert the planned layers and hook the optimizers; returns the session's fp8 state."""
    scales = Fp8Scales(recipe.fp8, [name for name, _, _ in plan.layers], device)
    out_dtype = recipe.compute_dtype(OpCategory.MATMUL)
    for index, (_, module, _) in enumerate(plan.layers):
        convert_(module, Fp8Binding(scales, scales.first_column(index), out_dtype))
    training = Fp8Training(scales, [module for _, module, _ in plan.layers], process_group)
    for index, optimizer in enumerate(optimizers):
        mine = [position for position, (_, _, owner) in enumerate(plan.layers) if owner == index]
        if mine:
            columns = slice(scales.first_column(mine[0]), scales.first_column(mine[-1] + 1))
            training.attach(optimizer, columns, lifecycle_of(optimizer))
    return training
