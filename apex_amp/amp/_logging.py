"""Rate-limited, lazily-read overflow messages.

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
"""

from __future__ import annotations

import collections
import logging
from typing import Optional

import torch
from torch import Tensor

__all__ = ["OverflowLog", "logger"]

logger = logging.getLogger("apex_amp")

FIRST_MESSAGES = 10
_MAX_PENDING = 64


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class OverflowLog:
    """Counts the overflows of one loss scaler on the host and logs them, rate-limited."""

    def __init__(self, loss_id: int, enabled: bool = True) -> None:
        self.loss_id = loss_id
        self.enabled = enabled
        self.count = 0  # overflows seen on the host so far
        self.unlogged = 0  # overflows not logged since the last message
        self._pending: collections.deque = collections.deque()

    def record(self, found_inf: Tensor, scale: Tensor, *, static: bool) -> None:
        """Queue one backward pass's flag and the scale after its update (no sync)."""
        values = torch.cat([found_inf.reshape(1).to(torch.float32), scale.reshape(1)])
        if values.device.type == "cuda":
            host_values = values.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            self._pending.append((host_values, ready, static))
            self.flush(block=len(self._pending) > _MAX_PENDING)
        else:
            self._consume(values, static)

    def flush(self, block: bool = False) -> None:
        """Log the queued records whose values have reached the host (all of them if ``block``)."""
        while self._pending:
            host_values, ready, static = self._pending[0]
            if not block and not ready.query():
                return
            ready.synchronize()
            self._pending.popleft()
            self._consume(host_values, static)

    def _consume(self, values: Tensor, static: bool) -> None:
        overflow, scale = values.tolist()
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

    def summary(self) -> Optional[str]:
        """One line with the number of overflows seen so far, or None if there were none."""
        self.flush(block=True)
        if not self.count:
            return None
        return f"loss scaler {self.loss_id}: {self.count} gradient overflows (steps skipped)"
