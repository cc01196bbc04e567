"""Runs the emulated-op tests of this folder (docs/cuda_emulation.md); the
command line is run.py, the main suite calls it from tests/test_cuda_emulation.py.

The tests in this folder compare the emulated CUDA launchers
(torch.ops.apex_amp_emulated) with the compiled CPU kernels (torch.ops.apex_amp).
They run in a child Python with AddressSanitizer's runtime preloaded, as an
instrumented library needs. Each run is recorded in build/emulation/status.json
with a fingerprint of the sources, for `python -m apex_amp report`, together
with the share of csrc/cuda's lines the emulated ops have executed since the
library was last rebuilt (gcov).
"""

from __future__ import annotations

import dataclasses
import datetime
import gzip
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import emulation_build
from apex_amp import _emulation_status

HERE = Path(__file__).resolve().parent
ROOT = emulation_build.ROOT
LIBRARY_ENV = "APEX_AMP_EMULATION_LIBRARY"
# Sources whose lines the coverage figure counts.
COVERED_SOURCES = "csrc/cuda/"


def preloaded_libraries() -> list[str]:
    """AddressSanitizer's runtime, which must come first in a process that loads
    instrumented code, and libstdc++, so that the runtime's C++ exception hooks
    find it at start-up (python itself does not link it)."""
    paths = []
    for name in ("libasan.so", "libstdc++.so.6"):
        path = subprocess.run([emulation_build.compiler(), f"-print-file-name={name}"],
                              capture_output=True, text=True, check=True).stdout.strip()
        if not os.path.isabs(path):
            raise RuntimeError(f"the compiler has no {name}, which the CUDA emulation needs")
        paths.append(path)
    return paths


def sanitizer_env(library: Path | None = None) -> dict[str, str]:
    """The environment of a process that runs instrumented code."""
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = ":".join([
        "abort_on_error=1",
        "detect_leaks=0",  # CPython and torch keep objects until exit
        # Fresh heap memory (torch.empty, the l2norm workspace) reads as NaN
        # (0xff bytes), so a kernel that reads what nobody wrote shows it.
        "malloc_fill_byte=255",
        "max_malloc_fill_size=1073741824",
    ])
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    if library is not None:
        env["LD_PRELOAD"] = " ".join(preloaded_libraries())
        env[LIBRARY_ENV] = str(library)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@dataclasses.dataclass
class SuiteRun:
    returncode: int
    output: str       # pytest's stdout and stderr, interleaved
    record: dict      # what build/emulation/status.json now says of this scope ({} if not recorded)


def run_tests(built: emulation_build.Built, markers: str = "", pytest_args: Sequence[str] = (),
              echo: bool = False) -> SuiteRun:
    """Runs this folder's tests against `built` in a sanitized child process, and records the result
    unless `pytest_args` narrow the selection (a -k or a file says nothing about the suite)."""
    # --capture=sys: a sanitizer writes its report straight to file descriptor 2
    # and aborts; pytest's default fd capture would swallow it.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=sys"]
    if markers:
        command += ["-m", markers]
    command += list(pytest_args)
    if not any(Path(arg.split("::")[0]).exists() for arg in pytest_args if not arg.startswith("-")):
        command.append(str(HERE))  # no test file named: the whole folder
    started = time.monotonic()
    child = subprocess.Popen(command, cwd=ROOT, env=sanitizer_env(built.library),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in child.stdout:
        lines.append(line)
        if echo:
            print(line, end="", flush=True)
    returncode = child.wait()
    output = "".join(lines)
    record = {}
    if not pytest_args:
        summary = output.strip().splitlines()[-1] if output.strip() else ""
        counts = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)
        scope = markers or "all"
        if built.chunk_size != emulation_build.DEFAULT_CHUNK_SIZE:
            scope += f", chunks of {built.chunk_size}"  # recorded apart from the default build's
        record = {
            "scope": scope,
            "passed": returncode == 0,
            "counts": {word: int(number) for number, word in counts},
            "seconds": round(time.monotonic() - started, 1),
            "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            "chunk_size": built.chunk_size,
            "coverage": line_coverage(built) if returncode == 0 else None,
        }
        _emulation_status.record_run(ROOT, record)
    return SuiteRun(returncode, output, record)


def gcov_reports(object_dir: Path) -> list[dict]:
    """gcov's JSON reports for the emulation library's objects (their counts so far)."""
    reports = []
    for counts in sorted(object_dir.glob("*.gcda")):
        if counts.stem == "gpu_rule_violations":
            continue  # the rule-violation program is not an op test
        subprocess.run(["gcov", "--json-format", "--object-directory", str(object_dir), str(counts)],
                       cwd=object_dir, capture_output=True, check=True)
        for report in sorted(object_dir.glob("*.gcov.json.gz")):
            with gzip.open(report, "rt") as stream:
                reports.append(json.load(stream))
            report.unlink()
    return reports


def line_coverage(built: emulation_build.Built) -> dict:
    """Lines of csrc/cuda executed by the emulated ops, in all and per file, with
    the lines never run; and the same for function instances, since a line of a
    template counts as run once any of its instantiations ran (a kernel's
    vector path for fp32 hides that of fp16 -> bf16)."""
    lines: dict[str, dict[int, int]] = {}
    instances: dict[str, dict[str, int]] = {}
    for report in gcov_reports(built.object_dir):
        for source in report["files"]:
            relative = os.path.relpath(Path(source["file"]).resolve(), ROOT)
            if not relative.startswith(COVERED_SOURCES):
                continue
            per_line = lines.setdefault(relative, {})
            for line in source["lines"]:
                per_line[line["line_number"]] = per_line.get(line["line_number"], 0) + line["count"]
            per_function = instances.setdefault(relative, {})
            for function in source["functions"]:
                name = function["demangled_name"]
                per_function[name] = per_function.get(name, 0) + function["execution_count"]
    files = {}
    for relative, per_line in sorted(lines.items()):
        missed = sorted(number for number, count in per_line.items() if count == 0)
        files[relative] = {"lines": len(per_line), "executed": len(per_line) - len(missed),
                           "missed": missed}
    total = sum(f["lines"] for f in files.values())
    executed = sum(f["executed"] for f in files.values())
    all_instances = {name: count for per_function in instances.values()
                     for name, count in per_function.items()}
    return {"lines": total, "executed": executed,
            "percent": round(100.0 * executed / total, 1) if total else None, "files": files,
            "instances": len(all_instances),
            "instances_executed": sum(1 for count in all_instances.values() if count > 0),
            "instances_missed": sorted(name for name, count in all_instances.items() if count == 0)}


def format_coverage(coverage: dict) -> str:
    rows = [f"csrc/cuda lines executed by the emulated ops: {coverage['executed']}/{coverage['lines']} "
            f"({coverage['percent']}%)"]
    for name, f in coverage["files"].items():
        missed = ", ".join(map(str, f["missed"])) or "none"
        rows.append(f"  {name:<34} {f['executed']:>4}/{f['lines']:<4} not run: {missed}")
    rows.append(f"function instances (template instantiations counted apart) executed: "
                f"{coverage['instances_executed']}/{coverage['instances']}")
    rows += [f"  not run: {name}" for name in coverage["instances_missed"]]
    return "\n".join(rows)
