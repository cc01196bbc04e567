"""The pure-PyTorch ops on the devices the compiled extension has no kernels for.

csrc registers a CPU kernel for every op, and a CUDA kernel when the build had a
CUDA toolkit. Without more, a call with tensors on any other device (CUDA in a
CPU-only build; XPU, MPS, an out-of-tree PrivateUse1 backend) would end in the
dispatcher's ``NotImplementedError``. So :func:`register` gives each op of the
extension's namespace its pure-PyTorch implementation as its
``CompositeExplicitAutograd`` kernel: the dispatcher uses such a kernel for every
device key that has no kernel of its own, and only for those. CPU (and CUDA, when
compiled) calls go to the compiled kernels exactly as before, at the same cost,
and the choice is the dispatcher's, so it holds under ``torch.compile`` too.

The first call on each device type logs one warning naming the device and how to
compile kernels for it; :func:`compiled_devices` says which devices have them
(``python -m apex_amp report`` prints it).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch

__all__ = ["DEVICE_KEYS", "REBUILD_HINT", "compiled_devices", "register"]

logger = logging.getLogger("apex_amp")

# The dispatch keys csrc can register kernels for (csrc/cpu, csrc/cuda).
DEVICE_KEYS = ("CPU", "CUDA")
# The dispatch key whose kernel the dispatcher uses for every device key without one.
FALLBACK_KEY = "CompositeExplicitAutograd"
REBUILD_HINT = ("apex_amp compiles CPU and CUDA kernels; for CUDA, rebuild with a CUDA toolkit: "
                "`APEX_AMP_CUDA=1 pip install --no-build-isolation .` (see docs/building.md)")

_warned_devices: set[str] = set()
_warned_lock = threading.Lock()


def compiled_devices(namespace: str = "apex_amp") -> list[str]:
    """The dispatch keys of :data:`DEVICE_KEYS` with a compiled kernel for every op of ``namespace``."""
    prefix = namespace + "::"
    names = [name for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix)]
    return [key for key in DEVICE_KEYS
            if names and all(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for name in names)]


def _device_type(args: tuple) -> str:
    # An op's tensors are all on one device (its checks refuse a mix): the first one found names
    # it. The list ops take a list first, which may be empty; their flags come after it.
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
        if isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    return item.device.type
    return "unknown"


def _warn_once(device_type: str, op_name: str, namespace: str) -> None:
    with _warned_lock:
        if device_type in _warned_devices:
            return
        _warned_devices.add(device_type)
    compiled = " and ".join(compiled_devices(namespace)) or "no device"
    logger.warning(
        "apex_amp: the compiled extension has no kernels for %s tensors (it has %s kernels); "
        "%s and every other apex_amp op on %s run the pure-PyTorch fallback (same results, slower). %s.",
        device_type, compiled, op_name, device_type, REBUILD_HINT,
    )


def _fallback_kernel(namespace: str, name: str, implementation: Callable) -> Callable:
    qualified = f"{namespace}::{name}"

    def kernel(*args: Any, **kwargs: Any) -> Any:
        device_type = _device_type(args)
        if device_type not in _warned_devices:
            _warn_once(device_type, qualified, namespace)
        return implementation(*args, **kwargs)

    kernel.__name__ = f"{name}_fallback_kernel"
    return kernel


def register(library: torch.library.Library, name: str, implementation: Callable) -> None:
    """Make ``implementation`` the kernel of ``library``'s op ``name`` on every device with no compiled one."""
    library.impl(name, _fallback_kernel(library.ns, name, implementation), FALLBACK_KEY)
