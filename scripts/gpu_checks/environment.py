"""What the GPU machine has: the GPU and its capability, the driver, torch and its CUDA, nvcc, the sanitizer.

Run by scripts/gpu_check.sh as its first step; ``--dry-run`` reports the same without asking for a GPU.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys

import torch


def tool_version(command: list[str]) -> str:
    if shutil.which(command[0]) is None:
        return "not found"
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in (done.stdout or done.stderr).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit {done.returncode}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="do not ask for a GPU")
    args = parser.parse_args(argv)
    print(f"python {platform.python_version()} ({sys.executable})")
    print(f"torch {torch.__version__}, built with CUDA {torch.version.cuda}")
    print(f"nvcc: {tool_version(['nvcc', '--version'])}")
    print(f"compute-sanitizer: {tool_version(['compute-sanitizer', '--version'])}")
    print(f"nvidia-smi: {tool_version(['nvidia-smi', '--query-gpu=name,driver_version,memory.total', '--format=csv,noheader'])}")
    if args.dry_run:
        print("KEY: dry run: no GPU asked for")
        return 0
    if not torch.cuda.is_available():
        print("KEY: torch sees no CUDA GPU")
        return 1
    properties = torch.cuda.get_device_properties(0)
    major, minor = torch.cuda.get_device_capability(0)
    print(f"GPU: {properties.name}, sm_{major}{minor}, {properties.multi_processor_count} SMs, "
          f"{properties.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible")
    print(f"KEY: {properties.name} sm_{major}{minor}, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
