"""Builds the host emulation of the CUDA kernels (test-only; docs/cuda_emulation.md).

    python tests/emulation/emulation_build.py [--chunk-size N]    # prints what it built

Writes a ninja file to build/emulation/ and runs ninja (incremental; MAX_JOBS
jobs, default 2). Two targets, both with AddressSanitizer, UBSan and gcov:

  libapex_amp_emulated.so  csrc/cuda/*.cu compiled as host C++ with include/cuda_emulation.h
                           force-included, csrc/cuda/register_cuda.cpp with
                           cpp/emulated_ops_prelude.h (the schemas come from apex_amp's
                           op registry, defined by conftest.py), plus the
                           emulated device (cpp/runtime.cpp, cpp/fiber.cpp) and the
                           test-only ops (cpp/inspection_ops.cpp). Its ops are
                           torch.ops.apex_amp_emulated.*; load it only into a process
                           started with AddressSanitizer's runtime preloaded (run.py).
  gpu_rule_violations      cpp/gpu_rule_violations.cpp: kernels that break GPU rules.

The real extension (setup.py) is not touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CSRC = ROOT / "csrc"
BUILD_DIR = ROOT / "build" / "emulation"

# Elements per chunk in this build (the shipped kernels use 65536): small
# enough that a tensor crossing a launch's 320-block limit has ~1.3M elements.
DEFAULT_CHUNK_SIZE = 4096

SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
              # vptr checks need one type_info per class across libraries, which
              # -fvisibility=hidden (below) gives up for torch's header-only classes.
              "-fno-sanitize=vptr"]


@dataclasses.dataclass(frozen=True)
class Built:
    library: Path       # libapex_amp_emulated.so
    violations: Path    # the gpu_rule_violations program
    object_dir: Path    # objects, gcov notes (.gcno) and counts (.gcda)
    chunk_size: int     # elements per chunk this build was compiled with
    rebuilt: bool       # whether ninja changed the library


def torch_paths() -> tuple[list[Path], Path]:
    import torch

    torch_dir = Path(torch.__file__).resolve().parent
    include = torch_dir / "include"
    return [include, include / "torch" / "csrc" / "api" / "include"], torch_dir / "lib"


def cxx_abi_flag() -> str:
    import torch

    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def ninja_binary() -> str:
    beside_python = Path(sys.executable).parent / "ninja"
    found = str(beside_python) if beside_python.exists() else shutil.which("ninja")
    if found is None:
        raise RuntimeError("ninja is needed to build the CUDA emulation; `pip install ninja`")
    return found


def compiler() -> str:
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if found is None:
        raise RuntimeError("a C++ compiler (g++) is needed to build the CUDA emulation; set CXX")
    return found


def ninja_file(chunk_size: int, out: Path) -> str:
    includes, torch_lib = torch_paths()
    cflags = ["-std=c++20", "-fPIC", "-O1", "-g", "-fno-omit-frame-pointer", *SANITIZERS,
              "--coverage", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
              "-Wall", "-Wno-unknown-pragmas", cxx_abi_flag(),
              f"-DAPEX_AMP_EMULATION_CHUNK_SIZE={chunk_size}",
              f"-I{HERE / 'include'}", f"-I{HERE / 'cpp'}", f"-I{CSRC}",
              *(f"-isystem {path}" for path in includes)]
    ldflags = [*SANITIZERS, "--coverage", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"]
    prelude = HERE / "cpp" / "emulated_ops_prelude.h"
    q = shlex.quote

    lines = [
        f"cxx = {q(compiler())}",
        f"cflags = {' '.join(cflags)}",
        f"ldflags = {' '.join(ldflags)}",
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $cflags $extra -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compile $in",
        "rule link_library",
        "  command = $cxx -shared $in -o $out $ldflags -lc10 -ltorch_cpu -ltorch",
        "  description = link $out",
        "rule link_program",
        "  command = $cxx $in -o $out $ldflags -lc10",
        "  description = link $out",
    ]

    def compile_step(source: Path, name: str, extra: str = "") -> str:
        obj = out / "obj" / f"{name}.o"
        lines.append(f"build {q(str(obj))}: cxx {q(str(source))}")
        if extra:
            lines.append(f"  extra = {extra}")
        return q(str(obj))

    # The launchers (*.cu) get the CUDA language as host C++; the registrations
    # (csrc/cuda/register_cuda.cpp) the prelude that moves them to apex_amp_emulated.
    launchers = f"-x c++ -include {q(str(HERE / 'include' / 'cuda_emulation.h'))}"
    registrations = f"-include {q(str(prelude))}"
    csrc_objects = []
    for source in sorted((CSRC / "cuda").glob("*.cu")):
        csrc_objects.append(compile_step(source, source.stem, launchers))
    for source in sorted((CSRC / "cuda").glob("*.cpp")):
        csrc_objects.append(compile_step(source, source.stem, registrations))
    device = [compile_step(HERE / "cpp" / "runtime.cpp", "runtime"),
              compile_step(HERE / "cpp" / "fiber.cpp", "fiber")]
    inspection = compile_step(HERE / "cpp" / "inspection_ops.cpp", "inspection_ops")
    violations = compile_step(HERE / "cpp" / "gpu_rule_violations.cpp", "gpu_rule_violations")

    lines.append(f"build {q(str(out / 'libapex_amp_emulated.so'))}: link_library "
                 f"{' '.join(csrc_objects + device + [inspection])}")
    lines.append(f"build {q(str(out / 'gpu_rule_violations'))}: link_program "
                 f"{' '.join([violations] + device)}")
    return "\n".join(lines) + "\n"


def build(chunk_size: int = DEFAULT_CHUNK_SIZE, verbose: bool = False) -> Built:
    """Builds (incrementally) both targets for `chunk_size`, in build/emulation/chunk<N>/."""
    if chunk_size <= 0 or chunk_size % 4 != 0:
        raise ValueError(f"chunk_size must be a positive multiple of 4 (kILP), got {chunk_size}")
    out = BUILD_DIR / f"chunk{chunk_size}"
    (out / "obj").mkdir(parents=True, exist_ok=True)
    ninja_path = out / "build.ninja"
    text = ninja_file(chunk_size, out)
    if not ninja_path.exists() or ninja_path.read_text() != text:
        ninja_path.write_text(text)
    library = out / "libapex_amp_emulated.so"
    before = library.stat().st_mtime_ns if library.exists() else None
    jobs = os.environ.get("MAX_JOBS", "2")
    result = subprocess.run([ninja_binary(), "-C", str(out), "-j", jobs],
                            capture_output=not verbose, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the CUDA emulation failed:\n{result.stdout}{result.stderr}")
    rebuilt = before != library.stat().st_mtime_ns
    if rebuilt:
        # Counts of an older build do not match the new objects' notes.
        for counts in (out / "obj").glob("*.gcda"):
            counts.unlink()
    return Built(library, out / "gpu_rule_violations", out / "obj", chunk_size, rebuilt)


def compile_errors(snippet: str) -> str:
    """Compiler errors of `snippet`, a C++ source using cuda_emulation.h ("" if it compiles)."""
    result = subprocess.run(
        [compiler(), "-std=c++20", "-fsyntax-only", f"-I{HERE / 'include'}", "-x", "c++", "-"],
        input=snippet, capture_output=True, text=True)
    return "" if result.returncode == 0 else result.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                        help=f"elements per chunk (default {DEFAULT_CHUNK_SIZE}; the shipped kernels use 65536)")
    args = parser.parse_args()
    built = build(args.chunk_size, verbose=True)
    print(f"library   {built.library}\nprogram   {built.violations}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
