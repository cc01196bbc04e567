"""Which implementations of the ops the tests run on.

Every op test runs on both: the compiled extension (``torch.ops.apex_amp``,
skipped with the reason when it is not built or is disabled by
APEX_AMP_FORCE_FALLBACK=1) and the pure-PyTorch fallback
(``torch.ops.apex_amp_fallback``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apex_amp import ops
from apex_amp._extension import STATUS

BACKENDS = ("extension", "fallback")


def namespace_of(backend: str):
    """torch.ops namespace of `backend`, or a pytest skip saying why it is unavailable."""
    if backend == "extension" and not STATUS.loaded:
        pytest.skip(f"compiled extension not in use: {STATUS.reason}")
    return ops.backend_namespace(backend)


# What each of the kernels' instruction sets needs of the CPU (csrc/cpu/isa_dispatch.cpp checks the same).
_ISA_FLAGS = {"default": set(), "avx2": {"avx2", "fma", "f16c"},
              "avx2_and_avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}}


def skip_unless_the_cpu_has(capability: str) -> None:
    """Skip a test that runs a child under ``ATEN_CPU_CAPABILITY=capability`` ("default", "avx2",
    "avx512") on a CPU without those instructions: torch believes the variable, and its own kernels
    of that capability would stop the child with SIGILL (seen on an AVX2-only AMD EPYC)."""
    needed = _ISA_FLAGS["avx2_and_avx512" if capability == "avx512" else capability]
    try:
        flags = set(" ".join(line.partition(":")[2] for line in Path("/proc/cpuinfo").read_text().splitlines()
                             if line.startswith("flags")).split())
    except OSError:  # not Linux: what the extension's own dispatch found in this process
        flags = set()
        if STATUS.loaded:
            isa = STATUS.module.build_info()["cpu_isa"]
            flags = _ISA_FLAGS["avx2_and_avx512" if isa == "avx512" else isa]
    missing = sorted(needed - flags)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: no {capability} kernels run here")
