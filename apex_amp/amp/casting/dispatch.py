"""How the O1 rules are applied: Python kernels at one dispatcher key, above autograd.

Mechanism. Every ``torch.*``, ``torch.nn.functional.*``, ``Tensor`` method and operator call
meets at the dispatcher. ``activate`` registers a kernel for each operator of :mod:`.rules`
at the Autocast key of :mod:`.carrier` and routes the calling thread's calls through that
key; each kernel applies the op's rule, then redispatches below the key (autograd records
the casts, as it records torch.autocast's). torch's own autocast flags stay False (as under
apex, whose O1 patched functions), so libraries that read ``torch.is_autocast_enabled``
see no autocast, and plain ``torch.autocast`` is untouched: O1 registers nothing at
``AutocastCPU`` / ``AutocastCUDA``.

What O1 gives an op is what torch's autocast gave it before this key existed: the row of
rules.py where the row applies on the call's device; where the row is ``native`` on that
device (torch's own policy gives the same rule) and for the ops torch's autocast casts that
rules.py leaves out (FFTs and linear algebra on CPU, pooling and padding ops, ...), torch's
own autocast kernel for that device (``torch.library.get_kernel``), called with torch's
autocast dtype set to O1's half dtype. Ops in neither fall through the key. The device is
the call's (CUDA when any argument is a CUDA tensor), so one kernel serves both devices.

Inside O1, ``with torch.autocast(device, enabled=False)`` changes nothing (apex's casts did
not see it either); ``amp.disable_casts()`` is the way out. An enabled ``torch.autocast``
block adds torch's policy below O1's (its key sits below O1's on CPU, above it on CUDA).

Costs (benchmarks/README.md, "Design choices and their measurements"): a Python kernel at
the key adds microseconds per forward call of the ops it covers (linear, matmul, conv and
the rule table's ops), and more when autograd enters it from a backward pass, so the
frontend runs backward and optimizer.step() under ``disable_casts()`` (what ``scale_loss``
wraps): no O1 kernel runs in backward.

Weight casts: torch's autocast weight cache is keyed only by tensor and emptied only when
the outermost ``torch.autocast`` block exits, which never happens under O1, so an updated
weight would keep its stale half copy. O1 turns that cache off. O1's half ops cast weights
through :class:`.cache.WeightCastCache`, which checks each weight's version counter, storage
and the grad mode before reusing a cast; the ops left to torch's kernels cast at each call.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from . import carrier, policy, registry
from ..._dtypes import HALF_DTYPES
from .policy import STATE, disable_casts
from .rules import DEVICES, RULES, Rule, aten_rules

__all__ = ["activate", "deactivate", "is_active", "disable_casts", "clear_cache"]

logger = logging.getLogger("apex_amp")

_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
_CPU, _CUDA = torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA
_NO_RULE = object()  # an op without a rule of ours on a device
_INPLACE = None  # the rule of an in-place op that must refuse half inputs


def _resolve(name: str) -> torch._ops.OpOverload:
    namespace, _, name = name.rpartition("::")
    base, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace or "aten"), base), overload or "default")


def _kernel_table() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """``"ns::op.overload"`` -> (our rule per device, torch's autocast kernel per device)."""
    table: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for device in DEVICES:
        for name, rule in aten_rules(device):
            table.setdefault(f"aten::{name}", ({}, {}))[0][device] = rule
        for row in RULES:
            for name in row.inplace:
                table.setdefault(f"aten::{name}", ({}, {}))[0][device] = _INPLACE
        key = _AUTOCAST_KEYS[device]
        for name in torch._C._dispatch_get_registrations_for_dispatch_key(key):
            try:
                original = torch.library.get_kernel(_resolve(name), key)
            except (AttributeError, RuntimeError) as error:  # an op Python cannot name
                logger.debug("apex_amp O1: torch's %s kernel of %s left out (%s)", key, name, error)
                continue
            table.setdefault(name, ({}, {}))[1][device] = original
    return table


def _make_kernel(name: str, rules: dict[str, Any], originals: dict[str, Any]):
    """The kernel of ``name`` at O1's key: our rule where ``rules`` has one for the call's
    device, else torch's autocast kernel for that device, else the op below the key."""
    op = _resolve(name)
    key_set = carrier.KEY_SET
    exclude_guard = torch._C._ExcludeDispatchKeyGuard
    graph_task_id = torch._C._current_graph_task_id
    to_half = policy.to_half
    short_name = name.partition("::")[2]

    def below(device, keyset, args, kwargs):
        original = originals.get(device)
        with exclude_guard(key_set):
            if original is not None:
                return original.call_boxed(keyset, *args, **kwargs)
            return op(*args, **kwargs)

    def kernel(keyset, *args, **kwargs):
        # The hot path (linear, conv, matmul in every forward): plain attribute reads.
        device = "cuda" if keyset.has(_CUDA) else "cpu" if keyset.has(_CPU) else None
        rule = rules.get(device, _NO_RULE)
        if rule is _NO_RULE or not STATE.active or graph_task_id() != -1:
            # A backward pass keeps the dtypes autograd chose (torch's policy, as before O1).
            return below(device, keyset, args, kwargs)
        if rule is Rule.HALF:
            dtype = STATE.half_dtype
            args = [to_half(a, dtype) for a in args]
            if kwargs:
                kwargs = {k: to_half(v, dtype) for k, v in kwargs.items()}
        elif rule is _INPLACE:
            if args[0].dtype in HALF_DTYPES:
                raise NotImplementedError(policy.inplace_message(f"aten::{short_name}", args[0].dtype))
            return below(device, keyset, args, kwargs)
        else:
            if rule is Rule.BANNED and not STATE.allow_banned:
                raise NotImplementedError(policy.banned_message(f"aten::{short_name}"))
            args, kwargs = policy.cast_call(rule, args, kwargs, STATE.half_dtype)
        with exclude_guard(key_set):
            return op(*args, **kwargs)

    kernel.__name__ = f"apex_amp_o1_{short_name.replace('.', '_')}"
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
        self._libraries.append(carrier.install_fallthrough())
        libraries: dict[str, torch.library.Library] = {}
        for name, (rules, originals) in _kernel_table().items():
            namespace = name.partition("::")[0]
            library = libraries.get(namespace)
            if library is None:
                library = libraries[namespace] = torch.library.Library(namespace, "IMPL")
                self._libraries.append(library)
            library.impl(name.partition("::")[2], _make_kernel(name, rules, originals), carrier.KEY_NAME,
                         with_keyset=True)

    def uninstall(self) -> None:
        # Library._destroy removes exactly our registrations (and the key's fallthrough).
        for library in self._libraries:
            library._destroy()
        self._libraries.clear()


_KERNELS = _AutocastKernels()


def _autocast_settings() -> dict:
    return {"dtype": {d: torch.get_autocast_dtype(d) for d in DEVICES},
            "cache": torch.is_autocast_cache_enabled(),
            "routed": carrier.is_routed(), "on": carrier.is_on()}


def _apply_autocast_settings(settings: dict) -> None:
    # torch's autocast kernels, which O1 calls for the ops it leaves to torch, cast to torch's
    # autocast dtype of the device: O1 sets it to its half dtype (the enabled flags it leaves alone).
    for device in DEVICES:
        torch.set_autocast_dtype(device, settings["dtype"][device])
    torch.set_autocast_cache_enabled(settings["cache"])
    carrier.route(settings["routed"])
    carrier.set_on(settings["on"])


def activate(half_dtype: torch.dtype, *, allow_banned: bool = False) -> None:
    """Turn the O1 rules on: from now on ops run in the precision the rule table gives them.

    The rule kernels and registered functions take effect process-wide; casting happens on
    the calling thread (the switch is per thread, carried into backward passes, which the
    frontend runs under :func:`disable_casts`); torch's autocast flags stay off.
    Calling it again changes the settings.

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
        _apply_autocast_settings({"dtype": {d: half_dtype for d in DEVICES},
                                  "cache": False,  # ours replaces torch's weight cache
                                  "routed": True, "on": True})
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
