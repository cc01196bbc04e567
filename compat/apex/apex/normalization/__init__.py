"""apex.normalization: apex's FusedLayerNorm and FusedRMSNorm (and their Mixed variants), on torch's own norms.

apex's layers with apex's constructor signatures (``normalized_shape``, ``eps=1e-5``,
``elementwise_affine=True``, ``memory_efficient=False``), parameter names (``weight``,
``bias``) and dtypes of results: the statistics in fp32, the output in the input's dtype
(``MixedFused*``: in the weight's dtype), as apex's CUDA kernels did. The computation is
torch's ``layer_norm`` / ``rms_norm`` on CPU and CUDA; ``memory_efficient`` (apex's
recompute-in-backward switch) changes nothing here. apex's functions (``fused_layer_norm``,
``fused_rms_norm_affine``, ...) are in :mod:`apex.normalization.fused_layer_norm`.

Example::

    >>> from apex.normalization import FusedLayerNorm, FusedRMSNorm
    >>> norm = FusedLayerNorm(64)
    >>> norm(torch.randn(8, 64).half()).dtype
    torch.float16
"""

from .fused_layer_norm import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm

__all__ = ["FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm"]
