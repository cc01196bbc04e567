"""scripts/gpu_check.sh, the one-command GPU validation: its dry run passes here, so it cannot rot.

The dry run goes through every step with what a machine without a GPU can run (docs/cuda_emulation.md);
the orchestration's rules (the arch list, the budget, a failed build) are checked on real commands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "gpu_checks"))

import run as gpu_check  # noqa: E402

STEP_NAMES = [step.name for step in gpu_check.STEPS]


def test_the_build_targets_only_the_visible_gpus_arch():
    assert gpu_check.arch_list_for((9, 0)) == "9.0"
    assert gpu_check.arch_list_for((8, 9)) == "8.9"
    plan = gpu_check.Plan(dry_run=False, python="python3", out=Path("."), arch_list="9.0", jobs=16)
    build = next(step for step in gpu_check.STEPS if step.name == "build")
    assert build.command(plan) == ["python3", "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."]
    assert build.env(plan) == {"TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": "16", "APEX_AMP_CUDA": "1"}


def test_every_test_file_of_the_cuda_step_exists_and_has_cuda_tests():
    for name in gpu_check.CUDA_TEST_FILES:
        path = ROOT / name
        assert path.is_file(), name
    marked = [name for name in gpu_check.CUDA_TEST_FILES if "device" in (ROOT / name).read_text()]
    assert len(marked) >= 8, marked


def _plan(tmp_path, dry_run=True):
    (tmp_path / "logs").mkdir(exist_ok=True)
    return gpu_check.Plan(dry_run=dry_run, python=sys.executable, out=tmp_path, arch_list="9.0", jobs=2)


def _step(name, code, **limits):
    return gpu_check.Step(name, "a test step", lambda plan: [sys.executable, "-c", code],
                          limits.get("timeout", 30), limits.get("minimum", 0), key=gpu_check.key_after("KEY:"))


def test_a_failing_step_is_recorded_with_its_exit_code_and_last_line(tmp_path):
    record = gpu_check.run_step(_step("boom", "print('KEY: 3 broken'); raise SystemExit(3)"), _plan(tmp_path),
                                100.0, build_ok=True)
    assert record["status"] == "failed (exit 3)"
    assert record["key"] == "3 broken"
    assert "raise SystemExit(3)" in (tmp_path / "logs" / "boom.log").read_text()


def test_a_step_past_its_time_box_is_stopped_and_recorded(tmp_path):
    record = gpu_check.run_step(_step("slow", "import time; time.sleep(30)", timeout=1),
                                _plan(tmp_path, dry_run=False), 100.0, build_ok=True)
    assert record["status"] == "timed out (1 s)"
    assert record["seconds"] < 10
    # A dry run's time boxes are larger: the CPU does the GPU's work.
    record = gpu_check.run_step(_step("slow", "import time; time.sleep(30)", timeout=1), _plan(tmp_path), 100.0,
                                build_ok=True)
    assert record["status"] == f"timed out ({gpu_check.DRY_RUN_TIME_FACTOR} s)"


def test_a_step_that_does_not_fit_the_budget_left_is_not_started(tmp_path):
    record = gpu_check.run_step(_step("late", "open('started', 'w')", minimum=50), _plan(tmp_path), 20.0,
                                build_ok=True)
    assert record["status"] == "not run"
    assert "20 s left" in record["key"]
    assert not (tmp_path / "logs" / "late.log").exists()


def test_nothing_that_needs_the_extension_runs_after_a_failed_build(tmp_path):
    record = gpu_check.run_step(_step("report", "pass"), _plan(tmp_path), 100.0, build_ok=False)
    assert (record["status"], record["key"]) == ("not run", "the build failed")


@pytest.mark.slow
def test_the_dry_run_passes_every_step_and_writes_the_summary(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--budget", "900"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = json.loads((tmp_path / "summary.json").read_text())
    logs = {r["step"]: (tmp_path / "logs" / f"{r['step']}.log").read_text() for r in summary["steps"]}
    failed = {r["step"]: logs[r["step"]][-2000:] for r in summary["steps"] if r["status"] != "ok"}
    assert not failed, failed
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [r["step"] for r in summary["steps"]] == STEP_NAMES
    assert summary["dry_run"] is True and summary["arch_list"] == "9.0"
    # The summary table comes last in the output, one row per step.
    assert done.stdout.rstrip().splitlines()[-1].startswith("| initcheck | ok |")
    assert (tmp_path / "summary.md").read_text().count("| ok |") == len(STEP_NAMES)
    # The build's command and environment are those of a real run (only not executed).
    assert f"would run: {sys.executable} -m pip install --no-build-isolation --no-deps -e ." in logs["build"]
    assert "# TORCH_CUDA_ARCH_LIST=9.0" in logs["build"]
    # The CUDA tests are collected (a renamed file or marker would show here), and every program ran.
    collected = int(summary["steps"][STEP_NAMES.index("pytest_cuda")]["key"].split("/")[0].split()[0])
    assert collected > 300
    assert "0 inf/NaN mismatches" in logs["compare_devices"]
    assert "8/8 configurations ran" in logs["sync_free_steps"]
    assert "training 7 configs ok" in logs["bench_training"]


def test_the_sanitizer_key_reads_every_tools_summary():
    assert gpu_check.sanitizer_key("...\n========= ERROR SUMMARY: 3 errors\n") == "3 errors"
    assert gpu_check.sanitizer_key("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
                                   "KEY: 16/40 rows bit for bit") == "0 hazards"
