"""Argument checks for the fake kernels and the pure-PyTorch fallback.

csrc/validate.h is the authority on what each op accepts. A fake (meta)
kernel has to check the metadata part of those rules itself (torch.compile
runs it instead of the kernels while tracing), and the fallback runs its op's
fake kernel before any work (apex_amp/_fallback.py), so both refuse what the
compiled ops refuse and name the same argument, in their own words: the
tests compare the error type and the argument named, never the wording.

Whether written tensors share memory needs real data pointers, which fake
tensors lack; those checks are here too, for the fallback alone.
"""

from __future__ import annotations

from typing import NoReturn, Sequence

import torch
from torch import Tensor

FLOATING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The storage dtypes of a fused optimizer's per-element state under fp32 or remainder masters
# (apex_amp/optimizers/state_formats.py), and those of them that keep one fp32 absmax per block.
STATE_FORMAT_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.uint8)
# Every dtype a state may have: a format, or fp16 (the state of fp16 params).
STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.uint8)
BLOCKED_STATE_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)
# The block sizes a blocked state may have (state_formats.MIN_BLOCK_SIZE, MAX_BLOCK_SIZE; a test pins them).
MIN_STATE_BLOCK, MAX_STATE_BLOCK = 32, 4096


def fail(op: str, message: str) -> NoReturn:
    raise RuntimeError(f"apex_amp.{op}: {message}")


def is_dense(t: Tensor) -> bool:
    """Every element stored once and no gaps, in any order of the dimensions
    (at::is_non_overlapping_and_dense): contiguous, channels_last, permuted."""
    if t.numel() == 0:
        return True
    expected_stride = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected_stride:
            return False
        expected_stride *= size
    return True


def same_memory_order(a: Tensor, b: Tensor) -> bool:
    """Whether dense a and b (of equal numel) store their elements in the same
    order: both contiguous, or equal sizes and strides (size-1 dimensions aside)."""
    if a.numel() <= 1 or (a.is_contiguous() and b.is_contiguous()):
        return True
    if a.shape != b.shape:
        return False
    return all(size == 1 or sa == sb for size, sa, sb in zip(a.shape, a.stride(), b.stride()))


def tensor_lists(op: str, device: torch.device, dtypes: Sequence[torch.dtype] = FLOATING_DTYPES,
                 **lists: Sequence[Tensor]) -> None:
    """Each tensor of each list: on `device`, of one of `dtypes` (fp32/fp16/bf16), dense."""
    for name, tensors in lists.items():
        for i, t in enumerate(tensors):
            if t.device != device:
                fail(op, f"{name}[{i}] is on {t.device}, not on {device} where the op runs; "
                         "put every tensor on one device")
            if t.dtype not in dtypes:
                fail(op, f"{name}[{i}] is {t.dtype}; the op takes {', '.join(map(str, dtypes))}")
            if not is_dense(t):
                fail(op, f"{name}[{i}] is not dense (sizes {tuple(t.shape)}, strides {t.stride()}: "
                         f"expanded, or sliced with a step); pass {name}[{i}].contiguous()")


def corresponding(op: str, name_a: str, a: Sequence[Tensor], **others: Sequence[Tensor]) -> None:
    """Each list of `others` pairs up with `a`: as long, with equal numel and memory order per index."""
    for name_b, b in others.items():
        if len(a) != len(b):
            fail(op, f"{name_a} holds {len(a)} tensors but {name_b} holds {len(b)}; pass lists of equal length")
        for i, (ta, tb) in enumerate(zip(a, b)):
            if ta.numel() != tb.numel():
                fail(op, f"{name_b}[{i}] has {tb.numel()} elements where {name_a}[{i}] has {ta.numel()}; "
                         "corresponding tensors need equal sizes")
            if not same_memory_order(ta, tb):
                fail(op, f"{name_b}[{i}] (strides {tb.stride()}) orders its elements unlike {name_a}[{i}] "
                         f"(strides {ta.stride()}); create {name_b}[{i}] with torch.empty_like({name_a}[{i}])")


def scalars(op: str, device: torch.device, dtype: torch.dtype = torch.float32, **tensors: Tensor) -> None:
    """One-element tensors of `dtype` on `device` (found_inf, inv_scale, scale, step, trackers)."""
    for name, t in tensors.items():
        if t.numel() != 1 or t.dtype != dtype or t.device != device:
            fail(op, f"{name} must be a one-element {dtype} tensor on {device}; got {t.numel()} "
                     f"element(s) of {t.dtype} on {t.device}")


def per_tensor_values(op: str, device: torch.device, name: str, values: Tensor, rows: int, count: int) -> None:
    """A contiguous float32 tensor on `device` of one value per tensor of the op's lists: shape
    (count,) for one row, (rows, count) for several (LAMB's norm_squares, NovoGrad's grad_norms)."""
    shape = (count,) if rows == 1 else (rows, count)
    if tuple(values.shape) != shape or values.dtype != torch.float32 or values.device != device \
            or not values.is_contiguous():
        fail(op, f"{name} must be a contiguous float32 tensor of shape {shape} on {device} (one value per "
                 f"param{'' if rows == 1 else ', per row'}); got shape {tuple(values.shape)} of {values.dtype} "
                 f"on {values.device}{'' if values.is_contiguous() else ', not contiguous'}")


def number(op: str, name: str, value: float, in_range: bool, expected: str) -> None:
    """A host number of the op; `in_range` is written so that NaN is False."""
    if not in_range:
        fail(op, f"{name} must be {expected}, got {value}")


# ---- memory (real tensors only: the fallback) ------------------------------------------
def _byte_range(t: Tensor) -> tuple[int, int]:
    # A dense tensor's bytes are one range starting at its data pointer.
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _share_memory(a: Tensor, b: Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a_start, a_end = _byte_range(a)
    b_start, b_end = _byte_range(b)
    return a_start < b_end and b_start < a_end


def _same_memory(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def disjoint_within(op: str, **lists: Sequence[Tensor]) -> None:
    """No two entries of a list the op writes share memory (an element would be written twice)."""
    for name, tensors in lists.items():
        spans = sorted((*_byte_range(t), i) for i, t in enumerate(tensors) if t.numel() > 0)
        for (_, previous_end, previous), (start, _, index) in zip(spans, spans[1:]):
            if start < previous_end:
                first, second = sorted((previous, index))
                fail(op, f"{name}[{first}] and {name}[{second}] share memory; the op writes each entry of "
                         f"{name}, so pass each tensor once")


def disjoint_pairs(op: str, name_a: str, a: Sequence[Tensor], name_b: str, b: Sequence[Tensor],
                   may_be_same: bool) -> None:
    """a[i] and b[i] do not share memory (or, when `may_be_same`, are one and the same tensor)."""
    for i, (ta, tb) in enumerate(zip(a, b)):
        if _share_memory(ta, tb) and not (may_be_same and _same_memory(ta, tb)):
            allowed = "the same tensor or separate ones" if may_be_same else "separate tensors"
            fail(op, f"{name_a}[{i}] and {name_b}[{i}] share memory; pass {allowed}")


# ---- fused optimizer steps (validate.h: validate_fused_step) --------------------------
def has_master(params: Sequence[Tensor], remainders: Sequence[Tensor], i: int) -> bool:
    """Whether params[i] is an fp32 master: fp32 itself, or a bf16 weight with its remainder."""
    return params[i].dtype == torch.float32 or bool(remainders)


def fused_step(op: str, device: torch.device, params: Sequence[Tensor], grads: Sequence[Tensor],
               states: dict[str, Sequence[Tensor]], model_params: Sequence[Tensor],
               remainders: Sequence[Tensor], absmaxes: Sequence[Tensor],
               inv_scale: Tensor | None, found_inf: Tensor | None, rounding: Tensor | None = None) -> None:
    """The lists, layouts and dtypes of one fused optimizer step, and its optional flags.

    Per index i: fp32 params[i], or bf16 params[i] with master_remainders[i] (fp32 masters),
    take grads of any floating dtype, a model copy (fp32 params only) and states in any format
    (STATE_FORMAT_DTYPES); fp16/bf16 params[i] without remainder take grads and states of their
    own dtype and no model copy. ``states`` in the op's order (state_absmaxes is state-list-major).
    """
    others = {"grads": grads, **states}
    if model_params:
        others["model_params"] = model_params
    tensor_lists(op, device, params=params, grads=grads, **({"model_params": model_params} if model_params else {}))
    tensor_lists(op, device, STATE_DTYPES, **states)
    corresponding(op, "params", params, **others)
    master_remainders(op, device, params, remainders, model_params)
    for i, param in enumerate(params):
        if has_master(params, remainders, i):
            for name, state in states.items():
                if state[i].dtype not in STATE_FORMAT_DTYPES:
                    fail(op, f"{name}[{i}] is {state[i].dtype}; the state of an fp32 master (params[{i}]) is one "
                             f"of {', '.join(map(str, STATE_FORMAT_DTYPES))}")
            continue
        if grads[i].dtype != param.dtype:
            fail(op, f"grads[{i}] is {grads[i].dtype} but params[{i}] is {param.dtype}; fp16/bf16 "
                     "params need grads of their own dtype (or keep fp32 master params)")
        if model_params:
            fail(op, f"model_params[{i}] was given for {param.dtype} params[{i}]; only fp32 master "
                     "params write a model copy, so pass model_params=[]")
        for name, state in states.items():
            if state[i].dtype != param.dtype:
                fail(op, f"{name}[{i}] is {state[i].dtype}; the state of {param.dtype} params[{i}] without a "
                         f"master takes their dtype (other formats need fp32 or remainder masters)")
    state_absmaxes(op, device, states, absmaxes)
    for name, flag in (("inv_scale", inv_scale), ("found_inf", found_inf)):
        if flag is not None:
            scalars(op, device, **{name: flag})
    state_rounding(op, device, params, rounding)


def state_rounding(op: str, device: torch.device, params: Sequence[Tensor], rounding: Tensor | None) -> None:
    """None (bf16 states round to nearest even), or a contiguous int64 (len(params), 2) tensor on
    ``device``: each param's stream key and the index of its first element in the whole parameter."""
    if rounding is None:
        return
    if (rounding.device != device or rounding.dtype != torch.int64 or tuple(rounding.shape) != (len(params), 2)
            or not rounding.is_contiguous()):
        fail(op, f"state_rounding must be a contiguous int64 tensor of shape ({len(params)}, 2) on {device} (a "
                 f"stream key and a first-element index per param); got {rounding.dtype} of shape "
                 f"{tuple(rounding.shape)} on {rounding.device}")


def master_remainders(op: str, device: torch.device, params: Sequence[Tensor], remainders: Sequence[Tensor],
                      model_params: Sequence[Tensor]) -> None:
    """Empty, or one int16 remainder per bf16 param, shaped and laid out like it, with no model copy."""
    if not remainders:
        return
    if len(remainders) != len(params):
        fail(op, f"params holds {len(params)} tensors but master_remainders holds {len(remainders)}; pass one "
                 "remainder per param or none")
    tensor_lists(op, device, (torch.int16,), master_remainders=remainders)
    for i, (param, remainder) in enumerate(zip(params, remainders)):
        if param.dtype != torch.bfloat16:
            fail(op, f"master_remainders[{i}] was given for {param.dtype} params[{i}]; a remainder completes a "
                     "bf16 weight to its fp32 master (fp16 is not the high half of fp32)")
        if remainder.shape != param.shape or not same_memory_order(param, remainder):
            fail(op, f"master_remainders[{i}] (sizes {tuple(remainder.shape)}, strides {remainder.stride()}) must "
                     f"have the sizes and strides of params[{i}]; make it with torch.empty_like(params[{i}], "
                     "dtype=torch.int16)")
    if model_params:
        fail(op, "model_params was given with master_remainders; the bf16 params are the model weights "
                 "themselves, so pass model_params=[]")


def state_absmaxes(op: str, device: torch.device, states: dict[str, Sequence[Tensor]],
                   absmaxes: Sequence[Tensor]) -> None:
    """One fp32 absmax tensor per state and param (state-list-major) when any state is blocked:
    numel 0 for an fp32/bf16 state, numel / B for a blocked one, B a power of two in [32, 4096]."""
    lists = list(states.items())
    count = sum(len(state) for _, state in lists)
    if not absmaxes:
        for name, state in lists:
            for i, t in enumerate(state):
                if t.dtype in BLOCKED_STATE_DTYPES:
                    fail(op, f"state_absmaxes is empty but {name}[{i}] is {t.dtype}, a blocked format; pass "
                             f"one fp32 absmax tensor per state and param ({count} in all, state-list-major)")
        return
    if len(absmaxes) != count:
        fail(op, f"state_absmaxes holds {len(absmaxes)} tensors; expected one per state and param, "
                 f"{len(lists)} state lists x {count // max(len(lists), 1)} params = {count}")
    tensor_lists(op, device, (torch.float32,), state_absmaxes=absmaxes)
    index = 0
    for name, state in lists:
        for i, t in enumerate(state):
            absmax = absmaxes[index]
            label = f"state_absmaxes[{index}] (of {name}[{i}])"
            if not absmax.is_contiguous():
                fail(op, f"{label} is not contiguous; pass state_absmaxes[{index}].contiguous()")
            if t.dtype not in BLOCKED_STATE_DTYPES:
                if absmax.numel() != 0:
                    fail(op, f"{label} holds {absmax.numel()} elements but {name}[{i}] is {t.dtype}, which keeps "
                             "no absmax; pass an empty fp32 tensor")
            elif t.numel() > 0 and not _is_block_count(t.numel(), absmax.numel()):
                fail(op, f"{label} holds {absmax.numel()} elements for the {t.numel()} of {name}[{i}]; a blocked "
                         f"state keeps one absmax per block of B elements, B a power of two in "
                         f"[{MIN_STATE_BLOCK}, {MAX_STATE_BLOCK}] dividing its numel")
            elif t.numel() == 0 and absmax.numel() != 0:
                fail(op, f"{label} holds {absmax.numel()} elements but {name}[{i}] is empty")
            index += 1


def _is_block_count(numel: int, blocks: int) -> bool:
    if blocks == 0 or numel % blocks:
        return False
    block = numel // blocks
    return MIN_STATE_BLOCK <= block <= MAX_STATE_BLOCK and block & (block - 1) == 0


def fused_memory(op: str, params: Sequence[Tensor], states: dict[str, Sequence[Tensor]],
                 model_params: Sequence[Tensor], remainders: Sequence[Tensor] = (),
                 absmaxes: Sequence[Tensor] = ()) -> None:
    """Written lists share no memory, within or across (an fp32 model copy may be its param itself)."""
    disjoint_within(op, params=params, model_params=model_params, master_remainders=remainders,
                    state_absmaxes=absmaxes, **states)
    written = [("params", params), *states.items()]
    if remainders:
        written.append(("master_remainders", remainders))
    for a in range(len(written)):
        for b in range(a + 1, len(written)):
            disjoint_pairs(op, *written[a], *written[b], may_be_same=False)
    disjoint_pairs(op, "params", params, "model_params", model_params, may_be_same=True)
    for k, absmax in enumerate(absmaxes):  # state_absmaxes[k] belongs to param k % len(params)
        for name, tensors in written:
            if _share_memory(absmax, tensors[k % len(params)]):
                fail(op, f"state_absmaxes[{k}] and {name}[{k % len(params)}] share memory; give each blocked "
                         "state its own absmax tensor")


def device_of(*tensors: Tensor | None) -> torch.device:
    """The device an op runs on: that of its first tensor argument (CPU for an op without one)."""
    return next((t.device for t in tensors if t is not None), torch.device("cpu"))


def host_numbers(op: str, **checks: tuple[float, bool, str]) -> None:
    """number() for several host numbers: name=(value, in_range, expected)."""
    for name, (value, in_range, expected) in checks.items():
        number(op, name, value, in_range, expected)


def adam_numbers(op: str, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 **more: tuple[float, bool, str]) -> None:
    """host_numbers() for Adam's hyper-parameters (Adam, LAMB, NovoGrad), then ``more``.

    Written so that NaN fails every check (as csrc/validate.h's ``check_betas`` and its callers).
    """
    host_numbers(
        op, lr=(lr, lr >= 0.0, ">= 0"), beta1=(beta1, 0.0 <= beta1 < 1.0, "in [0, 1)"),
        beta2=(beta2, 0.0 <= beta2 < 1.0, "in [0, 1)"), eps=(eps, eps >= 0.0, ">= 0"),
        weight_decay=(weight_decay, weight_decay >= 0.0, ">= 0"), **more)
