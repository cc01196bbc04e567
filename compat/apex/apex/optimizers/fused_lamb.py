"""``apex.optimizers.fused_lamb``, the module NVIDIA apex defined FusedLAMB in (``from apex.optimizers.fused_lamb import FusedLAMB``)."""

from apex_amp.optimizers import FusedLAMB

__all__ = ["FusedLAMB"]
