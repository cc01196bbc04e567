"""apex's private surface that third-party code probes: ``optimizer._amp_stash`` and ``amp._amp_state``.

NVIDIA apex kept its state on the user's objects and in a module-level
object, and code written for it reads them:

* ``hasattr(optimizer, "_amp_stash")`` is how mmengine's ``ApexOptimWrapper``
  and the Hugging Face Trainer tell whether ``amp.initialize`` has run (mmengine
  initializes again, every step, while it is missing);
* NVIDIA's BERT recipes resume with ``optimizer._lazy_init_maybe_master_weights()``
  and ``optimizer._amp_stash.lazy_init_called = True``, and set
  ``amp._amp_state.loss_scalers[0]._loss_scale = 2**20`` after ``initialize``;
* loggers read ``amp._amp_state.loss_scalers[i].loss_scale()`` and
  ``amp._amp_state.opt_properties.options``;
* NVIDIA's BERT ``run_pretraining.py`` all-reduces the gradients itself, has its amp_C kernels
  write an overflow into its own buffer, puts that buffer in the scaler's ``_overflow_buf`` and
  calls ``update_scale()``, which backs the scale off (or grows it) and says whether to skip.

Here these are views: an ``initialize`` with ``enabled=True`` puts an
:class:`AmpStash` on each optimizer (the one attribute apex_amp sets on a user
object, with the two lazy-init entry points apex's clients call), and
``amp._amp_state`` reads the latest session. They hold no state of their own:
every value is read from, or written through, the session that owns it.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from . import sessions
from .gradients import GradLifecycle, GradState
from .loss_scaler import LossScaler
from .recipe import Recipe

__all__ = ["AmpStash", "attach_stash", "LossScalerView", "PropertiesView", "loss_scaler_views", "opt_properties",
           "init"]

_STASH = "_amp_stash"
# apex's optimizer methods that its clients call directly; masters are made at initialize here,
# so both take in param groups added since (what apex's lazy init would have found).
_LAZY_INIT_METHODS = ("_lazy_init_maybe_master_weights", "_amp_lazy_init")


class AmpStash:
    """What ``optimizer._amp_stash`` shows: apex's field names, read from the optimizer's gradient lifecycle.

    ``lazy_init_called`` and ``already_patched`` are plain flags a client may set (nothing
    reads them); the parameter lists are read-only and follow ``add_param_group``.
    """

    def __init__(self, lifecycle: GradLifecycle, master_weights: bool) -> None:
        self._lifecycle = lifecycle
        self._master_weights = master_weights
        self.lazy_init_called = True  # masters are made by initialize itself
        self.already_patched = False

    def lazy_init(self) -> None:
        """apex's ``optimizer._lazy_init_maybe_master_weights()``: masters for param groups added since."""
        self._lifecycle.take_in_param_groups()

    @property
    def params_have_scaled_gradients(self) -> bool:
        """Whether ``delay_unscale=True`` passes left gradients that are still scaled."""
        return self._lifecycle.state is GradState.DELAYED

    def _groups(self) -> list[list[Tensor]]:
        optimizer = self._lifecycle.optimizer()
        return [] if optimizer is None else [list(group["params"]) for group in optimizer.param_groups]

    def _model_param(self, param: Tensor) -> Optional[Tensor]:
        return self._lifecycle.params.model_param_of.get(param)

    @property
    def fp16_groups(self) -> list[list[Tensor]]:
        """Per param group: the half model parameters (behind the masters under O2)."""
        if self._master_weights:
            return [[m for m in map(self._model_param, group) if m is not None] for group in self._groups()]
        return [[p for p in group if p.dtype in (torch.float16, torch.bfloat16)] for group in self._groups()]

    @property
    def fp32_from_fp16_groups(self) -> list[list[Tensor]]:
        """Per param group: the fp32 masters of half model parameters (O2; empty lists otherwise)."""
        return [[p for p in group if self._model_param(p) is not None] for group in self._groups()]

    @property
    def fp32_from_fp32_groups(self) -> list[list[Tensor]]:
        """Per param group: the fp32 parameters the optimizer updates directly."""
        return [[p for p in group if self._model_param(p) is None and p.dtype == torch.float32]
                for group in self._groups()]

    @property
    def all_fp16_params(self) -> list[Tensor]:
        return [p for group in self.fp16_groups for p in group]

    @property
    def all_fp32_from_fp16_params(self) -> list[Tensor]:
        return [p for group in self.fp32_from_fp16_groups for p in group]

    @property
    def all_fp32_from_fp32_params(self) -> list[Tensor]:
        return [p for group in self.fp32_from_fp32_groups for p in group]

    @property
    def all_fp32_params(self) -> list[Tensor]:
        """apex's name below O2 for the fp32 parameters (the same list as ``all_fp32_from_fp32_params``)."""
        return self.all_fp32_from_fp32_params


def attach_stash(optimizer: torch.optim.Optimizer, lifecycle: GradLifecycle, master_weights: bool,
                 also_on: Any = None) -> None:
    """``optimizer._amp_stash`` and apex's lazy-init methods (``initialize`` only, when enabled).

    Args:
        optimizer: the torch optimizer amp prepared.
        lifecycle: its gradient lifecycle, which the stash reads.
        master_weights: whether the session keeps fp32 masters (O2).
        also_on: the wrapper the user passed (LARC), which clients probe instead.
    """
    stash = AmpStash(lifecycle, master_weights)
    for target in (optimizer, also_on):
        if target is None:
            continue
        setattr(target, _STASH, stash)
        for name in _LAZY_INIT_METHODS:
            setattr(target, name, stash.lazy_init)


class LossScalerView:
    """``amp._amp_state.loss_scalers[i]``: apex's ``LossScaler`` names on one of amp's scalers.

    ``_loss_scale`` and ``_unskipped`` can be set, as NVIDIA's recipes do right after
    ``initialize`` (``amp._amp_state.loss_scalers[0]._loss_scale = 2**20``).

    ``_overflow_buf`` and ``update_scale()`` are apex's overflow check by hand: ``_overflow_buf``
    is a one-element int32 tensor on the scale's device, which apex's kernels (``amp_C``) set to
    1 when they meet an inf or NaN; a client may replace it with its own buffer, as NVIDIA's BERT
    does. ``update_scale()`` reads it, updates the scale by amp's own rule (the update a checked
    backward pass makes: back off on an overflow, grow after ``scale_window`` clean updates,
    the overflow message), clears the buffer, and returns whether the step should be skipped.
    The view is one object per scaler, so a buffer set on it stays. Passes through
    ``scale_loss(..., delay_overflow_check=True)`` leave the scale to ``update_scale()``, as in
    apex: one update per step, however many micro-batches.

    .. note:: Reading a value is a host read of the device scale (a sync on CUDA); so is
       ``update_scale()``, which reads the flag (as apex's did).
    """

    def __init__(self, scaler: LossScaler) -> None:
        self._scaler = scaler
        self._overflow_buf = torch.zeros(1, dtype=torch.int32, device=scaler.device)

    def update_scale(self) -> bool:
        """Account the overflow flag in ``_overflow_buf`` for one step; return whether to skip it.

        apex's ``LossScaler.update_scale``: with the flag set the scale backs off and the step is
        to be skipped (True); else the clean-step count grows, and the scale with it after
        ``scale_window`` clean steps. A scaler that does not check gradients (O0, O3 with a
        static scale) changes nothing and returns False. Unlike apex's, a static scale that
        checks gradients (O2 with ``loss_scale=128.0``) also returns True on an overflow, as
        amp's own steps skip then; and the buffer is cleared here (apex cleared it at the next
        ``scale_loss`` exit).

        Example::

            >>> scaler = amp._amp_state.loss_scalers[0]
            >>> scaler._overflow_buf = overflow_buf       # set by amp_C kernels on inf/NaN
            >>> if not scaler.update_scale():
            ...     optimizer.step()
        """
        flag = self._overflow_buf
        if not isinstance(flag, Tensor) or flag.numel() == 0:
            raise TypeError("amp._amp_state.loss_scalers[i]._overflow_buf must be a one-element int tensor (apex's "
                            "torch.cuda.IntTensor([0])) that the amp_C kernels set to 1 on an overflow, got "
                            f"{type(flag).__name__}")
        found_inf = (flag.reshape(-1)[:1] != 0).to(device=self._scaler.device, dtype=torch.float32)
        if not self._scaler.check_finite:
            flag.zero_()
            return False
        overflowed = self._scaler.update(found_inf)
        if overflowed is None:
            overflowed = bool(found_inf.item())
        flag.zero_()
        return overflowed

    def loss_scale(self) -> float:
        return self._scaler.loss_scale()

    @property
    def _loss_scale(self) -> float:
        return self._scaler.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self._scaler.set_scale(value)

    @property
    def _unskipped(self) -> int:
        return self._scaler.clean_steps()

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self._scaler.set_clean_steps(value)

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler.max_scale

    @property
    def _min_loss_scale(self) -> float:
        return self._scaler.min_scale

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler.scale_window


class PropertiesView:
    """``amp._amp_state.opt_properties``: the latest ``initialize``'s properties under apex's names."""

    def __init__(self, properties: Optional[Recipe]) -> None:
        self._properties = properties

    @property
    def options(self) -> dict[str, Any]:
        if self._properties is None:
            return {"enabled": False}
        return self._properties.apex_options()

    def __getattr__(self, name: str) -> Any:
        options = self.options
        if name in options:
            return options[name]
        raise AttributeError(f"amp._amp_state.opt_properties has no {name!r}; it has {sorted(options)}")


# One view per scaler, living as long as its scaler: a client keeps a view (and the
# _overflow_buf it set on it) across steps, as it kept apex's scaler object.
_VIEWS: "weakref.WeakKeyDictionary[LossScaler, LossScalerView]" = weakref.WeakKeyDictionary()


def loss_scaler_views() -> list[LossScalerView]:
    """Views of the latest session's loss scalers (empty before ``initialize`` or when disabled)."""
    session = sessions.latest_session()
    if session is None or not session.enabled:
        return []
    views = []
    for scaler in session.scalers:
        view = _VIEWS.get(scaler)
        if view is None:
            view = _VIEWS[scaler] = LossScalerView(scaler)
        views.append(view)
    return views


def opt_properties() -> PropertiesView:
    session = sessions.latest_session()
    return PropertiesView(None if session is None else session.properties)


def init(enabled: bool = True, loss_scale: Any = "dynamic", enable_caching: bool = True, verbose: bool = False,
         allow_banned: bool = False) -> None:
    """apex's first API, ``amp_handle = amp.init()``: not provided; raises, naming what to use instead.

    It exists so that scripts which bind ``amp.init`` (or pass it around) import; calling it
    raises a RuntimeError. apex's ``init`` patched torch's functions for the whole process and
    returned a handle (``wrap_optimizer``, ``handle.scale_loss``); apex_amp's O1 is set up per
    model by ``amp.initialize``.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O1")  # instead of amp.init()
    """
    raise RuntimeError(
        "amp.init() is NVIDIA apex's original API (a handle with wrap_optimizer and handle.scale_loss), "
        "which apex_amp does not provide: use `model, optimizer = amp.initialize(model, optimizer, "
        "opt_level='O1')` and `with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`"
        + ("" if enabled else "; for amp.init(enabled=False), leave amp out (or pass enabled=False to "
           "amp.initialize)")
    )
