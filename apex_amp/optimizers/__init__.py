"""Optimizers built on apex_amp's fused ops.

Example::

    >>> from apex_amp.optimizers import FusedAdam
    >>> optimizer = FusedAdam(model.parameters(), lr=1e-3)
"""

from .fused_adam import FusedAdam

__all__ = ["FusedAdam"]
