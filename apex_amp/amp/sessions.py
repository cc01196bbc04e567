"""How amp finds its state: the one place that maps user objects to sessions.

Each ``amp.initialize`` call makes one :class:`~apex_amp.amp.session.AmpSession`,
which owns everything of that call. Nothing of amp's state is stored on the
user's objects (the one attribute amp sets, apex's ``optimizer._amp_stash``, is
a view that third-party code probes; see ``apex_private.py``): this module
keeps, written only by ``initialize``,

* each optimizer's session (weakly, by identity), so ``scale_loss(loss,
  optimizer)`` and the other calls that take an optimizer find it;
* the latest session, for apex's calls that take no optimizer
  (``amp.state_dict()``, ``amp.load_state_dict()``, ``amp.loss_scale()``);
* the models an enabled ``initialize`` prepared, for clearer errors.

It also checks the optimizer arguments of those calls, so every call says the
same thing about a wrong one.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Iterable, Optional, Sequence

import torch

from .gradients import GradLifecycle
from .session import AmpSession

__all__ = [
    "register", "resolve", "Resolved", "session_for", "latest_session", "latest", "find_session", "unwrap",
    "as_optimizer_list", "one_optimizer", "was_initialized",
]

_SESSION_OF_OPTIMIZER: "weakref.WeakKeyDictionary[torch.optim.Optimizer, AmpSession]" = weakref.WeakKeyDictionary()
_INITIALIZED_MODELS: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_latest_session: Optional[AmpSession] = None
# scale_loss resolves the same optimizer argument every step: its resolution, by the argument's
# identity (held weakly; lists cannot be, and are resolved every time). Cleared by register().
_RESOLVED: dict[int, tuple["weakref.ref[Any]", "Resolved"]] = {}


@dataclasses.dataclass(frozen=True)
class Resolved:
    """An optimizer argument of an amp call: its session and its optimizers' lifecycles.

    Not the optimizers themselves: remembered, they would outlive the user's last reference
    (a lifecycle holds its optimizer weakly).
    """

    session: AmpSession
    lifecycles: list[GradLifecycle]


def register(session: AmpSession, optimizers: Iterable[torch.optim.Optimizer], models: Iterable[torch.nn.Module]) -> None:
    """Make ``session`` the session of ``optimizers`` and the latest one (``initialize`` only)."""
    global _latest_session
    _RESOLVED.clear()
    for optimizer in optimizers:
        _SESSION_OF_OPTIMIZER[optimizer] = session
    if session.enabled:
        _INITIALIZED_MODELS.update(models)
    _latest_session = session


def session_for(optimizer: torch.optim.Optimizer) -> Optional[AmpSession]:
    """The session that ``initialize`` made for ``optimizer``, or None."""
    return _SESSION_OF_OPTIMIZER.get(optimizer)


def was_initialized(model: torch.nn.Module) -> bool:
    """Whether an enabled ``initialize`` prepared ``model`` (cast it, hooked it)."""
    return model in _INITIALIZED_MODELS


def latest_session() -> Optional[AmpSession]:
    """The session of the latest ``initialize``, or None before the first."""
    return _latest_session


def latest(caller: str) -> AmpSession:
    """The session of the latest ``initialize``; ``amp.<caller>`` raises if there was none."""
    if _latest_session is None:
        raise RuntimeError(
            f"amp.{caller} was called before amp.initialize; first call "
            "`model, optimizer = amp.initialize(model, optimizer, opt_level=...)`"
        )
    return _latest_session


def unwrap(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer behind ``optimizer``: itself, or the one a wrapper holds in ``.optim``.

    apex accepted such wrappers (``apex.parallel.LARC``, ``apex_amp.optimizers.LARC``): objects
    that are not optimizers themselves but hold one and forward ``param_groups`` to it. amp's
    state and hooks belong to the wrapped optimizer. None when ``optimizer`` is neither.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer) and hasattr(optimizer, "param_groups"):
        return inner
    return None


def as_optimizer_list(optimizers: Any, what: str = "optimizers") -> list[torch.optim.Optimizer]:
    """``optimizers`` (one or a list; wrappers unwrapped) as a list of torch optimizers, or TypeError."""
    kind = "a torch.optim.Optimizer (or a wrapper holding one in .optim, such as LARC)"
    if isinstance(optimizers, (list, tuple)):
        found = []
        for index, optimizer in enumerate(optimizers):
            inner = unwrap(optimizer)
            if inner is None:
                raise TypeError(f"{what}[{index}] must be {kind}, got {type(optimizer).__name__}")
            found.append(inner)
        return found
    inner = unwrap(optimizers)
    if inner is None:
        raise TypeError(f"{what} must be {kind} or a list of them, got {type(optimizers).__name__}")
    return [inner]


def one_optimizer(optimizer: Any, caller: str) -> torch.optim.Optimizer:
    """The single optimizer ``amp.<caller>`` takes."""
    optimizers = as_optimizer_list(optimizer, "optimizer")
    if len(optimizers) != 1:
        raise TypeError(
            f"amp.{caller} takes one optimizer, got a list of {len(optimizers)}; call it once per optimizer"
        )
    return optimizers[0]


def find_session(optimizers: Sequence[torch.optim.Optimizer], caller: str) -> AmpSession:
    """The one session of ``optimizers``; ``amp.<caller>`` raises if they have none or several."""
    latest(caller)  # "before amp.initialize" first: the clearest message when nothing was initialized
    sessions: list[AmpSession] = []
    for optimizer in optimizers:
        session = session_for(optimizer)
        if session is None:
            raise RuntimeError(
                f"amp.{caller} got an optimizer ({type(optimizer).__name__}) that amp.initialize never saw; "
                "pass every optimizer to amp.initialize (and use the objects it returns)"
            )
        if session not in sessions:
            sessions.append(session)
    if len(sessions) > 1:
        raise RuntimeError(
            f"amp.{caller} got optimizers from different amp.initialize calls; pass all models and "
            "optimizers that are trained together to one amp.initialize call"
        )
    if not sessions:
        raise ValueError(f"amp.{caller} needs at least one optimizer, got an empty list")
    return sessions[0]


def resolve(optimizers: Any, caller: str) -> Resolved:
    """The session and lifecycles of ``optimizers`` (``find_session``), remembered per argument."""
    key = id(optimizers)
    entry = _RESOLVED.get(key)
    if entry is not None and entry[0]() is optimizers:
        return entry[1]
    optimizer_list = as_optimizer_list(optimizers)
    session = find_session(optimizer_list, caller)
    lifecycles = [session.lifecycle_of(optimizer) for optimizer in optimizer_list] if session.enabled else []
    resolved = Resolved(session, lifecycles)
    try:
        ref = weakref.ref(optimizers, functools.partial(_forget_resolved, _RESOLVED, key))
    except TypeError:  # a list or tuple of optimizers
        return resolved
    _RESOLVED[key] = (ref, resolved)
    return resolved


def _forget_resolved(resolved: dict, key: int, dead: "weakref.ref[Any]") -> None:
    # Holds the dict itself: at interpreter exit the module's globals may be gone when this runs.
    entry = resolved.get(key)
    if entry is not None and entry[0] is dead:
        del resolved[key]
