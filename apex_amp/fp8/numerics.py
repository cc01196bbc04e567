"""fp8 numerics: per-tensor scales, the saturating cast, and a Linear's three GEMMs through ``torch._scaled_mm``.

``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype)`` computes
``(a.float() @ b.float()) * scale_a * scale_b`` with fp8 inputs, accumulating
in fp32; ``scale_a``/``scale_b`` are the *inverse* scales (the cast multiplied
by the scale). On CUDA (fp8 tensor cores, sm_89 and later) it needs ``a``
row-major, ``b`` column-major, the inner dimension and ``b``'s columns
multiples of 16, and never two e5m2 inputs; the CPU kernel takes anything. The
functions here produce those layouts on every device, so the path tested on
the CPU is the one a GPU runs.

A non-finite value must not vanish in the saturating cast (an inf would become
448): the inverse scale handed to the GEMM is poisoned with ``0 * amax``, which
is NaN exactly when the tensor held an inf or NaN, so the GEMM's output, the
loss's gradients and amp's overflow check all see it.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

__all__ = [
    "GEMM_MULTIPLE", "fp8_max", "amax", "scale_from_amax", "cast_to_fp8", "gemm_inverse_scale",
    "forward_gemm", "input_grad_gemm", "weight_grad_gemm", "dims_supported",
]

GEMM_MULTIPLE = 16  # cuBLASLt's fp8 GEMMs: inner dimension and output columns multiples of 16
_FP32_MAX = torch.finfo(torch.float32).max


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def dims_supported(in_features: int, out_features: int) -> bool:
    """Whether a Linear's three GEMMs fit ``torch._scaled_mm`` on every device (the tokens dimension is padded)."""
    return in_features % GEMM_MULTIPLE == 0 and out_features % GEMM_MULTIPLE == 0


def amax(tensor: Tensor) -> Tensor:
    """The largest absolute value, as a float32 scalar on the tensor's device (NaN if it holds one)."""
    return tensor.abs().amax().to(torch.float32)


def scale_from_amax(amax_value: Tensor, top: Union[float, Tensor], margin: int, fallback: Tensor) -> Tensor:
    """``top / amax / 2**margin`` (``top``: the fp8 dtype's largest value); ``fallback`` where amax is 0 or
    not finite (Transformer Engine's rule)."""
    scale = torch.clamp(top / amax_value / (2.0**margin), max=_FP32_MAX)
    usable = (amax_value > 0) & torch.isfinite(amax_value)
    return torch.where(usable, scale, fallback)


def cast_to_fp8(tensor: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor * scale`` rounded to ``dtype``, saturating at its largest value (NaN stays NaN)."""
    top = fp8_max(dtype)
    return (tensor.to(torch.float32) * scale).clamp(-top, top).to(dtype)


def gemm_inverse_scale(scale: Tensor, tensor_amax: Tensor) -> Tensor:
    """``1 / scale`` for ``torch._scaled_mm``, NaN when the tensor held inf or NaN (module docstring)."""
    return scale.reciprocal() + tensor_amax * 0.0


def _column_major(matrix: Tensor) -> Tensor:
    return matrix.t().contiguous().t()


def forward_gemm(x8: Tensor, x_inv: Tensor, w8: Tensor, w_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``x @ w.t()`` for ``x8`` (tokens, in) and ``w8`` (out, in), both row-major."""
    return torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype)


def input_grad_gemm(g8: Tensor, g_inv: Tensor, w8: Tensor, w_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``grad_out @ w``: (tokens, out) x (out, in), the weight taken column-major."""
    return torch._scaled_mm(g8, _column_major(w8), scale_a=g_inv, scale_b=w_inv, out_dtype=out_dtype)


def weight_grad_gemm(g8: Tensor, g_inv: Tensor, x8: Tensor, x_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``grad_out.t() @ x``: (out, tokens) x (tokens, in). The tokens are the inner dimension here, so they
    are padded with zeros to a multiple of 16 (zeros add nothing to the fp32 sums)."""
    tokens = g8.shape[0]
    pad = -tokens % GEMM_MULTIPLE
    if pad:
        g8 = torch.cat([g8, g8.new_zeros(pad, g8.shape[1])])
        x8 = torch.cat([x8, x8.new_zeros(pad, x8.shape[1])])
    return torch._scaled_mm(g8.t().contiguous(), _column_major(x8), scale_a=g_inv, scale_b=x_inv,
                            out_dtype=out_dtype)
