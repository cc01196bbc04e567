"""Optimizers built on apex_amp's fused ops.

Example::

    >>> from apex_amp.optimizers import FusedAdam
    >>> optimizer = FusedAdam(model.parameters(), lr=1e-3)
    >>> sgd_with_larc = LARC(torch.optim.SGD(model.parameters(), lr=0.1))
"""

from .fused_adam import FusedAdam
from .larc import LARC

__all__ = ["FusedAdam", "LARC"]
