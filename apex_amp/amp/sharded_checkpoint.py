"""Distributed checkpoints: model, optimizer and amp's loss scalers as one ``torch.distributed.checkpoint`` entry.

``torch.distributed.checkpoint`` (DCP) saves each rank's shards of the DTensors
FSDP2 holds (parameters, which are the fp32 masters, and the optimizer state
made like them) and reshards them on load, so a checkpoint saved on one
number of ranks loads on another. :func:`checkpoint_state` returns a
``Stateful`` that DCP calls on save and load: its state is torch's
``get_state_dict(model, optimizers)`` plus ``amp``, the state of the
optimizers' amp session (the loss scale and its counters, which every rank
holds alike, so DCP stores them once).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..optimizers.fused_optimizer import FusedOptimizer
from . import sessions

__all__ = ["checkpoint_state", "CheckpointState"]


class CheckpointState:
    """Model, optimizer and amp state for ``dcp.save`` / ``dcp.load`` (see :func:`checkpoint_state`)."""

    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        self.model = model
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ..., "amp": ...}``: DTensor shards, and the scalers as Python numbers."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        session = sessions.find_session(self.optimizers, "checkpoint_state")
        for optimizer in self.optimizers:
            if isinstance(optimizer, FusedOptimizer):  # DCP loads into these tensors: they must exist
                optimizer.init_state()
        model_state, optimizer_state = get_state_dict(self.model, self.optimizers)
        return {"model": model_state, "optimizer": optimizer_state, "amp": session.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` saved (DCP has resharded the shards to this run's ranks)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        session = sessions.find_session(self.optimizers, "checkpoint_state")
        missing = sorted({"model", "optimizer", "amp"} - set(state_dict))
        if missing:
            raise ValueError(
                f"the checkpoint entry has no {missing}; it was not saved from amp.checkpoint_state(...) "
                "(save and load the same {name: amp.checkpoint_state(model, optimizer)} dict)"
            )
        # DCP has already read the tensors into the ones state_dict() handed it (the model's and the
        # optimizer's own): a run with other amp settings is refused here, before set_state_dict.
        session.load_state_dict(state_dict["amp"])
        set_state_dict(self.model, self.optimizers, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optimizer"])


def checkpoint_state(model: nn.Module, optimizers: Any) -> CheckpointState:
    """The model, its optimizer(s) and their amp state as one entry for ``torch.distributed.checkpoint``.

    Every rank calls ``dcp.save`` / ``dcp.load`` with it. Parameters sharded by
    ``fully_shard`` are saved as this rank's shards and resharded on load, so a
    checkpoint saved on N ranks loads on M (the values are the same, bit for
    bit; resuming on N ranks continues the run bit for bit). The loss scalers
    travel with it. Load after ``amp.initialize`` with the settings of the run
    that saved it: other settings (opt_level, half_dtype, num_losses) raise a
    ``ValueError``, by which time DCP has read the weights and optimizer state
    in place, so start again from fresh objects.

    Args:
        model: the model ``amp.initialize`` got (sharded by ``fully_shard``, or plain at O0/O1).
        optimizers: the optimizer(s) ``amp.initialize`` returned for it.

    Under O2 without ``fully_shard`` the optimizer holds amp's fp32 masters,
    which torch's ``get_state_dict`` cannot name; that raises a ``ValueError``
    (save ``model.state_dict()``, ``optimizer.state_dict()`` and
    ``amp.state_dict()`` with ``torch.save`` there).

    Example::

        >>> import torch.distributed.checkpoint as dcp
        >>> state = {"train": amp.checkpoint_state(model, optimizer)}
        >>> dcp.save(state, checkpoint_id="checkpoints/step100")
        >>> # later, on any number of ranks, after fully_shard, the optimizer and amp.initialize:
        >>> dcp.load(state, checkpoint_id="checkpoints/step100")
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"amp.checkpoint_state takes one model (a torch.nn.Module), got {type(model).__name__}; "
            "to checkpoint several, put them in one nn.ModuleList before fully_shard and amp.initialize"
        )
    optimizer_list = sessions.as_optimizer_list(optimizers)
    session = sessions.find_session(optimizer_list, "checkpoint_state")
    if session.enabled:
        for optimizer in optimizer_list:
            if session.lifecycle_of(optimizer).params.links:
                raise ValueError(
                    "amp.checkpoint_state needs optimizers that update the model's own parameters, but this "
                    "optimizer holds amp's fp32 master copies (O2 on a model not sharded by fully_shard), which "
                    "torch.distributed.checkpoint cannot name. Shard the model with fully_shard (its fp32 shards "
                    "are then the masters), or save model.state_dict() (the fp32 masters), "
                    "optimizer.state_dict() and amp.state_dict() with torch.save"
                )
    return CheckpointState(model, optimizer_list)
