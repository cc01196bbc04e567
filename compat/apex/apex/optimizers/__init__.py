"""apex.optimizers: apex_amp's FusedAdam under apex's name; apex's other fused optimizers raise.

``FusedAdam`` is ``apex_amp.optimizers.FusedAdam`` itself (same class, apex's arguments,
including ``adam_w_mode``, ``bias_correction`` and ``set_grad_none``). ``FusedSGD``,
``FusedLAMB``, ``FusedNovoGrad``, ``FusedAdagrad`` and ``FusedMixedPrecisionLamb`` are not
provided: importing one raises an ImportError naming its replacement.

Example::

    >>> from apex.optimizers import FusedAdam
    >>> optimizer = FusedAdam(model.parameters(), lr=1e-3, adam_w_mode=True, weight_decay=0.01)
"""

from apex_amp.optimizers import FusedAdam

from .._unavailable import missing_attribute

__all__ = ["FusedAdam"]


def __getattr__(name: str):
    raise missing_attribute(__name__, name)
