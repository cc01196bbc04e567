"""apex's fused optimizers on apex_amp's fused ops, and LARC.

Each fused optimizer is a :class:`FusedOptimizer` (the shared contract with amp and
``torch.amp.GradScaler``) whose whole update of a param group is one op call per device.

Example::

    >>> from apex_amp.optimizers import FusedAdam, FusedLAMB, FusedSGD
    >>> optimizer = FusedAdam(model.parameters(), lr=1e-3)
    >>> sgd_with_larc = LARC(torch.optim.SGD(model.parameters(), lr=0.1))
"""

from .fused_adagrad import FusedAdagrad
from .fused_adam import FusedAdam
from .fused_lamb import FusedLAMB, FusedMixedPrecisionLamb
from .fused_novograd import FusedNovoGrad
from .fused_optimizer import AmpStepArgs, FusedOptimizer
from .fused_sgd import FusedSGD
from .larc import LARC

__all__ = [
    "FusedAdam", "FusedSGD", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad", "FusedAdagrad",
    "FusedOptimizer", "AmpStepArgs", "LARC",
]
