#!/usr/bin/env bash
# The whole GPU validation of apex_amp as one command, for a machine with a CUDA GPU and no network:
# builds the kernels for the visible GPU's arch only (pip install --no-build-isolation --no-deps -e .
# with the machine's own python3 and torch), then, each step time-boxed and logged, continuing past a
# failing step: report --require-cuda, CUDA vs CPU kernels bit for bit, O1/O2 steps with no host sync,
# pytest -m cuda, compute-sanitizer memcheck and racecheck, and the GPU benchmarks. Writes
# $OUT/summary.md and $OUT/summary.json (and $OUT/logs/) and prints the summary table last.
#
#   bash scripts/gpu_check.sh              # on the GPU machine, from the repository root (~7-8 min on an H100)
#   bash scripts/gpu_check.sh --dry-run    # anywhere: everything that can run without a GPU
#   OUT=/tmp/gc bash scripts/gpu_check.sh --budget 400 --steps build,report,pytest_cuda
#
# Environment: OUT (default ./gpu_check_out), PYTHON (default python3). See docs/cuda_emulation.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
export OUT="${OUT:-$PWD/gpu_check_out}"
exec "$PYTHON" scripts/gpu_checks/run.py --python "$PYTHON" "$@"
