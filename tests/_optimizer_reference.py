"""Plain-PyTorch references of apex's fused optimizers, written from apex's kernels (commit e13873de).

Each function updates one optimizer's tensors in float64, one tensor at a time, following
apex's csrc/multi_tensor_{sgd_kernel,adagrad,novograd,lamb}.cu and apex/optimizers/*.py
(not apex_amp's code), so the tests compare the kernels with what apex computed. Gradients are
given unscaled.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor


def f64(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [t.detach().double().clone() for t in tensors]


def sgd(params, grads, buffers, *, lr, momentum, dampening, weight_decay, nesterov, first_run, wd_after_momentum):
    """apex's SGDFunctor: weight decay before (or after) the momentum; the first run copies the gradient."""
    for i, (p, g) in enumerate(zip(params, grads)):
        g = g.double().clone()
        if weight_decay != 0 and not wd_after_momentum:
            g = g + weight_decay * p
        if momentum != 0:
            buffers[i] = g.clone() if first_run else buffers[i] * momentum + (1 - dampening) * g
            g = g + momentum * buffers[i] if nesterov else buffers[i]
        if weight_decay != 0 and wd_after_momentum:
            g = g + weight_decay * p
        params[i] = p - lr * g


def adagrad(params, grads, sums, *, lr, eps, weight_decay, adagrad_w_mode):
    """apex's AdagradFunctor (L2 mode: decay into the gradient; w mode: decay added to the update)."""
    for i, (p, g) in enumerate(zip(params, grads)):
        g = g.double()
        if not adagrad_w_mode:
            g = g + weight_decay * p
        sums[i] = sums[i] + g * g
        update = g / (sums[i].sqrt() + eps)
        if adagrad_w_mode:
            update = update + weight_decay * p
        params[i] = p - lr * update


def novograd(params, grads, exp_avgs, moments: list[Optional[float]], step, *, lr, beta1, beta2, eps,
             weight_decay, bias_correction, grad_averaging, reg_inside_moment, norm_type):
    """apex's FusedNovoGrad: per-tensor norm blended (first step: the norm itself), then NovoGradFunctor."""
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = math.sqrt(1 - beta2**step) if bias_correction else 1.0
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for i, (p, g) in enumerate(zip(params, grads)):
        g = g.double()
        norm = float(g.norm(2)) if norm_type == 2 else float(g.abs().max()) if g.numel() else 0.0
        previous = moments[i]
        if previous is None:
            moments[i] = norm
        elif norm_type == 2:
            moments[i] = math.sqrt(beta2 * previous * previous + (1 - beta2) * norm * norm)
        else:
            moments[i] = beta2 * previous + (1 - beta2) * norm
        denom = moments[i] / bc2 + eps
        if reg_inside_moment:
            g = g / denom + weight_decay * p
            exp_avgs[i] = beta1 * exp_avgs[i] + beta3 * g
            params[i] = p - lr * (exp_avgs[i] / bc1)
        else:
            exp_avgs[i] = beta1 * exp_avgs[i] + beta3 * g
            params[i] = p - lr * ((exp_avgs[i] / bc1) / denom + weight_decay * p)


def lamb(params, grads, exp_avgs, exp_avg_sqs, step, *, lr, beta1, beta2, eps, weight_decay, bias_correction,
         grad_averaging, adam_w_mode, max_grad_norm, use_nvlamb, global_grad_norm=None, state_dtype=None):
    """apex's FusedLAMB: the global-norm clip, LAMBStage1Functor (update), LAMBStage2Functor (trust ratio).

    state_dtype: the moments are stored in it and the update taken from the stored moments (apex_amp's
    documented difference for fp16/bf16 state; apex took the current step's unrounded moments).
    """
    if global_grad_norm is None:
        global_grad_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    clip = global_grad_norm / max_grad_norm if global_grad_norm > max_grad_norm else 1.0
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for i, (p, g) in enumerate(zip(params, grads)):
        g = g.double() / clip
        if not adam_w_mode:
            g = g + weight_decay * p
        exp_avgs[i] = exp_avgs[i] * beta1 + beta3 * g
        exp_avg_sqs[i] = exp_avg_sqs[i] * beta2 + (1 - beta2) * g * g
        if state_dtype is not None:
            exp_avgs[i] = exp_avgs[i].to(state_dtype).double()
            exp_avg_sqs[i] = exp_avg_sqs[i].to(state_dtype).double()
        update = (exp_avgs[i] / bc1) / ((exp_avg_sqs[i] / bc2).sqrt() + eps)
        if adam_w_mode:
            update = update + weight_decay * p
        param_norm, update_norm = float(p.norm()), float(update.norm())
        ratio = lr
        if (use_nvlamb or weight_decay != 0) and param_norm != 0 and update_norm != 0:
            ratio = lr * param_norm / update_norm
        params[i] = p - ratio * update
