"""Argument validation of every apex_amp op, in Python.

A line-by-line mirror of csrc/validate.h and csrc/checks.h: the same checks in
the same order with the same messages (keep them in step when either changes), so the pure-PyTorch fallback
(apex_amp/_fallback.py) and the fake (meta) kernels that torch.compile runs
reject exactly the inputs the compiled kernels reject, with the same words.
Every message names the op, the argument (with its list index) and the fix.

Each ``validate_*`` function returns the device the op runs on, chosen as the
CUDA launchers choose it: the device of the op's scalar state (found_inf, step
or scale), or of ``tensors[0]`` for l2norm. (The CPU launchers run on the CPU,
which is the same device whenever the call reaches them.)
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

FLOATING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT32_MAX = 2**31 - 1

# c10::toString(ScalarType) spellings, so messages read like the C++ ones.
_C10_DTYPE_NAMES = {
    torch.float32: "Float",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.float64: "Double",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _C10_DTYPE_NAMES.get(dtype, str(dtype))


def _fail(op: str, message: str) -> None:
    raise RuntimeError(f"apex_amp.{op}: {message}")


def _number(value: float) -> str:
    # C++ streams print doubles like printf's %g.
    return f"{value:g}"


def check_same_length(op: str, name_a: str, a: Sequence[Tensor], name_b: str, b: Sequence[Tensor]) -> None:
    if len(a) != len(b):
        _fail(op, f"{name_a} and {name_b} must be lists of the same length, got {len(a)} and {len(b)}")


def check_tensor_list(
    op: str,
    name: str,
    tensors: Sequence[Tensor],
    device: torch.device,
    dtypes: Sequence[torch.dtype] = FLOATING_DTYPES,
) -> None:
    for i, t in enumerate(tensors):
        if t.device != device:
            _fail(op, f"{name}[{i}] is on {t.device} but the op runs on {device}; move every tensor to one device")
        if t.dtype not in dtypes:
            expected = ", ".join(dtype_name(d) for d in dtypes)
            _fail(op, f"{name}[{i}] has dtype {dtype_name(t.dtype)}; expected one of {expected}")
        if not t.is_contiguous():
            _fail(
                op,
                f"{name}[{i}] must be contiguous; call .contiguous() on it "
                "(parameters and gradients normally are)",
            )
        # checks.h also rejects internally overlapping tensors (expand()); a
        # contiguous tensor never overlaps itself, so that check cannot fire here.


def check_same_numel(op: str, name_a: str, a: Sequence[Tensor], name_b: str, b: Sequence[Tensor]) -> None:
    for i, (ta, tb) in enumerate(zip(a, b)):
        if ta.numel() != tb.numel():
            _fail(
                op,
                f"{name_a}[{i}] has {ta.numel()} elements but {name_b}[{i}] has {tb.numel()}; "
                "corresponding tensors must have the same size",
            )


def _overlap_status(a: Tensor, b: Tensor) -> str:
    """at::get_overlap_status(a, b) for the contiguous tensors that reach it:
    "full" (the same memory), "partial" or "no". Fake and meta tensors have
    no memory to compare and count as "no"."""
    if a is b:
        return "full"
    if a.numel() == 0 or b.numel() == 0:
        return "no"
    if is_fake(a) or is_fake(b) or a.device.type == "meta" or b.device.type == "meta":
        return "no"
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return "no"
    a_begin, b_begin = a.data_ptr(), b.data_ptr()
    a_end = a_begin + a.numel() * a.element_size()
    b_end = b_begin + b.numel() * b.element_size()
    if a_begin == b_begin and a_end == b_end:
        return "full" if a.stride() == b.stride() else "partial"
    return "partial" if a_begin < b_end and b_begin < a_end else "no"


def check_no_partial_overlap(op: str, name_a: str, a: Sequence[Tensor], name_b: str, b: Sequence[Tensor]) -> None:
    for i, (ta, tb) in enumerate(zip(a, b)):
        if _overlap_status(ta, tb) == "partial":
            _fail(
                op,
                f"{name_a}[{i}] and {name_b}[{i}] partially overlap in memory; pass the same tensor or separate ones",
            )


def check_disjoint_within(op: str, name: str, tensors: Sequence[Tensor]) -> None:
    """No two entries of a list the op writes in place share memory (checks.h's check_disjoint_within):
    an element reached through two entries would be updated twice."""
    spans = []
    for i, t in enumerate(tensors):
        if t.numel() == 0 or is_fake(t) or t.device.type == "meta":
            continue
        begin = t.data_ptr()
        spans.append((begin, begin + t.numel() * t.element_size(), i))
    spans.sort()
    for (_, previous_end, previous_index), (begin, _, index) in zip(spans, spans[1:]):
        if begin < previous_end:
            first, second = sorted((previous_index, index))
            _fail(
                op,
                f"{name}[{first}] and {name}[{second}] share memory; the op writes every entry of {name}, "
                "so each tensor must appear once (remove the duplicate)",
            )


def check_scalar_tensor(
    op: str, name: str, t: Tensor, device: torch.device, dtype: torch.dtype = torch.float32
) -> None:
    if t.numel() != 1:
        _fail(op, f"{name} must hold exactly one element, got {t.numel()}")
    if t.dtype != dtype:
        _fail(op, f"{name} must be {dtype_name(dtype)}, got {dtype_name(t.dtype)}")
    if t.device != device:
        _fail(op, f"{name} is on {t.device} but the op runs on {device}; keep it on the same device as the tensors")


def validate_check_finite(tensors: Sequence[Tensor], found_inf: Tensor) -> torch.device:
    op = "check_finite"
    device = found_inf.device
    check_tensor_list(op, "tensors", tensors, device)
    check_scalar_tensor(op, "found_inf", found_inf, device)
    return device


def validate_unscale(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> torch.device:
    op = "unscale_"
    device = found_inf.device
    check_tensor_list(op, "grads", grads, device)
    check_disjoint_within(op, "grads", grads)
    check_scalar_tensor(op, "found_inf", found_inf, device)
    check_scalar_tensor(op, "inv_scale", inv_scale, device)
    return device


def _validate_pairwise(
    op: str, names: tuple[str, str], a: Sequence[Tensor], b: Sequence[Tensor], device: torch.device
) -> None:
    check_same_length(op, names[0], a, names[1], b)
    check_tensor_list(op, names[0], a, device)
    check_tensor_list(op, names[1], b, device)
    check_disjoint_within(op, names[1], b)
    check_same_numel(op, names[0], a, names[1], b)
    check_no_partial_overlap(op, names[0], a, names[1], b)


def validate_scale(src: Sequence[Tensor], dst: Sequence[Tensor], scale: Tensor, found_inf: Tensor) -> torch.device:
    op = "scale_"
    device = found_inf.device
    _validate_pairwise(op, ("src", "dst"), src, dst, device)
    check_scalar_tensor(op, "scale", scale, device)
    check_scalar_tensor(op, "found_inf", found_inf, device)
    return device


def validate_axpby(x: Sequence[Tensor], y: Sequence[Tensor], a: Tensor, found_inf: Tensor) -> torch.device:
    op = "axpby_"
    device = found_inf.device
    _validate_pairwise(op, ("x", "y"), x, y, device)
    check_scalar_tensor(op, "a", a, device)
    check_scalar_tensor(op, "found_inf", found_inf, device)
    return device


def validate_l2norm(tensors: Sequence[Tensor]) -> torch.device:
    op = "l2norm"
    if len(tensors) == 0:
        # The compiled op never gets here: with no tensor at all the dispatcher
        # itself refuses the call ("There were no tensor arguments ...").
        _fail(op, "tensors is empty; pass at least one tensor (the device of the result comes from it)")
    device = tensors[0].device
    check_tensor_list(op, "tensors", tensors, device)
    return device


def _check_adam_dtypes(params, grads, exp_avgs, exp_avg_sqs, model_params) -> None:
    # params[i] fp32 (masters): grads[i] fp32/fp16/bf16, any model copy dtype;
    # params[i] fp16/bf16: grads[i] of the same dtype and no model copy;
    # the moments always have the dtype of params[i].
    op = "fused_adam_"
    has_model_params = len(model_params) > 0
    for i, param in enumerate(params):
        p = dtype_name(param.dtype)
        if param.dtype != torch.float32:
            if grads[i].dtype != param.dtype:
                _fail(
                    op,
                    f"grads[{i}] has dtype {dtype_name(grads[i].dtype)} but params[{i}] is {p}; fp16/bf16 "
                    "params need grads of the same dtype (or keep fp32 master params)",
                )
            if has_model_params:
                _fail(
                    op,
                    f"model_params[{i}] was given but params[{i}] is {p}; a model copy is written only from "
                    "fp32 master params, pass model_params=[] or fp32 params",
                )
        for name, moments in (("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
            if moments[i].dtype != param.dtype:
                _fail(
                    op,
                    f"{name}[{i}] has dtype {dtype_name(moments[i].dtype)}; expected {p}, "
                    f"the dtype of params[{i}]",
                )


def _check_adam_disjoint(name_a: str, a: Sequence[Tensor], name_b: str, b: Sequence[Tensor]) -> None:
    # Tensors that fused_adam_ writes element by element must not share memory at all.
    for i, (ta, tb) in enumerate(zip(a, b)):
        if _overlap_status(ta, tb) != "no":
            _fail(
                "fused_adam_",
                f"{name_a}[{i}] and {name_b}[{i}] share memory; each parameter needs its own moment buffers",
            )


def validate_fused_adam(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    model_params: Sequence[Tensor],
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    inv_scale: Optional[Tensor],
    found_inf: Optional[Tensor],
) -> torch.device:
    op = "fused_adam_"
    device = step.device
    for name, other in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        check_same_length(op, "params", params, name, other)
    has_model_params = len(model_params) > 0
    if has_model_params:
        check_same_length(op, "params", params, "model_params", model_params)
    for name, tensors in (
        ("params", params),
        ("grads", grads),
        ("exp_avgs", exp_avgs),
        ("exp_avg_sqs", exp_avg_sqs),
        ("model_params", model_params),
    ):
        check_tensor_list(op, name, tensors, device)
    for name, written in (
        ("params", params),
        ("exp_avgs", exp_avgs),
        ("exp_avg_sqs", exp_avg_sqs),
        ("model_params", model_params),
    ):
        check_disjoint_within(op, name, written)
    _check_adam_dtypes(params, grads, exp_avgs, exp_avg_sqs, model_params)
    for name, other in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        check_same_numel(op, "params", params, name, other)
    _check_adam_disjoint("params", params, "exp_avgs", exp_avgs)
    _check_adam_disjoint("params", params, "exp_avg_sqs", exp_avg_sqs)
    _check_adam_disjoint("exp_avgs", exp_avgs, "exp_avg_sqs", exp_avg_sqs)
    if has_model_params:
        check_same_numel(op, "params", params, "model_params", model_params)
        # An fp32 model_params[i] may be params[i] itself (a redundant write).
        check_no_partial_overlap(op, "params", params, "model_params", model_params)
    check_scalar_tensor(op, "step", step, device)
    if inv_scale is not None:
        check_scalar_tensor(op, "inv_scale", inv_scale, device)
    if found_inf is not None:
        check_scalar_tensor(op, "found_inf", found_inf, device)
    # Written so that NaN fails every check.
    if not lr >= 0.0:
        _fail(op, f"lr must be >= 0, got {_number(lr)}")
    if not 0.0 <= beta1 < 1.0:
        _fail(op, f"beta1 must be in [0, 1), got {_number(beta1)}")
    if not 0.0 <= beta2 < 1.0:
        _fail(op, f"beta2 must be in [0, 1), got {_number(beta2)}")
    if not eps >= 0.0:
        _fail(op, f"eps must be >= 0, got {_number(eps)}")
    if not weight_decay >= 0.0:
        _fail(op, f"weight_decay must be >= 0, got {_number(weight_decay)}")
    return device


def validate_update_scale(
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
) -> torch.device:
    op = "update_scale_"
    device = scale.device
    check_scalar_tensor(op, "scale", scale, device)
    check_scalar_tensor(op, "growth_tracker", growth_tracker, device, torch.int32)
    check_scalar_tensor(op, "hysteresis_tracker", hysteresis_tracker, device, torch.int32)
    check_scalar_tensor(op, "found_inf", found_inf, device)
    if not 1 <= growth_interval <= INT32_MAX:
        _fail(op, f"growth_interval must be an integer in [1, 2^31 - 1], got {growth_interval}")
    if not 1 <= hysteresis <= INT32_MAX:
        _fail(op, f"hysteresis must be an integer in [1, 2^31 - 1], got {hysteresis}")
    # Written so that NaN fails every check.
    if not growth_factor >= 1.0:
        _fail(op, f"growth_factor must be >= 1, got {_number(growth_factor)}")
    if not 0.0 < backoff_factor < 1.0:
        _fail(op, f"backoff_factor must be in (0, 1), got {_number(backoff_factor)}")
    if not 0.0 <= min_scale <= max_scale:
        _fail(
            op,
            f"need 0 <= min_scale <= max_scale, got min_scale={_number(min_scale)} "
            f"and max_scale={_number(max_scale)}",
        )
    return device
