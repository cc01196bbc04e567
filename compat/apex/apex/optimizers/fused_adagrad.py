"""``apex.optimizers.fused_adagrad``, the module NVIDIA apex defined FusedAdagrad in.

``from apex.optimizers.fused_adagrad import FusedAdagrad`` gives apex_amp's class itself.
"""

from apex_amp.optimizers import FusedAdagrad

__all__ = ["FusedAdagrad"]
