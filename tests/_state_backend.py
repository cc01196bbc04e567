"""The backend the optimizer-state tests run on: the ops in use where they take state formats.

issue-27-formats gives every fused op its state operands (``master_remainders``,
``state_absmaxes``) with a working pure-PyTorch implementation first; until its compiled CPU
kernels for them land, those kernels refuse bf16/fp8/int8 states and remainders with a
RuntimeError saying so ("... not yet"). The optimizer layer's tests (state layout, checkpoints,
remainder masters, the memory report) then run on the pure-PyTorch ops, the definition the
kernels are tested against, and so do the processes they start; once the kernels take state
formats, on the kernels.
"""

from __future__ import annotations

import functools

import pytest
import torch

from apex_amp import ops
from apex_amp._extension import FORCE_FALLBACK_ENV


@functools.lru_cache(maxsize=None)
def ops_in_use_take_state_formats() -> bool:
    """Whether the backend in use runs a step with a bf16 state and a remainder master (probed once)."""
    param = torch.ones(32, dtype=torch.bfloat16)
    try:
        ops.fused_sgd_([param], [torch.ones(32)], [torch.zeros(32, dtype=torch.bfloat16)], [], 0.1, 0.9, 0.0,
                       0.0, False, True, False, None, None,
                       master_remainders=[torch.zeros(32, dtype=torch.int16)], state_absmaxes=[])
    except RuntimeError as error:
        if "not yet" not in str(error):
            raise
        return False
    return True


@pytest.fixture
def formats_backend(monkeypatch):
    """The fused optimizers' ops on a backend that takes state formats (see the module docstring)."""
    if ops_in_use_take_state_formats():
        yield ops.BACKEND
        return
    monkeypatch.setattr(ops, "_ops", ops.backend_namespace("fallback"))
    monkeypatch.setenv(FORCE_FALLBACK_ENV, "1")  # and the processes a test starts
    ops._derived_wrapper.cache_clear()  # the derived wrappers hold the op of the backend they were made with
    yield "fallback"
    ops._derived_wrapper.cache_clear()
