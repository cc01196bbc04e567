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
  own weights (apex made them later, at the first backward, after the
  broadcast). So amp follows the wrapper: a forward pre-hook on each model
  notes the DDP wrapper its forward runs under (torch marks the active wrapper
  for TorchDynamo during its inner forward), and the next ``scale_loss``
  broadcasts rank 0's fp32 masters over that wrapper's process group, once per
  wrapper and optimizer, as ``amp.sync_masters`` and ``scale_loss(...,
  model=ddp_model)`` do. An unseeded apex script that initializes, then wraps
  in DDP, then trains with plain ``scale_loss(loss, optimizer)`` therefore
  keeps every rank bitwise identical, with rank 0's fp32 precision. Where the
  wrapper cannot be seen (its Python reducer), the first pass of a distributed
  run raises if a rank's masters do not match its model weights.
* **FSDP.** FSDP2 (``fully_shard``) works at O0, O1 and O2, its fp32 shards
  being the masters (:mod:`apex_amp.amp.fsdp2`, which checks its setup).
  ``FullyShardedDataParallel(use_orig_params=True)`` (FSDP1) works at O0 and
  O1 (the model stays fp32). O2/O3 on FSDP1 would cast the model and keep
  masters of full-size parameters, which FSDP1 has already flattened and
  sharded, so :func:`check_sharded_models` refuses them and names FSDP2. Under
  either, each rank checks its own gradient shard, so found-inf is
  synchronised automatically.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .fsdp2 import ShardedModels, check_fsdp2_models
from .master_weights import MasterLink, OptimizerParams
from .recipe import Recipe

__all__ = [
    "agree_on_overflow", "broadcast_masters", "check_sharded_models", "distributed_ready", "note_ddp_wrappers",
    "overflow_group", "warn_if_outside",
]

logger = logging.getLogger("apex_amp")

FSDP_SUPPORTED = (
    "Supported with FSDP: fully_shard (FSDP2) at O0, O1 and O2, and FullyShardedDataParallel(model, "
    "use_orig_params=True) at O0 or O1, each applied before the optimizer is built and before "
    "amp.initialize(model, optimizer, ...); for O2 on a sharded model use fully_shard with "
    "mp_policy=MixedPrecisionPolicy(param_dtype=<half_dtype>, reduce_dtype=torch.float32)"
)


def distributed_ready() -> bool:
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
    models: list[nn.Module], optimizers: list[torch.optim.Optimizer], properties: Recipe,
) -> tuple[Optional[Any], Optional[ShardedModels]]:
    """Refuse FSDP at levels amp cannot serve.

    Returns the process group the ranks must agree on found-inf over (None when no model is
    sharded) and the models FSDP2 shards (None when there are none).
    """
    fsdp2 = check_fsdp2_models(models, optimizers, properties)
    classes = _fsdp_classes()
    sharded = [m for model in models for m in model.modules() if classes and isinstance(m, classes[0])]
    flat = any(_is_flat_param(p) for optimizer in optimizers for group in optimizer.param_groups
               for p in group["params"])
    if not sharded and not flat:
        return (fsdp2.process_group if fsdp2 is not None else None), fsdp2
    if flat:
        raise ValueError(
            "the optimizer holds FSDP FlatParameters (FullyShardedDataParallel with use_orig_params=False); "
            f"amp needs the original parameters. {FSDP_SUPPORTED}"
        )
    if properties.casts_model_to_half or properties.master_weights:
        raise ValueError(
            f"opt_level={properties.opt_level} casts the model to half and keeps full-size fp32 masters, but the "
            f"model is sharded by FullyShardedDataParallel (FSDP1). {FSDP_SUPPORTED}"
        )
    group = getattr(sharded[0], "process_group", None)
    return (group if group is not None else torch.distributed.group.WORLD), fsdp2


# ---- the found-inf flag ---------------------------------------------------------------
def overflow_group(sync_overflow: Any) -> Optional[Any]:
    """The process group to reduce found-inf over for ``initialize(sync_overflow=...)``, or None."""
    if sync_overflow is None or sync_overflow is False:
        return None
    if sync_overflow is True:
        if not distributed_ready():
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


def _active_ddp_wrapper() -> Optional[nn.Module]:
    # Set by DistributedDataParallel around its inner module's forward (for TorchDynamo);
    # None when the wrapper runs its Python reducer, or in a torch without it.
    getter = getattr(nn.parallel.DistributedDataParallel, "_get_active_ddp_module", None)
    return getter() if getter is not None else None


def note_ddp_wrappers(model: nn.Module, found: "list[weakref.ref[nn.Module]]") -> RemovableHandle:
    """A forward pre-hook appending to ``found`` the DDP wrapper ``model``'s forward runs under; removed once it has."""
    handle: Optional[RemovableHandle] = None

    @torch.compiler.disable  # a few forwards at most, until the wrapper is seen
    def note_wrapper(module: nn.Module, args: tuple) -> None:
        wrapper = _active_ddp_wrapper()
        if wrapper is not None and wrapper.module is module:
            if all(ref() is not wrapper for ref in found):
                found.append(weakref.ref(wrapper))
            handle.remove()

    handle = model.register_forward_pre_hook(note_wrapper)
    return handle


def warn_if_outside(wrapper: nn.Module, params: OptimizerParams) -> None:
    """Warn when some of an optimizer's parameters escape ``wrapper``'s all-reduce (checked per rank)."""
    reduced = _reduced_params(wrapper)
    own = list(params.direct) + [link.model_param for link in params.links]
    outside = sum(1 for param in own if param not in reduced)
    if outside:
        logger.warning(
            "amp.scale_loss: %d of the %d parameters of an optimizer are outside this "
            "DistributedDataParallel wrapper (or ignored by it), so each rank checks their gradients on "
            "its own and the ranks can take different skip decisions; if those gradients can differ "
            "between ranks, pass sync_overflow=True to amp.initialize", outside, len(own),
        )


