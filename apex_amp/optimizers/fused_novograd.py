"""FusedNovoGrad: apex's FusedNovoGrad, one ``fused_novograd_`` op call per param group and device.

The op is defined here, by its pure-PyTorch implementation (apex_amp/_op_registry.py); its
math is amp_math.h's ``novograd_blend`` and ``NovoGradHyper`` rule, run by
csrc/cpu/fused_novograd_cpu.cpp and csrc/cuda/fused_novograd_cuda.cu. Under FSDP2 each rank
holds shards of the gradients: the step computes their per-tensor norms itself, combines them
over the ranks (apex_amp/_dtensor.py: ``reduce_over_shards``) and hands the op the norms of the
whole gradients (its ``grad_norms``).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch
from torch import Tensor

from .. import _checks as check
from .. import ops
from .._dtensor import any_dtensor, reduce_over_shards
from .._fallback import commit, f32, shaped_like, step_taken
from .._op_registry import define
from ._state_operands import StepOperands
from .fused_optimizer import AmpStepArgs, FusedBatch, FusedOptimizer

__all__ = ["FusedNovoGrad"]

_OP = "fused_novograd_"
# A second moment below 0 means "no gradient seen yet": the first norm is taken as it is.
_UNSEEN = -1.0


def _fake_fused_novograd(params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes,
                         step, lr, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging,
                         reg_inside_moment, norm_type, inv_scale=None, found_inf=None, state_rounding=None,
                         grad_norms=None) -> None:
    device = step.device
    check.fused_step(_OP, device, params, grads, {"exp_avgs": exp_avgs}, model_params, master_remainders,
                     state_absmaxes, inv_scale, found_inf, state_rounding)
    if len(exp_avg_sqs) != len(params):
        check.fail(_OP, f"params holds {len(params)} tensors but exp_avg_sqs holds {len(exp_avg_sqs)}; "
                        "pass one one-element second moment per param")
    for i, moment in enumerate(exp_avg_sqs):
        check.scalars(_OP, device, **{f"exp_avg_sqs[{i}]": moment})
    check.scalars(_OP, device, step=step)
    check.adam_numbers(_OP, lr, beta1, beta2, eps, weight_decay,
                       norm_type=(norm_type, norm_type in (0, 2), "2 (L2) or 0 (L-infinity)"))
    if grad_norms is not None:
        check.per_tensor_values(_OP, device, "grad_norms", grad_norms, 1, len(params))


@define(_OP, mutates_args=("params", "exp_avgs", "exp_avg_sqs", "model_params", "master_remainders",
                           "state_absmaxes", "step"), fake=_fake_fused_novograd)
def fused_novograd_(
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
    bias_correction: bool,
    grad_averaging: bool,
    reg_inside_moment: bool,
    norm_type: int,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    state_rounding: Optional[Tensor] = None,
    grad_norms: Optional[Tensor] = None,
) -> None:
    """NovoGrad over whole lists: each tensor's unscaled gradient norm (L2, or L-infinity with
    ``norm_type`` 0) blended into its one-element second moment in ``exp_avg_sqs`` (negative: not
    yet seen, the norm taken as it is), then the first moments and params, the fp16/bf16
    ``model_params`` written from the updated fp32 params; ``step`` incremented first. The first
    moments are read and written in their formats and the masters joined from and split into
    ``master_remainders`` (apex_amp/optimizers/_state_operands.py). Nothing changes when
    ``found_inf`` is non-zero. ``grad_norms`` (float32, one per param, of the gradients as given,
    before ``inv_scale``), when given, are taken instead of the norms of ``grads``: under FSDP2,
    the norms of the whole gradients whose shards ``grads`` are."""
    _fake_fused_novograd(params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes,
                         step, lr, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging,
                         reg_inside_moment, norm_type, inv_scale, found_inf, state_rounding, grad_norms)
    check.fused_memory(_OP, params, {"exp_avgs": exp_avgs}, model_params, master_remainders, state_absmaxes)
    check.disjoint_within(_OP, exp_avg_sqs=exp_avg_sqs)
    taken = step_taken(found_inf)
    if taken is False:
        return
    step_after = step + 1.0
    if params:
        grads, model_params = (shaped_like(t, params) for t in (grads, model_params))
        operands = StepOperands(params, [exp_avgs], master_remainders, state_absmaxes, state_rounding)
        lr, beta1, beta2, eps, weight_decay = (f32(v) for v in (lr, beta1, beta2, eps, weight_decay))
        beta3 = f32(1.0 - beta1) if grad_averaging else 1.0
        count = step_after.reshape(()).double()
        bc1 = (1.0 - torch.pow(beta1, count)).float() if bias_correction else torch.ones((), device=step.device)
        bc2_sqrt = (1.0 - torch.pow(beta2, count)).sqrt().float() if bias_correction else torch.ones((), device=step.device)
        norms = list(grad_norms) if grad_norms is not None else grad_norms_of(grads, norm_type)
        new_params, new_avgs, new_moments = [], [], []
        for i, p in enumerate(operands.masters):
            norm = norms[i] * inv_scale.reshape(()) if inv_scale is not None else norms[i]
            previous = exp_avg_sqs[i].reshape(())
            if norm_type == 2:
                blended = torch.sqrt(beta2 * previous * previous + f32(1.0 - beta2) * norm * norm)
            else:
                blended = beta2 * previous + f32(1.0 - beta2) * norm
            moment = torch.where(previous < 0, norm, blended)
            grad = grads[i].float() if inv_scale is None else grads[i].float() * inv_scale.reshape(())
            denom = moment / bc2_sqrt + eps
            if reg_inside_moment:
                grad = grad / denom + weight_decay * p
                m = beta1 * operands.states[0][i] + beta3 * grad
                p = p - lr * (m / bc1)
            else:
                m = beta1 * operands.states[0][i] + beta3 * grad
                p = p - lr * ((m / bc1) / denom + weight_decay * p)
            new_params.append(p)
            new_avgs.append(m)
            new_moments.append(moment.reshape(1))
        commit(exp_avg_sqs, new_moments, taken)
        operands.write_states(0, new_avgs, taken)
        operands.write_masters(new_params, taken, model_params)
    commit([step], [step_after], taken)


def grad_norms_of(grads: list[Tensor], norm_type: int) -> list[Tensor]:
    """Each gradient's norm in fp32: L2 (``norm_type`` 2), or the largest |g| (0; NaN if any is), 0 when empty."""
    if norm_type == 2:
        return list(torch._foreach_norm(grads, 2, dtype=torch.float32))
    return [g.float().abs().amax() if g.numel() else g.new_zeros((), dtype=torch.float32) for g in grads]


def _whole_grad_norms(grads: list[Tensor], owners: list[Tensor], norm_type: int) -> Tensor:
    # The norms of the whole gradients from this rank's shards: squares summed, maxima maxed.
    if norm_type == 2:
        squares = ops.l2norm(grads, per_tensor=True)[1].square()
        return reduce_over_shards(squares, owners).sqrt()
    return reduce_over_shards(torch.stack(grad_norms_of(grads, norm_type)), owners, op="max")


class FusedNovoGrad(FusedOptimizer):
    """NovoGrad whose update is one fused pass over all tensors of a param group (apex's FusedNovoGrad).

    The second moment is one number per tensor: a blend of its gradient norms (L2 by default,
    L-infinity with ``norm_type=0``), kept per parameter in the state as a one-element fp32
    ``exp_avg_sq`` (apex kept a list per group; the per-parameter state survives param groups
    that change between runs); the first moment ``exp_avg`` is per element. Under
    ``amp.initialize`` and ``torch.amp.GradScaler`` the gradients (and their norms) are
    unscaled as they are read and an overflowed step is skipped on the device, norms included.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        bias_correction: apply bias correction to both moments.
        betas: coefficients of the first moment and of the norm blend.
        eps: added to the denominator.
        weight_decay: weight decay factor.
        amsgrad: not supported (raises, as apex's FusedNovoGrad).
        reg_inside_moment: add the weight decay to the normalised gradient before the first
            moment (apex's moment mode 0) instead of to the update.
        grad_averaging: scale the gradient by (1 - beta1) in the first moment.
        norm_type: 2 for the L2 norm, 0 for the L-infinity norm.
        init_zero: start the second moment at 0 instead of the first gradient norm.
        set_grad_none: ``zero_grad()`` sets gradients to None (else zeroes them).
        master_weights: keep fp32 master copies of fp16/bf16 parameters in the
            optimizer state (without amp); the half parameters are rewritten in
            the same pass. ``"remainder"``: for bf16 parameters, keep only the low
            16 bits of each fp32 master (``master_remainder``, int16): the bf16
            parameter is its high half, so the master is exact in 2 bytes instead of 4.
        state_precision: how ``exp_avg`` is stored (the per-tensor ``exp_avg_sq`` stays fp32): ``"fp32"`` (default), ``"bf16"``,
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

        >>> optimizer = FusedNovoGrad(model.parameters(), lr=1e-2, betas=(0.95, 0.98), weight_decay=1e-3)
    """

    STATE_KEYS = ("exp_avg",)
    COUNTS_STEPS = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        set_grad_none: bool = True,
        master_weights: Union[bool, str] = False,
        state_precision: str = "fp32",
        state_block_size: int = 256,
        min_quantized_numel: int = 4096,
        state_rounding: str = "nearest",
        state_rounding_seed: Union[int, torch.Generator, None] = None,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        if norm_type not in (0, 2):
            raise ValueError(f"FusedNovoGrad supports norm_type 2 (L2) and 0 (L-infinity), got {norm_type}")
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Invalid betas: {betas}; both must be in [0, 1)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging, norm_type=norm_type,
                        init_zero=init_zero)
        super().__init__(params, defaults, set_grad_none=set_grad_none, master_weights=master_weights, state_precision=state_precision,
                         state_block_size=state_block_size, min_quantized_numel=min_quantized_numel,
                         state_rounding=state_rounding, state_rounding_seed=state_rounding_seed)
        self.reg_inside_moment = bool(reg_inside_moment)

    def _new_state(self, target: Tensor, group: dict[str, Any], layout: Any) -> dict[str, Tensor]:
        state = super()._new_state(target, group, layout)
        start = 0.0 if group["init_zero"] else _UNSEEN
        state["exp_avg_sq"] = torch.full((1,), start, dtype=torch.float32, device=target.device)
        return state

    def _fused_step(self, group: dict[str, Any], batch: FusedBatch, amp: AmpStepArgs) -> None:
        device = batch.device
        beta1, beta2 = group["betas"]
        moments = [self.state[p]["exp_avg_sq"] for p in batch.owners]
        norm_type = int(group["norm_type"])
        # FSDP2's shards: the norms of the whole gradients, the same on every rank (and so the moments).
        grad_norms = _whole_grad_norms(batch.grads, batch.owners, norm_type) if any_dtensor(batch.owners) else None
        ops.fused_novograd_(
            batch.params, batch.grads, batch.states["exp_avg"], moments, batch.model_params, batch.step,
            float(group["lr"]), beta1, beta2, float(group["eps"]), float(group["weight_decay"]),
            bool(group["bias_correction"]), bool(group["grad_averaging"]), self.reg_inside_moment, norm_type,
            None if amp.inv_scale is None else amp.inv_scale.to(device),
            None if amp.found_inf is None else amp.found_inf.to(device),
            master_remainders=batch.master_remainders, state_absmaxes=batch.state_absmaxes(),
            state_rounding=batch.state_rounding(), grad_norms=grad_norms,
        )
