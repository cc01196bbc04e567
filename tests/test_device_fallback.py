"""An op called on a device the extension has no kernels for runs the pure-PyTorch ops, with one warning.

The proof needs no GPU: tests/_python_device.py makes a device type (``nokernels``, torch's
PrivateUse1 backend) that has kernels for torch's ops and none for apex_amp's, which is what
CUDA tensors meet in a CPU-only build. Renaming PrivateUse1 is for the whole process, hence
the child process (tests/_device_fallback_child.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apex_amp import _build_report
from apex_amp._device_fallback import DEVICE_KEYS, compiled_devices
from apex_amp._extension import STATUS
from apex_amp._op_registry import OPS

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(not STATUS.loaded, reason=f"extension not built: {STATUS.reason}")


@pytest.fixture(scope="module")
def child() -> dict:
    # PYTHONPATH: the apex_amp of this checkout, and the test device beside this file.
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    result = subprocess.run([sys.executable, str(TESTS / "_device_fallback_child.py")], capture_output=True,
                            text=True, timeout=300, cwd=TESTS, env=environment)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_ops_on_a_device_without_kernels_run_the_pure_pytorch_ops(child):
    assert child["backend"] == "extension"
    assert "error" not in child, child["error"]
    assert child["ops"] == {name: True for name in
                            ("check_finite", "unscale_", "scale_", "axpby_", "l2norm", "update_scale_")}
    assert child["fused_adam"] is True
    assert child["compiled"] is True


def test_the_first_op_on_such_a_device_warns_once_naming_it_and_the_rebuild(child):
    # Six list and scaler calls, two optimizer steps and a compiled function on the device: one warning.
    assert len(child["warnings"]) == 1, child["warnings"]
    message = child["warnings"][0]
    assert "no kernels for nokernels tensors" in message
    assert "APEX_AMP_CUDA=1" in message and "docs/building.md" in message


def test_the_report_names_the_devices_with_compiled_kernels(child):
    assert child["compiled_devices"] == compiled_devices()
    devices_line = next(line for line in child["report"].splitlines() if line.startswith("  devices "))
    assert f"compiled kernels for {' and '.join(compiled_devices())}" in devices_line
    assert "any other device run the pure-PyTorch ops" in devices_line


@pytest.mark.parametrize("op_name", sorted(OPS))
def test_compiled_kernels_stay_the_dispatchers_choice_where_they_exist(op_name):
    # The hot path is untouched: a device key with a compiled kernel dispatches to it directly;
    # the pure-PyTorch kernel, registered once for the alias key, only fills the keys without one.
    qualified = f"apex_amp::{op_name}"
    table = dict(line.split(": ", 1) for line in torch._C._dispatch_dump_table(qualified).splitlines() if ": " in line)
    table = {key: table.get(key, "no kernel") for key in DEVICE_KEYS + ("XPU", "MPS", "PrivateUse1")}
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU")
    for key in DEVICE_KEYS + ("XPU", "MPS", "PrivateUse1"):
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key):
            assert "csrc/" in table[key] and table[key].endswith("[kernel]"), (key, table[key])
        else:
            # FALLBACK_KEY's kernel, registered by apex_amp/_op_registry.py, as the key's default.
            assert "apex_amp/_op_registry.py" in table[key] and table[key].endswith("[default backend kernel]"), (
                key, table[key])


def test_a_cpu_only_build_reports_cuda_as_running_the_fallback():
    info = _build_report.collect()
    info.update(extension_loaded=True, compiled_devices=["CPU"])
    line = _build_report.format_report(info)
    assert ("devices        compiled kernels for CPU; CUDA and any other device run the pure-PyTorch ops"
            in line) and "APEX_AMP_CUDA=1" in line
