"""Builds and runs the host emulation of the CUDA kernels (docs/cuda_emulation.md).

    python tests/emulation/run.py                 # build, then every emulated-op test
    python tests/emulation/run.py -m "not slow"   # the smoke subset
    python tests/emulation/run.py -- -k adam -x   # anything after -- goes to pytest

Prints the share of csrc/cuda's lines the emulated ops executed, and records
the run for `python -m apex_amp report`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import emulation_build  # noqa: E402
import emulation_runner  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", dest="markers", default="", help="pytest marker expression, e.g. 'not slow'")
    parser.add_argument("--chunk-size", type=int, default=emulation_build.DEFAULT_CHUNK_SIZE,
                        help="elements per chunk of the emulation build (the shipped kernels use 65536)")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = parser.parse_args()
    started = time.monotonic()
    built = emulation_build.build(args.chunk_size, verbose=True)
    print(f"== built in {time.monotonic() - started:.0f}s; running the emulated-op tests", flush=True)
    run = emulation_runner.run_tests(built, args.markers, args.pytest_args, echo=True)
    if run.record.get("coverage"):
        print(emulation_runner.format_coverage(run.record["coverage"]))
    print(f"== {'passed' if run.returncode == 0 else 'FAILED'} "
          f"({time.monotonic() - started:.0f}s in all)")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
