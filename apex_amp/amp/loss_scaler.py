"""One loss scaler per ``loss_id``: the scale and its counters live on the device.

The dynamic rule is apex's (x2 after ``scale_window`` clean steps, /2 on
overflow, a growth to inf never taken) plus a floor, a cap and an optional
hysteresis, refilled after every clean step (apex's rule) or only when the
scale grows (``consecutive_hysteresis=False``); it runs on the
device through :func:`apex_amp.ops.update_scale_`, so neither the check nor
the update ever forces a host sync. Only :meth:`LossScaler.loss_scale` and
:meth:`LossScaler.state_dict` read the device values, and say so.

Every scale is a normal float32 (the floor is validated, the cap is float32
max), so a backing-off scale never reaches 0 or a denormal; a scale stuck at
its floor while overflowing is reported by the overflow log's collapse guard
(:mod:`apex_amp.amp.overflow_log`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from .. import ops
from .overrides import LARGEST_SCALE, SMALLEST_SCALE
from .overflow_log import DEFAULT_COLLAPSE_RAISE_STEPS, DEFAULT_COLLAPSE_WARN_STEPS, OverflowLog

__all__ = ["LossScaler"]

GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5

# "floor_overflow_streak" (the collapse guard's count) is optional: older checkpoints lack it.
_STATE_KEYS = ("loss_scale", "unskipped", "hysteresis_tracker", "dynamic", "overflows", "floor_overflow_streak")


def _valid_scale(scale: Any) -> bool:
    return not isinstance(scale, bool) and isinstance(scale, (int, float)) and SMALLEST_SCALE <= scale <= LARGEST_SCALE


def _host_value(flag: Tensor) -> float:
    value = flag.tolist()
    return value[0] if isinstance(value, list) else value


class LossScaler:
    """The scale of one loss, its growth/hysteresis trackers and its overflow log.

    Args:
        loss_id: which loss this scaler belongs to (names it in messages).
        device: where the scale lives (the device of the model's parameters).
        init_scale: the scale before the first step (the scale itself when static).
        dynamic: whether the scale adapts to overflows.
        check_finite: whether gradients are checked and non-finite steps skipped.
        min_scale, max_scale: floor and cap of a dynamic scale.
        scale_window: clean steps before the scale grows.
        hysteresis: overflows tolerated before the scale backs off (1: at once).
        consecutive_hysteresis: refill the hysteresis after every clean step, so only overflows
            in a row back off (apex); False refills it only when the scale grows (Megatron).
        log_enabled: whether overflow messages go to the log (verbosity >= 1).
        collapse_warn_steps, collapse_raise_steps: overflows in a row with the scale at
            its floor (any overflow of a static scale) before the collapse warning and
            the RuntimeError (None: never); see :mod:`apex_amp.amp.overflow_log`.
    """

    def __init__(
        self,
        loss_id: int,
        device: torch.device,
        *,
        init_scale: float,
        dynamic: bool,
        check_finite: bool,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        scale_window: int = 2000,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = True,
        log_enabled: bool = True,
        collapse_warn_steps: Optional[int] = DEFAULT_COLLAPSE_WARN_STEPS,
        collapse_raise_steps: Optional[int] = DEFAULT_COLLAPSE_RAISE_STEPS,
    ) -> None:
        self.loss_id = loss_id
        self.device = torch.device(device)
        self.dynamic = dynamic
        self.check_finite = check_finite
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.scale = torch.full((1,), float(init_scale), dtype=torch.float32, device=self.device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.hysteresis_tracker = torch.full((1,), hysteresis, dtype=torch.int32, device=self.device)
        # Count of overflowing backward passes, accumulated on the device.
        self.overflows = torch.zeros(1, dtype=torch.int64, device=self.device)
        # The found-inf flag of a backward pass, reused by every pass (see found_inf_for_pass).
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        # A static scale is known on the host, which lets scale_loss skip work
        # (no multiply when it is 1.0, a read-only check instead of an unscale).
        self.static_value = None if dynamic else float(init_scale)
        self._static_inv_scale = None if dynamic else torch.full((1,), 1.0 / init_scale, device=self.device)
        # Changes whenever the scale may have changed (every update()): gradients of passes in one
        # epoch all carry the same scale, so they can be added up while still scaled.
        self.scale_epoch = 0
        self.log = OverflowLog(
            loss_id, enabled=log_enabled, floor=min_scale,
            warn_steps=collapse_warn_steps, raise_steps=collapse_raise_steps,
        )

    # The scale that multiplies the loss, as a 0-dim device tensor (no sync).
    def scale_for_loss(self) -> Tensor:
        return self.scale.reshape(())

    def inv_scale(self) -> Tensor:
        """1/scale as a one-element device tensor that later updates don't change."""
        if self._static_inv_scale is not None:
            return self._static_inv_scale
        return torch.reciprocal(self.scale)

    def found_inf_for_pass(self) -> Tensor:
        """The zeroed found-inf flag for one backward pass of this loss.

        One buffer, reused: the checks write it, and everything that outlives the
        pass's ``scale_loss`` takes a copy (the optimizer states clone it, the
        log copies it out), so zeroing it for the next pass changes nothing seen.
        """
        return self._found_inf.zero_()

    def update(self, found_inf: Tensor) -> Optional[bool]:
        """Account for one backward pass whose gradients set ``found_inf`` (no host sync on CUDA).

        Returns whether the pass overflowed when that is known on the host for free (a CPU
        flag), else None.
        """
        if not self.check_finite:
            return None
        self.scale_epoch += 1
        # On CPU the flag is in host memory already: reading it costs no sync, and spares the
        # int64 conversion and the log's concatenation (see benchmarks/README.md).
        # Read with tolist(), as the log always read CPU values: a plain copy, no dispatched op
        # (not even a reshape: a 0-dim flag gives a number, a 1-element one a list).
        host_flag = _host_value(found_inf) if found_inf.device.type == "cpu" else None
        if host_flag is None:
            self.overflows.add_(found_inf.to(torch.int64))
        elif host_flag:
            self.overflows.add_(int(host_flag))  # what found_inf.to(torch.int64) adds
        if self.dynamic:
            ops.update_scale_(
                self.scale,
                self.growth_tracker,
                self.hysteresis_tracker,
                found_inf,
                growth_factor=GROWTH_FACTOR,
                backoff_factor=BACKOFF_FACTOR,
                growth_interval=self.scale_window,
                hysteresis=self.hysteresis,
                min_scale=self.min_scale,
                max_scale=self.max_scale,
                consecutive_hysteresis=self.consecutive_hysteresis,
            )
        if host_flag is None:
            self.log.record(found_inf, self.scale, static=not self.dynamic)
            return None
        self.log.record_on_host(bool(host_flag), self.scale, static=not self.dynamic)
        return bool(host_flag)

    def loss_scale(self) -> float:
        """The current scale as a Python float.

        .. note:: Reads the device value: a host sync on CUDA.
        """
        return float(self.scale.item())

    def state_dict(self) -> dict[str, Any]:
        """Scale, counters and hysteresis as Python numbers (exact for float32/int32 values).

        .. note:: Reads the device values: a host sync on CUDA.
        """
        self.log.flush(block=True)
        return {
            "loss_scale": float(self.scale.item()),
            "unskipped": int(self.growth_tracker.item()),
            "hysteresis_tracker": int(self.hysteresis_tracker.item()),
            "dynamic": self.dynamic,
            "overflows": int(self.overflows.item()),
            "floor_overflow_streak": self.log.floor_streak,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (apex's ``loss_scale``/``unskipped`` alone load too)."""
        self._apply(self.checked_state(state))

    def checked_state(self, state: Any) -> dict[str, Any]:
        """The values ``state`` would load, validated; raises (changing nothing) on a bad entry."""
        name = f"loss_scaler{self.loss_id}"
        if not isinstance(state, Mapping):
            raise TypeError(f"amp state {name!r} must be a dict, got {type(state).__name__}")
        # Only apex's two keys are required, so apex checkpoints load too.
        for key in ("loss_scale", "unskipped"):
            if key not in state:
                raise ValueError(f"amp state {name!r} has no {key!r}; was it saved by amp.state_dict()?")
        unknown = set(state) - set(_STATE_KEYS)
        if unknown:
            raise ValueError(f"amp state {name!r} has unexpected keys {sorted(unknown)}; expected {list(_STATE_KEYS)}")
        if "dynamic" in state and bool(state["dynamic"]) != self.dynamic:
            kind = "dynamic" if state["dynamic"] else "static"
            raise ValueError(
                f"amp state {name!r} was saved with a {kind} loss scale but this run's scale is "
                f"{'dynamic' if self.dynamic else 'static'}; initialize with the same opt_level and loss_scale"
            )
        scale = state["loss_scale"]
        if not _valid_scale(scale):
            raise ValueError(
                f"amp state {name!r}: loss_scale must be a positive finite number, got {scale!r} (a normal "
                f"float32 value, in [{SMALLEST_SCALE:g}, {LARGEST_SCALE:g}]); the checkpoint is corrupted"
            )
        counters = {key: state.get(key, default) for key, default in
                    (("unskipped", 0), ("hysteresis_tracker", self.hysteresis), ("overflows", 0),
                     ("floor_overflow_streak", 0))}
        for key, value in counters.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"amp state {name!r}: {key} must be an integer >= 0, got {value!r}")
        return {"loss_scale": float(scale), **counters}

    def _apply(self, counters: Mapping[str, Any]) -> None:
        scale = counters["loss_scale"]
        self.log.flush(block=True)  # records of the steps before the load must not count after it
        self.scale.fill_(scale)
        self.growth_tracker.fill_(counters["unskipped"])
        self.hysteresis_tracker.fill_(counters["hysteresis_tracker"])
        self.overflows.fill_(counters["overflows"])
        self.log.restore_floor_streak(counters["floor_overflow_streak"])
        self._scale_changed(scale)

    def _scale_changed(self, scale: float) -> None:
        # Gradients kept scaled by earlier passes carry the old scale (and hold its inv_scale
        # tensor, which is therefore replaced, not overwritten).
        self.scale_epoch += 1
        if not self.dynamic:
            self.static_value = scale
            self._static_inv_scale = torch.full((1,), 1.0 / scale, device=self.device)

    # apex's LossScaler attributes, which clients set (amp._amp_state; apex_private.py).
    def set_scale(self, scale: float) -> None:
        """Set the scale now (apex's ``_loss_scale = ...``): a dynamic one goes on adapting from it."""
        if not _valid_scale(scale):
            raise ValueError(
                f"loss scaler {self.loss_id}: the loss scale must be a positive finite number (a normal float32 "
                f"value, in [{SMALLEST_SCALE:g}, {LARGEST_SCALE:g}]), got {scale!r}"
            )
        self.log.flush(block=True)
        self.scale.fill_(float(scale))
        self._scale_changed(float(scale))

    def clean_steps(self) -> int:
        """Clean steps since the scale last changed (apex's ``_unskipped``; a host read)."""
        return int(self.growth_tracker.item())

    def set_clean_steps(self, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"loss scaler {self.loss_id}: _unskipped must be an integer >= 0, got {count!r}")
        self.growth_tracker.fill_(count)
