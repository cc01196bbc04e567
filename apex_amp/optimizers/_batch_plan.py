"""The batches of a param group's fused step, worked out once and reused while nothing they depend on changes.

Building a step's batches walks every parameter in Python: its gradient, its model copy, its
state (created on first sight), DTensor shards, the merge of fp32 params into the batch with
a model copy, the group's step count. A step's cost on a small model is mostly that walk
(benchmarks/bench_overhead.py), and from one step to the next its result is the same but for
the gradient tensors. A :class:`BatchPlan` keeps the result and is reused when a cheap check
finds the same parameters, the same of them with a gradient, the same model copies and the
same state tensors; anything else (a param group added or changed, a state loaded, replaced
or deleted, a parameter without a gradient this time, a new model copy) builds afresh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from torch import Tensor

__all__ = ["BatchPlan", "copy_of_step"]

_NO_STATE: dict[str, Any] = {}


def copy_of_step(step: Tensor, device: Any) -> Tensor:
    """The value of a group's step count before the step, for the group's other batches.

    Another batch of the group (another device, or params without a model copy beside those
    with one) takes a copy: only the group's own tensor advances.
    """
    return step.to(device, copy=True)


@dataclasses.dataclass
class BatchPlan:
    """One group's batches and what they were built from.

    ``batches`` hold everything but the gradients; ``grad_positions[i]`` are the positions in
    the group's params of batch ``i``'s gradients; ``group_step`` the group's step count
    (``group["step"]``), which the first batch advances and the others take a copy of.
    """

    group: dict[str, Any]
    batches: list[Any]
    grad_positions: list[list[int]]
    group_step: Optional[Tensor]
    param_ids: list[int]
    model_of: Optional[list[Optional[Tensor]]]  # each param's half model param (None without amp's masters)
    model_params_key: tuple[int, int]
    has_grad: list[bool]
    state_keys: tuple[str, ...]  # the keys whose tensors the batches hold (and "step", "master_param")
    state_ids: list[int]
    settings: tuple[Any, ...]  # the optimizer's _plan_settings() when built

    @staticmethod
    def mapping_key(model_params: Mapping[Tensor, Tensor]) -> tuple[int, int]:
        """Which mapping of model params a plan was built with (amp's grows, never changes an entry)."""
        return (id(model_params), len(model_params)) if model_params else (0, 0)

    @staticmethod
    def signature(state: Mapping[Tensor, dict[str, Any]], params: list[Tensor], keys: tuple[str, ...]) -> list[int]:
        """The identities of ``params``' state tensors under ``keys`` (0 where there is none)."""
        states = [state.get(p, _NO_STATE) for p in params]
        return [id(s.get(key)) for s in states for key in keys]

    def grads(self, params: list[Tensor], model_params: Mapping[Tensor, Tensor]) -> Optional[list[Optional[Tensor]]]:
        """Each param's gradient (on the param, else on its model copy), or None when the plan is stale."""
        if self.model_params_key != self.mapping_key(model_params):
            return None
        if [id(p) for p in params] != self.param_ids:
            return None
        grads = [p.grad for p in params]
        if self.model_of is not None:
            grads = [g if g is not None or m is None else m.grad for g, m in zip(grads, self.model_of)]
        if [g is not None for g in grads] != self.has_grad:
            return None
        return grads

    def fill(self, grads: list[Optional[Tensor]]) -> list[Any]:
        """The plan's batches with this step's gradients (and step counts)."""
        for index, (batch, positions) in enumerate(zip(self.batches, self.grad_positions)):
            batch.grads = [grads[i] for i in positions]
            if self.group_step is not None:
                batch.step = copy_of_step(self.group_step, batch.device) if index else self.group_step
        return self.batches
