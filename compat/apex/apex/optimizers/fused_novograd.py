"""``apex.optimizers.fused_novograd``, the module NVIDIA apex defined FusedNovoGrad in.

``from apex.optimizers.fused_novograd import FusedNovoGrad`` gives apex_amp's class itself.
"""

from apex_amp.optimizers import FusedNovoGrad

__all__ = ["FusedNovoGrad"]
