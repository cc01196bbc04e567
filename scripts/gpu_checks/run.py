"""The GPU validation of apex_amp as one command: build, check, compare and time, within a lease.

Run by ``scripts/gpu_check.sh`` (see it and docs/cuda_emulation.md for when and how). Each step is
one command, time-boxed, logged to ``$OUT/logs/<step>.log``, and recorded (ok / failed / timed
out / not run, its seconds and its key figure, the line its program prints after ``KEY:``) in
``$OUT/summary.md`` and ``$OUT/summary.json``; a failing step does not stop the ones after it,
except that nothing needing the extension runs when the build failed. The steps run in order of
value, so a lease that runs short loses the benchmarks first; the whole run has a time budget
(``--budget``, default 480 s) and a step that would start with less than its minimum left is
recorded as not run.

``--dry-run`` runs everything that can run without a GPU: the arch detection on a faked
capability and the build command (printed, not run), ``report`` without ``--require-cuda``, the
CUDA tests collected but not run, and the comparison, the sync check and the benchmarks on the
CPU with tiny sizes; the summary is written as for a real run (tests/test_gpu_check.py runs it,
so this script cannot rot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
# The op tests on CUDA for both backends, the O1 table and the misuse checks of the ops.
CUDA_TEST_FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_ops_*.py")) + [
    "tests/test_o1_rules.py", "tests/test_o1_behaviour.py", "tests/test_misuse_ops.py",
    "tests/test_state_precision.py", "tests/test_memory_report.py"]


DRY_RUN_TIME_FACTOR = 4


@dataclasses.dataclass
class Step:
    """One step of the check: its command (for a real run and for a dry run), limits and key figure."""

    name: str
    what: str
    command: Callable[["Plan"], list[str]]
    timeout: float  # seconds at most
    minimum: float  # seconds that must be left in the budget to start it
    needs_build: bool = True
    key: Optional[Callable[[str], str]] = None  # the key figure, from the step's output
    env: Callable[["Plan"], dict] = lambda plan: {}


@dataclasses.dataclass
class Plan:
    dry_run: bool
    python: str
    out: Path
    arch_list: str
    jobs: int

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"


def arch_list_for(capability: tuple[int, int]) -> str:
    """TORCH_CUDA_ARCH_LIST for one GPU's compute capability: only its own arch (the quickest build)."""
    major, minor = capability
    return f"{major}.{minor}"


def detect_capability(python: str, fake: Optional[str]) -> tuple[int, int]:
    if fake:
        major, minor = fake.split(".")
        return int(major), int(minor)
    probe = subprocess.run([python, "-c", "import torch; print(*torch.cuda.get_device_capability(0))"],
                           capture_output=True, text=True)
    if probe.returncode:
        raise SystemExit(f"gpu_check: no CUDA GPU visible to {python}'s torch: {probe.stderr.strip()[-300:]}")
    major, minor = probe.stdout.split()
    return int(major), int(minor)


def key_after(marker: str) -> Callable[[str], str]:
    def read(output: str) -> str:
        lines = [line for line in output.splitlines() if line.startswith(marker)]
        return lines[-1][len(marker):].strip() if lines else ""
    return read


def pytest_key(output: str) -> str:
    lines = [line.strip("= ") for line in output.splitlines()
             if re.search(r"\b(passed|failed|error|errors|no tests ran|tests? collected)\b", line)]
    return lines[-1] if lines else ""


def sanitizer_key(output: str) -> str:
    # memcheck, synccheck and initcheck end with "ERROR SUMMARY: N errors"; racecheck with
    # "RACECHECK SUMMARY: N hazards displayed (N errors, N warnings)".
    found = re.findall(r"(?:ERROR SUMMARY: (\d+) errors?|RACECHECK SUMMARY: (\d+) hazards)", output)
    if found:
        errors, hazards = found[-1]
        return f"{errors} errors" if errors else f"{hazards} hazards"
    return key_after("KEY:")(output)


def _pytest_command(plan: Plan) -> list[str]:
    command = [plan.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", *CUDA_TEST_FILES]
    if plan.dry_run:
        return command + ["--collect-only"]
    if _has_module(plan.python, "xdist"):  # 16 cores on the GPU machines: the tests in parallel
        command += ["-n", str(min(8, plan.jobs))]
    return command


def _has_module(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def _sanitizer(tool: str, *options: str) -> Callable[[Plan], list[str]]:
    def command(plan: Plan) -> list[str]:
        program = [plan.python, "scripts/gpu_checks/compare_devices.py", "--device", plan.device]
        if plan.dry_run:  # no sanitizer without a GPU: the program alone
            return program
        return ["compute-sanitizer", "--tool", tool, "--error-exitcode", "1", *options, *program]
    return command


def _build_command(plan: Plan) -> list[str]:
    command = [plan.python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."]
    if plan.dry_run:  # what would run, checked for its parts
        return [plan.python, "-c", "import pathlib, sys; print('would run:', *sys.argv[1:]); "
                "sys.exit(0 if pathlib.Path('setup.py').is_file() else 'no setup.py here')", *command]
    return command


STEPS = [
    Step("environment", "GPU, driver, torch, nvcc", lambda p: [p.python, "scripts/gpu_checks/environment.py"]
         + (["--dry-run"] if p.dry_run else []), 30, 5, needs_build=False, key=key_after("KEY:")),
    Step("build", "pip install -e . for the GPU's arch only", _build_command, 300, 60, needs_build=False,
         env=lambda p: {"TORCH_CUDA_ARCH_LIST": p.arch_list, "MAX_JOBS": str(p.jobs), "APEX_AMP_CUDA": "1"}),
    Step("report", "python -m apex_amp report --require-cuda",
         lambda p: [p.python, "-m", "apex_amp", "report"] + ([] if p.dry_run else ["--require-cuda"]), 60, 10),
    Step("compare_devices", "CUDA vs CPU kernels, max ulp per op and dtype",
         lambda p: [p.python, "scripts/gpu_checks/compare_devices.py", "--device", p.device,
                    "--markdown", str(p.out / "logs" / "compare_devices.md")], 120, 20, key=key_after("KEY:")),
    Step("sync_free_steps", "O1 and O2 steps under set_sync_debug_mode('error')",
         lambda p: [p.python, "scripts/gpu_checks/sync_free_steps.py", "--device", p.device], 150, 20,
         key=key_after("KEY:")),
    Step("pytest_cuda", "pytest -m cuda: op tests on CUDA, both backends; the O1 table", _pytest_command, 240, 30,
         key=pytest_key),
    Step("memcheck", "compute-sanitizer memcheck on every op", _sanitizer("memcheck"), 150, 30,
         env=lambda p: {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, key=sanitizer_key),
    # racecheck instruments apex_amp's kernels only: over every kernel of torch too, the process
    # died at start-up without a report (H200, torch 2.11).
    Step("racecheck", "compute-sanitizer racecheck on every op",
         _sanitizer("racecheck", "--kernel-name", "kns=apex_amp"), 150, 30,
         key=sanitizer_key),
    Step("resources", "registers, stack and local memory per kernel (cuobjdump)",
         lambda p: [p.python, "scripts/gpu_checks/resources.py"] + (["--dry-run"] if p.dry_run else []), 60, 5,
         key=key_after("KEY:")),
    Step("bench_kernels", "O2 step, fused optimizers, overflow check vs torch; x copy bound",
         lambda p: [p.python, "benchmarks/bench_gpu.py", "kernels", "--device", p.device,
                    "--json", str(p.out / "logs" / "bench_kernels.json")], 150, 30, key=key_after("KEY:")),
    Step("bench_training", "GPT-2-small-sized step: O1/O2 vs torch.amp, bf16/fp16, fp8",
         lambda p: [p.python, "benchmarks/bench_gpu.py", "training", "--device", p.device,
                    "--json", str(p.out / "logs" / "bench_training.json")], 200, 40, key=key_after("KEY:")),
    # Last: the lease loses these first when it runs short.
    Step("synccheck", "compute-sanitizer synccheck (barriers) on every op", _sanitizer("synccheck"), 120, 30,
         key=sanitizer_key),
    Step("initcheck", "compute-sanitizer initcheck (reads of unwritten memory) on every op",
         _sanitizer("initcheck"), 120, 30, env=lambda p: {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
         key=sanitizer_key),
]


def run_step(step: Step, plan: Plan, budget_left: float, build_ok: bool) -> dict:
    record = {"step": step.name, "what": step.what, "status": "not run", "seconds": 0.0, "key": ""}
    if step.needs_build and not build_ok:
        record["key"] = "the build failed"
        return record
    if budget_left < step.minimum:
        record["key"] = f"{budget_left:.0f} s left of the budget, {step.minimum:.0f} s needed"
        return record
    command = step.command(plan)
    log_path = plan.out / "logs" / f"{step.name}.log"
    env = {**os.environ, **step.env(plan), "PYTHONUNBUFFERED": "1"}
    # In a dry run the CPU does the GPU's work (and a busy CI machine shares it): larger time boxes.
    timeout = min(step.timeout * (DRY_RUN_TIME_FACTOR if plan.dry_run else 1), budget_left)
    started = time.monotonic()
    with log_path.open("w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.write("".join(f"# {k}={v}\n" for k, v in step.env(plan).items()))
        log.flush()
        try:
            process = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     timeout=timeout)
            record["status"] = "ok" if process.returncode == 0 else f"failed (exit {process.returncode})"
        except subprocess.TimeoutExpired:
            record["status"] = f"timed out ({timeout:.0f} s)"
        except FileNotFoundError as error:
            log.write(f"\n{error}\n")
            record["status"] = "failed (command not found)"
    record["seconds"] = round(time.monotonic() - started, 1)
    output = log_path.read_text(errors="replace")
    if step.key is not None:
        record["key"] = step.key(output)
    elif record["status"] == "ok":
        record["key"] = f"{record['seconds']:.0f} s"
    if not record["status"] == "ok" and not record["key"]:
        record["key"] = output.strip().splitlines()[-1][-160:] if output.strip() else ""
    return record


def summary_table(records: list[dict], plan: Plan, total: float) -> str:
    mode = "dry run (no GPU)" if plan.dry_run else f"TORCH_CUDA_ARCH_LIST={plan.arch_list}"
    lines = [f"# apex_amp GPU check ({mode}; {total:.0f} s in all)", "",
             "| step | status | seconds | key figure |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']:.0f} | {r['key'].replace('|', '/')} |"
              for r in records]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="run what can run without a GPU (see above)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "gpu_check_out"),
                        help="where the logs and the summary go (default: $OUT, else ./gpu_check_out)")
    parser.add_argument("--python", default=os.environ.get("PYTHON", sys.executable),
                        help="the interpreter whose torch is used (default: $PYTHON, else this one)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run (default 480)")
    parser.add_argument("--fake-capability", default=None,
                        help="a compute capability such as 9.0 instead of asking the GPU (default in a dry run)")
    parser.add_argument("--steps", default=None, help="only these steps, comma-separated (default: all)")
    args = parser.parse_args(argv)
    fake = args.fake_capability or ("9.0" if args.dry_run else None)
    plan = Plan(dry_run=args.dry_run, python=args.python, out=args.out.resolve(),
                arch_list=arch_list_for(detect_capability(args.python, fake)), jobs=os.cpu_count() or 1)
    (plan.out / "logs").mkdir(parents=True, exist_ok=True)
    chosen = set(args.steps.split(",")) if args.steps else None
    unknown = (chosen or set()) - {s.name for s in STEPS}
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; the steps are {[s.name for s in STEPS]}")
    started = time.monotonic()
    records, build_ok = [], True
    for step in STEPS:
        if chosen is not None and step.name not in chosen:
            continue
        record = run_step(step, plan, args.budget - (time.monotonic() - started), build_ok)
        if step.name == "build":
            build_ok = record["status"] == "ok"
        records.append(record)
        print(f"gpu_check: {record['step']}: {record['status']} ({record['seconds']:.0f} s) {record['key']}",
              flush=True)
    total = time.monotonic() - started
    table = summary_table(records, plan, total)
    (plan.out / "summary.md").write_text(table)
    (plan.out / "summary.json").write_text(json.dumps(
        {"dry_run": plan.dry_run, "arch_list": plan.arch_list, "seconds": round(total, 1), "steps": records},
        indent=1))
    print("\n" + table)
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
