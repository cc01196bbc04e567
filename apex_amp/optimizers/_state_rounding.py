"""Stochastic rounding of a fused optimizer's bf16 state: the param-group settings and the op argument.

With ``state_rounding="stochastic"`` (a constructor argument of every fused optimizer and a
param-group key), the bf16 state of a group with ``state_precision="bf16"`` is rounded up or down
at random, without bias (:func:`state_formats.round_bf16_stochastic`), instead of to nearest even.
The random bits are a pure function of

* the group's ``state_rounding_seed`` (an int; drawn from ``torch``'s default generator, or from
  the ``torch.Generator`` given as the seed, when the group is made);
* the group's ``state_rounding_step``: an int64 counter on the params' device, advanced by every
  ``step()`` (taken or skipped; on the device, no host sync);
* the parameter's index among the optimizer's parameters (as ``state_dict()`` numbers them), and
  which of its states is rounded;
* the element's index in the whole parameter: an FSDP2 shard (a DTensor sharded on dim 0 whose
  rows lead in memory) starts at ``row offset * row length``, so every mesh draws the bits of one rank.

Seed and counter are param-group entries, so ``state_dict()`` saves them and ``load_state_dict``
restores them: a resumed run rounds exactly as the uninterrupted one.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor

from .._dtensor import is_dtensor
from ._batch_plan import FusedBatch
from .state_formats import StatePrecision, StateRounding, rounding_key

__all__ = ["ROUNDING_KEYS", "COUNTER_KEY", "resolve_seed", "check_group", "stochastic", "rounding_table",
           "counter_of", "advance_counter", "rounding_rows", "prepare_batches", "adopt_loaded"]

# The param-group keys of the rounding (saved in state_dict()'s param_groups), and its step counter.
ROUNDING_KEYS = ("state_rounding", "state_rounding_seed")
COUNTER_KEY = "state_rounding_step"
_COUNTER_UNIT = 1 << 32  # the counter's place in a stream key (state_formats.rounding_key)


def resolve_seed(seed: Any) -> Optional[int]:
    """A constructor's ``state_rounding_seed``: an int as given, a ``torch.Generator`` drawn from once, or None."""
    if isinstance(seed, torch.Generator):
        return _draw_seed(seed)
    if seed is None or (isinstance(seed, int) and not isinstance(seed, bool)):
        return seed
    raise TypeError(f"state_rounding_seed must be an int, a torch.Generator or None, got {type(seed).__name__}")


def _draw_seed(generator: Optional[torch.Generator] = None) -> int:
    return int(torch.randint(0, 2 ** 62, (), generator=generator, dtype=torch.int64))


def stochastic(group: Mapping[str, Any]) -> bool:
    """Whether ``group``'s bf16 state rounds stochastically."""
    return group.get("state_rounding", StateRounding.NEAREST.value) == StateRounding.STOCHASTIC.value


def check_group(group: dict[str, Any]) -> None:
    """Validate ``group``'s rounding keys, store the rounding by its name and give a stochastic param
    group without a seed one, drawn from torch's default generator (in place). The optimizer's
    defaults (no ``params``) are only validated: a group may override their precision."""
    rounding = StateRounding.parse(group.get("state_rounding", StateRounding.NEAREST.value))
    if "state_rounding" in group:
        group["state_rounding"] = rounding.value
    group["state_rounding_seed"] = resolve_seed(group.get("state_rounding_seed"))
    if rounding is not StateRounding.STOCHASTIC or "params" not in group:
        return
    precision = StatePrecision.parse(group.get("state_precision", StatePrecision.FP32.value))
    if precision is not StatePrecision.BF16:
        raise ValueError(
            f"state_rounding='stochastic' rounds bf16 optimizer state, but this param group's state_precision is "
            f"{precision.value!r}; use state_precision='bf16' with it, or state_rounding='nearest' for this group")
    if group["state_rounding_seed"] is None:
        group["state_rounding_seed"] = _draw_seed()


def _first_element(param: Tensor) -> int:
    # The index of this rank's first element in the whole parameter (memory order).
    if not is_dtensor(param) or param.numel() == 0:
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    # Dim-0 shards of a tensor whose rows lead in memory (FSDP2's) are one run of the whole
    # parameter's elements; under other placements the bits depend on the mesh (documented).
    return offsets[0] * (param.numel() // param.shape[0]) if offsets else 0


def rounding_table(group_seed: int, owners: Sequence[Tensor], param_index: Mapping[int, int],
                   device: torch.device) -> Tensor:
    """A batch's (len(owners), 2) int64 rows without the counter: each param's stream (the low 32
    bits of its key) and the index of its shard's first element in the whole parameter."""
    rows = [(rounding_key(group_seed, 0, param_index[id(p)]), _first_element(p)) for p in owners]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(owners), 2).to(device)


def counter_of(group: dict[str, Any]) -> Tensor:
    """The group's step counter: an int64 scalar on its params' device (0 when new; a count loaded
    from a checkpoint, on another device or as a number, becomes such a tensor here, once)."""
    device = group["params"][0].device if group["params"] else torch.device("cpu")
    counter = group.get(COUNTER_KEY)
    if not (isinstance(counter, Tensor) and counter.dtype == torch.int64 and counter.dim() == 0
            and counter.device == device):
        counter = torch.as_tensor(0 if counter is None else counter).to(device=device, dtype=torch.int64)
        group[COUNTER_KEY] = counter = counter.reshape(()).clone()
    return counter


def advance_counter(group: dict[str, Any]) -> Tensor:
    """The group's step counter, advanced by one: a new tensor, so that a ``state_dict()`` taken
    earlier keeps the count it was taken at."""
    group[COUNTER_KEY] = counter = counter_of(group) + 1
    return counter


def rounding_rows(table: Tensor, counter: Tensor) -> Tensor:
    """The ops' ``state_rounding`` of one step: the table's rows with the counter in the keys' high half."""
    counter = counter.to(table.device)
    # (counter << 32, 0) added to (stream, offset) rows, whose streams are below 2**32.
    return table + torch.stack([counter * _COUNTER_UNIT, torch.zeros_like(counter)])


def prepare_batches(param_groups: list[dict[str, Any]], batches: list[tuple[dict[str, Any], FusedBatch]]) -> None:
    """Advance each stochastic group's counter once for this step and give each of its batches this
    step's ``rounding_rows`` (the ops' ``state_rounding``); other groups' batches get None."""
    # The groups are found by identity in a list, not by id() in a dict: torch 2.11's dynamo cannot
    # trace id() of a dict (a compiled step would break its graph there).
    counters: list[tuple[dict[str, Any], Tensor]] = []
    index_of: Optional[dict[int, int]] = None
    for group, batch in batches:
        if not stochastic(group):
            batch.rounding_rows = None
            continue
        counter = next((advanced for owner, advanced in counters if owner is group), None)
        if counter is None:
            counter = advance_counter(group)
            counters.append((group, counter))
        seed = group["state_rounding_seed"]
        if batch.rounding_table is None or batch.rounding_seed != seed:
            if index_of is None:  # the params' indices as state_dict() numbers them
                params = itertools.chain.from_iterable(g["params"] for g in param_groups)
                index_of = {id(p): index for index, p in enumerate(params)}
            batch.rounding_table = rounding_table(seed, batch.owners, index_of, batch.device)
            batch.rounding_seed = seed
        batch.rounding_rows = rounding_rows(batch.rounding_table, counter)


def adopt_loaded(group: dict[str, Any], configured: Mapping[str, Any]) -> None:
    """After torch's ``load_state_dict``: the group keeps its own ``state_rounding`` (as its precision),
    and the checkpoint's seed and counter when it has them (a resume), else its own."""
    group["state_rounding"] = configured["state_rounding"]
    if group.get("state_rounding_seed") is None:
        group["state_rounding_seed"] = configured["state_rounding_seed"]
    if group.get(COUNTER_KEY) is None and configured.get(COUNTER_KEY) is not None:
        group[COUNTER_KEY] = configured[COUNTER_KEY]
    check_group(group)

