"""The dispatcher key O1's kernels are registered at, and the thread-local switch that routes calls to it.

O1 must cast ops without switching torch's autocast on: under apex (function patching)
``torch.is_autocast_enabled("cpu")`` and ``("cuda")`` read False, and libraries read
that flag to decide how to run (DeepSpeed >= 0.17.6 runs its engine's forward under
``torch.autocast(enabled=False)`` when it finds it on). In torch, a device's autocast flag
*is* its Autocast key being absent from the thread's excluded dispatch keys, so kernels at
``AutocastCPU`` / ``AutocastCUDA`` cannot run while that flag reads False.

O1 therefore carries its kernels on the Autocast key of a device apex_amp never runs on,
``AutocastIPU`` (Graphcore IPUs: torch registers no kernel there). That key sits where every
Autocast key sits, above autograd (so autograd records O1's casts), and tensors of no
device carry it, so a thread reaches it only when the key is in its *included* set as
well. The only trace left in torch's public state is ``torch.is_autocast_enabled("ipu")``,
which reads True on a thread while O1 casts there.

Two thread-local bits make the switch: the key in the thread's included set (set by
:func:`route`, a private torch binding: stable from torch 2.0 through 2.15, and the only
private call, kept here) and the key absent from its excluded set, which is the public
``torch.set_autocast_enabled("ipu", ...)``. :func:`set_on` flips only the latter, so
``disable_casts`` stays public API that ``torch.compile`` traces and guards.
"""
from __future__ import annotations

import torch

__all__ = ["KEY_NAME", "KEY_SET", "DEVICE", "is_on", "set_on", "route", "is_routed", "install_fallthrough"]

KEY_NAME = "AutocastIPU"
DEVICE = "ipu"  # the device type whose autocast flag is KEY_NAME's excluded bit
KEY_SET = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, KEY_NAME))


def is_on() -> bool:
    """Whether this thread's calls reach O1's kernels (given :func:`route`)."""
    return torch.is_autocast_enabled(DEVICE)


def set_on(on: bool) -> None:
    """Let this thread's calls reach O1's kernels (True) or pass them (False)."""
    torch.set_autocast_enabled(DEVICE, on)


def route(included: bool) -> None:
    """Put the key in this thread's included set (no tensor carries it), or take it out.

    Version note: ``torch._C._dispatch_tls_set_dispatch_key_included`` is private API.
    """
    torch._C._dispatch_tls_set_dispatch_key_included(getattr(torch._C.DispatchKey, KEY_NAME), included)


def is_routed() -> bool:
    return torch._C._dispatch_tls_is_dispatch_key_included(getattr(torch._C.DispatchKey, KEY_NAME))


def install_fallthrough() -> torch.library.Library:
    """Every op without an O1 kernel falls through the key (torch registers no fallback for it).

    Returns the registration; destroying it (``Library._destroy``) removes the fallback.
    """
    library = torch.library.Library("_", "IMPL")
    library.fallback(torch.library.fallthrough_kernel, KEY_NAME)
    return library
