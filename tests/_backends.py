"""Which implementations of the ops the tests run on.

Every op test runs on both: the compiled extension (``torch.ops.apex_amp``,
skipped with the reason when it is not built or is disabled by
APEX_AMP_FORCE_FALLBACK=1) and the pure-PyTorch fallback
(``torch.ops.apex_amp_fallback``).
"""

from __future__ import annotations

import pytest

from apex_amp import ops
from apex_amp._extension import STATUS

BACKENDS = ("extension", "fallback")


def namespace_of(backend: str):
    """torch.ops namespace of `backend`, or a pytest skip saying why it is unavailable."""
    if backend == "extension" and not STATUS.loaded:
        pytest.skip(f"compiled extension not in use: {STATUS.reason}")
    return ops.backend_namespace(backend)
