"""amp's own state: one ``AmpSession`` per ``initialize`` call, found by object identity.

Nothing is stored on the user's objects. The registry maps each optimizer
(weakly, by identity) to the session that ``initialize`` created for it, so
``scale_loss(loss, optimizer)`` finds its scalers and master weights; the
module-level ``amp.state_dict()`` (which takes no argument, as in apex) uses
the most recent session. Both are written only by ``initialize``.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, Iterable, Mapping, Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .loss_scaler import LossScaler
from .master_weights import MasterLink
from .optimizer_state import OptimizerAmpState
from .opt_levels import AmpProperties

__all__ = ["AmpSession", "session_for", "latest_session", "register_session", "register_models", "was_initialized"]

_SESSION_OF_OPTIMIZER: "weakref.WeakKeyDictionary[torch.optim.Optimizer, AmpSession]" = weakref.WeakKeyDictionary()
_LATEST: Optional["AmpSession"] = None
# Models an enabled initialize has prepared (cast, hooked): only for clearer errors.
_INITIALIZED_MODELS: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


class AmpSession:
    """The scalers, optimizer states and master weights created by one ``initialize`` call."""

    def __init__(self, properties: Optional[AmpProperties], device: torch.device, verbosity: int) -> None:
        self.properties = properties
        self.enabled = properties is not None
        self.device = torch.device(device)
        self.verbosity = verbosity
        # Process group whose ranks must agree on every skip (initialize's sync_overflow; distributed.py).
        self.overflow_group: Any = None
        self.one = torch.ones(1, device=self.device)
        self.warned_unreached = False  # the "backward reached no parameter" warning is logged once
        self.scalers: list[LossScaler] = []
        if properties is not None:
            self.scalers = [
                LossScaler(
                    loss_id,
                    self.device,
                    init_scale=properties.loss_scale,
                    dynamic=properties.dynamic_loss_scale,
                    check_finite=properties.check_finite,
                    min_scale=properties.min_loss_scale,
                    max_scale=properties.max_loss_scale,
                    scale_window=properties.scale_window,
                    hysteresis=properties.hysteresis,
                    consecutive_hysteresis=properties.consecutive_hysteresis,
                    log_enabled=verbosity >= 1,
                    collapse_warn_steps=properties.collapse_warn_steps,
                    collapse_raise_steps=properties.collapse_raise_steps,
                )
                for loss_id in range(properties.num_losses)
            ]
        self.optimizer_states: "weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerAmpState]" = (
            weakref.WeakKeyDictionary()
        )
        self._master_of = WeakIdKeyDictionary()  # half model param -> fp32 master

    # ---- masters ------------------------------------------------------------
    def register_masters(self, links: Iterable[MasterLink]) -> None:
        for link in links:
            self._master_of[link.model_param] = link.master

    def master_of(self, param: Tensor) -> Optional[Tensor]:
        return self._master_of.get(param)

    # ---- optimizers ---------------------------------------------------------
    def add_optimizer(self, optimizer: torch.optim.Optimizer, links: list[MasterLink]) -> None:
        self.optimizer_states[optimizer] = OptimizerAmpState(optimizer, self, links)

    def state_of(self, optimizer: torch.optim.Optimizer) -> OptimizerAmpState:
        return self.optimizer_states[optimizer]

    def flush_logs(self, block: bool = False, check_collapse: bool = False) -> None:
        for scaler in self.scalers:
            scaler.log.flush(block=block)
        if check_collapse:  # only where nothing is half-done: the start of scale_loss
            for scaler in self.scalers:
                scaler.log.raise_if_collapsed()

    # ---- checkpoints ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        state: dict[str, Any] = {f"loss_scaler{i}": scaler.state_dict() for i, scaler in enumerate(self.scalers)}
        state["amp_config"] = {
            "opt_level": self.properties.opt_level,
            "half_dtype": str(self.properties.half_dtype),
            "num_losses": self.properties.num_losses,
        }
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"amp.load_state_dict expects the dict from amp.state_dict(), got {type(state_dict).__name__}")
        if not self.enabled:
            return
        expected = {f"loss_scaler{i}" for i in range(len(self.scalers))}
        given = set(state_dict) - {"amp_config"}
        foreign = sorted(str(key) for key in given if not re.fullmatch(r"loss_scaler\d+", str(key)))
        if foreign:
            raise ValueError(
                f"amp.load_state_dict got keys {foreign}, which amp.state_dict() never writes (it writes "
                f"{sorted(expected)} and 'amp_config'); pass the amp part of the checkpoint, e.g. "
                "amp.load_state_dict(checkpoint['amp']), not the whole checkpoint"
            )
        if given != expected:
            raise ValueError(
                f"amp state has loss scalers {sorted(given)} but this run has {sorted(expected)} "
                f"(num_losses={len(self.scalers)}); initialize with the num_losses the checkpoint was saved with"
            )
        config = state_dict.get("amp_config")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(
                f"amp state 'amp_config' must be a dict, got {type(config).__name__}; "
                "was the checkpoint saved by amp.state_dict()?"
            )
        if config is not None:
            mine = {"opt_level": self.properties.opt_level, "half_dtype": str(self.properties.half_dtype)}
            for key, value in mine.items():
                if config.get(key) != value:
                    raise ValueError(
                        f"amp state was saved with {key}={config.get(key)!r} but this run uses {key}={value!r}; "
                        "initialize with the settings of the run that saved the checkpoint"
                    )
        # Validate every scaler before changing any, so a bad entry changes nothing.
        for i, scaler in enumerate(self.scalers):
            _check_only(scaler, state_dict[f"loss_scaler{i}"])
        for i, scaler in enumerate(self.scalers):
            scaler.load_state_dict(state_dict[f"loss_scaler{i}"])


def _check_only(scaler: LossScaler, state: Any) -> None:
    probe = LossScaler(
        scaler.loss_id, torch.device("cpu"), init_scale=1.0, dynamic=scaler.dynamic,
        check_finite=scaler.check_finite, hysteresis=scaler.hysteresis, log_enabled=False,
    )
    probe.load_state_dict(state)


def register_session(session: AmpSession, optimizers: Iterable[torch.optim.Optimizer]) -> None:
    global _LATEST
    for optimizer in optimizers:
        _SESSION_OF_OPTIMIZER[optimizer] = session
    _LATEST = session


def register_models(models: Iterable[torch.nn.Module]) -> None:
    _INITIALIZED_MODELS.update(models)


def was_initialized(model: torch.nn.Module) -> bool:
    return model in _INITIALIZED_MODELS


def session_for(optimizer: torch.optim.Optimizer) -> Optional[AmpSession]:
    return _SESSION_OF_OPTIMIZER.get(optimizer)


def latest_session() -> Optional[AmpSession]:
    return _LATEST
