"""amp across processes: one skip decision per step, masters after DDP's broadcast, FSDP's limits.

* **Skip decisions.** Under plain ``DistributedDataParallel`` every rank checks
  the same all-reduced gradients, so every rank skips the same steps with no
  extra communication. Gradients that DDP does not reduce (parameters outside
  the wrapped module, parameters DDP was told to ignore, FSDP's gradient
  shards) are checked per rank; ``amp.initialize(..., sync_overflow=True)``
  then MAX-reduces the found-inf flag of each checked backward pass over the
  process group before the loss scale is updated. The flag stays a device
  tensor, so this adds one tiny collective per backward pass and no host sync.
* **Masters.** DDP's constructor broadcasts rank 0's weights into the model,
  but under O2 ``initialize`` made the fp32 masters earlier, from each rank's
  own weights. :func:`sync_masters` broadcasts rank 0's masters too;
  ``scale_loss(..., model=ddp_model)`` calls it once per wrapper, and the first
  ``optimizer.step()`` of a distributed run raises if a rank's masters still do
  not match its model weights.
* **FSDP.** ``FullyShardedDataParallel(use_orig_params=True)`` works at O0 and
  O1 (the model stays fp32; found-inf is synchronised automatically because
  each rank checks its own shard). O2/O3 cast the model and keep masters of
  full-size parameters, which FSDP has already flattened and sharded, so
  :func:`check_sharded_models` refuses them with the supported setups named.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn

from .master_weights import MasterLink

__all__ = ["sync_masters"]

logger = logging.getLogger("apex_amp")

# DDP wrappers whose masters scale_loss(model=...) already synchronised, per optimizer state.
_SYNCED_WRAPPERS: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()

FSDP_SUPPORTED = (
    "Supported with FSDP: FullyShardedDataParallel(model, use_orig_params=True) at opt_level O0 or O1, "
    "wrapped before the optimizer is built and before amp.initialize(fsdp_model, optimizer, opt_level='O1'); "
    "for O2/O3 use DistributedDataParallel (amp.initialize first, then DDP)"
)


def _distributed_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _is_ddp(module: Any) -> bool:
    return isinstance(module, nn.parallel.DistributedDataParallel)


# ---- FSDP ---------------------------------------------------------------------------
def _fsdp_classes() -> tuple[type, ...]:
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (FullyShardedDataParallel, FSDPModule)


def _is_flat_param(param: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FlatParameter

    return isinstance(param, FlatParameter)


def check_sharded_models(
    models: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer], opt_level: str, casts_model: bool,
    master_weights: bool,
) -> Optional[Any]:
    """Refuse FSDP at levels amp cannot serve; return FSDP's process group when a model is sharded."""
    classes = _fsdp_classes()
    sharded = [m for model in models for m in model.modules() if classes and isinstance(m, classes)]
    flat = any(_is_flat_param(p) for optimizer in optimizers for group in optimizer.param_groups
               for p in group["params"])
    if not sharded and not flat:
        return None
    if flat:
        raise ValueError(
            "the optimizer holds FSDP FlatParameters (FullyShardedDataParallel with use_orig_params=False); "
            f"amp needs the original parameters. {FSDP_SUPPORTED}"
        )
    fsdp2 = [m for m in sharded if not isinstance(m, classes[0])]
    if fsdp2:
        raise ValueError(
            f"{type(fsdp2[0]).__name__} was sharded by fully_shard (FSDP2, DTensor parameters), which amp does "
            f"not support. {FSDP_SUPPORTED}"
        )
    if casts_model or master_weights:
        raise ValueError(
            f"opt_level={opt_level} casts the model to half and keeps full-size fp32 masters, but the model is "
            f"sharded by FSDP. {FSDP_SUPPORTED}"
        )
    first = sharded[0]
    group = getattr(first, "process_group", None)
    return group if group is not None else torch.distributed.group.WORLD


# ---- the found-inf flag ---------------------------------------------------------------
def overflow_group(sync_overflow: Any) -> Optional[Any]:
    """The process group to reduce found-inf over for ``initialize(sync_overflow=...)``, or None."""
    if sync_overflow is None or sync_overflow is False:
        return None
    if sync_overflow is True:
        if not _distributed_ready():
            raise RuntimeError(
                "amp.initialize(sync_overflow=True) needs torch.distributed: call "
                "torch.distributed.init_process_group(...) before amp.initialize"
            )
        return torch.distributed.group.WORLD
    if torch.distributed.is_available() and isinstance(sync_overflow, torch.distributed.ProcessGroup):
        return sync_overflow
    raise TypeError(
        f"sync_overflow must be False, True (the default process group) or a ProcessGroup, "
        f"got {type(sync_overflow).__name__}"
    )


def agree_on_overflow(found_inf: Tensor, group: Optional[Any]) -> None:
    """MAX-reduce ``found_inf`` in place so every rank of ``group`` skips the same steps (no host sync)."""
    if group is None:
        return
    torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX, group=group)


# ---- masters ------------------------------------------------------------------------
def _reduced_params(model: nn.Module) -> set[Tensor]:
    # The parameters whose gradients DDP all-reduces (all of a bare module's, for sync_masters).
    ignored = set(getattr(model, "parameters_to_ignore", ())) if _is_ddp(model) else set()
    inner = model.module if _is_ddp(model) else model
    return {param for name, param in inner.named_parameters() if name not in ignored}


def _links_in(model: nn.Module, links: Iterable[MasterLink]) -> list[MasterLink]:
    owned = _reduced_params(model)
    return [link for link in links if link.model_param in owned]


def broadcast_masters(model: nn.Module, links: list[MasterLink]) -> None:
    """Give every rank group-rank 0's masters of ``model``'s parameters; re-round the model from them."""
    links = _links_in(model, links)
    if not links:
        return
    group = model.process_group if _is_ddp(model) else torch.distributed.group.WORLD
    masters = [link.master.detach() for link in links]
    flat = torch.cat([master.reshape(-1) for master in masters])
    mine = flat.clone()
    torch.distributed.broadcast(flat, group=group, group_src=0)
    with torch.no_grad():
        offset = 0
        for link, master in zip(links, masters):
            master.copy_(flat[offset:offset + master.numel()].view_as(master))
            if not _is_ddp(model):
                # DDP's own broadcast already gave the model rank 0's rounding; writing it again
                # would bump the version of weights a pending forward saved for its backward.
                link.model_param.copy_(master)
            offset += master.numel()
    if not torch.equal(mine, flat):  # a host read, once per wrapper
        logger.warning(
            "rank %d: amp's fp32 master weights differed from rank 0's (the ranks built their models from "
            "different weights); they now hold rank 0's, as DDP did for the model weights",
            torch.distributed.get_rank(),
        )


def first_use_of_wrapper(
    model: Optional[nn.Module], states: Iterable[Any], overflow_group: Optional[Any]
) -> None:
    """``scale_loss(model=ddp)``, once per wrapper and optimizer: broadcast the masters, and warn when
    some gradients escape DDP's all-reduce while found-inf is not synchronised."""
    if not _is_ddp(model):
        return
    done = _SYNCED_WRAPPERS.setdefault(model, weakref.WeakSet())
    for state in states:
        if state in done:
            continue
        done.add(state)
        broadcast_masters(model, state.links)
        if overflow_group is None:
            reduced = _reduced_params(model)
            params = list(state.direct_params) + [link.model_param for link in state.links]
            outside = sum(1 for param in params if param not in reduced)
            if outside:
                logger.warning(
                    "amp.scale_loss: %d of the %d parameters of an optimizer are outside this "
                    "DistributedDataParallel wrapper (or ignored by it), so each rank checks their gradients on "
                    "its own and the ranks can take different skip decisions; if those gradients can differ "
                    "between ranks, pass sync_overflow=True to amp.initialize", outside, len(params),
                )


def sync_masters(model: nn.Module, optimizers: Any) -> None:
    """Copy rank 0's fp32 master weights to every rank (O2/O3 under DDP); call it on every rank.

    ``DistributedDataParallel`` broadcasts rank 0's weights into the model when
    it is built, but ``amp.initialize`` made the fp32 masters earlier, from
    each rank's own weights. When the ranks did not start from the same
    weights, call this once after wrapping (``amp.scale_loss(...,
    model=ddp_model)`` does it by itself the first time it sees the wrapper).

    Args:
        model: the ``DistributedDataParallel`` wrapper (its process group is
            used), or the bare model (the default process group is used).
        optimizers: the optimizer(s) returned by ``amp.initialize`` that hold
            the masters.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> ddp_model = torch.nn.parallel.DistributedDataParallel(model)
        >>> amp.sync_masters(ddp_model, optimizer)
    """
    from .handle import as_optimizer_list, find_session

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not _distributed_ready():
        raise RuntimeError("amp.sync_masters needs torch.distributed: call init_process_group first")
    optimizer_list = as_optimizer_list(optimizers)
    session = find_session(optimizer_list, "sync_masters")
    if not session.enabled:
        return
    for optimizer in optimizer_list:
        state = session.state_of(optimizer)
        broadcast_masters(model, state.links)
        if _is_ddp(model):
            _SYNCED_WRAPPERS.setdefault(model, weakref.WeakSet()).add(state)


def _same_values(a: Tensor, b: Tensor) -> bool:
    return torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())


def check_masters_match_model(links: list[MasterLink]) -> None:
    """First step of a distributed run: every model weight must be its master's rounding."""
    if not links or not _distributed_ready() or torch.distributed.get_world_size() < 2:
        return
    with torch.no_grad():
        mismatched = [index for index, link in enumerate(links) if not _same_values(
            link.master.to(link.model_param.dtype), link.model_param)]
    if mismatched:
        raise RuntimeError(
            f"rank {torch.distributed.get_rank()}: {len(mismatched)} model weights are not the rounding of "
            "amp's fp32 master weights (the first is master index "
            f"{mismatched[0]}). amp.initialize made the masters from this rank's own weights, and "
            "DistributedDataParallel has since broadcast rank 0's weights into the model (or the weights "
            "were changed behind amp's back). Build the model from the same seed on every rank, or call "
            "amp.sync_masters(ddp_model, optimizer) after wrapping, or pass model=ddp_model to amp.scale_loss"
        )
