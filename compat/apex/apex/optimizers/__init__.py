"""apex.optimizers: apex_amp's fused optimizers under apex's names.

Each is apex_amp's class itself (``apex.optimizers.FusedLAMB is apex_amp.optimizers.FusedLAMB``),
with apex's arguments: ``FusedAdam``, ``FusedSGD``, ``FusedLAMB``, ``FusedMixedPrecisionLamb``,
``FusedNovoGrad`` and ``FusedAdagrad``. apex's module paths work too
(``from apex.optimizers.fused_lamb import FusedLAMB``).

Example::

    >>> from apex.optimizers import FusedAdam, FusedLAMB
    >>> optimizer = FusedAdam(model.parameters(), lr=1e-3, adam_w_mode=True, weight_decay=0.01)
    >>> optimizer = FusedLAMB(model.parameters(), lr=1e-3, max_grad_norm=1.0)
"""

from apex_amp.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad,
                                 FusedSGD)

from .._unavailable import missing_attribute

__all__ = ["FusedAdam", "FusedSGD", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad", "FusedAdagrad"]


def __getattr__(name: str):
    raise missing_attribute(__name__, name)
