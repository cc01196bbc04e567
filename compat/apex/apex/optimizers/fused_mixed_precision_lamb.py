"""``apex.optimizers.fused_mixed_precision_lamb``, the module NVIDIA apex defined FusedMixedPrecisionLamb in.

``from apex.optimizers.fused_mixed_precision_lamb import FusedMixedPrecisionLamb`` gives apex_amp's class itself.
"""

from apex_amp.optimizers import FusedMixedPrecisionLamb

__all__ = ["FusedMixedPrecisionLamb"]
