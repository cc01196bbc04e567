"""``apex.optimizers.fused_adam``, the module NVIDIA apex defined FusedAdam in (``from apex.optimizers.fused_adam import FusedAdam``)."""

from apex_amp.optimizers import FusedAdam

__all__ = ["FusedAdam"]
