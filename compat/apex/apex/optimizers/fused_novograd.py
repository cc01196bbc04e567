"""``apex.optimizers.fused_novograd``, the module NVIDIA apex defined FusedNovoGrad in (``from apex.optimizers.fused_novograd import FusedNovoGrad``)."""

from apex_amp.optimizers import FusedNovoGrad

__all__ = ["FusedNovoGrad"]
