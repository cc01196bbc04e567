"""Loading the compiled extension ``apex_amp._C``, or saying why it is not used.

The ops have two implementations with the same signatures: the compiled
kernels (``torch.ops.apex_amp``) and the pure-PyTorch fallback
(``torch.ops.apex_amp_fallback``, apex_amp/_fallback.py). This module decides
once, at import, which one :mod:`apex_amp.ops` calls, and remembers why. A
loaded extension covers every device: one it has no kernels for runs the
fallback through the dispatcher (apex_amp/_device_fallback.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from types import ModuleType
from typing import Optional

logger = logging.getLogger("apex_amp")

# Set to 1 to ignore a built extension and run the pure-PyTorch fallback.
FORCE_FALLBACK_ENV = "APEX_AMP_FORCE_FALLBACK"


@dataclasses.dataclass(frozen=True)
class ExtensionStatus:
    """Whether the compiled kernels are in use, and why not when they are not."""

    loaded: bool
    reason: str
    module: Optional[ModuleType] = None

    def build_info(self) -> dict:
        """The extension's own build report (CUDA, archs, compiler), or {}."""
        return dict(self.module.build_info()) if self.module is not None else {}


def _load() -> ExtensionStatus:
    if os.environ.get(FORCE_FALLBACK_ENV, "0") not in ("", "0"):
        return ExtensionStatus(False, f"disabled by {FORCE_FALLBACK_ENV}=1")
    try:
        module = importlib.import_module("apex_amp._C")
    except ImportError as error:
        # A Python-only install has no _C at all; a broken build has one that
        # fails to load (ABI or torch version mismatch). Keep the reason.
        if isinstance(error, ModuleNotFoundError) and error.name == "apex_amp._C":
            reason = "not built (Python-only install; reinstall to compile the kernels)"
        else:
            reason = f"failed to load: {error}"
        return ExtensionStatus(False, reason)
    return ExtensionStatus(True, "loaded", module)


STATUS: ExtensionStatus = _load()

if not STATUS.loaded:
    logger.warning(
        "apex_amp: compiled kernels %s; using the pure-PyTorch fallback (same results, slower).",
        STATUS.reason,
    )
