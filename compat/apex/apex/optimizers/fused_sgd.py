"""``apex.optimizers.fused_sgd``, the module NVIDIA apex defined FusedSGD in.

``from apex.optimizers.fused_sgd import FusedSGD`` gives apex_amp's class itself.
"""

from apex_amp.optimizers import FusedSGD

__all__ = ["FusedSGD"]
