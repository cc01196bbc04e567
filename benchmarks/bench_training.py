"""End-to-end training step: apex_amp O1/O2 against torch.amp and fp32, on the examples' models.

A step is zero_grad, forward, loss, backward and the optimizer step, on a fixed batch, for
  * digits: the MLP of examples/train_digits.py (64-256-128-10 with BatchNorm, batch 64), and
  * lm: the character transformer of examples/transformer.py, sized so that activations
    dominate the memory as in real language-model training (see --lm-* and README.md).
Configurations, each in its own process (amp.initialize patches process-wide state, O1 turns
on its casts), all started at once and driven in interleaved rounds so that a change of load
on the machine hits every one of them alike:
  fp32           fp32, torch.optim.Adam(fused=True)
  apex O0        fp32, apex_amp FusedAdam through amp.initialize(opt_level="O0")
  torch.amp      torch.autocast("cpu", half) around forward and loss, Adam(fused=True); with fp16
                 a torch.amp.GradScaler too (torch's fp16 recipe). With bf16 torch documents
                 autocast without a scaler (bf16 has fp32's range), so none is used.
  apex O1        amp.initialize(opt_level="O1"), scale_loss, FusedAdam
  apex O2        amp.initialize(opt_level="O2"), scale_loss, FusedAdam
Each step is timed in wall time and in CPU time of the worker's thread (time.thread_time). With
one thread (the default) every op of the step, autograd's CPU backward included, runs on that
thread, so its CPU time is the step's work without the waits for a core that other processes
on a shared machine cause; the ratios then use CPU time (wall time with more threads).
Peak memory per configuration (CPU): bytes of the live model and optimizer tensors before a
step (parameters, buffers, fp32 masters, optimizer state) plus the peak of the bytes allocated
and not yet freed during one step, from the allocator events torch's profiler records
(profile_memory=True). On CUDA: torch.cuda.max_memory_allocated over one step.

Run (from the repository root, in the venv where apex_amp is installed):
    python benchmarks/bench_training.py                      # bf16, 1 thread: ~1.5 min idle, ~4 min on a busy machine
    python benchmarks/bench_training.py --half-dtype float16 # fp16: tiny shapes (CPU fp16 GEMMs are slow)
    python benchmarks/bench_training.py --models lm --rounds 5 --json /tmp/training.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))  # the models come from the examples themselves
sys.path.insert(0, str(HERE.parent))  # apex_amp from the checkout when it is not installed

from _timing import finish_run, machine_info, parallel_region_latency, print_targets  # noqa: E402
from _workers import run_configurations  # noqa: E402

CONFIGS = ("fp32", "apex O0", "torch.amp", "apex O1", "apex O2")
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT = {"bfloat16": "bf16", "float16": "fp16"}
MIB = 2**20

# ----------------------------------------------------------------------------- workloads (run in the workers)


def build_workload(model_name: str, args: dict) -> tuple[torch.nn.Module, Callable, tuple]:
    """(model, loss function, batch) with fixed seeds: every configuration gets the same weights and data."""
    torch.manual_seed(0)
    if model_name == "digits":
        import train_digits

        (x_train, y_train), _ = train_digits.load_data(0, torch.device("cpu"))
        hidden = train_digits.HIDDEN_FP16_ON_CPU if args["half_dtype"] == "float16" else train_digits.HIDDEN_DEFAULT
        model = train_digits.make_model(hidden)
        batch = (x_train[:64], y_train[:64])
        return model, lambda m, x, y: F.cross_entropy(m(x), y), batch
    import transformer

    model = transformer.make_model(args["lm_d_model"], args["lm_heads"], args["lm_layers"], args["lm_context"])
    ids = torch.randint(0, transformer.VOCAB_SIZE, (args["lm_batch"] * (args["lm_context"] + 1),))
    starts = torch.arange(args["lm_batch"]) * (args["lm_context"] + 1)
    return model, transformer.lm_loss, transformer.batch_of_windows(ids, starts, args["lm_context"])


def build_step(config: str, model_name: str, args: dict) -> tuple[Callable[[], None], list]:
    """The step function of one configuration and the objects whose tensors make up its state."""
    from apex_amp import amp
    from apex_amp.optimizers import FusedAdam

    model, loss_fn, (x, y) = build_workload(model_name, args)
    half = HALF_DTYPES[args["half_dtype"]]
    lr = 1e-3
    if config.startswith("apex"):
        optimizer = FusedAdam(model.parameters(), lr=lr)
        model, optimizer = amp.initialize(model, optimizer, opt_level=config.split()[1], half_dtype=half,
                                          verbosity=0)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model, x, y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()

        return step, [model, optimizer]

    optimizer = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    if config == "fp32":
        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, x, y).backward()
            optimizer.step()

        return step, [model, optimizer]

    scaler = torch.amp.GradScaler("cpu") if half == torch.float16 else None

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=half):
            loss = loss_fn(model, x, y)
        if scaler is None:  # bf16: torch's recipe is autocast alone
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # the fused Adam receives found_inf and the scale: no host sync
            scaler.update()

    return step, [model, optimizer, scaler]


def live_state_bytes(objects: list) -> int:
    """Bytes of the distinct storages of the models' parameters/buffers/grads and the optimizers' tensors."""
    tensors = []
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            tensors += [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, torch.optim.Optimizer):
            tensors += [p for group in obj.param_groups for p in group["params"]]
            tensors += [v for state in obj.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += [t.grad for t in list(tensors) if t.grad is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# What torch's profiler library (kineto) writes to the C-level stderr by itself on every start and
# stop, and about the GPU a CPU-only machine does not have; and c10's note on each free of a block
# allocated before profiling started, which step_peak_bytes accounts for: not the benchmark's output.
_KINETO_NOISE = re.compile(
    r"^(USDT|ERROR|WARNING|INFO):\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ \w+\.cpp:\d+\]"
    r"|^\[W\d{4} [\d:.]+ (?:\d+ )?CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the "
    r"profiling started"
)


@contextlib.contextmanager
def _without_kineto_noise() -> Iterator[None]:
    # Capture file descriptor 2 (where the C++ library writes), then pass on every other line.
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines():
                if not _KINETO_NOISE.match(line):
                    print(line, file=sys.stderr)


def step_peak_bytes(step: Callable[[], None]) -> int:
    """Peak of the bytes allocated and not yet freed during one ``step()``, from the profiler's allocator events."""
    with _without_kineto_noise(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        # Frees of blocks allocated before profiling started come with size 0: they are not
        # subtracted, so the peak can only be overstated, never understated.
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def measure(step: Callable[[], None], objects: list) -> dict[str, int]:
    """The configuration's peak memory (run in its worker by _workers.run_configurations)."""
    for obj in objects:  # start from no gradients: the state a step begins with
        if isinstance(obj, torch.optim.Optimizer):
            obj.zero_grad(set_to_none=True)
    state = live_state_bytes(objects)
    transient = step_peak_bytes(step)
    return {"state_bytes": state, "step_peak_bytes": transient, "peak_bytes": state + transient}


# ----------------------------------------------------------------------------- driving and reporting


def run_model(model_name: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """One worker per configuration, timed in interleaved rounds (_workers.py), then memory."""
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    reps = args.digits_reps if model_name == "digits" else args.lm_reps
    return run_configurations("bench_training", CONFIGS, model_name, settings, reps=reps, rounds=args.rounds,
                              measure=True)


def precision_of(config: str, half: str) -> str:
    return "fp32" if config in ("fp32", "apex O0") else SHORT[half]


def ratio_basis(args: argparse.Namespace) -> str:
    # With one thread every op of a step runs on the calling thread (autograd's CPU backward too), so
    # its CPU time is the step's work without the waits for a core that other processes cause.
    return "cpu_timing" if args.threads == 1 else "timing"


def render(model_name: str, results: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    basis = ratio_basis(args)
    torch_amp = results["torch.amp"][basis].median
    fp32 = results["fp32"][basis].median
    o0_peak = results["apex O0"]["peak_bytes"]
    rows = ["| model | configuration | precision | wall ms | IQR ms | CPU ms | / torch.amp | / fp32 | peak MiB "
            "| state + step MiB | peak / O0 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for config in CONFIGS:
        r = results[config]
        wall, cpu = r["timing"], r["cpu_timing"]
        same_precision = config in ("apex O1", "apex O2")
        versus_amp = f"{r[basis].median / torch_amp:.2f}" if same_precision else ""
        rows.append(
            f"| {model_name} | {config} | {precision_of(config, args.half_dtype)} | {wall.median * 1e3:.2f} "
            f"| {wall.iqr * 1e3:.2f} | {cpu.median * 1e3:.2f} | {versus_amp} | {r[basis].median / fp32:.2f} "
            f"| {r['peak_bytes'] / MIB:.1f} | {r['state_bytes'] / MIB:.1f} + {r['step_peak_bytes'] / MIB:.1f} "
            f"| {r['peak_bytes'] / o0_peak:.2f} |")
    return rows


def targets(all_results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    basis = ratio_basis(args)
    verdicts = []
    for model_name, results in all_results.items():
        torch_amp = results["torch.amp"][basis].median
        for config in ("apex O1", "apex O2"):
            ratio = results[config][basis].median / torch_amp
            verdicts.append((f"{model_name}: {config} step no slower than torch.amp", f"{ratio:.2f}x", ratio <= 1.0))
    if "lm" in all_results:
        ratio = all_results["lm"]["apex O2"]["peak_bytes"] / all_results["lm"]["apex O0"]["peak_bytes"]
        verdicts.append(("lm: apex O2 peak memory <= 0.6x apex O0", f"{ratio:.2f}x", ratio <= 0.6))
    return verdicts


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="digits,lm", help="any of digits,lm (default: %(default)s)")
    parser.add_argument("--half-dtype", default="bfloat16", choices=sorted(HALF_DTYPES), help="default: %(default)s")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per worker (default: %(default)s: steady numbers on a shared 2-core "
                             "machine; only one worker computes at a time)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaving rounds (default: %(default)s)")
    parser.add_argument("--digits-reps", type=int, default=300, help="timed steps per configuration (default: %(default)s)")
    parser.add_argument("--lm-reps", type=int, default=30, help="timed steps per configuration (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per worker first (default: %(default)s)")
    parser.add_argument("--lm-d-model", type=int, default=None, help="default: 128 (32 with float16)")
    parser.add_argument("--lm-heads", type=int, default=4, help="default: %(default)s")
    parser.add_argument("--lm-layers", type=int, default=None, help="default: 4 (1 with float16)")
    parser.add_argument("--lm-context", type=int, default=None, help="default: 256 (32 with float16)")
    parser.add_argument("--lm-batch", type=int, default=None, help="default: 8 (4 with float16)")
    parser.add_argument("--json", default=None, help="also write every sample and the machine report here")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models or set(args.models) - {"digits", "lm"}:
        parser.error(f"--models takes digits and/or lm, got {args.models}")
    fp16 = args.half_dtype == "float16"  # CPU fp16 GEMMs run at ~0.5 GFLOP/s: tiny shapes only
    defaults = dict(lm_d_model=32 if fp16 else 128, lm_layers=1 if fp16 else 4, lm_context=32 if fp16 else 256,
                    lm_batch=4 if fp16 else 8)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.threads, args.rounds, args.digits_reps, args.lm_reps, args.lm_batch, args.lm_layers) < 1:
        parser.error("--threads, --rounds, --*-reps, --lm-batch and --lm-layers must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    info = machine_info()
    print("apex_amp end-to-end training step benchmark")
    print(f"machine: {info['cpu_model']}, {info['logical_cpus']} logical CPUs; torch {info['torch_version']}, "
          f"{args.threads} thread(s) per configuration, ATen CPU capability {info['aten_cpu_capability']}; "
          f"python {info['python']}")
    print(f"load average at start (1/5/15 min): {info['load_average_1_5_15min']}"
          + ("  <- machine busy: timings are noisy" if info["load_average_1_5_15min"][0] > 1.0 else ""))
    print(f"parallel-region probe: {parallel_region_latency() * 1e6:.0f} us")
    print(f"half precision: {args.half_dtype}; lm: d_model {args.lm_d_model}, {args.lm_heads} heads, "
          f"{args.lm_layers} layers, context {args.lm_context}, batch {args.lm_batch}; digits: batch 64")
    all_results = {}
    for model_name in args.models:
        all_results[model_name] = run_model(model_name, args)
    lines = []
    for model_name, results in all_results.items():
        lines += render(model_name, results, args)[(0 if not lines else 2):]
    print()
    print("\n".join(lines))
    basis = "CPU-time" if ratio_basis(args) == "cpu_timing" else "wall-time"
    print(f"\nwall ms: median wall time of a step; CPU ms: median CPU time of the step's thread. / torch.amp: apex "
          f"{basis} median / torch.amp's at the same precision (< 1: apex faster); / fp32: {basis} median / fp32's. "
          "peak = state (parameters, buffers, masters, optimizer state before the step) "
          "+ step (peak of bytes allocated during one step, from the profiler's allocator events).")
    verdicts = targets(all_results, args)
    print_targets("issue 6", verdicts)
    finish_run(started, args.json, {
        "machine": info, "args": vars(args),
        "results": {m: {c: {**{k: v for k, v in r.items() if not k.endswith("timing")},
                            "wall": r["timing"].to_json(), "cpu": r["cpu_timing"].to_json()}
                        for c, r in res.items()} for m, res in all_results.items()},
        "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in verdicts]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
