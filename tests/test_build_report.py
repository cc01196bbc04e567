"""``python -m apex_amp``: the build report says which ops implementation runs and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apex_amp import _build_report, ops
from apex_amp._op_registry import OPS
from apex_amp._extension import STATUS

ROOT = Path(__file__).resolve().parents[1]
OP_NAMES = set(OPS)  # every op (tests/test_ops_schema.py: the extension defines the same)


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "apex_amp", *args], capture_output=True, text=True,
                          timeout=120, env=environment, cwd=ROOT)


def test_report_json_names_the_backend_in_use_and_every_op():
    result = run_cli("report", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["backend"] == ops.BACKEND
    assert info["extension_loaded"] == STATUS.loaded
    if STATUS.loaded:
        assert set(info["kernels"]) == OP_NAMES
        assert all("CPU" in keys for keys in info["kernels"].values())


@pytest.mark.skipif(not STATUS.loaded, reason=f"extension not built: {STATUS.reason}")
def test_report_shows_the_cpu_variant_in_use_among_those_compiled():
    build = STATUS.build_info()
    compiled = build["cpu_isas"].split()
    assert "default" in compiled and build["cpu_isa"] in compiled
    text = _build_report.format_report(_build_report.collect())
    assert f"{build['cpu_isa']} in use on this CPU" in text
    assert run_cli("report", "--require-extension").returncode == 0


def test_forced_fallback_is_reported_and_fails_require_extension():
    result = run_cli("--require-extension", APEX_AMP_FORCE_FALLBACK="1")
    assert result.returncode == 1
    assert "ops backend    fallback" in result.stdout
    assert "APEX_AMP_FORCE_FALLBACK" in result.stderr


def test_require_cuda_names_the_rebuild_when_cuda_is_missing():
    info = _build_report.collect()
    info["extension_loaded"] = True
    info["build_info"] = dict(info["build_info"], cuda=False)
    info["kernels"] = {name: ["CPU"] for name in OP_NAMES}
    found = _build_report.problems(info, require_cuda=True)
    assert any("APEX_AMP_CUDA=1" in problem for problem in found)
    assert any("op fused_adam_ has no CUDA kernel" in problem for problem in found)
    assert _build_report.problems(info, require_cuda=False) == []
