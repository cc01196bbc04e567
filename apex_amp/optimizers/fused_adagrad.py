"""FusedAdagrad: apex's FusedAdagrad, one ``fused_adagrad_`` op call per param group and device.

The op is defined here, by its pure-PyTorch implementation (apex_amp/_op_registry.py); its
math is amp_math.h's ``AdagradHyper`` rule, run by csrc/cpu/fused_adagrad_cpu.cpp and
csrc/cuda/fused_adagrad_cuda.cu.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch
from torch import Tensor

from .. import _checks as check
from .. import ops
from .._fallback import f32, shaped_like, step_taken, unscaled_fp32
from .._op_registry import define
from ._state_operands import StepOperands
from .fused_optimizer import AmpStepArgs, FusedBatch, FusedOptimizer

__all__ = ["FusedAdagrad"]

_OP = "fused_adagrad_"


def _fake_fused_adagrad(params, grads, state_sums, model_params, master_remainders, state_absmaxes, lr, eps,
                        weight_decay, adagrad_w_mode, inv_scale=None, found_inf=None, state_rounding=None) -> None:
    device = check.device_of(*params, inv_scale, found_inf)
    check.fused_step(_OP, device, params, grads, {"state_sums": state_sums}, model_params, master_remainders,
                     state_absmaxes, inv_scale, found_inf, state_rounding)
    check.host_numbers(_OP, lr=(lr, lr >= 0.0, ">= 0"), eps=(eps, eps >= 0.0, ">= 0"),
                       weight_decay=(weight_decay, weight_decay >= 0.0, ">= 0"))


@define(_OP, mutates_args=("params", "state_sums", "model_params", "master_remainders", "state_absmaxes"),
        fake=_fake_fused_adagrad)
def fused_adagrad_(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    model_params: list[Tensor],
    master_remainders: list[Tensor],
    state_absmaxes: list[Tensor],
    lr: float,
    eps: float,
    weight_decay: float,
    adagrad_w_mode: bool,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    state_rounding: Optional[Tensor] = None,
) -> None:
    """Adagrad over whole lists: grads unscaled by ``inv_scale``, ``state_sums`` += grad², weight decay
    added to the gradient (L2) or to the update (``adagrad_w_mode``), the sums read and written in their
    formats and the masters joined from and split into ``master_remainders``
    (apex_amp/optimizers/_state_operands.py), the fp16/bf16 ``model_params`` written from the updated
    fp32 params; nothing changes when ``found_inf`` is non-zero."""
    _fake_fused_adagrad(params, grads, state_sums, model_params, master_remainders, state_absmaxes, lr, eps,
                        weight_decay, adagrad_w_mode, inv_scale, found_inf, state_rounding)
    check.fused_memory(_OP, params, {"state_sums": state_sums}, model_params, master_remainders, state_absmaxes)
    taken = step_taken(found_inf)
    if taken is False or not params:
        return
    grads, model_params = (shaped_like(t, params) for t in (grads, model_params))
    operands = StepOperands(params, [state_sums], master_remainders, state_absmaxes, state_rounding)
    lr, eps, weight_decay = f32(lr), f32(eps), f32(weight_decay)
    grad = unscaled_fp32(grads, inv_scale)
    param = operands.masters
    if not adagrad_w_mode:
        grad = torch._foreach_add(grad, torch._foreach_mul(param, weight_decay))
    total = torch._foreach_add(operands.states[0], torch._foreach_mul(grad, grad))
    update = torch._foreach_div(grad, torch._foreach_add(torch._foreach_sqrt(total), eps))
    if adagrad_w_mode:
        update = torch._foreach_add(update, torch._foreach_mul(param, weight_decay))
    param = torch._foreach_sub(param, torch._foreach_mul(update, lr))
    operands.write_states(0, total, taken)
    operands.write_masters(param, taken, model_params)


class FusedAdagrad(FusedOptimizer):
    """Adagrad whose update is one fused pass over all tensors of a param group (apex's FusedAdagrad).

    Per parameter the state holds ``sum`` (the running sum of squared gradients, as
    ``torch.optim.Adagrad`` names it; apex's rule has no ``lr_decay`` and starts the sum at 0).
    Under ``amp.initialize`` and ``torch.amp.GradScaler`` the gradients are unscaled as they
    are read and an overflowed step is skipped on the device.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        eps: added to the denominator.
        weight_decay: weight decay factor.
        set_grad_none: ``zero_grad()`` sets gradients to None (else zeroes them).
        adagrad_w_mode: decoupled weight decay (added to the update) instead of L2 (added to the gradient).
        master_weights: keep fp32 master copies of fp16/bf16 parameters in the
            optimizer state (without amp); the half parameters are rewritten in
            the same pass. ``"remainder"``: for bf16 parameters, keep only the low
            16 bits of each fp32 master (``master_remainder``, int16): the bf16
            parameter is its high half, so the master is exact in 2 bytes instead of 4.
        state_precision: how the per-element state is stored: ``"fp32"`` (default), ``"bf16"``,
            ``"fp8"`` or ``"int8"`` (docs/low_precision_state.md); also a param-group key.
        state_block_size: the largest block of fp8/int8 state sharing one fp32 absmax (a power
            of two in [32, 4096], default 256); also a param-group key.
        min_quantized_numel: parameters with fewer elements (of the global, unsharded shape)
            keep fp32 state (default 4096); also a param-group key.
        state_rounding: how bf16 state is stored: ``"nearest"`` (to nearest even, default) or
            ``"stochastic"`` (unbiased random rounding, seeded: docs/low_precision_state.md); needs
            ``state_precision="bf16"``; also a param-group key.
        state_rounding_seed: the seed of ``"stochastic"``: an int, a ``torch.Generator`` (drawn
            from once) or None (drawn from torch's default generator); also a param-group key.

    Example::

        >>> optimizer = FusedAdagrad(model.parameters(), lr=1e-2)
    """

    STATE_KEYS = ("sum",)
    NONNEGATIVE_STATE_KEYS = frozenset({"sum"})

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
        adagrad_w_mode: bool = False,
        master_weights: Union[bool, str] = False,
        state_precision: str = "fp32",
        state_block_size: int = 256,
        min_quantized_numel: int = 4096,
        state_rounding: str = "nearest",
        state_rounding_seed: Union[int, torch.Generator, None] = None,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}; it must be >= 0")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}; it must be >= 0")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}; it must be >= 0")
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay), set_grad_none=set_grad_none,
                         master_weights=master_weights, state_precision=state_precision,
                         state_block_size=state_block_size, min_quantized_numel=min_quantized_numel,
                         state_rounding=state_rounding, state_rounding_seed=state_rounding_seed)
        self.adagrad_w_mode = bool(adagrad_w_mode)

    def _fused_step(self, group: dict[str, Any], batch: FusedBatch, amp: AmpStepArgs) -> None:
        device = batch.device
        ops.fused_adagrad_(
            batch.params, batch.grads, batch.states["sum"], batch.model_params,
            float(group["lr"]), float(group["eps"]), float(group["weight_decay"]), self.adagrad_w_mode,
            None if amp.inv_scale is None else amp.inv_scale.to(device),
            None if amp.found_inf is None else amp.found_inf.to(device),
            master_remainders=batch.master_remainders, state_absmaxes=batch.state_absmaxes(),
            state_rounding=batch.state_rounding(),
        )
