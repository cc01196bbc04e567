"""What NVIDIA apex's amp_C kernels compute, in plain PyTorch: the references of the compat amp_C.

Written from apex's CUDA sources (csrc/multi_tensor_*.cu at e13873de), element by element in
fp32 as the kernels do it, one tensor at a time, with the stored dtype's rounding on write.
Each function returns new tensors (and the flag apex's kernel would have raised) instead of
writing in place, so a check can run the compat kernel on copies and compare.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def nonfinite(tensors: list[Tensor]) -> bool:
    return any(not torch.isfinite(t.float()).all() for t in tensors)


def scale(src: list[Tensor], dst_dtypes: list[torch.dtype], factor: float) -> tuple[list[Tensor], bool]:
    """multi_tensor_scale: out = in * scale; flag on a non-finite *input* only."""
    return [(s.float() * factor).to(d) for s, d in zip(src, dst_dtypes)], nonfinite(src)


def axpby(x: list[Tensor], y: list[Tensor], out_dtypes: list[torch.dtype], a: float, b: float,
          arg_to_check: int) -> tuple[list[Tensor], bool]:
    out = [(a * xi.float() + b * yi.float()).to(d) for xi, yi, d in zip(x, y, out_dtypes)]
    checked = {-1: x + y, 0: x, 1: y}.get(arg_to_check, [])
    return out, nonfinite(checked)


def l2norm(tensors: list[Tensor], per_tensor: bool, factor: float = 1.0) -> tuple[Tensor, Tensor, bool]:
    """(total of shape [1], per-tensor norms of shape [n] or [0], flag): norms of tensors * factor."""
    squares = torch.stack([(t.double() * factor).pow(2).sum() for t in tensors])
    total = squares.sum().sqrt().float().reshape(1)
    norms = squares.sqrt().float() if per_tensor else torch.empty(0)
    return total, norms, not bool(torch.isfinite(total).all())


def sgd(grad: Tensor, weight: Tensor, mom: Tensor, *, wd: float, momentum: float, dampening: float, lr: float,
        nesterov: bool, first_run: bool, wd_after_momentum: bool, scale: float) -> tuple[Tensor, Tensor]:
    """SGDFunctor: returns (weight, momentum) in their stored dtypes."""
    g, w, m = grad.float() * scale, weight.float(), mom.float()
    if wd != 0 and not wd_after_momentum:
        g = g + wd * w
    if momentum != 0:
        m = g if first_run else m * momentum + (1 - dampening) * g
        g = g + momentum * m if nesterov else m
    if wd != 0 and wd_after_momentum:
        g = g + wd * w
    w = w + (-lr * g)
    return w.to(weight.dtype), (m if momentum != 0 else mom.float()).to(mom.dtype)


def _corrections(beta1: float, beta2: float, step: int, bias_correction: bool) -> tuple[float, float]:
    if not bias_correction:
        return 1.0, 1.0
    return 1 - beta1 ** step, 1 - beta2 ** step


def adam(grad: Tensor, param: Tensor, m: Tensor, v: Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
         step: int, mode: int, bias_correction: bool, decay: float, inv_scale: float = 1.0):
    """AdamFunctor (and the capturable ones with inv_scale): returns (param, m, v) as fp32."""
    bc1, bc2 = _corrections(beta1, beta2, step, bias_correction)
    g, p, m, v = grad.float() * inv_scale, param.float(), m.float(), v.float()
    if mode == 0:
        g = g + decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    update = (m / bc1) / (torch.sqrt(v / bc2) + eps)
    if mode != 0:
        update = update + decay * p
    return p - lr * update, m, v


def adagrad(grad: Tensor, param: Tensor, h: Tensor, *, lr: float, eps: float, mode: int, decay: float):
    g, p, h = grad.float(), param.float(), h.float()
    if mode == 0:
        g = g + decay * p
        h = h + g * g
        p = p - lr * (g / (torch.sqrt(h) + eps))
    else:
        h = h + g * g
        p = p - lr * (g / (torch.sqrt(h) + eps) + decay * p)
    return p, h


def novograd(grads: list[Tensor], params: list[Tensor], ms: list[Tensor], grad_norms: Tensor, *, lr: float,
             beta1: float, beta2: float, eps: float, step: int, bias_correction: bool, decay: float,
             grad_averaging: bool, mode: int, norm_type: int):
    """multi_tensor_novograd: returns (params, ms, grad_norms) as fp32."""
    bc1, bc2 = _corrections(beta1, beta2, step, bias_correction)
    bc2 = math.sqrt(bc2)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    new_norms, new_params, new_ms = [], [], []
    for g, p, m, old in zip(grads, params, ms, grad_norms.tolist()):
        g, p, m = g.float(), p.float(), m.float()
        if norm_type == 0:
            n = g.abs().max()
            blended = beta2 * old + (1 - beta2) * n
        else:
            n = g.pow(2).sum().sqrt()
            blended = torch.sqrt(beta2 * old * old + (1 - beta2) * n * n)
        denom = blended / bc2 + eps
        if mode == 0:
            g = g / denom + decay * p
            m = beta1 * m + beta3 * g
            p = p - lr * (m / bc1)
        else:
            m = beta1 * m + beta3 * g
            p = p - lr * ((m / bc1) / denom + decay * p)
        new_norms.append(blended)
        new_params.append(p)
        new_ms.append(m)
    return new_params, new_ms, torch.stack(new_norms).float()


def lamb(grads: list[Tensor], params: list[Tensor], ms: list[Tensor], vs: list[Tensor], *, lr: float, beta1: float,
         beta2: float, eps: float, step: int, bias_correction: bool, decay: float, grad_averaging: bool, mode: int,
         grad_norm: float, max_grad_norm: float, use_nvlamb: bool, inv_scale: float = 1.0):
    """multi_tensor_lamb (stage 1, the norms, stage 2) and lamb_mp (inv_scale): returns (params, ms, vs) as fp32."""
    bc1, bc2 = _corrections(beta1, beta2, step, bias_correction)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    clip = grad_norm / max_grad_norm if grad_norm > max_grad_norm else 1.0
    new_params, new_ms, new_vs = [], [], []
    for g, p, m, v in zip(grads, params, ms, vs):
        p32 = p.float()
        sg = g.float() * inv_scale / clip
        if mode == 0:
            sg = sg + decay * p32
        m = m.float() * beta1 + beta3 * sg
        v = v.float() * beta2 + (1 - beta2) * sg * sg
        update = (m / bc1) / (torch.sqrt(v / bc2) + eps)
        if mode != 0:
            update = update + decay * p32
        ratio = lr
        p_norm, u_norm = float(p32.norm()), float(update.norm())
        if (use_nvlamb or decay != 0) and p_norm != 0 and u_norm != 0:
            ratio = lr * (p_norm / u_norm)
        new_params.append(p32 - ratio * update)
        new_ms.append(m)
        new_vs.append(v)
    return new_params, new_ms, new_vs


def lamb_stage1(grad: Tensor, param: Tensor, m: Tensor, v: Tensor, *, decay: float, step: int, beta1: float,
                beta2: float, eps: float, grad_norm: float, max_grad_norm: float) -> tuple[Tensor, Tensor, Tensor]:
    """LAMBStage1Functor for one tensor: returns (update, m, v) in fp32; the corrections use step + 1."""
    clip = grad_norm / max_grad_norm if grad_norm > max_grad_norm else 1.0
    bc1, bc2 = 1 - beta1 ** (step + 1), 1 - beta2 ** (step + 1)
    g = grad.double() / clip
    m = m.double() * beta1 + (1 - beta1) * g
    v = v.double() * beta2 + (1 - beta2) * g * g
    update = (m / bc1) / (torch.sqrt(v / bc2) + eps) + decay * param.double()
    return update.float(), m.float(), v.float()


def lamb_stage2(param: Tensor, update: Tensor, *, param_norm: float, update_norm: float, lr: float,
                trust: bool) -> Tensor:
    """LAMBStage2Functor for one tensor: param - ratio * update (the update in the param's dtype first), fp32."""
    ratio = lr * (param_norm / update_norm) if trust and param_norm != 0 and update_norm != 0 else lr
    return (param.double() - ratio * update.to(param.dtype).double()).float()


def update_scale_hysteresis(scale: float, growth: int, hysteresis_left: int, found_inf: float, *,
                            growth_factor: float, backoff_factor: float, growth_interval: int,
                            hysteresis: int) -> tuple[float, int, int]:
    """update_scale_hysteresis_cuda_kernel on host numbers: (scale, growth tracker, hysteresis tracker).

    apex compiles it with --use_fast_math: a subnormal fp32 result is flushed to zero."""
    if found_inf > 0:
        hysteresis_left -= 1
        if hysteresis_left > 0:
            return scale, 0, hysteresis_left
    if found_inf:
        scale = float(torch.tensor(scale * backoff_factor, dtype=torch.float32))
        scale = 0.0 if abs(scale) < torch.finfo(torch.float32).tiny else scale
        growth = 0
    else:
        successful = growth + 1
        if successful == growth_interval:
            grown = float(torch.tensor(scale * growth_factor, dtype=torch.float32))
            if math.isfinite(grown):
                scale = grown
            growth = 0
        else:
            growth = successful
    if found_inf <= 0:
        hysteresis_left = hysteresis
    return scale, growth, hysteresis_left
