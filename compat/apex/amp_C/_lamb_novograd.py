"""amp_C's LAMB and NovoGrad kernels, on apex_amp's fused optimizer ops.

apex's LAMB kernels computed per-tensor norms of the params and of the update with the noop
flag, which those norms set when they met an inf or NaN; apex_amp's ``fused_lamb_`` keeps its
norms to itself, so the flag is set here from the updated params, which are inf or NaN exactly
where a param or its update was. apex's LAMB also left the update in the gradient tensors (as
scratch); apex_amp's op leaves the gradients unchanged.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from apex_amp import ops

from ._apex_amp_adapter import (check_optimizer_dtypes, device_scalar, host_number, noop_flag_of, raise_flag,
                                skip_flag, step_before, unpack)

__all__ = ["multi_tensor_lamb", "multi_tensor_lamb_mp", "multi_tensor_novograd"]


def _one_number(name: str, argument: str, value: Tensor, device: torch.device) -> Tensor:
    if not isinstance(value, Tensor) or value.numel() != 1 or value.dtype != torch.float32 or value.device != device:
        raise TypeError(f"amp_C.{name}: {argument} must be a one-element torch.float32 tensor on {device} (apex's "
                        f"kernel reads it there), e.g. multi_tensor_l2norm's first result")
    return value.reshape(1)


def _flag_nonfinite(flag: Tensor, params: list[Tensor], device: torch.device) -> None:
    found = torch.zeros(1, device=device)
    ops.check_finite(params, found)
    raise_flag(flag, found)


def multi_tensor_lamb(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], lr: float, beta1: float,
                      beta2: float, epsilon: float, step: int, bias_correction: int, weight_decay: float,
                      grad_averaging: int, mode: int, global_grad_norm: Tensor, max_grad_norm: float,
                      use_nvlamb: Optional[bool] = None) -> None:
    """apex's ``amp_C.multi_tensor_lamb``: one LAMB step (``mode`` 0: L2 decay, 1: decoupled decay).

    The gradients are divided by ``global_grad_norm / max_grad_norm`` when the norm exceeds
    ``max_grad_norm``; each tensor's update is scaled by its trust ratio ||param|| / ||update||
    (when ``weight_decay`` is non-zero or ``use_nvlamb``). The step is taken whatever the noop
    flag, which is set when a param or its update is inf or NaN, as in apex. Unlike apex, the
    gradients are left as they were.

    Example::

        >>> norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)
        >>> multi_tensor_applier(amp_C.multi_tensor_lamb, overflow_buf, [grads, params, exp_avgs, exp_avg_sqs],
        ...                      1e-3, 0.9, 0.999, 1e-6, step, 1, 0.01, 1, 1, norm, 1.0, False)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device.
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs]``.
        lr: learning rate.
        beta1: first-moment decay.
        beta2: second-moment decay.
        epsilon: added to the denominator.
        step: the step count, this step included.
        bias_correction: 1 to apply Adam's bias correction.
        weight_decay: weight decay factor.
        grad_averaging: 1 to scale the gradient by (1 - beta1) in the first moment.
        mode: 0 adds the weight decay to the gradient, 1 to the update (adam_w_mode).
        global_grad_norm: one-element float32 norm of all gradients (on the device).
        max_grad_norm: the clipping threshold (> 0).
        use_nvlamb: apply the trust ratio also without weight decay.
    """
    name = "multi_tensor_lamb"
    lists, device = unpack(name, chunk_size, tensor_lists, (4,))
    check_optimizer_dtypes(name, lists, "apex_amp.optimizers.FusedLAMB on fp32 master weights")
    grads, params, exp_avgs, exp_avg_sqs = lists
    flag = noop_flag_of(name, noop_flag, device)
    ops.fused_lamb_(params, grads, exp_avgs, exp_avg_sqs, [], step_before(step, device),
                    _one_number(name, "global_grad_norm", global_grad_norm, device), float(lr), float(beta1),
                    float(beta2), float(epsilon), float(weight_decay), int(bias_correction) == 1,
                    int(grad_averaging) == 1, int(mode) != 0, float(max_grad_norm), bool(use_nvlamb), None, None)
    _flag_nonfinite(flag, params, device)


def multi_tensor_lamb_mp(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], lr: Tensor,
                         beta1: float, beta2: float, epsilon: float, step: Tensor, bias_correction: int,
                         weight_decay: float, grad_averaging: int, mode: int, global_grad_norm: Tensor,
                         max_grad_norm: Union[float, Tensor], use_nvlamb: Optional[bool], found_inf: Tensor,
                         inv_scale: Tensor) -> None:
    """apex's ``amp_C.multi_tensor_lamb_mp``: :func:`multi_tensor_lamb` with device arguments and fp32 masters.

    With five lists the second holds fp32 master weights (and the moments are fp32) and the fifth
    the reduced-precision model weights, rewritten in the same pass. The gradients are multiplied
    by ``inv_scale`` as they are read; the clip compares ``global_grad_norm`` with
    ``max_grad_norm`` as given (apex's FusedMixedPrecisionLamb scales both by the loss scale),
    on the device. Nothing changes while ``noop_flag`` is set; ``found_inf`` is accepted and
    unused, as in apex's kernel.

    .. note:: apex_amp's op takes the learning rate as a number: a CUDA ``lr`` tensor is read
       once per call (a host sync apex did not have), and a call inside CUDA graph capture raises.

    Example::

        >>> multi_tensor_applier(amp_C.multi_tensor_lamb_mp, overflow_buf,
        ...                      [grads, masters, exp_avgs, exp_avg_sqs, params], lr, 0.9, 0.999, 1e-6, step,
        ...                      1, 0.01, 1, 1, grad_norm, max_grad_norm, False, found_inf, inv_scale)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device; a set flag skips the step.
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs]`` or ``[..., model params]``.
        lr: learning rate (a one-element tensor or a number).
        beta1, beta2, epsilon, bias_correction, weight_decay, grad_averaging, mode, use_nvlamb:
            as :func:`multi_tensor_lamb`.
        step: the step count, this step included (a one-element tensor).
        global_grad_norm: one-element float32 norm of the gradients as given (on the device).
        max_grad_norm: the clipping threshold, in the same units (a tensor or a number).
        found_inf: unused (apex's kernel ignored it too).
        inv_scale: one-element float32 factor of the gradients (1 / the loss scale).
    """
    name = "multi_tensor_lamb_mp"
    lists, device = unpack(name, chunk_size, tensor_lists, (4, 5))
    check_optimizer_dtypes(name, lists, "apex_amp.optimizers.FusedMixedPrecisionLamb")
    grads, params, exp_avgs, exp_avg_sqs = lists[:4]
    flag = noop_flag_of(name, noop_flag, device)
    unscale = _one_number(name, "inv_scale", inv_scale, device)
    # apex_amp's op clips by grad_norm * inv_scale against a number: that is apex's
    # global_grad_norm / max_grad_norm against 1, computed here on the device.
    relative_norm = _one_number(name, "global_grad_norm", global_grad_norm, device) / (
        device_scalar(max_grad_norm, device) * unscale)
    ops.fused_lamb_(params, grads, exp_avgs, exp_avg_sqs, lists[4] if len(lists) == 5 else [],
                    step_before(step, device), relative_norm, host_number(name, "lr", lr), float(beta1), float(beta2),
                    float(epsilon), float(weight_decay), int(bias_correction) == 1, int(grad_averaging) == 1,
                    int(mode) != 0, 1.0, bool(use_nvlamb), unscale, skip_flag(flag))
    _flag_nonfinite(flag, params, device)


def multi_tensor_novograd(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], grad_norms: Tensor,
                          lr: float, beta1: float, beta2: float, epsilon: float, step: int, bias_correction: int,
                          weight_decay: float, grad_averaging: int, mode: int, norm_type: int) -> None:
    """apex's ``amp_C.multi_tensor_novograd``: one NovoGrad step, with a second moment per tensor.

    Each tensor's gradient norm (``norm_type`` 0: L-infinity, otherwise L2) is blended into its
    entry of ``grad_norms`` in place (L2: sqrt(beta2 n_old^2 + (1 - beta2) n^2); L-infinity:
    beta2 n_old + (1 - beta2) n). ``mode`` 0 adds the weight decay to the normalised gradient
    before the first moment, 1 to the update. The step is taken whatever the noop flag, which is
    set when a gradient is inf or NaN, as apex's norms did. An entry of ``grad_norms`` below
    zero means "no gradient seen yet" to apex_amp (the norm is taken as it is); apex's
    FusedNovoGrad never stores one.

    Example::

        >>> multi_tensor_applier(amp_C.multi_tensor_novograd, overflow_buf, [grads, params, exp_avgs], grad_norms,
        ...                      1e-2, 0.95, 0.98, 1e-8, step, 1, 0.001, 1, 1, 2)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device.
        tensor_lists: ``[grads, params, exp_avgs]``.
        grad_norms: contiguous float32 tensor of one second moment per tensor, updated in place.
        lr: learning rate.
        beta1: first-moment decay.
        beta2: decay of the norm blend.
        epsilon: added to the denominator.
        step: the step count, this step included.
        bias_correction: 1 to apply bias correction.
        weight_decay: weight decay factor.
        grad_averaging: 1 to scale the gradient by (1 - beta1) in the first moment.
        mode: 0 for the decay inside the moment (reg_inside_moment), 1 for the decay in the update.
        norm_type: 0 for the L-infinity norm, 2 (any other value in apex) for L2.
    """
    name = "multi_tensor_novograd"
    (grads, params, exp_avgs), device = unpack(name, chunk_size, tensor_lists, (3,))
    check_optimizer_dtypes(name, [grads, params, exp_avgs], "apex_amp.optimizers.FusedNovoGrad on fp32 params")
    flag = noop_flag_of(name, noop_flag, device)
    if (not isinstance(grad_norms, Tensor) or grad_norms.dtype != torch.float32 or grad_norms.device != device
            or grad_norms.numel() != len(params) or not grad_norms.is_contiguous()):
        raise TypeError(f"amp_C.{name}: grad_norms must be a contiguous torch.float32 tensor of {len(params)} "
                        f"elements (one per tensor) on {device}, updated in place")
    found = torch.zeros(1, device=device)
    ops.check_finite(grads, found)
    # One-element views of grad_norms: apex_amp's op writes each tensor's moment into its own.
    moments = list(grad_norms.view(-1).split(1))
    ops.fused_novograd_(params, grads, exp_avgs, moments, [], step_before(step, device), float(lr), float(beta1),
                        float(beta2), float(epsilon), float(weight_decay), int(bias_correction) == 1,
                        int(grad_averaging) == 1, int(mode) == 0, 0 if int(norm_type) == 0 else 2, None, None)
    raise_flag(flag, found)
