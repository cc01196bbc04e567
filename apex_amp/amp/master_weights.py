"""fp32 master weights for a half model (O2): the optimizer updates the masters.

The optimizer's ``param_groups`` are edited in place so that each half model
parameter is replaced by its fp32 master, and any state the optimizer already
holds for the model parameter moves to the master (cast to fp32, the step
count untouched). Parameters that are already fp32 (batchnorm under
keep_batchnorm_fp32, layers outside the models) are their own masters: amp
calls them *direct* parameters, because the optimizer reads their own ``.grad``.

Masters start from the user's exact fp32 weights (taken before the model was
cast). apex made its masters lazily, at the first backward pass, from the
model's half weights, so weights changed between ``initialize`` and the first
backward (by the user, or by DistributedDataParallel's broadcast) were picked
up. :func:`mismatched_links` finds such changes and :func:`adopt_model_weights`
takes them over; the gradient lifecycle does both once, before the first pass.

Param groups added after ``initialize`` get masters the next time amp looks
(a pass, a step, ``amp.master_params``) or before a ``load_state_dict`` of the
model or the optimizer, from the exact fp32 value where one is known
(:class:`LoadedValues`: what ``model.load_state_dict`` loaded into the half
parameter), so a resume that re-adds a group continues bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping, Optional

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from .._dtypes import HALF_DTYPES

__all__ = [
    "MasterLink", "LoadedValues", "OptimizerParams", "attach_masters", "mismatched_links", "adopt_model_weights", "reconcile_masters",
    "follow_model_layouts",
]

logger = logging.getLogger("apex_amp")


@dataclasses.dataclass(frozen=True, eq=False)
class MasterLink:
    """A half model parameter and the fp32 master the optimizer updates in its place."""

    model_param: nn.Parameter
    master: nn.Parameter


def _move_state(optimizer: torch.optim.Optimizer, old: Tensor, new: Tensor) -> None:
    if old not in optimizer.state:
        return
    state = optimizer.state.pop(old)
    optimizer.state[new] = {
        key: value.to(new.dtype) if key != "step" and isinstance(value, Tensor) and value.is_floating_point() else value
        for key, value in state.items()
    }


# The exact fp32 value a master of this half parameter should start from (a private copy), or None.
Fp32ValueOf = Callable[[Tensor], Optional[Tensor]]


def attach_masters(
    optimizer: torch.optim.Optimizer,
    first_group: int = 0,
    fp32_value_of: Optional[Fp32ValueOf] = None,
) -> list[MasterLink]:
    """Replace the half params of ``optimizer.param_groups[first_group:]`` by fp32 masters.

    Args:
        optimizer: the user's optimizer, edited in place.
        first_group: index of the first param group to process (later add_param_group calls).
        fp32_value_of: the exact fp32 value of a parameter where one is known (taken before
            the model was cast, or loaded by ``model.load_state_dict``), as a private copy,
            so masters start from the user's exact weights rather than from their half rounding.

    Returns:
        The new links, in param-group order.
    """
    links = []
    for group in optimizer.param_groups[first_group:]:
        params = group["params"]
        for index, param in enumerate(params):
            if param.dtype not in HALF_DTYPES:
                continue
            source = fp32_value_of(param) if fp32_value_of is not None else None
            data = source if source is not None else param.detach().to(torch.float32)
            master = nn.Parameter(data, requires_grad=param.requires_grad)
            params[index] = master
            _move_state(optimizer, param, master)
            links.append(MasterLink(param, master))
    return links


def _same_values(a: Tensor, b: Tensor) -> bool:
    return torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())


def mismatched_links(links: list[MasterLink]) -> list[int]:
    """Indices of the links whose model weight is not the rounding of its master (a host read)."""
    with torch.no_grad():
        return [
            index for index, link in enumerate(links)
            if not _same_values(link.master.to(link.model_param.dtype), link.model_param)
        ]


def adopt_model_weights(links: list[MasterLink]) -> None:
    """Make each master the fp32 value of its model weight, as apex's lazily made masters were."""
    with torch.no_grad():
        for link in links:
            link.master.copy_(link.model_param)


def follow_model_layouts(links: list[MasterLink], optimizer_state: Mapping[Tensor, dict]) -> int:
    """Give each master (and its optimizer state) its model weight's memory layout; returns how many moved.

    A model converted with ``model.to(memory_format=torch.channels_last)`` after ``initialize``
    has weights and gradients in the new layout; the fused ops walk corresponding tensors
    element for element, so the masters must follow. The values are copied exactly.
    """
    moved = 0
    with torch.no_grad():
        for link in links:
            master, model_param = link.master, link.model_param
            if master.stride() == model_param.stride():
                continue
            moved += 1
            master.data = torch.empty_like(model_param, dtype=torch.float32).copy_(master.data)
            if master.grad is not None:
                master.grad = torch.empty_like(master).copy_(master.grad)
            state = optimizer_state.get(master, {})
            for key, value in state.items():
                if isinstance(value, Tensor) and value.shape == master.shape:
                    state[key] = torch.empty_like(master, dtype=value.dtype).copy_(value)
    return moved


def reconcile_masters(links: list[MasterLink]) -> None:
    """Before the first pass: masters whose model weight changed since ``initialize`` take it over.

    apex made its masters at the first backward, from the model's weights as they were then, so
    weights changed after ``initialize`` (a user's init, a loaded embedding) were trained. In a
    distributed run a rank whose weights changed is refused instead: adopting the change on that
    rank alone would leave the ranks with different masters (a DDP wrapper amp saw has already
    given every rank rank 0's masters by then).
    """
    changed = mismatched_links(links) if links else []
    if not changed:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized() and (
        torch.distributed.get_world_size() > 1
    ):
        raise RuntimeError(
            f"rank {torch.distributed.get_rank()}: {len(changed)} model weights are not the rounding of "
            f"amp's fp32 master weights (the first is master index {changed[0]}). amp.initialize made the "
            "masters from this rank's own weights, and the weights were changed since (DistributedDataParallel "
            "broadcasts rank 0's weights into the model; amp follows that by itself unless the wrapper runs "
            "its Python reducer). Build the model from the same seed on every rank, or call "
            "amp.sync_masters(ddp_model, optimizer) after wrapping, or pass model=ddp_model to amp.scale_loss"
        )
    adopt_model_weights([links[index] for index in changed])
    logger.info(
        "amp: %d model weights were changed after amp.initialize; their fp32 masters now start from them",
        len(changed),
    )


class LoadedValues:
    """fp32 values ``model.load_state_dict`` gave half parameters that have no master yet.

    A resume may load the model before it re-adds a param group (``add_param_group``); the
    group's masters are made afterwards and must start from the checkpoint's fp32 values, not
    from their half rounding, for the run to continue bit for bit. The loaded tensors are
    referenced, not copied, and forgotten at the next backward pass.
    """

    def __init__(self) -> None:
        self._values = WeakIdKeyDictionary()  # half model param -> the fp32 tensor loaded into it

    def remember(self, param: Tensor, value: Tensor) -> None:
        if value.dtype == torch.float32 and param.dtype in HALF_DTYPES and value.shape == param.shape:
            self._values[param] = value

    def take(self, param: Tensor) -> Optional[Tensor]:
        """A private fp32 copy of the value loaded into ``param``, if ``param`` still holds its rounding."""
        value = self._values.pop(param, None)
        if value is None:
            return None
        with torch.no_grad():
            if not _same_values(value.to(device=param.device, dtype=param.dtype), param):
                return None  # the weight was changed after the load: start from the weight
            return torch.empty_like(param, dtype=torch.float32).copy_(value)

    def forget(self) -> None:
        if len(self._values):
            self._values = WeakIdKeyDictionary()


class OptimizerParams:
    """The parameters of one optimizer as amp sees them: master links and direct parameters.

    Args:
        links: the masters ``initialize`` attached (empty below O2).
        make_masters: whether param groups added later get masters too (O2).
        on_new_links: called with the links of groups added later.
        fp32_value_of: the exact fp32 values known for parameters of groups added later.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, links: list[MasterLink], make_masters: bool,
        on_new_links: Callable[[list[MasterLink]], None], fp32_value_of: Optional[Fp32ValueOf] = None,
    ) -> None:
        self._fp32_value_of = fp32_value_of
        self.links: list[MasterLink] = []
        self.model_param_of: dict[Tensor, Tensor] = {}  # master -> its half model param
        self.direct: list[Tensor] = []  # optimizer params updated through their own .grad
        self.ordered: list[Tensor] = []  # every optimizer param (masters and direct), in param-group order
        self._num_groups = 0
        self.makes_masters = make_masters
        self._on_new_links = on_new_links
        self._add_links(links)
        self._refresh(optimizer)

    def _add_links(self, links: list[MasterLink]) -> None:
        self.links.extend(links)
        for link in links:
            self.model_param_of[link.master] = link.model_param
        self._on_new_links(links)

    def _refresh(self, optimizer: torch.optim.Optimizer) -> None:
        self._num_groups = len(optimizer.param_groups)
        self.ordered = [p for group in optimizer.param_groups for p in group["params"]]
        self.direct = [p for p in self.ordered if p not in self.model_param_of]

    def sync(self, optimizer: torch.optim.Optimizer) -> int:
        """Take in groups added by ``add_param_group`` since the last call; returns how many links were added."""
        if len(optimizer.param_groups) == self._num_groups:
            return 0
        new_links = (attach_masters(optimizer, first_group=self._num_groups, fp32_value_of=self._fp32_value_of)
                     if self.makes_masters else [])
        self._add_links(new_links)
        self._refresh(optimizer)
        return len(new_links)
