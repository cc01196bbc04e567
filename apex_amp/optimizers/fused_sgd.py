"""FusedSGD: SGD with momentum (apex's FusedSGD), one ``fused_sgd_`` op call per param group and device.

The op is defined here, by its pure-PyTorch implementation (apex_amp/_op_registry.py); its
math is amp_math.h's ``sgd_update``, run by csrc/cpu/fused_sgd_cpu.cpp and csrc/cuda/fused_sgd_cuda.cu.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch
from torch import Tensor
from torch.optim.optimizer import required

from .. import _checks as check
from .. import ops
from .._fallback import f32, shaped_like, step_taken, unscaled_fp32
from .._op_registry import define
from ._state_operands import StepOperands
from .fused_optimizer import AmpStepArgs, FusedBatch, FusedOptimizer

__all__ = ["FusedSGD"]

_OP = "fused_sgd_"


def _fake_fused_sgd(params, grads, momentum_buffers, model_params, master_remainders, state_absmaxes, lr, momentum,
                    dampening, weight_decay, nesterov, first_run, wd_after_momentum, inv_scale=None,
                    found_inf=None, state_rounding=None) -> None:
    device = check.device_of(*params, inv_scale, found_inf)
    states = {"momentum_buffers": momentum_buffers} if momentum_buffers else {}
    check.fused_step(_OP, device, params, grads, states, model_params, master_remainders, state_absmaxes,
                     inv_scale, found_inf, state_rounding)
    check.host_numbers(
        _OP, lr=(lr, lr >= 0.0, ">= 0"), momentum=(momentum, momentum >= 0.0, ">= 0"),
        dampening=(dampening, 0.0 <= dampening <= 1.0, "in [0, 1]"),
        weight_decay=(weight_decay, weight_decay >= 0.0, ">= 0"))
    if bool(momentum_buffers) != (momentum != 0.0):
        check.fail(_OP, f"pass momentum_buffers (one per param) exactly when momentum is not 0 (momentum="
                        f"{momentum}, {len(momentum_buffers)} buffers)")
    if nesterov and not (momentum > 0.0 and dampening == 0.0):
        check.fail(_OP, "nesterov needs momentum > 0 and dampening 0")


@define(_OP, mutates_args=("params", "momentum_buffers", "model_params", "master_remainders", "state_absmaxes"),
        fake=_fake_fused_sgd)
def fused_sgd_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    model_params: list[Tensor],
    master_remainders: list[Tensor],
    state_absmaxes: list[Tensor],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    first_run: bool,
    wd_after_momentum: bool,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    state_rounding: Optional[Tensor] = None,
) -> None:
    """SGD over whole lists: grads unscaled by ``inv_scale``, ``weight_decay`` added before the momentum
    (after it with ``wd_after_momentum``), ``momentum_buffers`` (none when momentum is 0) set to the
    gradient on the ``first_run``, the buffers read and written in their formats and the masters
    joined from and split into ``master_remainders`` (apex_amp/optimizers/_state_operands.py), the
    fp16/bf16 ``model_params`` written from the updated fp32 params; nothing changes when
    ``found_inf`` is non-zero."""
    _fake_fused_sgd(params, grads, momentum_buffers, model_params, master_remainders, state_absmaxes, lr, momentum,
                    dampening, weight_decay, nesterov, first_run, wd_after_momentum, inv_scale, found_inf,
                    state_rounding)
    states = {"momentum_buffers": momentum_buffers} if momentum_buffers else {}
    check.fused_memory(_OP, params, states, model_params, master_remainders, state_absmaxes)
    taken = step_taken(found_inf)
    if taken is False or not params:
        return
    grads, model_params = (shaped_like(t, params) for t in (grads, model_params))
    operands = StepOperands(params, list(states.values()), master_remainders, state_absmaxes, state_rounding)
    lr, momentum, weight_decay = f32(lr), f32(momentum), f32(weight_decay)
    grad = unscaled_fp32(grads, inv_scale)
    param = operands.masters
    if weight_decay != 0.0 and not wd_after_momentum:
        grad = torch._foreach_add(grad, torch._foreach_mul(param, weight_decay))
    if momentum_buffers:
        if first_run:
            buffer = grad
        else:
            buffer = torch._foreach_add(torch._foreach_mul(operands.states[0], momentum),
                                        torch._foreach_mul(grad, f32(1.0 - f32(dampening))))
        grad = torch._foreach_add(grad, torch._foreach_mul(buffer, momentum)) if nesterov else buffer
        operands.write_states(0, buffer, taken)
    if weight_decay != 0.0 and wd_after_momentum:
        grad = torch._foreach_add(grad, torch._foreach_mul(param, weight_decay))
    param = torch._foreach_sub(param, torch._foreach_mul(grad, lr))
    operands.write_masters(param, taken, model_params)


class FusedSGD(FusedOptimizer):
    """SGD with momentum whose update is one fused pass over all tensors of a param group (apex's FusedSGD).

    torch.optim.SGD's update and state (``momentum_buffer``, created from the first gradient),
    apex's arguments. Under ``amp.initialize`` (O2: fp32 masters, the half model copy written in
    the same pass) and under ``torch.amp.GradScaler`` the gradients are unscaled as they are
    read and an overflowed step is skipped on the device.

    .. note:: With ``dampening`` > 0, a parameter's first step under amp or a GradScaler reads
       the overflow flag once (a host sync), so that a skipped first step leaves no buffer behind.

    Args:
        params: parameters or param groups.
        lr: learning rate (required unless every param group has its own ``lr``).
        momentum: momentum factor.
        dampening: dampening of the momentum.
        weight_decay: weight decay (L2 penalty), added to the gradient.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0).
        wd_after_momentum: add the weight decay after the momentum instead of before (apex).
        materialize_master_grads: accepted for apex compatibility; the fused step always reads
            the gradients where amp left them, so there is nothing to materialize.
        set_grad_none: ``zero_grad()`` sets gradients to None (apex's default: zeroes them).
        master_weights: keep fp32 master copies of fp16/bf16 parameters in the
            optimizer state (without amp); the half parameters are rewritten in
            the same pass. ``"remainder"``: for bf16 parameters, keep only the low
            16 bits of each fp32 master (``master_remainder``, int16): the bf16
            parameter is its high half, so the master is exact in 2 bytes instead of 4.
        state_precision: how the momentum buffer is stored: ``"fp32"`` (default), ``"bf16"``,
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

        >>> optimizer = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: Any = required,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
        master_weights: Union[bool, str] = False,
        state_precision: str = "fp32",
        state_block_size: int = 256,
        min_quantized_numel: int = 4096,
        state_rounding: str = "nearest",
        state_rounding_seed: Union[int, torch.Generator, None] = None,
    ) -> None:
        # apex's and torch's convention: without lr= every param group must give its own
        # (torch's add_param_group names a group that does not).
        if lr is None:
            raise TypeError("FusedSGD needs a learning rate: FusedSGD(params, lr=...), or lr in every param group")
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}; it must be >= 0")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}; it must be >= 0")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}; it must be >= 0")
        if not 0.0 <= dampening <= 1.0:
            raise ValueError(f"Invalid dampening value: {dampening}; it must be in [0, 1]")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov)
        super().__init__(params, defaults, set_grad_none=set_grad_none, master_weights=master_weights, state_precision=state_precision,
                         state_block_size=state_block_size, min_quantized_numel=min_quantized_numel,
                         state_rounding=state_rounding, state_rounding_seed=state_rounding_seed)
        self.wd_after_momentum = bool(wd_after_momentum)
        self.materialize_master_grads = bool(materialize_master_grads)

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _fused_step(self, group: dict[str, Any], batch: FusedBatch, amp: AmpStepArgs) -> None:
        device = batch.device
        found_inf = None if amp.found_inf is None else amp.found_inf.to(device)
        has_momentum = group["momentum"] != 0
        new = [i for i, created in enumerate(batch.new_state) if created] if has_momentum else []
        if new and found_inf is not None and group["dampening"] != 0 and bool(found_inf.item()):
            # A skipped first step must not leave a zero buffer that the next step would damp.
            for i in new:
                del self.state[batch.owners[i]]["momentum_buffer"]
                self.state[batch.owners[i]].pop("momentum_buffer_absmax", None)
            return
        runs = [(False, [i for i in range(len(batch.params)) if i not in set(new)]), (True, new)]
        for first_run, indices in runs:
            if not indices:
                continue

            def pick(tensors: list[Tensor]) -> list[Tensor]:
                return [tensors[i] for i in indices] if len(indices) != len(batch.params) else tensors

            ops.fused_sgd_(
                pick(batch.params), pick(batch.grads),
                pick(batch.states["momentum_buffer"]) if has_momentum else [],
                pick(batch.model_params) if batch.model_params else [],
                float(group["lr"]), float(group["momentum"]), float(group["dampening"]),
                float(group["weight_decay"]), bool(group["nesterov"]), first_run, self.wd_after_momentum,
                None if amp.inv_scale is None else amp.inv_scale.to(device), found_inf,
                master_remainders=pick(batch.master_remainders) if batch.master_remainders else [],
                state_absmaxes=batch.state_absmaxes(None if len(indices) == len(batch.params) else indices),
                state_rounding=batch.state_rounding(None if len(indices) == len(batch.params) else indices),
            )
