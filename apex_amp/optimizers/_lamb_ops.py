"""LAMB's ops: ``fused_lamb_`` and its two passes, ``fused_lamb_moments_`` and ``fused_lamb_update_``.

Each op is defined here by its pure-PyTorch implementation (apex_amp/_op_registry.py); the math
is amp_math.h's ``lamb_moments`` and ``LambHyper`` rule, run by csrc/cpu/fused_lamb_cpu.cpp and
csrc/cuda/fused_lamb_cuda.cu. LAMB needs two passes over its tensors: the trust ratio of a tensor
(||param|| / ||update direction||) is known only once the moments of all its elements are. The
first pass hands the per-tensor squared norms out; the second takes them back. ``fused_lamb_``
is both passes in one call. The passes are ops of their own for FSDP2, where a rank holds a shard
of each tensor: its squared norms are partial sums, added over the ranks between the passes
(apex_amp/_dtensor.py: ``reduce_over_shards``).

The contract between the passes is that of the kernels: the first stores fp32 and fp16/bf16
moments kept in their params' dtype (they carry their values to the second pass); moments in a
format (bf16 of an fp32 master, fp8, int8, or beside remainder masters) are not stored by it,
since their codes would lose the fp32 values: the second pass computes them again from the same
gradients and stores them. So ``fused_lamb_update_`` must follow ``fused_lamb_moments_`` on the
same lists with the same arguments, and nothing may write the moments or gradients in between.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from torch import Tensor

from .. import _checks as check
from .._fallback import commit, f32, shaped_like, step_taken
from .._op_registry import define
from ._state_operands import StepOperands

__all__ = ["fused_lamb_", "fused_lamb_moments_", "fused_lamb_update_"]

_OP, _MOMENTS_OP, _UPDATE_OP = "fused_lamb_", "fused_lamb_moments_", "fused_lamb_update_"
_MUTATED_BY_UPDATE = ("params", "exp_avgs", "exp_avg_sqs", "model_params", "master_remainders", "state_absmaxes",
                      "step")


def _check_lamb(op, params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
                grad_norm, lr, beta1, beta2, eps, weight_decay, max_grad_norm, inv_scale, found_inf,
                state_rounding=None) -> None:
    device = step.device
    check.fused_step(op, device, params, grads, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
                     model_params, master_remainders, state_absmaxes, inv_scale, found_inf, state_rounding)
    check.scalars(op, device, step=step, grad_norm=grad_norm)
    check.adam_numbers(op, lr, beta1, beta2, eps, weight_decay,
                       max_grad_norm=(max_grad_norm, max_grad_norm > 0.0, "> 0 (inf: no clipping)"))


def _check_memory(op, params, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes) -> None:
    check.fused_memory(op, params, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}, model_params,
                       master_remainders, state_absmaxes)


# ---- the math, shared by the three ops ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Lamb:
    """One LAMB step's operands in fp32 and its scalars (amp_math.h's LambHyper, prepared for the step)."""

    operands: StepOperands
    grads: list[Tensor]
    beta1: float
    beta2: float
    beta3: float
    eps: float
    weight_decay: float
    adam_w_mode: bool
    bias_correction1: Tensor
    bias_correction2: Tensor
    unscale: Tensor  # inv_scale, or 1
    clip: Tensor  # the global-norm clip: the gradients are divided by it (>= 1)

    @classmethod
    def of(cls, params, grads, exp_avgs, exp_avg_sqs, master_remainders, state_absmaxes, state_rounding, step,
           grad_norm, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, adam_w_mode,
           max_grad_norm, inv_scale) -> "_Lamb":
        operands = StepOperands(params, [exp_avgs, exp_avg_sqs], master_remainders, state_absmaxes, state_rounding)
        beta1, beta2 = f32(beta1), f32(beta2)
        count = (step + 1.0).reshape(()).double()
        ones = torch.ones((), device=step.device)
        unscale = ones if inv_scale is None else inv_scale.reshape(())
        norm = grad_norm.reshape(()) * unscale
        clip = torch.where(norm > f32(max_grad_norm), norm / f32(max_grad_norm), ones)
        return cls(operands, shaped_like(list(grads), list(params)), beta1, beta2,
                   f32(1.0 - beta1) if grad_averaging else 1.0, f32(eps), f32(weight_decay), adam_w_mode,
                   (1.0 - torch.pow(beta1, count)).float() if bias_correction else ones,
                   (1.0 - torch.pow(beta2, count)).float() if bias_correction else ones,
                   unscale, clip)

    def moments(self, i: int) -> tuple[Tensor, Tensor]:
        """Tensor i's new moments, as the second pass reads them (rounded to a legacy state's dtype)."""
        grad = self.grads[i].float() * self.unscale / self.clip
        p, states = self.operands.masters[i], self.operands.states
        if not self.adam_w_mode:
            grad = grad + self.weight_decay * p
        m = self.operands.as_stored(0, i, states[0][i] * self.beta1 + self.beta3 * grad)
        v = self.operands.as_stored(1, i, states[1][i] * self.beta2 + f32(1.0 - self.beta2) * grad * grad)
        return m, v

    def direction(self, i: int, m: Tensor, v: Tensor) -> Tensor:
        direction = (m / self.bias_correction1) / (torch.sqrt(v / self.bias_correction2) + self.eps)
        if self.adam_w_mode:
            direction = direction + self.weight_decay * self.operands.masters[i]
        return direction


def _moments_pass(lamb: _Lamb, exp_avgs, exp_avg_sqs, taken: Union[bool, Tensor]) -> Tensor:
    # The moments kept in their params' dtype are stored; the squared norms of each master and direction.
    squares = []
    for i, p in enumerate(lamb.operands.masters):
        m, v = lamb.moments(i)
        for k, (state, value) in enumerate(((exp_avgs, m), (exp_avg_sqs, v))):
            if lamb.operands.keeps_legacy_state(k, i):
                commit([lamb.operands.stored[k][i]], [value], taken)
        squares.append(torch.stack([torch.linalg.vector_norm(p), torch.linalg.vector_norm(lamb.direction(i, m, v))])
                       .square())
    return torch.stack(squares, dim=1)


def _update_pass(lamb: _Lamb, norm_squares: Tensor, model_params, lr: float, use_nvlamb: bool,
                 taken: Union[bool, Tensor]) -> None:
    # The moments a first pass stored are read back; the others are computed again, then stored.
    operands = lamb.operands
    lr = f32(lr)
    use_ratio = use_nvlamb or lamb.weight_decay != 0.0
    new_params, new_avgs, new_sqs = [], [], []
    for i, p in enumerate(operands.masters):
        recomputed = lamb.moments(i)
        m, v = (operands.states[k][i] if operands.keeps_legacy_state(k, i) else recomputed[k] for k in (0, 1))
        direction = lamb.direction(i, m, v)
        param_norm, direction_norm = norm_squares[0, i].sqrt(), norm_squares[1, i].sqrt()
        ratio = torch.where((param_norm != 0) & (direction_norm != 0) & use_ratio,
                            lr * (param_norm / direction_norm), torch.full_like(param_norm, lr))
        new_params.append(p - ratio * direction)
        new_avgs.append(m)
        new_sqs.append(v)
    operands.write_states(0, new_avgs, taken)
    operands.write_states(1, new_sqs, taken)
    operands.write_masters(new_params, taken, shaped_like(list(model_params), operands.params))


# ---- fused_lamb_: both passes ------------------------------------------------------------------
def _fake_fused_lamb(params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
                     grad_norm, lr, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, adam_w_mode,
                     max_grad_norm, use_nvlamb, inv_scale=None, found_inf=None, state_rounding=None) -> None:
    _check_lamb(_OP, params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
                grad_norm, lr, beta1, beta2, eps, weight_decay, max_grad_norm, inv_scale, found_inf, state_rounding)


@define(_OP, mutates_args=_MUTATED_BY_UPDATE, fake=_fake_fused_lamb)
def fused_lamb_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    model_params: list[Tensor],
    master_remainders: list[Tensor],
    state_absmaxes: list[Tensor],
    step: Tensor,
    grad_norm: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    grad_averaging: bool,
    adam_w_mode: bool,
    max_grad_norm: float,
    use_nvlamb: bool,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    state_rounding: Optional[Tensor] = None,
) -> None:
    """LAMB over whole lists: gradients unscaled by ``inv_scale`` and divided by the global-norm clip
    (``grad_norm``, the norm of the gradients as given, times ``inv_scale``, over ``max_grad_norm``
    when above it), Adam's moments, the update direction (plus decoupled decay in ``adam_w_mode``,
    L2 decay into the gradient otherwise), applied with lr times each tensor's trust ratio
    ||param|| / ||direction|| (when decay is on or ``use_nvlamb``); ``step`` incremented first, the
    fp16/bf16 ``model_params`` written from the updated fp32 params. The moments are read and written
    in their formats and the masters joined from and split into ``master_remainders``
    (apex_amp/optimizers/_state_operands.py). Nothing changes when ``found_inf`` is non-zero.
    The same as ``fused_lamb_moments_`` then ``fused_lamb_update_`` with the squared norms it returned."""
    _fake_fused_lamb(params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
                     grad_norm, lr, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, adam_w_mode,
                     max_grad_norm, use_nvlamb, inv_scale, found_inf, state_rounding)
    _check_memory(_OP, params, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes)
    taken = step_taken(found_inf)
    if taken is False:
        return
    if params:
        lamb = _Lamb.of(params, grads, exp_avgs, exp_avg_sqs, master_remainders, state_absmaxes, state_rounding,
                        step, grad_norm, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging,
                        adam_w_mode, max_grad_norm, inv_scale)
        norm_squares = _moments_pass(lamb, exp_avgs, exp_avg_sqs, taken)
        # The update pass reads the stored moments: its operands are read after the first pass.
        lamb = dataclasses.replace(lamb, operands=StepOperands(params, [exp_avgs, exp_avg_sqs], master_remainders,
                                                               state_absmaxes, state_rounding))
        _update_pass(lamb, norm_squares, model_params, lr, use_nvlamb, taken)
    commit([step], [step + 1.0], taken)


# ---- fused_lamb_moments_: the first pass -------------------------------------------------------
def _fake_lamb_moments(params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
                       grad_norm, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, adam_w_mode,
                       max_grad_norm, inv_scale=None, found_inf=None) -> Tensor:
    _check_lamb(_MOMENTS_OP, params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes,
                step, grad_norm, 0.0, beta1, beta2, eps, weight_decay, max_grad_norm, inv_scale, found_inf)
    return torch.empty((2, len(params)), dtype=torch.float32, device=step.device)


@define(_MOMENTS_OP, mutates_args=("exp_avgs", "exp_avg_sqs"), fake=_fake_lamb_moments)
def fused_lamb_moments_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    model_params: list[Tensor],
    master_remainders: list[Tensor],
    state_absmaxes: list[Tensor],
    step: Tensor,
    grad_norm: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    grad_averaging: bool,
    adam_w_mode: bool,
    max_grad_norm: float,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
) -> Tensor:
    """LAMB's first pass (``fused_lamb_``'s arguments, less those of the update): the moments of step
    ``step + 1`` (``step`` is not changed), stored where they are kept in their params' dtype (the
    module docstring); returns a float32 (2, len(params)) tensor: the squared L2 norms of each fp32
    master (row 0) and of its update direction (row 1), of these tensors as given (under FSDP2:
    this rank's shards). All zeros, with nothing written, when ``found_inf`` is non-zero."""
    squares = _fake_lamb_moments(params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders,
                                 state_absmaxes, step, grad_norm, beta1, beta2, eps, weight_decay, bias_correction,
                                 grad_averaging, adam_w_mode, max_grad_norm, inv_scale, found_inf)
    _check_memory(_MOMENTS_OP, params, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes)
    taken = step_taken(found_inf)
    if taken is False or not params:
        return squares.zero_()
    lamb = _Lamb.of(params, grads, exp_avgs, exp_avg_sqs, master_remainders, state_absmaxes, None, step, grad_norm,
                    beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, adam_w_mode, max_grad_norm,
                    inv_scale)
    computed = _moments_pass(lamb, exp_avgs, exp_avg_sqs, taken)
    return computed if taken is True else torch.where(taken, computed, torch.zeros_like(computed))


# ---- fused_lamb_update_: the second pass -------------------------------------------------------
def _fake_lamb_update(params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
                      grad_norm, norm_squares, lr, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging,
                      adam_w_mode, max_grad_norm, use_nvlamb, inv_scale=None, found_inf=None,
                      state_rounding=None) -> None:
    _check_lamb(_UPDATE_OP, params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes,
                step, grad_norm, lr, beta1, beta2, eps, weight_decay, max_grad_norm, inv_scale, found_inf,
                state_rounding)
    check.per_tensor_values(_UPDATE_OP, step.device, "norm_squares", norm_squares, 2, len(params))


@define(_UPDATE_OP, mutates_args=_MUTATED_BY_UPDATE, fake=_fake_lamb_update)
def fused_lamb_update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    model_params: list[Tensor],
    master_remainders: list[Tensor],
    state_absmaxes: list[Tensor],
    step: Tensor,
    grad_norm: Tensor,
    norm_squares: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    grad_averaging: bool,
    adam_w_mode: bool,
    max_grad_norm: float,
    use_nvlamb: bool,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    state_rounding: Optional[Tensor] = None,
) -> None:
    """LAMB's second pass, after ``fused_lamb_moments_`` on the same lists with the same arguments: the
    update with lr times each tensor's trust ratio from ``norm_squares`` (the first pass's squared
    norms, rows: masters, directions; under FSDP2 summed over the ranks first), the moments in a
    format stored, the fp16/bf16 ``model_params`` written, ``step`` incremented. Nothing changes
    when ``found_inf`` is non-zero."""
    _fake_lamb_update(params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
                      grad_norm, norm_squares, lr, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging,
                      adam_w_mode, max_grad_norm, use_nvlamb, inv_scale, found_inf, state_rounding)
    _check_memory(_UPDATE_OP, params, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes)
    taken = step_taken(found_inf)
    if taken is False:
        return
    if params:
        lamb = _Lamb.of(params, grads, exp_avgs, exp_avg_sqs, master_remainders, state_absmaxes, state_rounding,
                        step, grad_norm, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging,
                        adam_w_mode, max_grad_norm, inv_scale)
        _update_pass(lamb, norm_squares, model_params, lr, use_nvlamb, taken)
    commit([step], [step + 1.0], taken)
