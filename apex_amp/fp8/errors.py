"""How far an fp8 Linear's three GEMMs are from exact, next to the same GEMMs in a half dtype.

For one layer and one (input, output gradient) pair, :func:`gemm_errors`
computes the forward, input-gradient and weight-gradient products three ways:
in fp64 from the layer's own weight (the reference), in fp8 exactly as the
layer runs them (its current scales, nothing recorded), and in the half dtype
(``torch.matmul`` on half inputs). The relative error is
``||result - reference||_F / ||reference||_F``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .linear import Fp8Linear
from .numerics import forward_gemm, input_grad_gemm, weight_grad_gemm
from .scaling import GRAD_OUTPUT, INPUT, WEIGHT, quantise

__all__ = ["GemmError", "gemm_errors"]


@dataclasses.dataclass(frozen=True)
class GemmError:
    """The relative error of one GEMM in fp8 and in the half dtype."""

    gemm: str  # "forward", "input grad" or "weight grad"
    fp8: float
    half: float


def _relative(value: Tensor, reference: Tensor) -> float:
    return float((value.double() - reference).norm() / reference.norm())


def gemm_errors(layer: Fp8Linear, x: Tensor, grad_out: Tensor, half_dtype: torch.dtype) -> list[GemmError]:
    """The three GEMMs of ``layer`` on ``x`` (tokens, in) and ``grad_out`` (tokens, out): fp8 and half vs fp64.

    Args:
        layer: an :class:`Fp8Linear` (after ``amp.initialize(..., fp8=...)``).
        x: the layer's input, flattened to (tokens, in_features).
        grad_out: the gradient of its output, (tokens, out_features).
        half_dtype: the dtype of the half-precision GEMMs to compare with.

    Example::

        >>> errors = gemm_errors(model.fc1, x, grad_out, torch.bfloat16)
        >>> [(e.gemm, round(e.fp8, 3), round(e.half, 4)) for e in errors]
    """
    binding = layer.fp8_binding
    scales, recipe = binding.scales, binding.scales.recipe
    weight = layer.weight.detach()

    def cast(tensor: Tensor, role: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return quantise(tensor, scales.amax_history, scales.scale, binding.first_column + role, dtype,
                        recipe.margin, recipe.delayed, record=False)

    with torch.no_grad():
        x8, x_inv = cast(x, INPUT, recipe.forward_dtype)
        w8, w_inv = cast(weight, WEIGHT, recipe.forward_dtype)
        g8, g_inv = cast(grad_out, GRAD_OUTPUT, recipe.backward_dtype)
        x64, w64, g64 = x.double(), weight.double(), grad_out.double()
        xh, wh, gh = x.to(half_dtype), weight.to(half_dtype), grad_out.to(half_dtype)
        out = torch.float32
        return [
            GemmError("forward", _relative(forward_gemm(x8, x_inv, w8, w_inv, out), x64 @ w64.t()),
                      _relative(xh @ wh.t(), x64 @ w64.t())),
            GemmError("input grad", _relative(input_grad_gemm(g8, g_inv, w8, w_inv, out), g64 @ w64),
                      _relative(gh @ wh, g64 @ w64)),
            GemmError("weight grad", _relative(weight_grad_gemm(g8, g_inv, x8, x_inv, out), g64.t() @ x64),
                      _relative(gh.t() @ xh, g64.t() @ x64)),
        ]
