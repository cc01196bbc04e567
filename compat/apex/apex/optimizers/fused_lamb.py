"""``apex.optimizers.fused_lamb``, the module NVIDIA apex defined FusedLAMB in.

``from apex.optimizers.fused_lamb import FusedLAMB`` gives apex_amp's class itself.
"""

from apex_amp.optimizers import FusedLAMB

__all__ = ["FusedLAMB"]
