"""The batches of a param group's fused step (:class:`FusedBatch`), worked out once and reused
while nothing they depend on changes.

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

import torch
from torch import Tensor

__all__ = ["BatchPlan", "FusedBatch", "copy_of_step", "merge_fp32_into_copy_batches"]

_NO_STATE: dict[str, Any] = {}


@dataclasses.dataclass
class FusedBatch:
    """The tensors of one op call: one param group, one device, with or without a model copy.

    ``owners`` are the optimizer's params (whose state the batch holds), ``params`` what is
    updated (the params, or optimizer-owned masters), ``states`` the per-element state lists by
    key, ``absmaxes`` their per-block absmaxes (numel 0 for a state that has none),
    ``master_remainders`` the int16 low halves of remainder masters (one per param, or none),
    ``new_state`` whether each param's state was created for this step. DTensors (FSDP2)
    are their local shards: the ops are elementwise per tensor.
    """

    device: torch.device
    owners: list[Tensor] = dataclasses.field(default_factory=list)
    params: list[Tensor] = dataclasses.field(default_factory=list)
    grads: list[Tensor] = dataclasses.field(default_factory=list)
    states: dict[str, list[Tensor]] = dataclasses.field(default_factory=dict)
    model_params: list[Tensor] = dataclasses.field(default_factory=list)
    new_state: list[bool] = dataclasses.field(default_factory=list)
    step: Optional[Tensor] = None  # the group's step count (optimizers that count steps)
    absmaxes: dict[str, list[Optional[Tensor]]] = dataclasses.field(default_factory=dict)  # None: not blocked
    master_remainders: list[Tensor] = dataclasses.field(default_factory=list)
    # Stochastic rounding of bf16 state (_state_rounding.py): the rows without the step counter
    # (made with rounding_seed), and this step's rows, the ops' state_rounding (None: to nearest even).
    rounding_table: Optional[Tensor] = None
    rounding_seed: Optional[int] = None
    rounding_rows: Optional[Tensor] = None

    def state_rounding(self, indices: Optional[list[int]] = None) -> Optional[Tensor]:
        """The ops' ``state_rounding`` for the params at ``indices`` (default all)."""
        if self.rounding_rows is None or indices is None:
            return self.rounding_rows
        return self.rounding_rows[indices]

    def state_absmaxes(self, indices: Optional[list[int]] = None) -> list[Tensor]:
        """The ops' ``state_absmaxes``: state-list-major, for the params at ``indices`` (default all),
        numel-0 tensors for the states that are not blocked; [] when none is."""
        lists = [self.absmaxes[key] for key in self.states]
        if indices is not None:
            lists = [[absmaxes[i] for i in indices] for absmaxes in lists]
        if all(t is None for absmaxes in lists for t in absmaxes):
            return []
        return [torch.empty(0, device=self.device) if t is None else t for absmaxes in lists for t in absmaxes]


# fp32 params without a model copy join the batch of those with one (typically the fp32
# BatchNorm params next to O2's half model params), each passed as its own model copy: the
# ops allow model_params[i] to be params[i] and write the same value twice, to cache lines
# just written, which costs less than the fixed overhead of a second call and a copy of the
# step (benchmarks/README.md has the measurement).
def merge_fp32_into_copy_batches(batches: dict[tuple[torch.device, bool, bool], FusedBatch]) -> list[FusedBatch]:
    for device in {device for device, _, _ in batches}:
        with_copy, without = batches.get((device, True, False)), batches.get((device, False, False))
        if with_copy is None or without is None:
            continue
        if any(t.dtype != torch.float32 for t in without.params):
            continue  # a half param without a master cannot have a model copy: two calls
        with_copy.owners += without.owners
        with_copy.params += without.params
        with_copy.grads += without.grads
        for name in with_copy.states:
            with_copy.states[name] += without.states[name]
            with_copy.absmaxes[name] += without.absmaxes[name]
        with_copy.model_params += without.params
        with_copy.new_state += without.new_state
        del batches[(device, False, False)]
    return list(batches.values())


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
