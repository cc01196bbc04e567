"""Reading and restoring a run's amp state: the public calls other than ``initialize`` and ``scale_loss``.

``amp.state_dict`` / ``load_state_dict`` / ``loss_scale`` take no optimizer and
use the latest ``initialize`` (as apex's did); ``master_params``,
``step_was_skipped`` and ``sync_masters`` take the optimizer(s) and use their session.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from . import distributed, sessions

__all__ = ["state_dict", "load_state_dict", "master_params", "step_was_skipped", "loss_scale", "sync_masters"]


def state_dict(destination: Optional[dict] = None) -> dict[str, Any]:
    """The state of every loss scaler (scale, counters, hysteresis) of the latest ``initialize``.

    Save it with the model's and the optimizer's state dicts; together they
    resume a run bit for bit. Under O2, ``model.state_dict()`` holds the fp32
    master weights.

    Args:
        destination: optional dict to fill (apex compatibility); a new dict otherwise.

    .. note:: Reads the scales from the device: a host sync on CUDA.

    Example::

        >>> checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
        ...               "amp": amp.state_dict()}
        >>> torch.save(checkpoint, "checkpoint.pt")
    """
    state = sessions.latest("state_dict").state_dict()
    if destination is None:
        return state
    destination.update(state)
    return destination


def load_state_dict(state_dict: Mapping[str, Any]) -> None:
    """Restore the loss scalers saved by :func:`state_dict` (after ``initialize``, same settings).

    Args:
        state_dict: the dict returned by :func:`state_dict`.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> checkpoint = torch.load("checkpoint.pt")
        >>> model.load_state_dict(checkpoint["model"])
        >>> optimizer.load_state_dict(checkpoint["optimizer"])
        >>> amp.load_state_dict(checkpoint["amp"])
    """
    sessions.latest("load_state_dict").load_state_dict(state_dict)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
    """The parameters ``optimizer`` really updates: the fp32 masters under O2, the model's otherwise.

    After ``scale_loss`` exits their gradients are unscaled, so they are the
    ones to clip. Safe anywhere, as apex's plain generator over
    ``param_groups`` was: before ``initialize`` and for an optimizer amp never
    saw it yields the optimizer's own parameters; inside ``optimizer.step()``
    (a step hook, a grad-norm logger), inside a ``scale_loss`` block or between
    ``delay_unscale=True`` passes it changes nothing and yields the parameters
    as the step will read them. It never changes whether a step is skipped.

    Args:
        optimizer: an optimizer (one returned by ``amp.initialize``, or any other).

    Example::

        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=1.0)
        >>> optimizer.step()
    """
    optimizer = sessions.one_optimizer(optimizer, "master_params")
    session = sessions.session_for(optimizer)
    if session is not None and session.enabled:
        # Gradients kept scaled for a fused step: clipping needs the true values now.
        session.lifecycle_of(optimizer).prepare_to_read()
    return iter([p for group in optimizer.param_groups for p in group["params"]])


def step_was_skipped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the last ``optimizer.step()`` was skipped because its gradients were not finite.

    Use it, for instance, not to advance an LR scheduler on skipped steps.

    Args:
        optimizer: an optimizer returned by ``amp.initialize``.

    .. note:: Reads the overflow flag from the device: a host sync on CUDA.

    Example::

        >>> optimizer.step()
        >>> if not amp.step_was_skipped(optimizer):
        ...     scheduler.step()
    """
    optimizer = sessions.one_optimizer(optimizer, "step_was_skipped")
    session = sessions.find_session([optimizer], "step_was_skipped")
    if not session.enabled:
        return False
    return session.lifecycle_of(optimizer).skip.last_was_skipped()


def loss_scale(loss_id: int = 0) -> float:
    """The current loss scale of ``loss_id`` in the latest ``initialize``.

    Args:
        loss_id: which loss scaler.

    .. note:: Reads the scale from the device: a host sync on CUDA.

    Example::

        >>> print(f"loss scale {amp.loss_scale():.0f}")
    """
    session = sessions.latest("loss_scale")
    if not session.enabled:
        return 1.0
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(session.scalers):
        raise ValueError(f"loss_id must be in [0, {len(session.scalers) - 1}], got {loss_id!r}")
    session.flush_logs(block=True)
    return session.scalers[loss_id].loss_scale()


def sync_masters(model: nn.Module, optimizers: Any) -> None:
    """Copy rank 0's fp32 master weights to every rank (O2/O3 under DDP); call it on every rank.

    ``DistributedDataParallel`` broadcasts rank 0's weights into the model when
    it is built, but ``amp.initialize`` made the fp32 masters earlier, from
    each rank's own weights. amp does this by itself the first time
    ``amp.scale_loss`` runs after a forward through the wrapper (or sees it as
    ``model=ddp_model``); call it where amp cannot see the wrapper (DDP's
    Python reducer, a forward that goes around the wrapper), or to give the
    ranks rank 0's masters at a point of your choosing.

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
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not distributed.distributed_ready():
        raise RuntimeError("amp.sync_masters needs torch.distributed: call init_process_group first")
    optimizer_list = sessions.as_optimizer_list(optimizers)
    session = sessions.find_session(optimizer_list, "sync_masters")
    if session.enabled:
        session.sync_masters(model, [session.lifecycle_of(optimizer) for optimizer in optimizer_list])
