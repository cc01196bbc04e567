"""``Fp8Linear``: an ``nn.Linear`` whose forward, input-gradient and weight-gradient GEMMs run in fp8.

``amp.initialize(..., fp8=...)`` turns each eligible ``nn.Linear`` into one by
class assignment (:func:`convert_`): the module keeps its identity, its
parameters (which the optimizer holds), its hooks and its ``state_dict``
keys; ``isinstance(layer, nn.Linear)`` still holds. What it gains is a binding
to its three columns of the session's :class:`~apex_amp.fp8.scaling.Fp8Scales`.

Per call: the input and the weight are cast to the forward fp8 dtype and
multiplied by ``torch._scaled_mm`` (output in the level's compute dtype, the
bias added in that dtype); backward casts the output gradient to the backward
fp8 dtype and computes the input gradient (against the saved fp8 weight) and
the weight gradient (against the saved fp8 input) the same way. Autograd saves
the fp8 copies, one byte per element. Amaxes are recorded only when autograd
records the call (training); an evaluation under ``torch.no_grad()`` uses the
scales as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..amp.casting import disable_casts
from .numerics import dims_supported, forward_gemm, input_grad_gemm, weight_grad_gemm
from .recipe import Fp8Recipe
from .scaling import GRAD_OUTPUT, INPUT, WEIGHT, Fp8Scales, quantise

__all__ = ["Fp8Linear", "Fp8Binding", "eligibility", "convert_"]


@dataclasses.dataclass(frozen=True)
class Fp8Binding:
    """Where an Fp8Linear's scales live and what its GEMMs produce."""

    scales: Fp8Scales
    first_column: int
    out_dtype: torch.dtype  # the level's compute dtype for matmuls (the half dtype)


def _cast(tensor: Tensor, binding: Fp8Binding, role: int, dtype: torch.dtype, record: bool) -> tuple[Tensor, Tensor]:
    scales = binding.scales
    return quantise(tensor, scales.amax_history, scales.scale, binding.first_column + role, dtype,
                    scales.recipe.margin, scales.recipe.delayed, record)


def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], binding: Fp8Binding, record: bool):
    forward_dtype = binding.scales.recipe.forward_dtype
    x2 = x.reshape(-1, x.shape[-1])
    x8, x_inv = _cast(x2, binding, INPUT, forward_dtype, record)
    w8, w_inv = _cast(weight, binding, WEIGHT, forward_dtype, record)
    out = forward_gemm(x8, x_inv, w8, w_inv, binding.out_dtype)
    if bias is not None:
        out = out + bias.to(binding.out_dtype)
    if x.dim() != 2:  # a 2-D input gets the GEMM's own tensor back (not a view of it)
        out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out, (x8, x_inv, w8, w_inv)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], binding: Fp8Binding) -> Tensor:
        out, (x8, x_inv, w8, w_inv) = _forward(x, weight, bias, binding, record=True)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.binding = binding
        ctx.x_shape, ctx.x_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        with torch.autocast(grad_out.device.type, enabled=False):
            return _Fp8LinearFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        binding = ctx.binding
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        g8, g_inv = _cast(g2, binding, GRAD_OUTPUT, binding.scales.recipe.backward_dtype, record=True)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = input_grad_gemm(g8, g_inv, w8, w_inv, ctx.x_dtype)
            if len(ctx.x_shape) != 2:
                grad_x = grad_x.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = weight_grad_gemm(g8, g_inv, x8, x_inv, ctx.weight_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = g2.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose three GEMMs run in fp8 (made by ``amp.initialize(..., fp8=...)``).

    Args:
        in_features: as ``nn.Linear`` (only through ``convert_``: the layer needs an fp8 binding).
        out_features: as ``nn.Linear``.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2", fp8=True)
        >>> type(model.fc1).__name__, isinstance(model.fc1, torch.nn.Linear)
        ('Fp8Linear', True)
    """

    fp8_binding: Fp8Binding

    def forward(self, x: Tensor) -> Tensor:
        binding = self.fp8_binding
        # The fp8 path sets every dtype itself: neither torch's autocast nor O1's casts may reach its
        # ops, and torch.autocast(enabled=False) does not switch O1 off (amp/casting/dispatch.py).
        # Where torch._scaled_mm's CPU kernel is a composite of fp32 ops (AVX2 CPUs without
        # AVX-512, torch 2.14), O1 would cast its inner matmul to half and round the product
        # before the scales (tests/test_fp8.py fails on such a CPU without disable_casts).
        with torch.autocast(x.device.type, enabled=False), disable_casts():
            if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad
                                            or (self.bias is not None and self.bias.requires_grad)):
                return _Fp8LinearFunction.apply(x, self.weight, self.bias, binding)
            return _forward(x, self.weight, self.bias, binding, record=False)[0]

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8=True"


def eligibility(name: str, module: nn.Module, recipe: Fp8Recipe) -> Optional[str]:
    """Why the ``nn.Linear`` ``module`` stays out of fp8, or None when it converts.

    Only modules of type ``nn.Linear`` itself are candidates (subclasses may compute something else).
    """
    if recipe.module_filter is not None and not recipe.module_filter(name, module):
        return "excluded by Fp8Recipe.module_filter"
    if not dims_supported(module.in_features, module.out_features):
        return (f"{module.in_features}->{module.out_features}: torch._scaled_mm needs in_features and "
                "out_features multiples of 16")
    return None


def convert_(module: nn.Linear, binding: Fp8Binding) -> None:
    """Make ``module`` an :class:`Fp8Linear` bound to ``binding`` (in place, same object)."""
    module.__class__ = Fp8Linear
    module.fp8_binding = binding
