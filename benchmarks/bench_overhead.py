"""amp's fixed cost per step: apex_amp O0-O3 against a plain fp32 loop and torch.amp, on a tiny and a small model.

On a GPU the kernels run asynchronously and a small model's step is bounded by the host: hooks,
bookkeeping, launches. This measures that host work on the CPU, where every op of a step runs on
the calling thread: the CPU time of the step's thread (time.thread_time), medians of interleaved
rounds, each configuration in its own processes (amp.initialize changes process-wide state), three
per configuration by default with their steps pooled (a process's memory layout alone moves the
tiny model's step by several percent: _workers.py). Configurations, with torch's fused Adam ("Adam") or apex_amp's FusedAdam:
  fp32 / <opt>       a plain loop: zero_grad, forward, loss, backward, step
  torch.amp / Adam   torch.autocast("cpu", half) around forward and loss, Adam(fused=True), with a
                     torch.amp.GradScaler for fp16 (torch's recipe; bf16 has none)
  apex Ox / <opt>    amp.initialize(opt_level=Ox), amp.scale_loss, the optimizer
Models: tiny, the digits MLP of examples/train_digits.py (64-256-128-10 with BatchNorm, batch 64);
small, a 4-layer MLP of width 512 with LayerNorm (batch 32). The half dtype is --half-dtype.

Targets (issue 20): O0 <= 1.05x the plain fp32 loop with the same optimizer; O1 <= 0.9x and
O2 + FusedAdam <= 0.75x torch.amp, on the tiny model, fp16 and bf16.

Run (from the repository root, in the venv where apex_amp is installed):
    python benchmarks/bench_overhead.py                          # bf16, both models, ~5 min idle
    python benchmarks/bench_overhead.py --models tiny --phases   # and where each step's time goes
    python benchmarks/bench_overhead.py --half-dtype float16 --models tiny
    python benchmarks/bench_overhead.py --models tiny --configs "apex O0 / Adam,apex O0 / FusedAdam" --replicas 8
    python benchmarks/bench_overhead.py --models tiny --configs "apex O0 / Adam" --paired-o0 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))

from _timing import finish_run, machine_info, parallel_region_latency, print_targets  # noqa: E402
from _workers import run_configurations  # noqa: E402

LEVELS = ("O0", "O1", "O2", "O3")
CONFIGS = ("fp32 / Adam", "fp32 / FusedAdam", "torch.amp / Adam",
           *(f"apex {level} / {opt}" for level in LEVELS for opt in ("Adam", "FusedAdam")))
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def with_baselines(names: list[str]) -> tuple[str, ...]:
    """The chosen configurations and the baselines their ratios need, in CONFIGS's order.

    Every configuration brings the plain fp32 loop with its optimizer; O1-O3 bring torch.amp, which
    their targets compare against (O0's compares against fp32 only).
    """
    unknown = [name for name in names if name not in CONFIGS]
    if unknown or not names:
        raise ValueError(f"--configs takes a comma-separated subset of: {', '.join(CONFIGS)}; got {names}")
    chosen = set(names)
    for name in names:
        kind, opt = name.split(" / ")
        chosen.add(f"fp32 / {opt}")
        if kind == "torch.amp" or kind.startswith("apex") and kind != "apex O0":
            chosen.update(("torch.amp / Adam", "fp32 / Adam"))
    return tuple(config for config in CONFIGS if config in chosen)


def build_model(model_name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    if model_name == "tiny":
        import train_digits

        (x_train, y_train), _ = train_digits.load_data(0, torch.device("cpu"))
        return train_digits.make_model(train_digits.HIDDEN_DEFAULT), (x_train[:64], y_train[:64])
    width = 512
    layers: list[nn.Module] = [nn.Linear(64, width)]
    for _ in range(3):
        layers += [nn.LayerNorm(width), nn.GELU(), nn.Linear(width, width)]
    layers += [nn.LayerNorm(width), nn.Linear(width, 10)]
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(2))
    return nn.Sequential(*layers), (x, y)


def build_step(config: str, model_name: str, args: dict) -> tuple[Callable[[], None], list]:
    """The step of one configuration (run in its worker)."""
    from apex_amp import amp
    from apex_amp.optimizers import FusedAdam

    model, (x, y) = build_model(model_name)
    half = HALF_DTYPES[args["half_dtype"]]
    kind, opt_name = config.split(" / ")

    def optimizer_for(params):
        return FusedAdam(params, lr=1e-3) if opt_name == "FusedAdam" else torch.optim.Adam(params, lr=1e-3, fused=True)

    optimizer = optimizer_for(model.parameters())
    if kind.startswith("apex"):
        model, optimizer = amp.initialize(model, optimizer, opt_level=kind.split()[1], half_dtype=half, verbosity=0)

        def step(stamp: Callable[[str], None] = _no_stamp) -> None:
            optimizer.zero_grad(set_to_none=True)
            stamp("zero_grad")
            loss = F.cross_entropy(model(x), y)
            stamp("forward")
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                stamp("scale_loss entry")
                scaled_loss.backward()
                stamp("backward")
            stamp("scale_loss exit")
            optimizer.step()
            stamp("step")

        return step, [model, optimizer]
    if kind == "fp32":
        def step(stamp: Callable[[str], None] = _no_stamp) -> None:
            optimizer.zero_grad(set_to_none=True)
            stamp("zero_grad")
            loss = F.cross_entropy(model(x), y)
            stamp("forward")
            loss.backward()
            stamp("backward")
            optimizer.step()
            stamp("step")

        return step, [model, optimizer]
    scaler = torch.amp.GradScaler("cpu") if half == torch.float16 else None

    def step(stamp: Callable[[str], None] = _no_stamp) -> None:
        optimizer.zero_grad(set_to_none=True)
        stamp("zero_grad")
        with torch.autocast("cpu", dtype=half):
            loss = F.cross_entropy(model(x), y)
        stamp("forward")
        (loss if scaler is None else scaler.scale(loss)).backward()
        stamp("backward")
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        stamp("step")

    return step, [model, optimizer]


def _no_stamp(phase: str) -> None:
    pass


PHASES = ("zero_grad", "forward", "scale_loss entry", "backward", "scale_loss exit", "step")


def measure(step: Callable[..., None], objects: list, steps: int = 2000) -> dict[str, Any]:
    """Run in the worker (``--phases``): the median time of each phase of a step, in seconds.

    A phase ends at its stamp; ``time.perf_counter`` between stamps of one step, so the phases
    add up to the step. Medians over ``steps`` steps run back to back (after the timed rounds).
    """
    durations: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(steps):
        last = [time.perf_counter()]

        def stamp(phase: str) -> None:
            now = time.perf_counter()
            durations[phase].append(now - last[0])
            last[0] = now

        step(stamp)
    return {"phases": {phase: statistics.median(values) for phase, values in durations.items() if values}}


def paired_o0(opt_name: str, model_name: str, args: dict, blocks: int = 40, block_steps: int = 50) -> float:
    """Run in a fresh process (``--paired-o0``): O0's step CPU time over the plain fp32 loop's, both built here.

    The two loops alternate in blocks of ``block_steps`` steps (the order flips each block), so both
    share one process's imports and allocator history: the layout noise between processes that the
    rounds above pool over is not in this ratio. Valid for O0 only, which changes no process-wide
    state (no casts, no patched functions): the plain loop runs as it would alone.
    """
    sys.path[:0] = [str(HERE), str(HERE.parent / "examples"), str(HERE.parent)]
    torch.set_num_threads(args["threads"])
    configs = (f"fp32 / {opt_name}", f"apex O0 / {opt_name}")
    steps = {config: build_step(config, model_name, args)[0] for config in configs}
    samples: dict[str, list[float]] = {config: [] for config in steps}
    for step in steps.values():
        for _ in range(args["warmup"]):
            step()
    for block in range(blocks):
        for config in configs if block % 2 == 0 else configs[::-1]:
            step = steps[config]
            for _ in range(block_steps):
                start = time.thread_time()
                step()
                samples[config].append(time.thread_time() - start)
    plain, o0 = (statistics.median(samples[config]) for config in configs)
    return o0 / plain


def run_paired_o0(model_name: str, args: dict, processes: int) -> tuple[list[str], list[tuple[str, str, bool]]]:
    """``--paired-o0``: ``processes`` fresh processes per optimizer, one after the other.

    Returns a table row per optimizer and O0's target judged on the median over the processes.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    rows, verdicts = [], []
    for opt_name in ("Adam", "FusedAdam"):
        ratios = []
        for _ in range(processes):
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                ratios.append(pool.submit(paired_o0, opt_name, model_name, args).result())
        ratio = statistics.median(ratios)
        per_process = " ".join(f"{r:.3f}" for r in ratios)
        rows.append(f"| {model_name} | apex O0 / {opt_name} | {ratio:.3f} | {per_process} |")
        verdicts.append((f"{model_name}: O0 / {opt_name} <= 1.05x fp32 / {opt_name}, in one process",
                         f"{ratio:.3f}x", ratio <= 1.05))
    return rows, verdicts


def render(model_name: str, results: dict[str, dict[str, Any]]) -> list[str]:
    cpu = {config: r["cpu_timing"].median for config, r in results.items()}
    rows = []
    for config in results:
        opt = config.split(" / ")[1]
        versus_fp32 = cpu[config] / cpu[f"fp32 / {opt}"]
        versus_amp = ("" if config.startswith("fp32") or "torch.amp / Adam" not in cpu
                      else f"{cpu[config] / cpu['torch.amp / Adam']:.2f}")
        r = results[config]
        per_process = " ".join(f"{median * 1e3:.3f}" for median in r["replica_cpu_medians"])
        rows.append(f"| {model_name} | {config} | {cpu[config] * 1e3:.3f} | {r['cpu_timing'].iqr * 1e3:.3f} "
                    f"| {per_process} | {r['timing'].median * 1e3:.3f} | {versus_fp32:.2f} | {versus_amp} |")
    return rows


def render_phases(model_name: str, results: dict[str, dict[str, Any]]) -> list[str]:
    rows = []
    for config in results:
        phases = results[config]["phases"]
        cells = [f"{phases[p] * 1e6:.1f}" if p in phases else "" for p in PHASES]
        rows.append(f"| {model_name} | {config} | " + " | ".join(cells) + f" | {sum(phases.values()) * 1e6:.1f} |")
    return rows


def targets(model_name: str, results: dict[str, dict[str, Any]]) -> list[tuple[str, str, bool]]:
    cpu = {config: r["cpu_timing"].median for config, r in results.items()}
    verdicts = []
    for opt in ("Adam", "FusedAdam"):
        if f"apex O0 / {opt}" not in cpu:
            continue
        ratio = cpu[f"apex O0 / {opt}"] / cpu[f"fp32 / {opt}"]
        verdicts.append((f"{model_name}: O0 / {opt} <= 1.05x fp32 / {opt}", f"{ratio:.2f}x", ratio <= 1.05))
    for config, bound in (("apex O1 / Adam", 0.9), ("apex O1 / FusedAdam", 0.9), ("apex O2 / FusedAdam", 0.75)):
        if config not in cpu:
            continue
        ratio = cpu[config] / cpu["torch.amp / Adam"]
        verdicts.append((f"{model_name}: {config} <= {bound}x torch.amp", f"{ratio:.2f}x", ratio <= bound))
    return verdicts


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small", help="any of tiny,small (default: %(default)s)")
    parser.add_argument("--half-dtype", default="bfloat16", choices=sorted(HALF_DTYPES), help="default: %(default)s")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated configurations to run, each with the baselines its ratios need "
                             "(default: all; e.g. 'apex O0 / Adam' with --replicas 8 narrows O0's ratio)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaving rounds (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=400,
                        help="timed steps per configuration and process (default: %(default)s)")
    parser.add_argument("--replicas", type=int, default=3,
                        help="worker processes per configuration, their steps pooled (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per worker first (default: %(default)s)")
    parser.add_argument("--phases", action="store_true",
                        help="then time each phase of a step (zero_grad, forward, scale_loss entry, backward, "
                             "scale_loss exit, step) in every worker: 2000 more steps each")
    parser.add_argument("--paired-o0", type=int, default=0, metavar="N",
                        help="then, in N fresh processes per optimizer, O0 and the plain fp32 loop side by side in "
                             "one process (blocks of 50 steps, alternated): O0's ratio without the layout noise "
                             "between processes")
    parser.add_argument("--json", default=None, help="also write every median and the machine report here")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models or set(args.models) - {"tiny", "small"}:
        parser.error(f"--models takes tiny and/or small, got {args.models}")
    try:
        args.configs = with_baselines([c.strip() for c in args.configs.split(",") if c.strip()])
    except ValueError as error:
        parser.error(str(error))
    if min(args.threads, args.rounds, args.reps, args.replicas, args.warmup + 1) < 1:
        parser.error("--threads, --rounds, --reps and --replicas must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    info = machine_info()
    print("apex_amp fixed cost per step")
    print(f"machine: {info['cpu_model']}, {info['logical_cpus']} logical CPUs; torch {info['torch_version']}, "
          f"{args.threads} thread(s) per configuration, half dtype {args.half_dtype}")
    print(f"load average at start (1/5/15 min): {info['load_average_1_5_15min']}"
          + ("  <- machine busy: timings are noisy" if info["load_average_1_5_15min"][0] > 1.0 else ""))
    print(f"parallel-region probe: {parallel_region_latency() * 1e6:.0f} us")
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    rows = ["| model | configuration | CPU ms | IQR ms | per process ms | wall ms | / fp32 (same optimizer) "
            "| / torch.amp |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    phase_rows = ["| model | configuration | " + " | ".join(f"{p} us" for p in PHASES) + " | sum us |",
                  "| --- | --- | " + " | ".join("---" for _ in PHASES) + " | --- |"]
    verdicts, all_results, paired_rows = [], {}, []
    for model_name in args.models:
        results = run_configurations("bench_overhead", args.configs, model_name, settings, reps=args.reps,
                                     rounds=args.rounds, measure=args.phases, replicas=args.replicas)
        all_results[model_name] = results
        rows += render(model_name, results)
        if args.phases:
            phase_rows += render_phases(model_name, results)
        if model_name == "tiny":
            verdicts += targets(model_name, results)
        if args.paired_o0:
            rows_of_model, paired_verdicts = run_paired_o0(model_name, settings, args.paired_o0)
            paired_rows += rows_of_model
            if model_name == "tiny":
                verdicts += paired_verdicts
    print()
    print("\n".join(rows))
    print("\nCPU ms: median CPU time of a step's thread, over the steps of every process of the configuration; "
          "per process ms: each process's median; / fp32: against the plain fp32 loop with the same "
          "optimizer; / torch.amp: against autocast + (GradScaler) + Adam(fused=True) at the same half dtype.")
    if args.phases:
        print("\nphases (median wall us of each, 2000 steps back to back in each configuration's first process after the rounds):\n")
        print("\n".join(phase_rows))
    if paired_rows:
        print(f"\nO0 and the plain fp32 loop in one process ({args.paired_o0} process(es) per optimizer, "
              "thread CPU time, medians of 2000 steps each):\n")
        print("\n".join(["| model | configuration | / fp32 (same process): median | per process |",
                         "| --- | --- | --- | --- |", *paired_rows]))
    print_targets("issue 20, tiny model", verdicts)
    finish_run(started, args.json, {
        "machine": info, "args": vars(args),
        "results": {m: {c: {"cpu": r["cpu_timing"].to_json(), "wall": r["timing"].to_json(),
                            **({"phases": r["phases"]} if "phases" in r else {})}
                        for c, r in res.items()} for m, res in all_results.items()},
        "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in verdicts], "paired_o0": paired_rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
