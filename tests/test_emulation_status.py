"""What `python -m apex_amp report` says of the CUDA emulation suite (apex_amp/_emulation_status.py)."""

from __future__ import annotations

from apex_amp import _build_report, _emulation_status


def fake_checkout(tmp_path):
    for name in ("csrc/cuda/kernel.cu", "tests/emulation/test_kernel.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("// v1\n")
    return tmp_path


def run(scope, passed=True):
    return {"scope": scope, "passed": passed, "counts": {"passed": 7}, "finished": "2030-01-01T00:00:00",
            "coverage": {"percent": 97.5}}


def test_no_recorded_run_names_the_command(tmp_path):
    status = _emulation_status.summary(fake_checkout(tmp_path))
    assert status["state"] == "not run"
    assert _emulation_status.RUN_COMMAND in status["text"]


def test_fast_subset_and_slow_part_passing_on_the_current_sources_is_a_pass_with_coverage(tmp_path):
    root = fake_checkout(tmp_path)
    _emulation_status.record_run(root, run("not slow"))
    assert _emulation_status.summary(root)["state"] == "fast subset passed"
    _emulation_status.record_run(root, run("slow"))
    status = _emulation_status.summary(root)
    assert status["state"] == "passed"
    assert "fast subset (7 passed" in status["text"] and "slow part (7 passed" in status["text"]
    assert "csrc/cuda lines run 97.5%" in status["text"]


def test_a_change_to_the_tested_sources_makes_every_earlier_run_stale(tmp_path):
    root = fake_checkout(tmp_path)
    _emulation_status.record_run(root, run("all"))
    (root / "csrc" / "cuda" / "kernel.cu").write_text("// v2\n")
    status = _emulation_status.summary(root)
    assert status["state"] == "stale" and _emulation_status.RUN_COMMAND in status["text"]


def test_a_whole_suite_run_on_the_current_sources_outweighs_older_partial_runs(tmp_path):
    root = fake_checkout(tmp_path)
    _emulation_status.record_run(root, run("slow"))
    (root / "csrc" / "cuda" / "kernel.cu").write_text("// v2\n")
    _emulation_status.record_run(root, run("all"))
    status = _emulation_status.summary(root)
    assert status["state"] == "passed" and "whole suite" in status["text"]


def test_a_failed_run_fails_the_whole_status(tmp_path):
    root = fake_checkout(tmp_path)
    _emulation_status.record_run(root, run("not slow"))
    _emulation_status.record_run(root, run("slow", passed=False))
    status = _emulation_status.summary(root)
    assert status["state"] == "failed" and status["text"].startswith("FAILED: slow part")


def test_a_run_of_another_build_neither_makes_nor_hides_a_pass(tmp_path):
    root = fake_checkout(tmp_path)
    _emulation_status.record_run(root, run("all, chunks of 65536"))
    assert _emulation_status.summary(root)["state"] == "not run"
    _emulation_status.record_run(root, run("all"))
    assert _emulation_status.summary(root)["state"] == "passed"
    _emulation_status.record_run(root, run("all, chunks of 65536", passed=False))
    status = _emulation_status.summary(root)
    assert status["state"] == "failed" and "all, chunks of 65536" in status["text"]


def test_report_has_a_cuda_emulation_line():
    info = _build_report.collect()
    assert info["cuda_emulation"]["state"] in {
        "passed", "fast subset passed", "failed", "stale", "not run", "no checkout"}
    assert f"  CUDA emulation {info['cuda_emulation']['text']}" in _build_report.format_report(info)
