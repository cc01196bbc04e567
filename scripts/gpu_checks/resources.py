"""Registers, stack and local memory of every CUDA kernel in the built extension (cuobjdump).

A kernel with local memory (spilled registers, or an array the compiler could not keep in
registers) or a large stack runs slower than its loads and stores suggest; one with more than
128 registers per thread cannot launch 512 threads per block. Prints one row per kernel and arch
and a KEY line; exits 1 when no kernel is found in apex_amp's extension (a build without CUDA).

Run: ``python scripts/gpu_checks/resources.py [--library PATH]``
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"Function (\S+?):\s*(.*)$")
FIELD = re.compile(r"(\w+):(\d+)")
# 65536 registers per SM: 512 threads per block need at most 128 registers each.
MAX_REGISTERS_AT_512_THREADS = 128


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME", ""), *sorted(glob.glob("/usr/local/cuda*"), reverse=True)]
    # Triton, which CUDA builds of torch install, ships its own copy.
    triton = importlib.util.find_spec("triton")
    if triton is not None and triton.origin:
        homes.append(str(Path(triton.origin).parent / "backends" / "nvidia"))
    for home in homes:
        candidate = Path(home) / "bin" / "cuobjdump"
        if home and candidate.is_file():
            return str(candidate)
    raise SystemExit("resources: cuobjdump not found (put the CUDA toolkit's bin on PATH or set CUDA_HOME)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", type=Path, default=None, help="default: apex_amp/_C*.so of this checkout")
    parser.add_argument("--dry-run", action="store_true",
                        help="a build without CUDA kernels is not a failure (scripts/gpu_check.sh --dry-run)")
    args = parser.parse_args(argv)
    library = args.library or next(iter(sorted((ROOT / "apex_amp").glob("_C*.so"))), None)
    if library is None:
        raise SystemExit("resources: no apex_amp/_C*.so here: build apex_amp first")
    done = subprocess.run([cuobjdump(), "--dump-resource-usage", str(library)], capture_output=True, text=True)
    # cuobjdump prints "Function <name>:" and, on that line or the next, "REG:40 STACK:0 SHARED:0 LOCAL:0 ...".
    arch, rows, function = "?", [], None
    for line in done.stdout.splitlines():
        if line.strip().startswith("arch ="):
            arch = line.split("=")[1].strip()
        match = ROW.search(line)
        text = match.group(2) if match else line
        if match:
            function = match.group(1).rstrip(":")
        fields = {k: int(v) for k, v in FIELD.findall(text)}
        if function is not None and "REG" in fields:
            rows.append((arch, function, fields))
            function = None
    if not rows:
        print(done.stdout[-2000:] + done.stderr[-2000:])
        print("KEY: no CUDA kernels in the extension" + (" (a CPU-only build; dry run)" if args.dry_run else ""))
        return 0 if args.dry_run else 1
    print("| arch | kernel | REG | STACK | SHARED | LOCAL |\n| --- | --- | --- | --- | --- | --- |")
    for arch, name, f in rows:
        print(f"| {arch} | {name[:90]} | {f.get('REG', 0)} | {f.get('STACK', 0)} | {f.get('SHARED', 0)} "
              f"| {f.get('LOCAL', 0)} |")
    registers = max(f.get("REG", 0) for _, _, f in rows)
    local = sum(1 for _, _, f in rows if f.get("LOCAL", 0) or f.get("STACK", 0))
    too_many = sum(1 for _, _, f in rows if f.get("REG", 0) > MAX_REGISTERS_AT_512_THREADS)
    print(f"KEY: {len(rows)} kernels, max {registers} registers, {local} with stack/local memory, "
          f"{too_many} over {MAX_REGISTERS_AT_512_THREADS} registers")
    return 1 if too_many else 0


if __name__ == "__main__":
    sys.exit(main())
