"""FusedAdam: Adam/AdamW with one ``fused_adam_`` op call per param group and device.

The op is defined here, by its pure-PyTorch implementation (apex_amp/_op_registry.py); its
math is amp_math.h's ``adam_update``, run by csrc/cpu/fused_adam_cpu.cpp and
csrc/cuda/fused_adam_cuda.cu.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch
from torch import Tensor

from .. import _checks as check
from .. import ops
from .._fallback import as_fp32, commit, f32, step_taken, shaped_like, unscaled_fp32
from .._op_registry import define
from ._state_operands import StepOperands
from .fused_optimizer import AmpStepArgs, FusedBatch, FusedOptimizer

__all__ = ["FusedAdam"]

_OP = "fused_adam_"


def _adam_step_scalars(
    step_after: Tensor, lr: float, beta1: float, beta2: float, bias_correction: bool
) -> tuple[Union[float, Tensor], Union[float, Tensor]]:
    """(step_size, sqrt(1 - beta2^step)) as in amp_math.h's make_adam_step_params."""
    if not bias_correction:
        return f32(lr), 1.0
    # In float64 on the step's device (beta^step loses all precision in fp32), then fp32.
    step = step_after.reshape(()).double()
    bias_correction1 = 1.0 - torch.pow(f32(beta1), step)
    bias_correction2 = 1.0 - torch.pow(f32(beta2), step)
    return (f32(lr) / bias_correction1).float(), bias_correction2.sqrt().float()


def _adam_math(params, grads, exp_avgs, exp_avg_sqs, inv_scale, step_size, bc2_sqrt, hyper):
    """amp_math.h's adam_update on whole lists, in fp32, same order of operations."""
    lr, beta1, beta2, eps, weight_decay, adamw_mode = hyper
    grad = unscaled_fp32(grads, inv_scale)
    param, exp_avg, exp_avg_sq = as_fp32(params), as_fp32(exp_avgs), as_fp32(exp_avg_sqs)
    if weight_decay != 0.0:
        if adamw_mode:
            param = torch._foreach_mul(param, f32(1.0 - f32(lr * weight_decay)))
        else:
            grad = torch._foreach_add(grad, torch._foreach_mul(param, weight_decay))
    exp_avg = torch._foreach_add(
        torch._foreach_mul(exp_avg, beta1), torch._foreach_mul(grad, f32(1.0 - beta1))
    )
    exp_avg_sq = torch._foreach_add(
        torch._foreach_mul(exp_avg_sq, beta2),
        torch._foreach_mul(torch._foreach_mul(grad, f32(1.0 - beta2)), grad),
    )
    denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(exp_avg_sq), bc2_sqrt), eps)
    param = torch._foreach_sub(param, torch._foreach_div(torch._foreach_mul(exp_avg, step_size), denom))
    return param, exp_avg, exp_avg_sq


def _fake_fused_adam(
    params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step, lr, beta1,
    beta2, eps, weight_decay, adamw_mode, bias_correction, inv_scale=None, found_inf=None, state_rounding=None,
) -> None:
    op, device = _OP, step.device
    check.fused_step(op, device, params, grads, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
                     model_params, master_remainders, state_absmaxes, inv_scale, found_inf,
                     state_rounding)
    check.scalars(op, device, step=step)
    check.adam_numbers(op, lr, beta1, beta2, eps, weight_decay)


@define(_OP, mutates_args=("params", "exp_avgs", "exp_avg_sqs", "model_params", "master_remainders",
                           "state_absmaxes", "step"), fake=_fake_fused_adam)
def fused_adam_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    model_params: list[Tensor],
    master_remainders: list[Tensor],
    state_absmaxes: list[Tensor],
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    state_rounding: Optional[Tensor] = None,
) -> None:
    """Adam/AdamW over whole lists: grads unscaled by ``inv_scale``, the moments read and written in
    their formats and the masters joined from and split into ``master_remainders``
    (apex_amp/optimizers/_state_operands.py), the fp16/bf16 ``model_params`` written from the
    updated fp32 params; ``step`` incremented first. Nothing changes when ``found_inf`` is non-zero."""
    _fake_fused_adam(
        params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
        lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, inv_scale, found_inf, state_rounding,
    )
    check.fused_memory(_OP, params, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}, model_params,
                       master_remainders, state_absmaxes)
    taken = step_taken(found_inf)
    if taken is False:
        return
    step_after = step + 1.0
    if params:
        grads, model_params = (shaped_like(tensors, params) for tensors in (grads, model_params))
        operands = StepOperands(params, [exp_avgs, exp_avg_sqs], master_remainders, state_absmaxes, state_rounding)
        step_size, bc2_sqrt = _adam_step_scalars(step_after, lr, beta1, beta2, bias_correction)
        hyper = tuple(f32(h) for h in (lr, beta1, beta2, eps, weight_decay)) + (adamw_mode,)
        param, exp_avg, exp_avg_sq = _adam_math(
            operands.masters, grads, *operands.states, inv_scale, step_size, bc2_sqrt, hyper
        )
        operands.write_masters(param, taken, model_params)
        operands.write_states(0, exp_avg, taken)
        operands.write_states(1, exp_avg_sq, taken)
    commit([step], [step_after], taken)


class FusedAdam(FusedOptimizer):
    """Adam and AdamW whose whole update is one fused pass over all tensors of a param group.

    apex's signature; a real ``torch.optim.Optimizer`` (``state_dict``, LR
    schedulers and hooks work as usual). Per parameter the state holds
    ``exp_avg`` and ``exp_avg_sq``; the step count is the group's,
    ``param_groups[i]["step"]``, as in apex (where schedulers read and may write
    it, and checkpoints hold it): a float32 tensor on the parameters' device,
    created by the first step and incremented by the op itself, so a skipped
    step never needs the host. ``load_state_dict`` also takes apex's checkpoints
    and ``torch.optim.Adam``'s layout (a step per parameter, moved to the group).

    Under ``amp.initialize`` the step also receives amp's arguments: the
    ``found_inf`` flag (a non-zero flag makes the step a no-op on the device),
    the ``inv_scale`` of gradients left scaled (unscaling folded into the same
    pass) and, under O2, the half model parameters of the fp32 masters, which
    supply the gradients and are rewritten in the same pass. Under
    ``torch.amp.GradScaler`` the same happens with the scaler's scale and flag
    (``scaler.step(optimizer)``; fp16 parameters need no unscaling by the scaler).

    Parameters sharded by FSDP2 (``fully_shard``: DTensors) are updated shard
    by shard: each rank's call covers its own shards, with no communication,
    and ``exp_avg``/``exp_avg_sq`` are DTensors sharded like their parameter
    (so ``torch.distributed.checkpoint`` saves and reshards them).

    Args:
        params: parameters or param groups.
        lr: learning rate.
        bias_correction: apply Adam's bias correction.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        adam_w_mode: True for decoupled weight decay (AdamW), False for L2 (Adam).
        weight_decay: weight decay factor.
        amsgrad: not supported (raises, as apex's FusedAdam).
        set_grad_none: ``zero_grad()`` sets gradients to None (else zeroes them).
        capturable: accepted for apex compatibility; the step count always lives
            on the device, which is what apex's capturable mode provides.
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

        >>> optimizer = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> loss_fn(model(x), y).backward()
        >>> optimizer.step()
        >>> optimizer.zero_grad()
    """

    STATE_KEYS = ("exp_avg", "exp_avg_sq")
    NONNEGATIVE_STATE_KEYS = frozenset({"exp_avg_sq"})
    COUNTS_STEPS = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: Union[bool, str] = False,
        state_precision: str = "fp32",
        state_block_size: int = 256,
        min_quantized_numel: int = 4096,
        state_rounding: str = "nearest",
        state_rounding_seed: Union[int, torch.Generator, None] = None,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}; it must be >= 0")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}; it must be >= 0")
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Invalid betas: {betas}; both must be in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}; it must be >= 0")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults, set_grad_none=set_grad_none, master_weights=master_weights, state_precision=state_precision,
                         state_block_size=state_block_size, min_quantized_numel=min_quantized_numel,
                         state_rounding=state_rounding, state_rounding_seed=state_rounding_seed)
        self.adam_w_mode = bool(adam_w_mode)
        self.capturable = bool(capturable)

    def _fused_step(self, group: dict[str, Any], batch: FusedBatch, amp: AmpStepArgs) -> None:
        beta1, beta2 = group["betas"]
        device = batch.device
        ops.fused_adam_(
            batch.params, batch.grads, batch.states["exp_avg"], batch.states["exp_avg_sq"], batch.step,
            lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], adamw_mode=self.adam_w_mode,
            bias_correction=group["bias_correction"], model_params=batch.model_params,
            master_remainders=batch.master_remainders, state_absmaxes=batch.state_absmaxes(),
            state_rounding=batch.state_rounding(),
            inv_scale=None if amp.inv_scale is None else amp.inv_scale.to(device),
            found_inf=None if amp.found_inf is None else amp.found_inf.to(device),
        )
