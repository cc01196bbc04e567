"""How the O1 rules are applied: torch's dispatcher-level autocast plus our own Autocast kernels.

Mechanism. ``activate`` switches torch's autocast on for CPU and CUDA outside any ``with``
block (``torch.set_autocast_enabled``) with the half dtype, so every call through
``torch.*``, ``torch.nn.functional.*``, ``Tensor`` methods and operators reaches the
``AutocastCPU`` / ``AutocastCUDA`` dispatch keys. Where torch's policy on a device differs
from :mod:`.rules` (its CPU policy leaves softmax, log_softmax, sum, cumsum, norms and more
in half; neither device promotes dot/cross/index_put mixed inputs on CPU; BCE is not banned
on CPU), a Python kernel registered at that key applies our rule and then redispatches
below autocast. The kernels are registered on ``activate`` and removed on ``deactivate``,
so plain ``torch.autocast`` is untouched unless O1 is active; while it is, a kernel called
outside an O1 context (another thread's own ``torch.autocast``, a backward pass) hands the
call to torch's own autocast kernel for that op (``torch.library.get_kernel``), or past the
autocast key when torch had none.

Why this route (the figures are in benchmarks/README.md, "Design choices and their
measurements"; ``benchmarks/bench_o1_overhead.py`` reproduces them):
  - dispatcher autocast costs nothing per op in Python; torch's own kernels stay in C++.
    Python wrappers on module attributes (apex's way) would miss calls through Tensor
    methods and operators; module hooks see no functional calls at all;
  - a Python kernel at the Autocast key adds microseconds per forward call, and more when
    autograd enters it from a backward pass (it runs backward with the caller's autocast
    state and our kernel must re-take the GIL);
  - so Python kernels are registered only where torch's policy differs from rules.py. The
    linear/matmul/conv ops keep torch's kernels, which made a whole MLP or transformer step
    measurably cheaper than with Python kernels for them;
  - the frontend runs backward and optimizer.step() under ``disable_casts()`` (what
    ``scale_loss`` wraps), so no Python kernel runs in backward.

Weight casts: torch's autocast weight cache is keyed only by tensor and emptied only when
the outermost ``torch.autocast`` block exits, which with global enabling never happens, so
an updated weight would keep its stale half copy. O1 turns that cache off. The half ops
apex_amp implements (RNNs and their cells, einsum, addmv/addr/mv on CPU) cast weights
through :class:`.cache.WeightCastCache`, which checks each weight's version counter,
storage and the grad mode before reusing a cast; ops left to torch's kernels (linear,
matmul, conv) cast the weight at each call, like torch.autocast when a weight is used
once per iteration, and one extra pass over the weight when it is reused (small next to
the matmul that reads it).
"""
from __future__ import annotations

import logging

import torch

from . import policy, registry
from ..._dtypes import HALF_DTYPES
from .policy import STATE, disable_casts
from .rules import DEVICES, RULES, Rule, aten_rules

__all__ = ["activate", "deactivate", "is_active", "disable_casts", "clear_cache"]

logger = logging.getLogger("apex_amp")

_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


def _resolve(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _make_kernel(name: str, rule: Rule | None, device: str):
    """A kernel for ``aten::name`` at the Autocast key of ``device``; ``rule`` None means an
    in-place op that must refuse half inputs."""
    op = _resolve(name)
    key = _AUTOCAST_KEYS[device]
    own_key = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    original = None
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key):
        original = torch.library.get_kernel(op, key)  # torch's own policy for this op

    def passthrough(keyset, args, kwargs):
        if original is not None:
            return original.call_boxed(keyset, *args, **kwargs)
        with torch._C._ExcludeDispatchKeyGuard(own_key):
            return op(*args, **kwargs)

    def run_below_autocast(args, kwargs):
        with torch._C._ExcludeDispatchKeyGuard(own_key):
            return op(*args, **kwargs)

    if rule is None:
        def kernel(keyset, *args, **kwargs):
            if STATE.active and not policy.in_backward() and args[0].dtype in HALF_DTYPES:
                raise NotImplementedError(policy.inplace_message(f"aten::{name}", args[0].dtype))
            return passthrough(keyset, args, kwargs)
    elif rule is Rule.HALF:
        # The hot path (linear, conv, matmul in every forward): kept to plain attribute reads.
        to_half = policy.to_half
        graph_task_id = torch._C._current_graph_task_id
        exclude_guard = torch._C._ExcludeDispatchKeyGuard

        def kernel(keyset, *args, **kwargs):
            if not STATE.active or graph_task_id() != -1:
                return passthrough(keyset, args, kwargs)
            dtype = STATE.half_dtype
            args = [to_half(a, dtype) for a in args]
            if kwargs:
                kwargs = {k: to_half(v, dtype) for k, v in kwargs.items()}
            with exclude_guard(own_key):
                return op(*args, **kwargs)
    else:
        def kernel(keyset, *args, **kwargs):
            if not STATE.active or policy.in_backward():
                return passthrough(keyset, args, kwargs)
            if rule is Rule.BANNED and not STATE.allow_banned:
                raise NotImplementedError(policy.banned_message(f"aten::{name}"))
            args, kwargs = policy.cast_call(rule, args, kwargs, STATE.half_dtype)
            return run_below_autocast(args, kwargs)

    kernel.__name__ = f"apex_amp_o1_{name.replace('.', '_')}_{device}"
    return kernel


class _AutocastKernels:
    """The torch.library registrations of the O1 kernels, installed while O1 is active."""

    def __init__(self) -> None:
        self._libraries: list = []

    @property
    def installed(self) -> bool:
        return bool(self._libraries)

    def install(self) -> None:
        if self._libraries:
            return
        for device in DEVICES:
            library = torch.library.Library("aten", "IMPL")
            self._libraries.append(library)
            kernels = list(aten_rules(device))
            kernels += [(name, None) for row in RULES for name in row.inplace]
            for name, rule in kernels:
                library.impl(name, _make_kernel(name, rule, device), _AUTOCAST_KEYS[device], with_keyset=True)

    def uninstall(self) -> None:
        # Library._destroy removes exactly our registrations, so torch's own autocast
        # kernels are in charge again.
        for library in self._libraries:
            library._destroy()
        self._libraries.clear()


_KERNELS = _AutocastKernels()


def _autocast_settings() -> dict:
    return {"enabled": {d: torch.is_autocast_enabled(d) for d in DEVICES},
            "dtype": {d: torch.get_autocast_dtype(d) for d in DEVICES},
            "cache": torch.is_autocast_cache_enabled()}


def _apply_autocast_settings(settings: dict) -> None:
    for device in DEVICES:
        torch.set_autocast_dtype(device, settings["dtype"][device])
        torch.set_autocast_enabled(device, settings["enabled"][device])
    torch.set_autocast_cache_enabled(settings["cache"])


def activate(half_dtype: torch.dtype, *, allow_banned: bool = False) -> None:
    """Turn the O1 rules on: from now on ops run in the precision the rule table gives them.

    The rule kernels and registered functions take effect process-wide; casting happens on
    the calling thread (torch's autocast switch is per thread, and torch carries it into
    DataParallel replicas and backward). Calling it again changes the settings.

    Args:
        half_dtype: ``torch.float16`` or ``torch.bfloat16``, the dtype of "half" ops.
        allow_banned: run banned ops (binary_cross_entropy) in fp32 instead of raising.

    Example::

        >>> from apex_amp.amp import casting
        >>> casting.activate(torch.bfloat16)
        >>> torch.softmax(torch.nn.Linear(4, 4)(torch.randn(2, 4)), -1).dtype
        torch.float32
        >>> casting.deactivate()
    """
    if half_dtype not in HALF_DTYPES:
        raise ValueError(f"half_dtype must be torch.float16 or torch.bfloat16, got {half_dtype!r}")
    if not isinstance(allow_banned, bool):
        raise TypeError(f"allow_banned must be a bool, got {type(allow_banned).__name__}")
    with STATE.lock:
        if not STATE.active:
            STATE.saved_autocast = _autocast_settings()
            _KERNELS.install()
        STATE.half_dtype = half_dtype
        STATE.allow_banned = allow_banned
        STATE.active = True
        STATE.cache.clear()
        registry.install_wrappers()
        _apply_autocast_settings({"enabled": {d: True for d in DEVICES},
                                  "dtype": {d: half_dtype for d in DEVICES},
                                  "cache": False})  # ours replaces torch's weight cache
    logger.debug("apex_amp O1 casting active with %s", half_dtype)


def deactivate() -> None:
    """Turn the O1 rules off and restore the autocast settings from before :func:`activate`.

    Example::

        >>> from apex_amp.amp import casting
        >>> casting.activate(torch.bfloat16); casting.deactivate(); casting.is_active()
        False
    """
    with STATE.lock:
        if not STATE.active:
            return
        STATE.active = False
        registry.uninstall_wrappers()
        _KERNELS.uninstall()
        if STATE.saved_autocast is not None:
            _apply_autocast_settings(STATE.saved_autocast)
            STATE.saved_autocast = None
        STATE.cache.clear()
    logger.debug("apex_amp O1 casting inactive")


def is_active() -> bool:
    """Whether :func:`activate` is in effect.

    Example::

        >>> from apex_amp.amp import casting
        >>> casting.is_active()
        False
    """
    return STATE.active


def clear_cache() -> None:
    """Drop every cached half cast of an fp32 weight.

    The frontend calls it after ``optimizer.step()`` and when ``scale_loss`` exits. Casts
    are also checked against each weight's version counter on every use, so a missed call
    cannot make a stale weight visible (except writes through ``tensor.data``, which
    bypass the version counter).

    Example::

        >>> from apex_amp.amp import casting
        >>> casting.clear_cache()
    """
    STATE.cache.clear()
