"""The host emulation of the CUDA kernels, from the main suite (docs/cuda_emulation.md).

Builds csrc/cuda as host C++ under AddressSanitizer and UBSan (a few minutes
the first time, incremental after; tests/emulation/emulation_build.py), then:
  * runs each kernel of tests/emulation/cpp/gpu_rule_violations.cpp, which
    breaks one rule a GPU enforces, and checks that the emulation fails it the
    way a GPU would; and one kernel that keeps every rule, which must pass;
  * checks that kernel arguments a GPU cannot take do not compile;
  * runs the emulated-op tests (tests/emulation: emulated CUDA launchers
    against the CPU kernels): the smoke subset here, the rest under `slow`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "emulation"))

import emulation_build  # noqa: E402
import emulation_runner  # noqa: E402
from apex_amp import _emulation_status  # noqa: E402

# What each case of gpu_rule_violations must fail with: the sanitizer's or
# the emulation's words, or the error C10_CUDA_KERNEL_LAUNCH_CHECK() throws.
GPU_RULES = {
    "misaligned_vector_load": r"misaligned address \S+ for type 'const struct VectorOf', which requires 16 byte alignment",
    "misaligned_vector_store": r"store to misaligned address \S+ for type 'struct VectorOf', which requires 16 byte alignment",
    "read_past_tensor": r"heap-buffer-overflow(.|\n)*READ of size 4(.|\n)*0 bytes to the right of 400-byte region",
    "write_past_tensor": r"heap-buffer-overflow(.|\n)*WRITE of size 4(.|\n)*0 bytes to the right of 400-byte region",
    "shared_index_out_of_bounds": r"index \d+ out of bounds for type 'float \[32\]'",
    "divergent_syncthreads": r"returned while other threads of its block wait at __syncthreads\(\)",
    "syncthreads_at_two_sites": r"waits at __syncthreads\(\) at \S+ while thread \(0,0,0\) waits at the one at",
    "shuffle_after_lane_returned": r"lane 5 of mask 0xffffffff has returned",
    "shuffle_in_partial_warp": r"mask 0xffffffff names lane 16, which this block does not have",
    "too_many_threads": r"launch failed: CUDA error: invalid configuration argument",
    "no_blocks": r"launch failed: CUDA error: invalid configuration argument",
    "too_much_dynamic_shared_memory": r"launch failed: CUDA error: invalid argument",
    "launch_on_default_stream": r"not on the current stream",
    "launch_without_device_guard": r"launched without a device guard",
    "unchecked_launch_error": r"error of an earlier launch \(invalid configuration argument\) was never checked",
    "thread_index_outside_kernel": r"threadIdx/blockIdx/blockDim/gridDim used outside a kernel",
}

KERNEL_PARAMETER_RULES = {
    "over_4kb": ("struct Big { char bytes[4097]; };", "Big", "Big{}",
                 "kernel parameters exceed 4 KB"),
    "reference": ("", "const float&", "1.f", "a kernel parameter cannot be a reference"),
    "not_trivially_copyable": ("struct Owner { Owner() = default; Owner(const Owner&) {} };", "Owner",
                               "Owner{}", "every parameter type must be trivially copyable"),
}


@pytest.fixture(scope="module")
def built():
    return emulation_build.build()


def run_case(built, case):
    return subprocess.run([str(built.violations), case], env=emulation_runner.sanitizer_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", GPU_RULES)
def test_emulation_fails_a_kernel_that_breaks_a_gpu_rule(built, case):
    result = run_case(built, case)
    assert result.returncode != 0, f"{case} ran to completion:\n{result.stdout}{result.stderr}"
    assert re.search(GPU_RULES[case], result.stderr), result.stderr[-4000:]


def test_kernel_keeping_every_rule_passes_the_same_checks(built):
    # Shared memory, a barrier, shuffles and atomics, and csrc/cuda's element
    # loop over aligned and misaligned tensors across launches.
    result = run_case(built, "well_behaved")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "well_behaved: ok" in result.stdout


@pytest.mark.parametrize("rule", KERNEL_PARAMETER_RULES)
def test_kernel_arguments_a_gpu_cannot_take_do_not_compile(rule):
    declarations, parameter, argument, message = KERNEL_PARAMETER_RULES[rule]
    snippet = f"""
        #include "cuda_emulation.h"
        {declarations}
        __global__ void kernel({parameter}) {{}}
        void launch() {{ APEX_AMP_LAUNCH(1, 1, 0, nullptr, kernel)({argument}); }}
    """
    assert message in emulation_build.compile_errors(snippet)
    # The same launch of a kernel taking a float compiles: the rule, not the snippet, fails.
    fine = snippet.replace(f"kernel({parameter})", "kernel(float)").replace(f")({argument})", ")(1.f)")
    assert emulation_build.compile_errors(fine) == ""


def assert_suite_passed(built, markers):
    run = emulation_runner.run_tests(built, markers)
    assert run.returncode == 0, run.output[-20000:]
    recorded = _emulation_status.summary()["runs"][markers]
    assert recorded["passed"] and recorded["counts"].get("passed", 0) > 0
    assert recorded["fingerprint"] == _emulation_status.source_fingerprint(emulation_build.ROOT)


def test_emulated_cuda_ops_match_cpu_kernels_smoke(built):
    assert_suite_passed(built, "not slow")


@pytest.mark.slow
def test_emulated_cuda_ops_match_cpu_kernels_full_matrix(built):
    assert_suite_passed(built, "slow")
