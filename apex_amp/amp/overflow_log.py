"""The overflow log of one loss scaler: rate-limited, lazily-read messages and the scale-collapse guard.

The message needs two device values on the host (was there an overflow, what
is the new scale). Reading them when they are produced would force a host
sync in every scale_loss, which is exactly what the fused path avoids. So:

* on CPU the values are already on the host: the message is logged at once;
* on CUDA the two values are copied to pinned host memory with a non-blocking
  copy and an event; the record is logged when a later call (the next
  scale_loss, or anything that reads amp state) finds the event complete.
  Nobody waits unless the queue grows past ``_MAX_PENDING`` records or the
  user asks for state (``flush(block=True)``).

Rate limit: the first ``FIRST_MESSAGES`` overflows of a scaler are logged,
then only the ones whose count is a power of two, each followed by a summary
of how many were not logged, so a long run of overflows writes O(log n) lines.

Scale-collapse guard: the same records tell whether an overflow happened with
the scale at its floor (a dynamic scale at ``min_loss_scale`` after the
update, or any static scale), so counting such overflows in a row costs no
extra device read. At ``warn_steps`` in a row the log says that scaling is not
the cause and what to check; at ``raise_steps`` in a row
:meth:`OverflowLog.raise_if_collapsed`, called at the start of the next
``scale_loss`` (where nothing is half-done: the step of the last overflow
was skipped as usual), raises ``RuntimeError``. A clean step resets the
count. Reading amp state or saving a checkpoint never raises, so a collapsed
run can still be inspected and saved. On CUDA the records are read lazily, so
the warning and the error may come a step or two after the overflow that
triggered them.
"""

from __future__ import annotations

import collections
import logging
from typing import Optional

import torch
from torch import Tensor

__all__ = ["OverflowLog", "logger", "DEFAULT_COLLAPSE_WARN_STEPS", "DEFAULT_COLLAPSE_RAISE_STEPS"]

logger = logging.getLogger("apex_amp")

FIRST_MESSAGES = 10
_MAX_PENDING = 64
# Overflows in a row at the floor before the warning / the RuntimeError. A healthy
# run overflows now and then and recovers the next step; 25 in a row at the
# floor means scaling cannot help, and 500 skipped steps in a row is a run
# that is no longer training.
DEFAULT_COLLAPSE_WARN_STEPS = 25
DEFAULT_COLLAPSE_RAISE_STEPS = 500

_NOT_THE_SCALE = "The gradients are not finite even at this scale, so loss scaling is not the cause"
_MAYBE_THE_SCALE = (
    "A static scale cannot back off: if it is too large for these gradients, use loss_scale='dynamic'"
)
_COLLAPSE_CAUSES = (
    "Likely causes: (1) NaN or inf in the input data or the targets (check the batch with torch.isfinite); "
    "(2) a loss computed in half precision (compute it in float32, e.g. criterion(output.float(), target), "
    "and keep softmax/log/exp/sums of many terms in float32); "
    "(3) a learning rate too high or weights that already diverged (check that the weights are finite "
    "and lower the learning rate or add gradient clipping on amp.master_params(optimizer))"
)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class OverflowLog:
    """Counts the overflows of one loss scaler on the host and logs them, rate-limited."""

    def __init__(
        self,
        loss_id: int,
        enabled: bool = True,
        *,
        floor: float = 1.0,
        warn_steps: Optional[int] = DEFAULT_COLLAPSE_WARN_STEPS,
        raise_steps: Optional[int] = DEFAULT_COLLAPSE_RAISE_STEPS,
    ) -> None:
        self.loss_id = loss_id
        self.enabled = enabled
        self.count = 0  # overflows seen on the host so far
        self.unlogged = 0  # overflows not logged since the last message
        # The floor as the device holds it (float32), so that "scale == floor" compares exactly.
        self.floor = torch.tensor(floor, dtype=torch.float32).item()
        self.warn_steps = warn_steps
        self.raise_steps = raise_steps
        self.floor_streak = 0  # overflows in a row with the scale at its floor
        self.collapse_message: Optional[str] = None  # set once floor_streak reaches raise_steps
        # Records queued until their values reach the host (CUDA flags only); the step hooks look
        # at it before calling flush, on every step.
        self.pending: collections.deque = collections.deque()

    def record(self, found_inf: Tensor, scale: Tensor, *, static: bool) -> None:
        """Queue one backward pass's flag and the scale after its update (no sync)."""
        values = torch.cat([found_inf.reshape(1).to(torch.float32), scale.reshape(1)])
        if values.device.type == "cuda":
            host_values = values.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            self.pending.append((host_values, ready, static))
            self.flush(block=len(self.pending) > _MAX_PENDING)
        else:
            self._consume(values, static)

    def record_on_host(self, overflow: bool, scale: Tensor, *, static: bool) -> None:
        """``record`` for a CPU scaler whose flag was read already; the scale is read only on overflow."""
        self._account(overflow, scale.reshape(1).tolist()[0] if overflow else None, static)

    def flush(self, block: bool = False) -> None:
        """Log the queued records whose values have reached the host (all of them if ``block``)."""
        while self.pending:
            host_values, ready, static = self.pending[0]
            if not block and not ready.query():
                return
            ready.synchronize()
            self.pending.popleft()
            self._consume(host_values, static)

    def _consume(self, values: Tensor, static: bool) -> None:
        overflow, scale = values.tolist()
        self._account(bool(overflow), scale, static)

    def _account(self, overflow: bool, scale: Optional[float], static: bool) -> None:
        # scale: the scale after the update, needed (and given) only when overflow is True.
        self._watch_collapse(overflow, scale, static)
        if not overflow:
            return
        self.count += 1
        if self.count > FIRST_MESSAGES and not _is_power_of_two(self.count):
            self.unlogged += 1
            return
        if not self.enabled:
            return
        if static:
            logger.warning(
                "Gradient overflow.  Skipping step, loss scaler %d keeping static loss scale %s",
                self.loss_id, scale,
            )
        else:
            logger.warning(
                "Gradient overflow.  Skipping step, loss scaler %d reducing loss scale to %s",
                self.loss_id, scale,
            )
        if self.unlogged:
            logger.warning(
                "Gradient overflow: %d more overflows of loss scaler %d were not logged; "
                "%d steps skipped so far (messages are now logged at power-of-two counts only)",
                self.unlogged, self.loss_id, self.count,
            )
            self.unlogged = 0

    def _watch_collapse(self, overflow: bool, scale: Optional[float], static: bool) -> None:
        # A dynamic scale above its floor still has room to back off: not a collapse (yet).
        if not overflow or not (static or scale <= self.floor):
            self.floor_streak = 0
            self.collapse_message = None
            return
        self.floor_streak += 1
        where = f"static loss scale {scale}" if static else f"loss scale at its floor (min_loss_scale={scale})"
        state = (
            f"{self.floor_streak} gradient overflows in a row for loss scaler {self.loss_id} with the "
            f"{where}: every one of these steps was skipped"
        )
        lead = _MAYBE_THE_SCALE if static and scale > 1.0 else _NOT_THE_SCALE
        if self.floor_streak == self.warn_steps:
            if self.raise_steps is None:
                then = "amp will not stop the run (collapse_raise_steps=None)"
            else:
                then = f"amp raises RuntimeError at {self.raise_steps} in a row (collapse_raise_steps)"
            logger.warning("Loss scale collapse: %s. %s. %s. If this goes on, %s.", state, lead, _COLLAPSE_CAUSES, then)
        if self.raise_steps is not None and self.floor_streak >= self.raise_steps:
            self.collapse_message = (
                f"Loss scale collapse: {state}, so the model has stopped training. {lead}. {_COLLAPSE_CAUSES}. "
                "To keep going regardless, pass a larger collapse_raise_steps (or None) to amp.initialize"
            )

    def raise_if_collapsed(self) -> None:
        """Raise ``RuntimeError`` if ``raise_steps`` overflows in a row at the floor have been seen."""
        if self.collapse_message is not None:
            raise RuntimeError(self.collapse_message)

    def restore_floor_streak(self, streak: int) -> None:
        """Continue the count of a checkpointed run (the error, if due, comes with its next overflow)."""
        self.floor_streak = streak
        self.collapse_message = None
