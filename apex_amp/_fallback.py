"""The pure-PyTorch implementation and the fake kernel of apex_amp's list and scaler ops.

Each function decorated with ``@define`` *is* its op's definition
(apex_amp/_op_registry.py): its signature is the schema of both
``torch.ops.apex_amp.<name>`` (the compiled kernels) and
``torch.ops.apex_amp_fallback.<name>`` (this implementation), so that
:mod:`apex_amp.ops` can call either implementation the same way, and both
work with ``torch.library.opcheck`` and ``torch.compile``. The fallback is
used when the compiled extension is missing or ``APEX_AMP_FORCE_FALLBACK=1``.
The fused optimizers' ops are defined the same way next to their optimizer
(apex_amp/optimizers/).

Each op here has two parts. Its fake (meta) kernel checks the metadata of
the arguments (the metadata part of csrc/validate.h's rules, in
apex_amp/_checks.py's words) and describes the outputs; the registry
registers it for both namespaces. Its
fallback runs the fake kernel first, then the memory checks that need real
tensors, then the math. ``unscale_`` is torch's own
``_amp_foreach_non_finite_check_and_unscale_``, which does exactly that op's
job; torch has no primitive that matches the other ops exactly (see
docs/adding_an_op.md).

Semantics are those of the kernels: math in fp32 whatever the storage dtype,
``found_inf`` written (1.0) only when an inf/NaN is met and never cleared,
tensors of any dense layout. The fp32 arithmetic follows csrc/amp_math.h
operation by operation, so results agree with the kernels to a few units in
the last place; corresponding tensors pair up element by element as in the
kernels (same shape, or both contiguous and viewed as one another's shape).

No op here forces a host-device sync: flags and the loss-scale rule are
applied with masked writes on the device (``masked_fill_``, ``torch.where``).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from . import _checks as check
from ._op_registry import FALLBACK_NAMESPACE, define

# The helpers below are shared with the fused optimizers' fallbacks (apex_amp/optimizers).
__all__ = ["NAMESPACE", "f32", "as_fp32", "shaped_like", "step_taken", "commit"]

NAMESPACE = FALLBACK_NAMESPACE


def f32(value: float) -> float:
    # The kernels receive the schema's doubles as C++ floats: round the same way.
    return torch.tensor(value, dtype=torch.float32).item()


def as_fp32(tensors: list[Tensor]) -> list[Tensor]:
    return [t.float() for t in tensors]


def _flag_nonfinite(found_inf: Tensor, tensors: list[Tensor]) -> None:
    """found_inf := 1 if any element of ``tensors`` is inf or NaN; never cleared."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return
    # amp_math.h's probe: x * 0 is NaN exactly when x is inf or NaN, and a
    # sum that meets a NaN stays NaN (a max would not, on every device).
    probes = torch._foreach_mul(tensors, 0.0)
    probe_sums = torch._foreach_norm(probes, 1, dtype=torch.float32)
    any_nonfinite = torch.stack(probe_sums).sum().isnan()
    found_inf.masked_fill_(any_nonfinite, 1.0)


def _write(dst: list[Tensor], values: list[Tensor]) -> None:
    # One rounding from the fp32 value to each destination's dtype.
    if dst:
        torch._foreach_copy_(dst, values)


def shaped_like(tensors: list[Tensor], like: list[Tensor]) -> list[Tensor]:
    """Each tensor with the shape of its counterpart in ``like``, so that torch's ops pair them element by
    element as the kernels do (in memory order). The checks admit only equal shapes (then with equal strides)
    or two contiguous tensors, for which the reshape is a view: nothing is copied."""
    return [t if t.shape == o.shape else t.view(o.shape) for t, o in zip(tensors, like)]


def _scaled_fp32(tensors: list[Tensor], factor: Tensor) -> list[Tensor]:
    if not tensors:
        return []
    return torch._foreach_mul(as_fp32(tensors), factor.reshape(()))


def unscaled_fp32(grads: list[Tensor], inv_scale: Optional[Tensor]) -> list[Tensor]:
    """The fused rules' gradients: in fp32, times ``inv_scale`` when one is given (as the kernels read them)."""
    return as_fp32(grads) if inv_scale is None else _scaled_fp32(grads, inv_scale)


# ---- check_finite ---------------------------------------------------------------------------
def _fake_check_finite(tensors: list[Tensor], found_inf: Tensor) -> None:
    op, device = "check_finite", found_inf.device
    check.tensor_lists(op, device, tensors=tensors)
    check.scalars(op, device, found_inf=found_inf)


@define("check_finite", mutates_args=("found_inf",), fake=_fake_check_finite)
def check_finite(tensors: list[Tensor], found_inf: Tensor) -> None:
    _fake_check_finite(tensors, found_inf)
    _flag_nonfinite(found_inf, tensors)


# ---- unscale_ -------------------------------------------------------------------------------
def _fake_unscale(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    op, device = "unscale_", found_inf.device
    check.tensor_lists(op, device, grads=grads)
    check.scalars(op, device, found_inf=found_inf, inv_scale=inv_scale)


@define("unscale_", mutates_args=("grads", "found_inf"), fake=_fake_unscale)
def unscale_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    _fake_unscale(grads, found_inf, inv_scale)
    check.disjoint_within("unscale_", grads=grads)
    # Exactly this op: grads *= inv_scale in fp32, found_inf := 1 on an inf/NaN grad (before
    # scaling). torch's CUDA kernel has no bf16 (its dispatch is float, double and half; seen on
    # torch 2.11 on an H200), so bf16 CUDA grads take the same two steps written out.
    by_torch = [g for g in grads if not _torch_cannot_unscale(g)]
    if by_torch:
        torch._amp_foreach_non_finite_check_and_unscale_(by_torch, found_inf, inv_scale)
    written_out = [g for g in grads if _torch_cannot_unscale(g)]
    if written_out:
        unscale_written_out_(written_out, found_inf, inv_scale)


def _torch_cannot_unscale(grad: Tensor) -> bool:
    return grad.is_cuda and grad.dtype == torch.bfloat16


def unscale_written_out_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``unscale_`` without torch's fused op: the probe of check_finite, then the product in fp32,
    rounded once into each gradient. (An in-place foreach multiply of bf16 CUDA tensors by a
    tensor scalar rounded the scalar to bf16 first: two ulp off on an H200, torch 2.11.)"""
    _flag_nonfinite(found_inf, grads)
    _write(grads, _scaled_fp32(grads, inv_scale))


# ---- scale_ and axpby_ ----------------------------------------------------------------------
def _check_pairs(op: str, names: tuple[str, str], a: list[Tensor], b: list[Tensor], device: torch.device) -> None:
    check.tensor_lists(op, device, **{names[0]: a, names[1]: b})
    check.corresponding(op, names[0], a, **{names[1]: b})


def _fake_scale(src: list[Tensor], dst: list[Tensor], scale: Tensor, found_inf: Tensor) -> None:
    op, device = "scale_", found_inf.device
    _check_pairs(op, ("src", "dst"), src, dst, device)
    check.scalars(op, device, scale=scale, found_inf=found_inf)


@define("scale_", mutates_args=("dst", "found_inf"), fake=_fake_scale)
def scale_(src: list[Tensor], dst: list[Tensor], scale: Tensor, found_inf: Tensor) -> None:
    _fake_scale(src, dst, scale, found_inf)
    check.disjoint_within("scale_", dst=dst)
    check.disjoint_pairs("scale_", "src", src, "dst", dst, may_be_same=True)
    src = shaped_like(src, dst)
    results = [r.to(d.dtype) for r, d in zip(_scaled_fp32(src, scale), dst)]
    # A non-finite src element gives a non-finite product (inf * 0 is NaN), so
    # checking the converted results covers "src or result" in one pass.
    _flag_nonfinite(found_inf, results)
    _write(dst, results)


def _fake_axpby(x: list[Tensor], y: list[Tensor], a: Tensor, b: float, found_inf: Tensor) -> None:
    op, device = "axpby_", found_inf.device
    _check_pairs(op, ("x", "y"), x, y, device)
    check.scalars(op, device, a=a, found_inf=found_inf)


@define("axpby_", mutates_args=("y", "found_inf"), fake=_fake_axpby)
def axpby_(x: list[Tensor], y: list[Tensor], a: Tensor, b: float, found_inf: Tensor) -> None:
    _fake_axpby(x, y, a, b, found_inf)
    check.disjoint_within("axpby_", y=y)
    check.disjoint_pairs("axpby_", "x", x, "y", y, may_be_same=True)
    if not x:
        return
    x = shaped_like(x, y)
    sums = torch._foreach_add(_scaled_fp32(x, a), torch._foreach_mul(as_fp32(y), f32(b)))
    results = [r.to(t.dtype) for r, t in zip(sums, y)]
    # As in scale_: an inf/NaN in x always reaches the result.
    _flag_nonfinite(found_inf, results)
    _write(y, results)


# ---- l2norm ---------------------------------------------------------------------------------
def _check_l2norm(tensors: list[Tensor]) -> None:
    if len(tensors) == 0:
        # The compiled op never gets here: with no tensor at all the dispatcher
        # itself refuses the call ("There were no tensor arguments ...").
        check.fail("l2norm", "tensors is empty; pass at least one tensor (the result's device comes from it)")
    check.tensor_lists("l2norm", tensors[0].device, tensors=tensors)


def _fake_l2norm(tensors: list[Tensor], per_tensor: bool) -> tuple[Tensor, Tensor]:
    _check_l2norm(tensors)
    first = tensors[0]
    total = first.new_empty((), dtype=torch.float32)
    norms = first.new_empty((len(tensors) if per_tensor else 0,), dtype=torch.float32)
    return total, norms


@define("l2norm", mutates_args=(), fake=_fake_l2norm)
def l2norm(tensors: list[Tensor], per_tensor: bool) -> tuple[Tensor, Tensor]:
    _check_l2norm(tensors)
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    total = torch.linalg.vector_norm(norms)
    return total, norms if per_tensor else norms.new_empty(0)


# ---- what the fused optimizers' ops share ------------------------------------------------
def step_taken(found_inf: Optional[Tensor]) -> Union[bool, Tensor]:
    """Whether a fused optimizer op takes its step: a bool when known without a sync, else a device mask."""
    if found_inf is None:
        return True
    if found_inf.device.type == "cpu":
        # Host memory: reading it is free, and lets a skipped step do no work.
        return bool(found_inf.item() == 0)
    return found_inf.reshape(()) == 0


def commit(dst: list[Tensor], values: list[Tensor], taken: Union[bool, Tensor]) -> None:
    if taken is True:
        _write(dst, values)
    else:
        # Skipped on the device: write every element back unchanged, bit for bit.
        _write(dst, [torch.where(taken, v.to(d.dtype), d) for v, d in zip(values, dst)])


# ---- update_scale_ --------------------------------------------------------------------------
INT32_MAX = 2**31 - 1


def _fake_update_scale(
    scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
    growth_interval, hysteresis, min_scale, max_scale, consecutive_hysteresis,
) -> None:
    op, device = "update_scale_", scale.device
    check.scalars(op, device, scale=scale)
    check.scalars(op, device, torch.int32, growth_tracker=growth_tracker, hysteresis_tracker=hysteresis_tracker)
    check.scalars(op, device, found_inf=found_inf)
    check.number(op, "growth_interval", growth_interval, 1 <= growth_interval <= INT32_MAX,
                 "an integer in [1, 2^31 - 1]")
    check.number(op, "hysteresis", hysteresis, 1 <= hysteresis <= INT32_MAX, "an integer in [1, 2^31 - 1]")
    # Written so that NaN fails every check; min_scale 0 and max_scale inf turn the floor and the cap off.
    check.number(op, "growth_factor", growth_factor, growth_factor >= 1.0, ">= 1")
    check.number(op, "backoff_factor", backoff_factor, 0.0 < backoff_factor < 1.0, "in (0, 1)")
    check.number(op, "min_scale", min_scale, 0.0 <= min_scale <= max_scale,
                 f"in [0, max_scale] (max_scale={max_scale})")


def _times(scale: Tensor, factor: float) -> Tensor:
    # amp_math.h: the fp32 scale times a double factor, rounded once to fp32.
    return (scale.double() * factor).float()


@define("update_scale_", mutates_args=("scale", "growth_tracker", "hysteresis_tracker"),
        fake=_fake_update_scale)
def update_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
    consecutive_hysteresis: bool,
) -> None:
    _fake_update_scale(
        scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
        growth_interval, hysteresis, min_scale, max_scale, consecutive_hysteresis,
    )
    # amp_math.h's update_scale_math restated in torch ops, for installs without a compiler: both
    # branches computed and the right one picked on the device (no host sync).
    min_scale, max_scale = f32(min_scale), f32(max_scale)
    overflow = found_inf.reshape(()) != 0
    old_scale = scale.reshape(())
    old_growth = growth_tracker.reshape(())
    old_hysteresis = hysteresis_tracker.reshape(())

    spent_hysteresis = torch.clamp_min(old_hysteresis - 1, 0)
    reduced = _times(old_scale, backoff_factor)
    backed_off = torch.where(reduced > min_scale, reduced, min_scale)
    scale_on_overflow = torch.where(spent_hysteresis == 0, backed_off, old_scale)

    counted = old_growth + 1
    grows = counted >= growth_interval
    grown = _times(old_scale, growth_factor)
    capped = torch.where(grown <= max_scale, grown, torch.where(old_scale > max_scale, old_scale, max_scale))
    # A product that is inf in fp32 is no scale: the old one stays.
    scale_when_clean = torch.where(grows & torch.isfinite(grown), capped, old_scale)
    refilled = hysteresis if consecutive_hysteresis else torch.where(grows, hysteresis, old_hysteresis)

    scale.copy_(torch.where(overflow, scale_on_overflow, scale_when_clean))
    growth_tracker.copy_(torch.where(overflow | grows, 0, counted))
    hysteresis_tracker.copy_(torch.where(overflow, spent_hysteresis, refilled))
