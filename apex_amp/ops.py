"""Typed wrappers around apex_amp's fused multi-tensor ops.

Each function takes whole lists of tensors and makes one op call for all of
them. They call the compiled kernels (``torch.ops.apex_amp``) when the
extension is loaded, otherwise the pure-PyTorch fallback
(``torch.ops.apex_amp_fallback``) with the same semantics; see
:data:`apex_amp._extension.STATUS` for which and why. Where the extension is
loaded but has no kernel for the tensors' device (CUDA tensors and a CPU-only
build), the dispatcher runs the pure-PyTorch implementation for that device,
with one warning (apex_amp/_device_fallback.py).

Conventions:
  * ``found_inf`` is a one-element float32 tensor; ops that check values write
    1.0 into it on the first inf/NaN and never clear it.
  * ``inv_scale`` / ``scale`` / ``a`` are one-element float32 tensors on the
    tensors' device, so no call forces a host sync.
  * fp32, fp16 and bf16 tensors may be mixed in one list; math runs in fp32.
  * tensors may have any dense layout (contiguous, channels_last,
    channels_last_3d, permuted); corresponding tensors of different lists
    (``src[i]`` and ``dst[i]``, ``params[i]`` and ``grads[i]``, ...) are
    paired element by element in memory, so they must share it: both
    contiguous, or the same sizes and strides (``torch.empty_like`` gives
    that). Tensors that are not dense (expanded, strided slices) are refused.

Example::

    >>> import torch
    >>> from apex_amp import ops
    >>> grads = [torch.full((3,), 65536.0), torch.full((2,), 131072.0, dtype=torch.bfloat16)]
    >>> found_inf = torch.zeros(1)
    >>> ops.unscale_(grads, found_inf, torch.full((1,), 1 / 65536.0))
    >>> grads[1]
    tensor([2., 2.], dtype=torch.bfloat16)
    >>> bool(found_inf.item())   # a host sync: read the flag only when you need the answer
    False
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from . import _fallback  # noqa: F401  defines the list and scaler ops (the optimizers define theirs)
from ._extension import STATUS
from ._op_registry import OPS

__all__ = [
    "BACKEND",
    "check_finite",
    "unscale_",
    "scale_",
    "axpby_",
    "l2norm",
    "fused_adam_",
    "update_scale_",
    "backend_namespace",
]

# "extension" or "fallback": which implementation these wrappers call. "extension" means the compiled
# kernels on the devices that have them (_device_fallback.compiled_devices()), the fallback elsewhere.
BACKEND: str = "extension" if STATUS.loaded else "fallback"

def backend_namespace(backend: Optional[str] = None):
    """The ``torch.ops`` namespace of ``backend`` ("extension" or "fallback").

    Args:
        backend: which implementation; ``None`` means the one in use (:data:`BACKEND`).

    Example::

        >>> import torch
        >>> from apex_amp import ops
        >>> ns = ops.backend_namespace("fallback")   # the pure-PyTorch ops, always available
        >>> found_inf = torch.zeros(1)
        >>> ns.check_finite([torch.tensor([1.0, float("nan")])], found_inf)
        >>> found_inf
        tensor([1.])
    """
    backend = BACKEND if backend is None else backend
    if backend == "extension":
        if not STATUS.loaded:
            raise RuntimeError(
                f"apex_amp's compiled extension is not available ({STATUS.reason}); "
                "use backend='fallback' or rebuild with `pip install --no-build-isolation .`"
            )
        return torch.ops.apex_amp
    if backend == "fallback":
        return torch.ops.apex_amp_fallback
    raise ValueError(f"backend must be 'extension' or 'fallback', got {backend!r}")


_ops = backend_namespace()


# The fused optimizer ops' state operands (docs/kernels.md, "State operands"): lists that
# torch.library cannot make optional, so the derived wrappers take them as keywords, default ().
STATE_OPERANDS = ("master_remainders", "state_absmaxes")


def __getattr__(name: str):
    # An op with no hand-written wrapper below (the fused optimizers' ops): the op of the backend in
    # use, called with the arguments of its definition (apex_amp/_op_registry.py), the state
    # operands (if it has them) as keyword arguments.
    if name in OPS:
        return _derived_wrapper(name)
    raise AttributeError(f"module 'apex_amp.ops' has no attribute {name!r}")


@functools.lru_cache(maxsize=None)
def _derived_wrapper(name: str) -> Callable:
    op = getattr(_ops, name)
    definition = inspect.signature(OPS[name].fallback)
    names = list(definition.parameters)
    if not all(operand in names for operand in STATE_OPERANDS):
        return op
    # The definition's signature without the state operands, which come last as keyword-only ().
    public = definition.replace(parameters=[
        *(p for p in definition.parameters.values() if p.name not in STATE_OPERANDS),
        *(inspect.Parameter(operand, inspect.Parameter.KEYWORD_ONLY, default=()) for operand in STATE_OPERANDS),
    ])

    def wrapper(*args, **kwargs):
        bound = public.bind(*args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        return op(*(list(values[n]) if n in STATE_OPERANDS else values[n] for n in names))

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__signature__ = public
    wrapper.__doc__ = (f"``torch.ops.apex_amp.{name}`` on the backend in use; ``master_remainders`` and "
                       "``state_absmaxes`` (keyword-only, default empty) are its state operands.\n\n"
                       + (OPS[name].fallback.__doc__ or ""))
    return wrapper


def check_finite(tensors: Sequence[Tensor], found_inf: Tensor) -> None:
    """Set ``found_inf`` to 1 if any element of ``tensors`` is inf or NaN (read-only).

    Args:
        tensors: tensors to check (fp32/fp16/bf16, may be mixed).
        found_inf: one-element float32 flag, written only when a bad value is found.

    Example::

        >>> import torch
        >>> from apex_amp import ops
        >>> found_inf = torch.zeros(1)
        >>> ops.check_finite([torch.ones(4), torch.tensor([0.5, float("inf")], dtype=torch.float16)], found_inf)
        >>> found_inf
        tensor([1.])
    """
    _ops.check_finite(list(tensors), found_inf)


def unscale_(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and flag non-finite values.

    Args:
        grads: gradients to unscale in place (fp32/fp16/bf16, may be mixed).
        found_inf: one-element float32 flag, set to 1 if any grad element is inf/NaN.
        inv_scale: one-element float32 tensor, usually ``1 / loss_scale``.

    Example::

        >>> import torch
        >>> from apex_amp import ops
        >>> grads = [torch.tensor([1024.0, -2048.0])]
        >>> found_inf = torch.zeros(1)
        >>> ops.unscale_(grads, found_inf, torch.full((1,), 1 / 1024.0))
        >>> grads[0], found_inf
        (tensor([ 1., -2.]), tensor([0.]))
    """
    _ops.unscale_(list(grads), found_inf, inv_scale)


def scale_(src: Sequence[Tensor], dst: Sequence[Tensor], scale: Tensor, found_inf: Tensor) -> None:
    """Write ``dst[i] = src[i] * scale`` with dtype conversion and flag non-finite values.

    Used for model grads -> fp32 master grads (``scale = 1/loss_scale``) and
    fp32 master params -> half model params (``scale = 1``).

    Args:
        src: input tensors.
        dst: output tensors, same sizes as ``src``; may be ``src`` itself.
        scale: one-element float32 multiplier.
        found_inf: one-element float32 flag, set to 1 if an element of ``src``
            or of the converted result is inf/NaN.

    Example::

        >>> import torch
        >>> from apex_amp import ops
        >>> master = [torch.tensor([1.0, 70000.0])]
        >>> model_copy = [torch.empty(2, dtype=torch.float16)]
        >>> found_inf = torch.zeros(1)
        >>> ops.scale_(master, model_copy, torch.ones(1), found_inf)
        >>> model_copy[0], found_inf   # 70000 overflows fp16: flagged
        (tensor([1., inf], dtype=torch.float16), tensor([1.]))
    """
    _ops.scale_(list(src), list(dst), scale, found_inf)


def axpby_(x: Sequence[Tensor], y: Sequence[Tensor], a: Tensor, b: float, found_inf: Tensor) -> None:
    """Compute ``y[i] = a * x[i] + b * y[i]`` in place and flag non-finite values.

    Gradient accumulation across backward passes with different loss scales:
    ``x`` holds the new scaled grads, ``a`` their inverse scale, ``y`` the
    stashed unscaled grads with ``b = 1``.

    Args:
        x: input tensors.
        y: accumulators, updated in place, same sizes as ``x``.
        a: one-element float32 multiplier of ``x`` (a device scalar: no host sync).
        b: multiplier of ``y``.
        found_inf: one-element float32 flag, set to 1 if an element of ``x`` or
            of the result is inf/NaN.

    Example::

        >>> import torch
        >>> from apex_amp import ops
        >>> stashed = [torch.tensor([1.0, 2.0])]      # unscaled grads of an earlier pass
        >>> new = [torch.tensor([512.0, 512.0])]      # this pass's grads, scaled by 256
        >>> found_inf = torch.zeros(1)
        >>> ops.axpby_(new, stashed, torch.full((1,), 1 / 256.0), 1.0, found_inf)
        >>> stashed[0]
        tensor([3., 4.])
    """
    _ops.axpby_(list(x), list(y), a, float(b), found_inf)


def l2norm(tensors: Sequence[Tensor], per_tensor: bool = False) -> tuple[Tensor, Tensor]:
    """The L2 norm of all elements of ``tensors`` (and of each tensor), in fp32.

    Args:
        tensors: tensors to measure (fp32/fp16/bf16, may be mixed).
        per_tensor: also return one norm per tensor.

    Returns:
        ``(total, per_tensor_norms)``: a 0-dim float32 tensor, and a float32
        tensor of ``len(tensors)`` norms (empty when ``per_tensor`` is False).

    Example::

        >>> import torch
        >>> from apex_amp import ops
        >>> total, per_tensor = ops.l2norm([torch.tensor([3.0]), torch.tensor([4.0], dtype=torch.bfloat16)],
        ...                                per_tensor=True)
        >>> total, per_tensor
        (tensor(5.), tensor([3., 4.]))
    """
    return _ops.l2norm(list(tensors), per_tensor)


def fused_adam_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    step: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    model_params: Sequence[Tensor] = (),
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    master_remainders: Sequence[Tensor] = (),
    state_absmaxes: Sequence[Tensor] = (),
    state_rounding: Optional[Tensor] = None,
) -> None:
    """One Adam or AdamW step over whole lists of tensors, one pass per element.

    Args:
        params: weights to update: fp32 masters, bf16 weights with ``master_remainders``, or
            the same dtype as ``grads``.
        grads: gradients (fp32/fp16/bf16); multiplied by ``inv_scale`` when given.
        exp_avgs: first moments, updated in place: the dtype of ``params``, or for fp32 and
            remainder masters any state format (fp32, bf16, fp8 e4m3, int8; docs/kernels.md).
        exp_avg_sqs: second moments, likewise (int8 format: uint8 codes).
        step: one-element float32 step counter, incremented by the op (unless skipped);
            bias correction uses the incremented value.
        lr: learning rate.
        beta1: first-moment decay.
        beta2: second-moment decay.
        eps: added to the denominator.
        weight_decay: decay factor; decoupled (AdamW) or L2 (Adam) per ``adamw_mode``.
        adamw_mode: True for AdamW, False for Adam with L2 weight decay.
        bias_correction: apply Adam's bias correction.
        model_params: empty, or fp16/bf16 model weights rewritten from the
            updated ``params`` in the same pass (O2's model copy).
        inv_scale: one-element float32 factor applied to the grads (fused unscale).
        found_inf: one-element float32 flag; when non-zero the op changes nothing.
        master_remainders: empty, or one int16 tensor per bf16 param: the low 16 bits that make
            ``params[i]`` an exact fp32 master (state_formats.join_master), rewritten by the step.
        state_absmaxes: empty when no state is blocked (fp8/int8), else one fp32 tensor per
            state and param, ``exp_avgs``' first: one absmax per block, empty for fp32/bf16 states.
        state_rounding: None (bf16 states of fp32/remainder masters round to nearest even), or a
            contiguous int64 (len(params), 2) tensor on the params' device: per param, the stream key
            and the index of its first element in the whole parameter; bf16 states then round
            stochastically (state_formats.round_bf16_stochastic; every fused op takes it).

    Example::

        >>> import torch
        >>> from apex_amp import ops
        >>> master = [torch.ones(4)]                               # fp32 master weights
        >>> grad = [torch.full((4,), 128.0, dtype=torch.bfloat16)]  # grads scaled by 128
        >>> m, v = [torch.zeros(4)], [torch.zeros(4)]
        >>> model_weight = [torch.ones(4, dtype=torch.bfloat16)]
        >>> step = torch.zeros(1)
        >>> ops.fused_adam_(master, grad, m, v, step, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
        ...                 model_params=model_weight, inv_scale=torch.full((1,), 1 / 128.0),
        ...                 found_inf=torch.zeros(1))
        >>> master[0], model_weight[0], step
        (tensor([0.9000, 0.9000, 0.9000, 0.9000]), tensor([0.8984, 0.8984, 0.8984, 0.8984], dtype=torch.bfloat16), tensor([1.]))
    """
    _ops.fused_adam_(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(model_params),
        list(master_remainders),
        list(state_absmaxes),
        step,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adamw_mode),
        bool(bias_correction),
        inv_scale,
        found_inf,
        state_rounding,
    )


def update_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    consecutive_hysteresis: bool = True,
) -> None:
    """Apply the dynamic loss-scale rule for one step, on the scale's device.

    On overflow (``found_inf`` non-zero): reset the growth counter, spend one
    unit of hysteresis, and once it is spent multiply the scale by
    ``backoff_factor`` (floored at ``min_scale``). Otherwise count the clean
    step; after ``growth_interval`` of them multiply the scale by
    ``growth_factor`` (capped at ``max_scale``; a product that is inf in fp32
    leaves the scale as it was). The hysteresis refills after every clean step
    (``consecutive_hysteresis=True``, apex's ``update_scale_hysteresis``: only
    overflows in a row back the scale off) or only when the scale grows
    (``False``: Megatron's rule, DeepSpeed's default). Products are taken in
    double and rounded once, as apex and torch do; with ``min_scale=0`` and
    ``max_scale=inf`` this is apex's rule exactly.

    Args:
        scale: one-element float32 loss scale, updated in place.
        growth_tracker: one-element int32 count of clean steps in a row.
        hysteresis_tracker: one-element int32 count of overflows still tolerated.
        found_inf: one-element float32 flag of this step.
        growth_factor: multiplier after ``growth_interval`` clean steps.
        backoff_factor: multiplier on overflow.
        growth_interval: clean steps between growths.
        hysteresis: overflows tolerated before backing off (1 = back off at once).
        min_scale: floor of the scale (0: none).
        max_scale: cap of the scale (inf: none).
        consecutive_hysteresis: refill the hysteresis after every clean step (True) or at growth only.

    Example::

        >>> import torch
        >>> from apex_amp import ops
        >>> scale = torch.full((1,), 65536.0)
        >>> growth, hysteresis = torch.zeros(1, dtype=torch.int32), torch.full((1,), 2, dtype=torch.int32)
        >>> for found_inf in (1.0, 0.0, 1.0):   # isolated overflows between clean steps: tolerated
        ...     ops.update_scale_(scale, growth, hysteresis, torch.full((1,), found_inf), hysteresis=2)
        >>> scale
        tensor([65536.])
        >>> ops.update_scale_(scale, growth, hysteresis, torch.ones(1), hysteresis=2)  # a second in a row
        >>> scale
        tensor([32768.])
    """
    _ops.update_scale_(
        scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        float(growth_factor),
        float(backoff_factor),
        int(growth_interval),
        int(hysteresis),
        float(min_scale),
        float(max_scale),
        bool(consecutive_hysteresis),
    )
