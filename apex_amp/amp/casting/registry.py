"""Python-level casting: apex's registration API and the rule rows that have no aten operator.

A registered function is replaced on its module by a wrapper while O1 is active. When
casting is on, the wrapper casts the arguments (half, fp32 or promote) and runs the
original with casting off, so the function runs in exactly the precision it was
registered for, as torch's ``custom_fwd(cast_inputs=...)`` does. Registrations made before
:func:`~apex_amp.amp.casting.activate` are applied by it; those made while O1 is active
apply at once. Code that imported the function by name (``from m import f``) before the
wrapper was installed keeps calling the original; wrap your own functions with the
decorators instead, which need no patching.
"""
from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

from . import policy
from .policy import STATE, disable_casts
from .rules import Rule, python_rules

__all__ = [
    "register_half_function", "register_float_function", "register_promote_function",
    "unregister_function", "half_function", "float_function", "promote_function",
]

logger = logging.getLogger("apex_amp")


def _cast_wrapper(original: Callable, rule: Rule) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not policy.casting_enabled():
            return original(*args, **kwargs)
        args, kwargs = policy.cast_call(rule, args, kwargs, STATE.half_dtype)
        with disable_casts():
            return original(*args, **kwargs)

    wrapper.__apex_amp_original__ = original
    wrapper.__apex_amp_rule__ = rule
    return wrapper


@dataclass
class _Patch:
    module: Any
    name: str
    rule: Rule
    original: Callable | None = None  # set while the wrapper is installed
    wrapper: Callable | None = None

    def install(self) -> None:
        if self.wrapper is not None:
            return
        self.original = getattr(self.module, self.name)
        self.wrapper = _cast_wrapper(self.original, self.rule)
        setattr(self.module, self.name, self.wrapper)

    def uninstall(self) -> None:
        if self.wrapper is None:
            return
        if getattr(self.module, self.name, None) is self.wrapper:
            setattr(self.module, self.name, self.original)
        else:
            logger.warning("%s.%s was replaced by someone else while apex_amp O1 was active; "
                           "leaving the replacement in place", _module_name(self.module), self.name)
        self.original = self.wrapper = None


def _module_name(module: Any) -> str:
    return getattr(module, "__name__", type(module).__name__)


# (id(module), name) -> _Patch. The rows of rules.py come first; a user registration of
# the same function replaces its row (the user's choice wins) until it is unregistered.
_PATCHES: dict[tuple[int, str], _Patch] = {}
_BUILTIN: dict[tuple[int, str], tuple[Any, str, Rule]] = {}
def python_owner(path: str) -> Any:
    """The object a Python rule row patches: a module ("torch.nn.functional") or a class ("torch.Tensor")."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module_path, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module_path), name)


for _module_path, _name, _rule in python_rules():
    _module = python_owner(_module_path)
    _BUILTIN[(id(_module), _name)] = (_module, _name, _rule)
    _PATCHES[(id(_module), _name)] = _Patch(_module, _name, _rule)
_USER_KEYS: set[tuple[int, str]] = set()


def install_wrappers() -> None:
    for patch in _PATCHES.values():
        patch.install()


def uninstall_wrappers() -> None:
    for patch in _PATCHES.values():
        patch.uninstall()


def _register(module: Any, name: str, rule: Rule, api: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{api}: name must be a str naming an attribute of the module, got {type(name).__name__}")
    if not hasattr(module, name):
        raise ValueError(f"{api}: {_module_name(module)} has no attribute {name!r}; pass the module "
                         "(or class) that defines the function and the function's exact name")
    if not callable(getattr(module, name)):
        raise TypeError(f"{api}: {_module_name(module)}.{name} is not callable")
    with STATE.lock:
        key = (id(module), name)
        _replace_patch(key, _Patch(module, name, rule))
        _USER_KEYS.add(key)


def _replace_patch(key: tuple[int, str], patch: _Patch | None) -> None:
    previous = _PATCHES.pop(key, None)
    if previous is not None:
        previous.uninstall()
    if patch is not None:
        _PATCHES[key] = patch
        if STATE.active:
            patch.install()


def register_half_function(module: Any, name: str) -> None:
    """Run ``module.name`` in half precision under O1 (its floating inputs are cast).

    Works before or after O1 is activated.

    Args:
        module: the module, class or object holding the function.
        name: the function's attribute name; ``ValueError`` if it does not exist.

    Example::

        >>> import my_extension  # doctest: +SKIP
        >>> amp.register_half_function(my_extension, "fused_gemm")  # doctest: +SKIP
    """
    _register(module, name, Rule.HALF, "register_half_function")


def register_float_function(module: Any, name: str) -> None:
    """Run ``module.name`` in fp32 under O1 (its half inputs are cast to fp32).

    Works before or after O1 is activated.

    Args:
        module: the module, class or object holding the function.
        name: the function's attribute name; ``ValueError`` if it does not exist.

    Example::

        >>> amp.register_float_function(torch, "sigmoid")  # doctest: +SKIP
    """
    _register(module, name, Rule.FP32, "register_float_function")


def register_promote_function(module: Any, name: str) -> None:
    """Run ``module.name`` in the widest floating dtype among its tensor inputs under O1.

    Works before or after O1 is activated.

    Args:
        module: the module, class or object holding the function.
        name: the function's attribute name; ``ValueError`` if it does not exist.

    Example::

        >>> amp.register_promote_function(my_ops, "fused_add")  # doctest: +SKIP
    """
    _register(module, name, Rule.PROMOTE, "register_promote_function")


def unregister_function(module: Any, name: str) -> None:
    """Undo a ``register_*_function`` call (the original function is put back).

    Args:
        module: the module passed at registration.
        name: the attribute name passed at registration; ``ValueError`` if not registered.

    Example::

        >>> amp.unregister_function(torch, "sigmoid")  # doctest: +SKIP
    """
    with STATE.lock:
        key = (id(module), name)
        if key not in _USER_KEYS:
            raise ValueError(f"unregister_function: {_module_name(module)}.{name} was never registered "
                             "with register_half/float/promote_function")
        _USER_KEYS.discard(key)
        builtin = _BUILTIN.get(key)
        _replace_patch(key, _Patch(*builtin) if builtin is not None else None)


def half_function(fn: Callable) -> Callable:
    """Decorator: ``fn`` runs in half precision under O1.

    Example::

        >>> @amp.half_function  # doctest: +SKIP
        ... def fused_gelu_linear(x, weight): ...
    """
    return _cast_wrapper(fn, Rule.HALF)


def float_function(fn: Callable) -> Callable:
    """Decorator: ``fn`` runs in fp32 under O1.

    Example::

        >>> @amp.float_function  # doctest: +SKIP
        ... def stable_logsumexp(x): ...
    """
    return _cast_wrapper(fn, Rule.FP32)


def promote_function(fn: Callable) -> Callable:
    """Decorator: ``fn`` runs in the widest floating dtype among its tensor inputs under O1.

    Example::

        >>> @amp.promote_function  # doctest: +SKIP
        ... def blend(a, b, w): ...
    """
    return _cast_wrapper(fn, Rule.PROMOTE)
