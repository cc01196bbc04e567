"""Set-up of the emulated CUDA kernel tests: loads the library that
tests/emulation/emulation_build.py builds (csrc/cuda compiled for the host, ops in
torch.ops.apex_amp_emulated) next to the real CPU kernels (torch.ops.apex_amp).
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

LIBRARY_ENV = "APEX_AMP_EMULATION_LIBRARY"


def _address_sanitizer_loaded() -> bool:
    return hasattr(ctypes.CDLL(None), "__asan_init")


def pytest_configure(config):
    library = os.environ.get(LIBRARY_ENV)
    if not library or not _address_sanitizer_loaded():
        raise pytest.UsageError(
            "these tests run csrc/cuda's kernels in the host emulation, which needs "
            "AddressSanitizer's runtime loaded before Python starts; run them with "
            "`python tests/emulation/run.py` (docs/cuda_emulation.md)")
    from apex_amp._extension import STATUS

    if not STATUS.loaded:
        raise pytest.UsageError(
            f"the emulated kernels are compared with the compiled CPU kernels, but apex_amp._C "
            f"is {STATUS.reason}; build it with `bash scripts/setup.sh`")
    torch.ops.load_library(library)
    # The emulated launchers register kernels only; their schemas are apex_amp's, from the one
    # definition of each op (apex_amp/_op_registry.py), under the emulation's namespace.
    from apex_amp._op_registry import OPS, define_schemas

    define_schemas("apex_amp_emulated", OPS.values())
    # The CPU kernels need no second thread for these sizes, and the machine is shared.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def limits():
    from _twins import Limits

    return Limits.of_build()
