"""amp_C's SGD, Adam and Adagrad kernels, on apex_amp's fused optimizer ops.

apex's lists become the op's arguments (apex put the gradients first, apex_amp the params),
its integer modes become booleans, its step (the count including this step) becomes
apex_amp's counter of the steps before it. Whether the noop flag skips the work is apex's
choice per kernel: ``multi_tensor_sgd`` and the capturable Adams skip, the others do not.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from apex_amp import ops

from ._apex_amp_adapter import (check_optimizer_dtypes, device_scalar, host_number, noop_flag_of, skip_flag,
                                step_before, unpack)

__all__ = ["multi_tensor_sgd", "multi_tensor_adam", "multi_tensor_adam_capturable",
           "multi_tensor_adam_capturable_master", "multi_tensor_adagrad"]


def multi_tensor_sgd(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], wd: float,
                     momentum: float, dampening: float, lr: float, nesterov: bool, first_run: bool,
                     wd_after_momentum: bool, scale: float) -> None:
    """apex's ``amp_C.multi_tensor_sgd``: one SGD step; nothing changes while ``noop_flag`` is set.

    The gradients are multiplied by ``scale`` as they are read; the weight decay is added before
    the momentum (after it with ``wd_after_momentum``); on the ``first_run`` the momentum buffer
    is set to the gradient; a fourth list receives a copy of the updated weights (apex's fp16
    model weights). With ``momentum`` 0 the momentum list is left alone, as in apex.

    Example::

        >>> multi_tensor_applier(amp_C.multi_tensor_sgd, overflow_buf, [grads, params, momentums],
        ...                      weight_decay, 0.9, 0.0, lr, False, first_run, False, 1.0 / loss_scale)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device; a set flag skips the step.
        tensor_lists: ``[grads, weights, momentums]`` or ``[grads, fp32 weights, momentums, model weights]``.
        wd: weight decay.
        momentum: momentum factor.
        dampening: dampening of the momentum.
        lr: learning rate.
        nesterov: Nesterov momentum.
        first_run: the momentum buffers are new: set them to the gradient.
        wd_after_momentum: add the weight decay after the momentum.
        scale: factor applied to the gradients (``1 / loss_scale``).
    """
    name = "multi_tensor_sgd"
    lists, device = unpack(name, chunk_size, tensor_lists, (3, 4))
    check_optimizer_dtypes(name, lists, "torch.optim.SGD(foreach=True)")
    grads, params, momentums = lists[:3]
    flag = noop_flag_of(name, noop_flag, device)
    ops.fused_sgd_(params, grads, momentums if momentum != 0 else [], lists[3] if len(lists) == 4 else [],
                   float(lr), float(momentum), float(dampening), float(wd), bool(nesterov), bool(first_run),
                   bool(wd_after_momentum), device_scalar(scale, device), skip_flag(flag))


def _adam(name: str, lists: list[list[Tensor]], device: torch.device, step: Union[int, Tensor], lr: float,
          beta1: float, beta2: float, epsilon: float, mode: int, bias_correction: int, weight_decay: float,
          inv_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
    check_optimizer_dtypes(name, lists, "torch.optim.Adam(foreach=True)")
    grads, params, exp_avgs, exp_avg_sqs = lists[:4]
    hyper = dict(lr=lr, beta1=float(beta1), beta2=float(beta2), eps=float(epsilon), weight_decay=float(weight_decay),
                 adamw_mode=int(mode) != 0, bias_correction=int(bias_correction) == 1, inv_scale=inv_scale,
                 found_inf=found_inf)
    if len(lists) == 5:  # [grads, model params, moments, fp32 master params]
        ops.fused_adam_(lists[4], grads, exp_avgs, exp_avg_sqs, step_before(step, device), model_params=params,
                        **hyper)
        return
    # apex's kernel updates fp16/bf16 params beside fp32 moments; apex_amp's op does that through fp32
    # masters (written back in the same pass), so such params get temporary ones.
    through_master = [i for i, p in enumerate(params)
                      if p.dtype != torch.float32 and exp_avgs[i].dtype == torch.float32]
    direct = [i for i in range(len(params)) if i not in set(through_master)]
    for indices, via_master in ((direct, False), (through_master, True)):
        if not indices:
            continue
        chosen = [params[i] for i in indices]
        ops.fused_adam_([p.float() for p in chosen] if via_master else chosen, [grads[i] for i in indices],
                        [exp_avgs[i] for i in indices], [exp_avg_sqs[i] for i in indices], step_before(step, device),
                        model_params=chosen if via_master else (), **hyper)


def multi_tensor_adam(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], lr: float, beta1: float,
                      beta2: float, epsilon: float, step: int, mode: int, bias_correction: int,
                      weight_decay: float) -> None:
    """apex's ``amp_C.multi_tensor_adam``: one Adam (``mode`` 0: L2 decay) or AdamW (``mode`` 1) step.

    ``step`` counts this step (apex's FusedAdam increments it first); ``noop_flag`` is neither
    read nor written, as in apex. fp16/bf16 weights may have fp32 moments (apex's FusedAdam
    state): they are updated in fp32 and rounded once.

    Example::

        >>> multi_tensor_applier(amp_C.multi_tensor_adam, overflow_buf, [grads, params, exp_avgs, exp_avg_sqs],
        ...                      1e-3, 0.9, 0.999, 1e-8, step, 1, 1, 0.01)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device (unused, as in apex).
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs]``.
        lr: learning rate.
        beta1: first-moment decay.
        beta2: second-moment decay.
        epsilon: added to the denominator.
        step: the step count, this step included.
        mode: 0 for Adam with L2 weight decay, 1 for AdamW.
        bias_correction: 1 to apply Adam's bias correction.
        weight_decay: weight decay factor.
    """
    name = "multi_tensor_adam"
    lists, device = unpack(name, chunk_size, tensor_lists, (4,))
    noop_flag_of(name, noop_flag, device)
    _adam(name, lists, device, step, float(lr), beta1, beta2, epsilon, mode, bias_correction, weight_decay, None, None)


def _capturable(name: str, chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], depth: int,
                lr: Tensor, beta1: float, beta2: float, epsilon: float, step: Tensor, mode: int,
                bias_correction: int, weight_decay: float, inv_scale: Tensor) -> None:
    lists, device = unpack(name, chunk_size, tensor_lists, (depth,))
    flag = noop_flag_of(name, noop_flag, device)
    if not isinstance(inv_scale, Tensor) or inv_scale.numel() != 1 or inv_scale.dtype != torch.float32:
        raise TypeError(f"amp_C.{name}: inv_scale must be a one-element torch.float32 tensor (1 / the loss scale)")
    inv_scale = inv_scale.reshape(1).to(device)
    skipped = skip_flag(flag)
    _adam(name, lists, device, step, host_number(name, "lr", lr), beta1, beta2, epsilon, mode, bias_correction,
          weight_decay, inv_scale, skipped)
    # apex's kernel also left the unscaled gradients in place (unless it skipped): unscale by 1 when skipped.
    ops.unscale_(lists[0], torch.zeros(1, device=device), torch.where(skipped != 0, 1.0, inv_scale))


def multi_tensor_adam_capturable(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], lr: Tensor,
                                 beta1: float, beta2: float, epsilon: float, step: Tensor, mode: int,
                                 bias_correction: int, weight_decay: float, inv_scale: Tensor) -> None:
    """apex's ``amp_C.multi_tensor_adam_capturable``: :func:`multi_tensor_adam` with device arguments.

    ``step`` (int tensor) and ``inv_scale`` stay on the device; the gradients are unscaled by
    ``inv_scale`` as they are read and left unscaled in place, as apex did; nothing changes while
    ``noop_flag`` is set.

    .. note:: apex_amp's op takes the learning rate as a number: a CUDA ``lr`` tensor is read
       once per call (a host sync apex did not have), and a call inside CUDA graph capture raises.

    Example::

        >>> multi_tensor_applier(amp_C.multi_tensor_adam_capturable, overflow_buf,
        ...                      [grads, params, exp_avgs, exp_avg_sqs], lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.0,
        ...                      inv_scale)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device; a set flag skips the step.
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs]``.
        lr: learning rate (a one-element tensor or a number).
        beta1, beta2, epsilon, mode, bias_correction, weight_decay: as :func:`multi_tensor_adam`.
        step: the step count, this step included (a one-element tensor).
        inv_scale: one-element float32 factor of the gradients (1 / the loss scale).
    """
    _capturable("multi_tensor_adam_capturable", chunk_size, noop_flag, tensor_lists, 4, lr, beta1, beta2, epsilon,
                step, mode, bias_correction, weight_decay, inv_scale)


def multi_tensor_adam_capturable_master(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]],
                                        lr: Tensor, beta1: float, beta2: float, epsilon: float, step: Tensor,
                                        mode: int, bias_correction: int, weight_decay: float,
                                        inv_scale: Tensor) -> None:
    """apex's ``amp_C.multi_tensor_adam_capturable_master``: the capturable step on fp32 master weights.

    As :func:`multi_tensor_adam_capturable` with a fifth list of fp32 master weights, which the
    step updates; the params of the second list receive their rounded copy in the same pass.

    Example::

        >>> multi_tensor_applier(amp_C.multi_tensor_adam_capturable_master, overflow_buf,
        ...                      [grads, params, exp_avgs, exp_avg_sqs, masters], lr, 0.9, 0.999, 1e-8, step,
        ...                      1, 1, 0.0, inv_scale)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device; a set flag skips the step.
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs, master params]``.
        lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay, inv_scale: as
            :func:`multi_tensor_adam_capturable`.
    """
    _capturable("multi_tensor_adam_capturable_master", chunk_size, noop_flag, tensor_lists, 5, lr, beta1, beta2,
                epsilon, step, mode, bias_correction, weight_decay, inv_scale)


def multi_tensor_adagrad(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], lr: float,
                         epsilon: float, mode: int, weight_decay: float) -> None:
    """apex's ``amp_C.multi_tensor_adagrad``: one Adagrad step (``mode`` 0: L2 decay, 1: decoupled decay).

    ``noop_flag`` is neither read nor written, as in apex.

    Example::

        >>> multi_tensor_applier(amp_C.multi_tensor_adagrad, overflow_buf, [grads, params, state_sums],
        ...                      1e-2, 1e-10, 0, 0.0)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device (unused, as in apex).
        tensor_lists: ``[grads, params, state_sums]``.
        lr: learning rate.
        epsilon: added to the denominator.
        mode: 0 adds the weight decay to the gradient, 1 to the update (adagrad_w_mode).
        weight_decay: weight decay factor.
    """
    name = "multi_tensor_adagrad"
    (grads, params, state_sums), device = unpack(name, chunk_size, tensor_lists, (3,))
    check_optimizer_dtypes(name, [grads, params, state_sums], "torch.optim.Adagrad(foreach=True)")
    noop_flag_of(name, noop_flag, device)
    ops.fused_adagrad_(params, grads, state_sums, [], float(lr), float(epsilon), float(weight_decay), int(mode) != 0)
