"""amp_C's two-stage LAMB kernels (``multi_tensor_lamb_stage1_cuda`` / ``_stage2_cuda``), in plain PyTorch.

apex kept them for code that runs LAMB in two calls with its own norms in between, as
NVIDIA's DeepLearningExamples BERT ``BertLAMB`` does (it binds both names when its module is
imported): stage 1 turns the gradients into Adam's update plus decoupled decay, the caller takes
per-tensor norms of the params and of the update (``amp_C.multi_tensor_l2norm``), stage 2 applies
the update with each tensor's trust ratio. apex_amp has no op of its own for them (its
``fused_lamb_`` does both stages in one pass): they are written here with torch's own operators,
on the tensors' device, one tensor at a time, and never read a value back to the host.

As in apex, neither stage reads or sets the noop flag (apex left the check out on purpose, so
that infs and NaNs propagate into the update). Differences: the math is in fp32 and rounded once,
on write (apex's stage 1 rounded each intermediate to the state's dtype for fp16 states; DLE's
states are fp32); bf16 tensors are taken too (apex: fp32 and fp16).
"""

from __future__ import annotations

from numbers import Real
from typing import Optional, Union

import torch
from torch import Tensor

from ._apex_amp_adapter import check_optimizer_dtypes, noop_flag_of, unpack

__all__ = ["multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda"]

_REPLACEMENT = "apex_amp.optimizers.FusedLAMB (or amp_C.multi_tensor_lamb, both stages in one call)"


def _per_tensor(name: str, argument: str, values: Tensor, count: int, device: torch.device) -> list[Tensor]:
    # apex's kernels read entry i of a float32 device array for tensor i.
    if (not isinstance(values, Tensor) or values.dtype != torch.float32 or values.device != device
            or values.numel() < count):
        got = (f"{values.numel()} element(s) of {values.dtype} on {values.device}" if isinstance(values, Tensor)
               else type(values).__name__)
        raise TypeError(f"amp_C.{name}: {argument} must be a torch.float32 tensor on {device} with one entry per "
                        f"tensor ({count}), e.g. torch.tensor(decays, device=...) or multi_tensor_l2norm's second "
                        f"result with per_tensor=True; got {got}")
    return list(values.reshape(-1)[:count].unbind())


def _number_on(name: str, argument: str, value: Union[float, Tensor], device: torch.device) -> Tensor:
    # apex took the global norm as a number before 2020 and as a one-element float32 tensor since.
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"amp_C.{name}: {argument} must hold one number, got {value.numel()} elements")
        return value.reshape(()).to(device=device, dtype=torch.float32)
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"amp_C.{name}: {argument} must be a number or a one-element tensor, got "
                        f"{type(value).__name__}")
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def multi_tensor_lamb_stage1_cuda(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]],
                                  per_tensor_decay: Tensor, step: int, beta1: float, beta2: float, epsilon: float,
                                  global_grad_norm: Union[float, Tensor], max_global_grad_norm: float) -> None:
    """apex's ``amp_C.multi_tensor_lamb_stage1_cuda``: Adam's update with decoupled decay, written to ``update``.

    With ``clip = global_grad_norm / max_global_grad_norm`` when the norm exceeds the maximum
    (else 1) and the bias corrections of step ``step + 1`` (apex's kernel adds the one)::

        g = grad / clip
        exp_avg = beta1 * exp_avg + (1 - beta1) * g
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
        update = (exp_avg / bc1) / (sqrt(exp_avg_sq / bc2) + epsilon) + decay[i] * param

    ``exp_avg`` and ``exp_avg_sq`` are updated in place; params and gradients are not changed
    (``update`` may share memory with either). The clip is chosen on the device. The noop flag
    is neither read nor set.

    Example::

        >>> norm = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)[0]
        >>> multi_tensor_applier(amp_C.multi_tensor_lamb_stage1_cuda, overflow_buf,
        ...                      [grads, params, exp_avgs, exp_avg_sqs, updates], decays, step,
        ...                      0.9, 0.999, 1e-6, norm, 1.0)

    Args:
        chunk_size: the applier's chunk size (checked; not used).
        noop_flag: one-element int32 flag on the tensors' device (checked; not used, as in apex).
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs, updates]``.
        per_tensor_decay: float32 tensor on the device, one weight decay per tensor.
        step: the number of steps taken before this one (the corrections use ``step + 1``).
        beta1: first-moment decay.
        beta2: second-moment decay.
        epsilon: added to the denominator.
        global_grad_norm: the norm of all gradients (a one-element tensor, or a number as
            apex took it before 2020).
        max_global_grad_norm: the clipping threshold.
    """
    name = "multi_tensor_lamb_stage1_cuda"
    lists, device = unpack(name, chunk_size, tensor_lists, (5,))
    check_optimizer_dtypes(name, lists, _REPLACEMENT)
    noop_flag_of(name, noop_flag, device)
    grads, params, exp_avgs, exp_avg_sqs, updates = lists
    decays = _per_tensor(name, "per_tensor_decay", per_tensor_decay, len(params), device)
    norm = _number_on(name, "global_grad_norm", global_grad_norm, device)
    maximum = float(max_global_grad_norm)
    clip = torch.where(norm > maximum, norm / maximum, torch.ones((), device=device))
    next_step = float(int(step) + 1)
    correction1 = 1.0 - float(beta1) ** next_step
    correction2 = 1.0 - float(beta2) ** next_step
    for grad, param, exp_avg, exp_avg_sq, update, decay in zip(grads, params, exp_avgs, exp_avg_sqs, updates, decays):
        scaled = grad.float() / clip
        new_exp_avg = exp_avg.float() * beta1 + (1.0 - beta1) * scaled
        new_exp_avg_sq = exp_avg_sq.float() * beta2 + (1.0 - beta2) * scaled * scaled
        denominator = torch.sqrt(new_exp_avg_sq / correction2) + epsilon
        new_update = (new_exp_avg / correction1) / denominator + decay * param.float()
        # Written last: `update` may be the gradient or the param itself (DLE uses fp16 params as scratch).
        update.copy_(new_update)
        exp_avg.copy_(new_exp_avg)
        exp_avg_sq.copy_(new_exp_avg_sq)


def multi_tensor_lamb_stage2_cuda(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]],
                                  per_tensor_param_norm: Tensor, per_tensor_update_norm: Tensor, lr: float,
                                  weight_decay: Optional[float] = None, use_nvlamb: Optional[bool] = None) -> None:
    """apex's ``amp_C.multi_tensor_lamb_stage2_cuda``: ``param -= ratio * update``, with LAMB's trust ratio.

    ``ratio`` is ``lr * param_norm[i] / update_norm[i]`` (``lr`` when either norm is zero) for
    tensors that take the trust ratio: all of them with ``use_nvlamb``, else only when
    ``weight_decay`` is non-zero; otherwise ``lr``. Called without ``weight_decay``, as apex's
    kernel was before April 2020 (DeepLearningExamples BERT's ``BertLAMB`` calls it so), every
    tensor takes the trust ratio, as it did then. The update is rounded to the param's dtype
    before use, as in apex. The noop flag is neither read nor set.

    Example::

        >>> multi_tensor_applier(amp_C.multi_tensor_lamb_stage2_cuda, overflow_buf, [params, updates],
        ...                      param_norms, update_norms, lr, weight_decay, False)

    Args:
        chunk_size: the applier's chunk size (checked; not used).
        noop_flag: one-element int32 flag on the tensors' device (checked; not used, as in apex).
        tensor_lists: ``[params, updates]``.
        per_tensor_param_norm: float32 tensor on the device, ``||param||`` per tensor.
        per_tensor_update_norm: float32 tensor on the device, ``||update||`` per tensor.
        lr: learning rate.
        weight_decay: the decay the update was made with (None: the pre-2020 kernel).
        use_nvlamb: take the trust ratio whatever the decay.
    """
    name = "multi_tensor_lamb_stage2_cuda"
    (params, updates), device = unpack(name, chunk_size, tensor_lists, (2,))
    check_optimizer_dtypes(name, [params, updates], _REPLACEMENT)
    noop_flag_of(name, noop_flag, device)
    lr = float(lr)
    trust = weight_decay is None or bool(use_nvlamb) or float(weight_decay) != 0.0
    if trust:
        param_norms = _per_tensor(name, "per_tensor_param_norm", per_tensor_param_norm, len(params), device)
        update_norms = _per_tensor(name, "per_tensor_update_norm", per_tensor_update_norm, len(params), device)
    for index, (param, update) in enumerate(zip(params, updates)):
        ratio: Union[float, Tensor] = lr
        if trust:
            param_norm, update_norm = param_norms[index], update_norms[index]
            ratio = torch.where((param_norm != 0) & (update_norm != 0), lr * (param_norm / update_norm),
                                torch.full((), lr, device=device))
        param.copy_(param.float() - ratio * update.to(param.dtype).float())
