"""amp_C's list kernels (scale, axpby, the L2 norms) and its loss-scale update, on apex_amp's ops.

Each function takes apex's arguments in apex's order and returns what apex's returned. The
noop flag is handled as apex's kernels handled it: these kernels never skip on it (except
``multi_tensor_l2norm_mp``) and set it when they meet an inf or NaN.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from apex_amp import ops

from ._apex_amp_adapter import device_scalar, noop_flag_of, raise_flag, unpack

__all__ = ["multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_l2norm_mp",
           "multi_tensor_l2norm_scale", "multi_tensor_unscale_l2norm", "update_scale_hysteresis"]


def _flags(device: torch.device) -> tuple[Tensor, Tensor]:
    # (found: what the call reports in noop_flag, scratch: apex_amp's own flag where apex had none)
    return torch.zeros(1, device=device), torch.zeros(1, device=device)


def _per_tensor(name: str, per_tensor: Optional[bool]) -> bool:
    if per_tensor is not None and not isinstance(per_tensor, bool):
        raise TypeError(f"amp_C.{name}: per_tensor must be True, False or None, got {per_tensor!r}")
    return bool(per_tensor)


def _same_memory(a: Tensor, b: Tensor) -> bool:
    # `p.grad` and `p.grad.data` are different objects over the same memory: compare the memory.
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], scale: float) -> None:
    """apex's ``amp_C.multi_tensor_scale``: ``out[i] = in[i] * scale`` with dtype conversion.

    ``noop_flag`` is set when an element of ``in`` is inf or NaN (as apex: an overflow of the
    product itself is not flagged); the work is done whatever the flag. This costs one more read
    of ``in`` than apex's kernel (apex_amp's ``scale_`` also flags overflowing products).

    Example::

        >>> multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [grads, grads], clip_coef)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device.
        tensor_lists: ``[in, out]``; ``out[i]`` may be ``in[i]`` itself.
        scale: the factor.
    """
    (src, dst), device = unpack("multi_tensor_scale", chunk_size, tensor_lists, (2,))
    flag = noop_flag_of("multi_tensor_scale", noop_flag, device)
    found, scratch = _flags(device)
    ops.check_finite(src, found)
    ops.scale_(src, dst, device_scalar(scale, device), scratch)
    raise_flag(flag, found)


def multi_tensor_axpby(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], a: float, b: float,
                       arg_to_check: int) -> None:
    """apex's ``amp_C.multi_tensor_axpby``: ``out[i] = a * x[i] + b * y[i]``, in fp32, rounded once.

    ``noop_flag`` is set when an element of the checked inputs is inf or NaN: ``x`` and ``y``
    for ``arg_to_check`` -1, ``x`` for 0, ``y`` for 1, none otherwise; the work is done whatever
    the flag. ``out[i]`` may be ``y[i]`` or ``x[i]`` itself, or a tensor of its own.

    Example::

        >>> multi_tensor_applier(amp_C.multi_tensor_axpby, overflow_buf, [new_grads, stashed, stashed],
        ...                      1.0 / loss_scale, 1.0, 0)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device.
        tensor_lists: ``[x, y, out]``.
        a: factor of ``x``.
        b: factor of ``y``.
        arg_to_check: which inputs to check for inf/NaN (-1 both, 0 ``x``, 1 ``y``).
    """
    name = "multi_tensor_axpby"
    (xs, ys, outs), device = unpack(name, chunk_size, tensor_lists, (3,))
    flag = noop_flag_of(name, noop_flag, device)
    found, scratch = _flags(device)
    checked = {-1: xs + ys, 0: xs, 1: ys}.get(int(arg_to_check), [])
    if checked:
        ops.check_finite(checked, found)  # before any output is written: out may be x or y
    a_t, b_t = device_scalar(a, device), device_scalar(b, device)
    into_y, into_x, apart = [], [], []
    for i, out in enumerate(outs):
        (into_y if _same_memory(out, ys[i]) else into_x if _same_memory(out, xs[i]) else apart).append(i)
    if into_y:
        ops.axpby_([xs[i] for i in into_y], [ys[i] for i in into_y], a_t, float(b), scratch)
    if into_x:
        ops.axpby_([ys[i] for i in into_x], [xs[i] for i in into_x], b_t, float(a), scratch)
    if apart:
        # b * y first, then a * x added in fp32; a half output is rounded once, from an fp32 buffer.
        buffers = [outs[i] if outs[i].dtype == torch.float32 else torch.empty_like(outs[i], dtype=torch.float32)
                   for i in apart]
        ops.scale_([ys[i] for i in apart], buffers, b_t, scratch)
        ops.axpby_([xs[i] for i in apart], buffers, a_t, 1.0, scratch)
        rounded = [(outs[i], buffer) for i, buffer in zip(apart, buffers) if buffer is not outs[i]]
        if rounded:
            ops.scale_([buffer for _, buffer in rounded], [out for out, _ in rounded], torch.ones(1, device=device),
                       scratch)
    raise_flag(flag, found)


def _norms(name: str, chunk_size: int, noop_flag: Tensor, tensor_lists: Any, per_tensor: Optional[bool],
           depths: tuple[int, ...] = (1,)) -> tuple[list[list[Tensor]], Tensor, Tensor, Tensor]:
    lists, device = unpack(name, chunk_size, tensor_lists, depths)
    flag = noop_flag_of(name, noop_flag, device)
    total, norms = ops.l2norm(lists[0], _per_tensor(name, per_tensor))
    return lists, flag, total.reshape(1), norms


def multi_tensor_l2norm(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]],
                        per_tensor: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """apex's ``amp_C.multi_tensor_l2norm``: the L2 norm of all tensors of ``tensor_lists[0]``, in fp32.

    Returns apex's shapes: ``(total, per_tensor_norms)``, a one-element float32 tensor and a
    float32 tensor of one norm per tensor (``per_tensor=True``) or of none. ``noop_flag`` is set
    when the norm is not finite: an inf or NaN element, or squares that overflow fp32 (apex
    decided that per chunk of ``chunk_size`` elements, apex_amp's kernels per chunk of their
    own, so a sum that overflows only across chunks may differ). The flag never skips the work.

    Example::

        >>> total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)
        >>> clip_coef = max_norm / (total + 1e-6)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device.
        tensor_lists: ``[tensors]`` (fp32/fp16/bf16, may be mixed).
        per_tensor: also return each tensor's norm.
    """
    _, flag, total, norms = _norms("multi_tensor_l2norm", chunk_size, noop_flag, tensor_lists, per_tensor)
    raise_flag(flag, ~torch.isfinite(total))
    return total, norms


def multi_tensor_l2norm_mp(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]],
                           per_tensor: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """apex's ``amp_C.multi_tensor_l2norm_mp``: :func:`multi_tensor_l2norm`, skipped while ``noop_flag`` is set.

    A skipped call returned uninitialised memory in apex; here its norms are NaN (decided on the
    device: no host sync).

    Example::

        >>> total, per_tensor = multi_tensor_applier(amp_C.multi_tensor_l2norm_mp, overflow_buf, [params], True)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device; a set flag skips the call.
        tensor_lists: ``[tensors]`` (fp32/fp16/bf16, may be mixed).
        per_tensor: also return each tensor's norm.
    """
    _, flag, total, norms = _norms("multi_tensor_l2norm_mp", chunk_size, noop_flag, tensor_lists, per_tensor)
    skipped = flag != 0
    raise_flag(flag, ~torch.isfinite(total))
    return torch.where(skipped, math.nan, total), torch.where(skipped, math.nan, norms)


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]],
                                inv_scale: Tensor, per_tensor: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """apex's ``amp_C.multi_tensor_unscale_l2norm``: the L2 norm of ``tensors * inv_scale``; the tensors are unchanged.

    As :func:`multi_tensor_l2norm`, with the norms multiplied by ``inv_scale`` (a device tensor:
    no host sync); ``noop_flag`` is set when the unscaled norm is not finite (apex_amp squares
    the elements before unscaling, so an element above ~1.8e19 counts as an overflow).

    Example::

        >>> total, _ = multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, overflow_buf, [grads],
        ...                                 scaler._scale.reciprocal(), False)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device.
        tensor_lists: ``[tensors]`` (fp32/fp16/bf16, may be mixed).
        inv_scale: one-element float32 tensor on the tensors' device.
        per_tensor: also return each tensor's norm.
    """
    name = "multi_tensor_unscale_l2norm"
    _, flag, total, norms = _norms(name, chunk_size, noop_flag, tensor_lists, per_tensor)
    if not isinstance(inv_scale, Tensor) or inv_scale.numel() != 1 or inv_scale.dtype != torch.float32 \
            or inv_scale.device != total.device:
        raise TypeError(f"amp_C.{name}: inv_scale must be a one-element torch.float32 tensor on {total.device}, "
                        f"as apex's kernel reads it there")
    factor = inv_scale.reshape(())
    total, norms = total * factor, norms * factor
    raise_flag(flag, ~torch.isfinite(total))
    return total, norms


def multi_tensor_l2norm_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], scale: float,
                              per_tensor: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """apex's ``amp_C.multi_tensor_l2norm_scale``: the L2 norm of ``in`` (as :func:`multi_tensor_l2norm`)
    and ``out[i] = in[i] * scale``.

    Example::

        >>> total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm_scale, overflow_buf, [grads, grads],
        ...                                 1.0 / world_size, False)

    Args:
        chunk_size: the applier's chunk size (checked; apex_amp chooses its own chunks).
        noop_flag: one-element int32 flag on the tensors' device.
        tensor_lists: ``[in, out]``; ``out[i]`` may be ``in[i]`` itself.
        scale: the factor of the copy.
        per_tensor: also return each tensor's norm (of ``in``).
    """
    (src, dst), flag, total, norms = _norms("multi_tensor_l2norm_scale", chunk_size, noop_flag, tensor_lists,
                                            per_tensor, depths=(2,))
    scratch = torch.zeros(1, device=total.device)
    ops.scale_(src, dst, device_scalar(scale, total.device), scratch)
    raise_flag(flag, ~torch.isfinite(total))
    return total, norms


def update_scale_hysteresis(current_scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                            found_inf: Tensor, growth_factor: float, backoff_factor: float, growth_interval: int,
                            hysteresis: int) -> Tensor:
    """apex's ``amp_C.update_scale_hysteresis``: the dynamic loss scale with hysteresis, on the device.

    An overflow (``found_inf`` 1) spends one unit of hysteresis and resets the growth count;
    once the hysteresis is spent the scale is multiplied by ``backoff_factor``. A clean step
    refills the hysteresis and counts; after ``growth_interval`` of them the scale is multiplied
    by ``growth_factor`` unless that is inf in fp32. No floor and no cap, as in apex, whose
    fast-math build turned a scale below fp32's smallest normal number into 0. The rule is
    apex_amp's ``update_scale_``; ``hysteresis_tracker`` then takes apex's value (it counts on
    below zero through overflows in a row, where apex_amp's stops at zero: same decisions).

    Example::

        >>> amp_C.update_scale_hysteresis(scale, growth_tracker, hysteresis_tracker, found_inf,
        ...                               2.0, 0.5, 1000, 2)

    Args:
        current_scale: one-element float32 scale, updated in place and returned.
        growth_tracker: one-element int32 count of clean steps, updated in place.
        hysteresis_tracker: one-element int32 count of overflows still tolerated, updated in place.
        found_inf: one-element float32 flag of this step (0 or 1).
        growth_factor: multiplier after ``growth_interval`` clean steps.
        backoff_factor: multiplier on overflow once the hysteresis is spent.
        growth_interval: clean steps between growths.
        hysteresis: overflows tolerated in a row.
    """
    previous = hysteresis_tracker.clone() if isinstance(hysteresis_tracker, Tensor) else hysteresis_tracker
    ops.update_scale_(current_scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor=growth_factor,
                      backoff_factor=backoff_factor, growth_interval=int(growth_interval), hysteresis=int(hysteresis),
                      min_scale=0.0, max_scale=math.inf, consecutive_hysteresis=True)
    hysteresis_tracker.copy_(torch.where(found_inf.reshape(()) != 0, previous - 1, int(hysteresis)))
    # apex builds amp_C with --use_fast_math, which flushes a subnormal float to zero: a scale backed
    # off below fp32's smallest normal number became 0 there (apex's own test expects it).
    current_scale.masked_fill_(current_scale.abs() < torch.finfo(torch.float32).tiny, 0.0)
    return current_scale
