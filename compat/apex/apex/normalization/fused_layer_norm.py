"""apex.normalization.fused_layer_norm: apex's norm layers and functions on torch's ``layer_norm`` and ``rms_norm``.

Every function takes apex's arguments in apex's order. The statistics and the affine transform
are computed in fp32 from the input, the weight and the bias as given, and the result is
returned in the input's dtype (``mixed_dtype_*`` and the ``MixedFused*`` layers: in the
weight's dtype), which is what apex's CUDA kernels returned; apex's CPU fallback of
``FusedRMSNorm`` returned fp32 for a half input with fp32 weights, the kernel's dtype is kept
here on every device. ``memory_efficient`` is accepted and changes nothing.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm", "fused_layer_norm",
           "fused_layer_norm_affine", "mixed_dtype_fused_layer_norm_affine", "fused_rms_norm",
           "fused_rms_norm_affine", "mixed_dtype_fused_rms_norm_affine"]

_Shape = Union[int, Sequence[int], torch.Size]


def _shape(normalized_shape: _Shape) -> torch.Size:
    if isinstance(normalized_shape, numbers.Integral):
        return torch.Size((int(normalized_shape),))
    return torch.Size(normalized_shape)


def _as_float(tensor: Optional[Tensor]) -> Optional[Tensor]:
    return None if tensor is None else tensor.float()


def _layer_norm(input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], normalized_shape: _Shape,
                eps: float, out_dtype: torch.dtype) -> Tensor:
    # fp32 statistics and affine, as apex's kernels; one rounding to the output dtype.
    out = F.layer_norm(input.float(), _shape(normalized_shape), _as_float(weight), _as_float(bias), eps)
    return out.to(out_dtype)


def _rms_norm(input: Tensor, weight: Optional[Tensor], normalized_shape: _Shape, eps: float,
              out_dtype: torch.dtype) -> Tensor:
    out = F.rms_norm(input.float(), list(_shape(normalized_shape)), _as_float(weight), eps)
    return out.to(out_dtype)


def fused_layer_norm_affine(input: Tensor, weight: Tensor, bias: Tensor, normalized_shape: _Shape,
                            eps: float = 1e-6, memory_efficient: bool = False) -> Tensor:
    """Layer norm with weight and bias; the result in ``input``'s dtype (apex's ``fused_layer_norm_affine``)."""
    return _layer_norm(input, weight, bias, normalized_shape, eps, input.dtype)


def fused_layer_norm(input: Tensor, normalized_shape: _Shape, eps: float = 1e-6,
                     memory_efficient: bool = False) -> Tensor:
    """Layer norm without affine parameters; the result in ``input``'s dtype."""
    return _layer_norm(input, None, None, normalized_shape, eps, input.dtype)


def mixed_dtype_fused_layer_norm_affine(input: Tensor, weight: Tensor, bias: Tensor, normalized_shape: _Shape,
                                        eps: float = 1e-6, memory_efficient: bool = False) -> Tensor:
    """Layer norm with weight and bias; the result in ``weight``'s dtype (apex's mixed-dtype kernel)."""
    return _layer_norm(input, weight, bias, normalized_shape, eps, weight.dtype)


def fused_rms_norm_affine(input: Tensor, weight: Tensor, normalized_shape: _Shape, eps: float = 1e-6,
                          memory_efficient: bool = False) -> Tensor:
    """RMS norm with a weight; the result in ``input``'s dtype (apex's ``fused_rms_norm_affine``)."""
    return _rms_norm(input, weight, normalized_shape, eps, input.dtype)


def fused_rms_norm(input: Tensor, normalized_shape: _Shape, eps: float = 1e-6,
                   memory_efficient: bool = False) -> Tensor:
    """RMS norm without a weight; the result in ``input``'s dtype."""
    return _rms_norm(input, None, normalized_shape, eps, input.dtype)


def mixed_dtype_fused_rms_norm_affine(input: Tensor, weight: Tensor, normalized_shape: _Shape, eps: float = 1e-6,
                                      memory_efficient: bool = False) -> Tensor:
    """RMS norm with a weight; the result in ``weight``'s dtype (apex's mixed-dtype kernel)."""
    return _rms_norm(input, weight, normalized_shape, eps, weight.dtype)


class FusedLayerNorm(nn.Module):
    """apex's ``FusedLayerNorm``: layer norm over the last dimensions, the result in the input's dtype.

    Example::

        >>> norm = apex.normalization.FusedLayerNorm([10, 10], elementwise_affine=False)
        >>> norm(torch.randn(20, 5, 10, 10)).shape
        torch.Size([20, 5, 10, 10])

    Args:
        normalized_shape: the trailing shape to normalise over (an int for the last dimension).
        eps: added to the variance.
        elementwise_affine: learnable ``weight`` (ones) and ``bias`` (zeros) of that shape.
        memory_efficient: apex's recompute switch; accepted, changes nothing.
    """

    def __init__(self, normalized_shape: _Shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape))
            self.bias = nn.Parameter(torch.empty(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        return _layer_norm(input, self.weight, self.bias, self.normalized_shape, self.eps, input.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class FusedRMSNorm(nn.Module):
    """apex's ``FusedRMSNorm``: ``x / sqrt(mean(x^2) + eps) * weight``, the result in the input's dtype.

    Example::

        >>> norm = apex.normalization.FusedRMSNorm(64)
        >>> norm(torch.randn(8, 64)).shape
        torch.Size([8, 64])

    Args:
        normalized_shape: the trailing shape to normalise over (an int for the last dimension).
        eps: added to the mean square.
        elementwise_affine: a learnable ``weight`` (ones) of that shape.
        memory_efficient: apex's recompute switch; accepted, changes nothing.
    """

    def __init__(self, normalized_shape: _Shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)

    def forward(self, input: Tensor) -> Tensor:
        return _rms_norm(input, self.weight, self.normalized_shape, self.eps, input.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


def _mixed_affine(layer: str, kwargs: dict) -> None:
    # apex's Mixed* layers are always affine: elementwise_affine warns, and False raises.
    if "elementwise_affine" in kwargs:
        warnings.warn(f"{layer} does not support `elementwise_affine` argument", stacklevel=3)
        if not kwargs.pop("elementwise_affine"):
            raise RuntimeError(f"{layer} does not support `elementwise_affine = False`: use "
                               f"apex.normalization.{layer.replace('Mixed', '')}(..., elementwise_affine=False)")
    if kwargs:
        raise TypeError(f"{layer}() got unexpected keyword arguments {sorted(kwargs)}")


class MixedFusedLayerNorm(FusedLayerNorm):
    """apex's ``MixedFusedLayerNorm``: :class:`FusedLayerNorm` whose result takes the weight's dtype.

    Example::

        >>> norm = apex.normalization.MixedFusedLayerNorm(64)
        >>> norm(torch.randn(8, 64).half()).dtype
        torch.float32

    Args:
        normalized_shape: the trailing shape to normalise over.
        eps: added to the variance.
        memory_efficient: accepted, changes nothing.
    """

    def __init__(self, normalized_shape: _Shape, eps: float = 1e-5, *, memory_efficient: bool = False,
                 **kwargs) -> None:
        _mixed_affine("MixedFusedLayerNorm", kwargs)
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True, memory_efficient=memory_efficient)

    def forward(self, input: Tensor) -> Tensor:
        return _layer_norm(input, self.weight, self.bias, self.normalized_shape, self.eps, self.weight.dtype)


class MixedFusedRMSNorm(FusedRMSNorm):
    """apex's ``MixedFusedRMSNorm``: :class:`FusedRMSNorm` whose result takes the weight's dtype.

    Example::

        >>> norm = apex.normalization.MixedFusedRMSNorm(64)
        >>> norm(torch.randn(8, 64).half()).dtype
        torch.float32

    Args:
        normalized_shape: the trailing shape to normalise over.
        eps: added to the mean square.
        memory_efficient: accepted, changes nothing.
    """

    def __init__(self, normalized_shape: _Shape, eps: float = 1e-5, *, memory_efficient: bool = False,
                 **kwargs) -> None:
        _mixed_affine("MixedFusedRMSNorm", kwargs)
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True, memory_efficient=memory_efficient)

    def forward(self, input: Tensor) -> Tensor:
        return _rms_norm(input, self.weight, self.normalized_shape, self.eps, self.weight.dtype)
