"""The compiled CPU kernels of every instruction set agree with the fallback.

The extension picks its CPU kernels once per process, following torch's
ATEN_CPU_CAPABILITY (default, avx2, avx512), so a test process only ever runs
one of them. This test starts one small process per instruction set and
compares every op of the extension with the fallback there
(tests/_compare_backends.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _backends import skip_unless_the_cpu_has
from apex_amp._extension import STATUS

REPO = Path(__file__).resolve().parents[1]
COMPARE_SCRIPT = Path(__file__).resolve().parent / "_compare_backends.py"


@pytest.mark.slow
@pytest.mark.parametrize("capability", ("default", "avx2", "avx512"))
def test_every_cpu_instruction_set_matches_the_fallback(capability):
    skip_unless_the_cpu_has(capability)
    if not STATUS.loaded:
        pytest.skip(f"compiled extension not in use: {STATUS.reason}")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": str(REPO)}
    env.pop("APEX_AMP_FORCE_FALLBACK", None)
    child = subprocess.run(
        [sys.executable, str(COMPARE_SCRIPT)], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    if report["capability"].lower() != capability:
        pytest.skip(f"this CPU runs {report['capability']}, not {capability}")
    assert report["problems"] == []
