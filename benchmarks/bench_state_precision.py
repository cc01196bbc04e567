"""Low-precision optimizer state (issue 27): step time, bytes per parameter and accuracy, against the peers.

Sections (``--section``, default both):
  step      one optimizer step on a transformer-like list of tensors of 1M/16M/64M elements (fp32 params
            and grads, as an O2 step sees its masters; every state in fp32 unless the row says otherwise):
            apex_amp FusedAdam with each ``state_precision`` (and ``master_weights="remainder"`` on bf16
            params), torch's AdamW(fused=True), bitsandbytes' AdamW8bit (its CPU backend) and torchao's
            AdamW8bit (compiled by torch.compile: its first step is reported apart). Medians of interleaved
            rounds; bytes of state per parameter; each apex row's bytes moved per element against the
            machine's streaming bandwidth measured in the same run.
  accuracy  the examples' digits MLP and character transformer trained at O2 bf16 (30 / 6 epochs as the
            examples do, fewer with --quick) with FusedAdam at every state precision, with int8 state and
            remainder masters, and with bitsandbytes' and torchao's AdamW8bit, each with seeds
            0..--seeds-1: mean, std and range of the held-out loss and test accuracy, and the targets
            judged on the means (benchmarks/_state_accuracy.py says what a seed sets).

Peers come from the ``bench`` extra (``pip install -e .[bench]``: bitsandbytes, torchao); a peer that is
missing is reported as such, not skipped silently. Where the tree's FusedAdam does not take
``state_precision`` yet, apex_amp's low-precision rows time the fused op itself with those states
(``apex fused_adam_ op ...``: benchmarks/_state_op_step.py, the same kernel call FusedAdam makes).

Run (from the repository root, idle machine, ~5-10 min):
    python benchmarks/bench_state_precision.py
    python benchmarks/bench_state_precision.py --section step --sizes 1M,16M
    python benchmarks/bench_state_precision.py --section accuracy --quick
    python benchmarks/bench_state_precision.py --section accuracy --threads 1 --seeds 5 --no-torchao
    python benchmarks/bench_state_precision.py --section accuracy --threads 1 --seeds 40 --examples digits
"""

from __future__ import annotations

import argparse
import gc
import inspect
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))

from _kernel_workloads import transformer_like_shapes  # noqa: E402
from _timing import Bandwidth, finish_run, format_table, machine_info, print_targets, time_interleaved  # noqa: E402

from apex_amp import amp  # noqa: E402
from apex_amp.optimizers import FusedAdam  # noqa: E402
from _state_op_step import OpLevelAdam  # noqa: E402
import _state_accuracy  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
PRECISIONS = ("fp32", "bf16", "fp8", "int8")
# Bytes an Adam step moves per element besides its state: fp32 param read + write, fp32 grad read.
PARAM_AND_GRAD_BYTES = 12.0
STATE_BYTES = {"fp32": 8.0, "bf16": 4.0, "fp8": 2.0, "int8": 2.0}  # two moments, one byte or more each


def has_state_precision() -> bool:
    return "state_precision" in inspect.signature(FusedAdam.__init__).parameters


def parse_size(text: str) -> int:
    text = text.strip().upper()
    factor = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * factor)


# ----------------------------------------------------------------------------------------------- peers


def load_bitsandbytes() -> tuple[Optional[object], str]:
    try:
        import bitsandbytes
    except Exception as error:  # noqa: BLE001 - any import failure means: not available here
        return None, f"bitsandbytes not importable ({type(error).__name__}: {error}); pip install -e .[bench]"
    return bitsandbytes, f"bitsandbytes {bitsandbytes.__version__}"


def load_torchao_adamw8bit() -> tuple[Optional[type], str]:
    try:
        import torchao
        from torchao.optim import AdamW8bit
    except Exception as error:  # noqa: BLE001
        return None, f"torchao not importable ({type(error).__name__}: {error}); pip install -e .[bench]"
    return AdamW8bit, f"torchao {torchao.__version__}"


# ------------------------------------------------------------------------------------------------ step


def make_params(shapes, dtype, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(dtype))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(dtype)
        params.append(p)
    return params


def plain_tensors(value: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``value``'s data (a tensor subclass such as torchao's 8-bit state holds several)."""
    if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        return [t for name in names for t in plain_tensors(getattr(value, name))]
    return [value]


def state_bytes_per_param(optimizer: torch.optim.Optimizer, params) -> float:
    """Bytes of per-element optimizer state (each storage once; step counters excluded) per parameter."""
    storages = {}
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                for tensor in plain_tensors(value):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / sum(p.numel() for p in params)


def step_configurations(shapes, bnb, ao_adamw8bit) -> dict[str, tuple[Optional[Callable], str]]:
    """name -> (factory building (optimizer, params), note)."""
    configs: dict[str, tuple[Optional[Callable], str]] = {}
    apex_kwargs = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adam_w_mode=True)
    low_precision = has_state_precision()
    for precision in PRECISIONS:
        name = f"apex FusedAdam {precision} state"
        if precision != "fp32" and not low_precision:
            # The op has the formats before FusedAdam takes the argument: time the op itself.
            name = f"apex fused_adam_ op {precision} state"

            def build_op(precision=precision):
                params = make_params(shapes, torch.float32, 0)
                return OpLevelAdam(params, precision, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY), params

            configs[name] = (build_op, "")
            continue

        def build(precision=precision):
            params = make_params(shapes, torch.float32, 0)
            extra = {"state_precision": precision} if low_precision else {}
            return FusedAdam(params, **apex_kwargs, **extra), params

        configs[name] = (build, "")
    remainder_name = "apex FusedAdam int8 state, remainder masters (bf16 params)"
    if low_precision:
        def build_remainder():
            params = make_params(shapes, torch.bfloat16, 0)
            return FusedAdam(params, **apex_kwargs, state_precision="int8", master_weights="remainder"), params

        configs[remainder_name] = (build_remainder, "")
    else:
        def build_op_remainder():
            params = make_params(shapes, torch.bfloat16, 0)
            return OpLevelAdam(params, "int8", lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                               remainder=True), params

        configs["apex fused_adam_ op int8 state, remainder masters (bf16 params)"] = (build_op_remainder, "")

    def build_torch():
        params = make_params(shapes, torch.float32, 0)
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True), params

    configs["torch AdamW(fused=True)"] = (build_torch, "")
    if bnb is not None:
        def build_bnb():
            params = make_params(shapes, torch.float32, 0)
            return bnb.optim.AdamW8bit(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY), params

        configs["bitsandbytes AdamW8bit"] = (build_bnb, "")
    else:
        configs["bitsandbytes AdamW8bit"] = (None, "not installed")
    if ao_adamw8bit is not None:
        def build_ao():
            params = make_params(shapes, torch.float32, 0)
            return ao_adamw8bit(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY), params

        configs["torchao AdamW8bit (compiled)"] = (build_ao, "")
    else:
        configs["torchao AdamW8bit (compiled)"] = (None, "not installed")
    return configs


def run_step_section(sizes: list[int], reps: int, bnb, ao_adamw8bit, bandwidth: Bandwidth) -> list[dict]:
    rows = []
    for size in sizes:
        shapes, description = transformer_like_shapes(size)
        elements = sum(math.prod(s) for s in shapes)
        print(f"\n{size / 2**20:g}M: {description}")
        configs = step_configurations(shapes, bnb, ao_adamw8bit)
        built, first_step, notes = {}, {}, {}
        for name, (factory, note) in configs.items():
            if factory is None:
                notes[name] = note
                continue
            try:
                optimizer, params = factory()
                started = time.perf_counter()
                optimizer.step()  # creates the state; torchao compiles here
                first_step[name] = time.perf_counter() - started
                built[name] = (optimizer, params)
            except Exception as error:  # noqa: BLE001 - a peer that fails here is reported, not fatal
                notes[name] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
        timings = time_interleaved({name: optimizer.step for name, (optimizer, _) in built.items()},
                                   warmup=2, reps=reps, rounds=3)
        baseline = timings.get("apex FusedAdam fp32 state")
        for name in configs:
            if name not in built:
                rows.append({"size": size, "config": name, "note": notes[name]})
                continue
            optimizer, params = built[name]
            timing = timings[name]
            row = {"size": size, "elements": elements, "config": name, "ms": timing.median * 1e3,
                   "iqr_ms": timing.iqr * 1e3,
                   "first_step_s": first_step[name], "state_bytes_per_param": state_bytes_per_param(optimizer, params),
                   "vs_fp32_state": timing.median / baseline.median if baseline else None}
            precision = next((p for p in PRECISIONS if name.startswith((f"apex FusedAdam {p}",
                                                                        f"apex fused_adam_ op {p}"))), None)
            if precision is not None:
                moved = PARAM_AND_GRAD_BYTES + STATE_BYTES[precision]
                if "remainder" in name:
                    moved = 2 * 2 + 2 * 2 + 2 + STATE_BYTES[precision]  # bf16 param + remainder r/w, bf16 grad
                row["bound_multiple"] = bandwidth.bound_multiple(timing.median, elements, moved)
            rows.append(row)
        del built
        gc.collect()
    return rows


def render_step_rows(rows: list[dict]) -> str:
    table = []
    for row in rows:
        if "ms" not in row:
            table.append([f"{row['size'] / 2**20:g}M", row["config"], "", "", "", "", "", row["note"]])
            continue
        table.append([f"{row['size'] / 2**20:g}M", row["config"], f"{row['ms']:.2f}",
                      "" if row["vs_fp32_state"] is None else f"{row['vs_fp32_state']:.2f}x",
                      f"{row['state_bytes_per_param']:.2f}", f"{row['first_step_s'] * 1e3:.0f}",
                      "" if "bound_multiple" not in row else f"{row['bound_multiple']:.2f}", ""])
    return format_table(["size", "configuration", "step ms", "/ fp32 state", "state B/param", "first step ms",
                         "x bound", "note"], table)


def step_targets(rows: list[dict]) -> list[tuple[str, str, bool]]:
    verdicts = []
    for row in rows:
        if "ms" not in row or not row["config"].startswith("apex") or row["config"].endswith("fp32 state"):
            continue
        size = f"{row['size'] / 2**20:g}M"
        limit = 1.2 if "int8" in row["config"] and "remainder" not in row["config"] else 1.0
        if row["size"] >= 16 * 2**20 or limit > 1.0:
            verdicts.append((f"{size} {row['config']} <= {limit}x the fp32-state step",
                             f"{row['vs_fp32_state']:.2f}x", row["vs_fp32_state"] <= limit))
        for peer in ("bitsandbytes AdamW8bit", "torchao AdamW8bit (compiled)"):
            other = next((r for r in rows if r["size"] == row["size"] and r["config"] == peer and "ms" in r), None)
            if other is not None:
                verdicts.append((f"{size} {row['config']} faster than {peer}", f"{row['ms'] / other['ms']:.2f}x",
                                 row["ms"] < other["ms"]))
    return verdicts


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=["step", "accuracy", "all"], default="all")
    parser.add_argument("--sizes", default="1M,16M,64M", help="elements per step (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=15, help="timed steps per configuration (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="fewer training epochs in the accuracy section")
    parser.add_argument("--seeds", type=int, default=None,
                        help="accuracy: train each configuration with seeds 0..N-1 (default: 5, 2 with --quick)")
    parser.add_argument("--no-torchao", default="", metavar="REASON", nargs="?", const="skipped (--no-torchao)",
                        help="accuracy: leave torchao's AdamW8bit out, with REASON in its row")
    parser.add_argument("--examples", default="digits,lm",
                        help="accuracy: which examples to train, digits and/or lm (default: %(default)s; the "
                             "transformer takes most of the time, so many seeds of digits alone are cheap)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    info = machine_info()
    print("low-precision optimizer state")
    print(f"machine: {info['cpu_model']}, {info['logical_cpus']} logical CPUs; torch {info['torch_version']}, "
          f"{info['torch_threads']} threads; load average at start {info['load_average_1_5_15min']}")
    bnb, bnb_note = load_bitsandbytes()
    ao_adamw8bit, ao_note = load_torchao_adamw8bit()
    print(f"peers: {bnb_note}; {ao_note}; apex_amp state_precision: {'yes' if has_state_precision() else 'no'}")
    payload = {"machine": info}
    if args.section in ("step", "all"):
        bandwidth = Bandwidth.measure(buffer_mb=256)
        print("streaming bandwidth:\n" + bandwidth.describe())
        rows = run_step_section([parse_size(s) for s in args.sizes.split(",")], args.reps, bnb, ao_adamw8bit,
                                bandwidth)
        print("\n" + render_step_rows(rows))
        print("first step ms: the step that creates the state (torchao compiles its step there)")
        print_targets("issue 27, step", step_targets(rows))
        payload.update(step=rows, bandwidth=bandwidth.to_json())
    if args.section in ("accuracy", "all"):
        seeds = args.seeds or (2 if args.quick else 5)
        if seeds < 1:
            raise SystemExit(f"--seeds must be at least 1, got {seeds}")
        examples = tuple(e.strip() for e in args.examples.split(",") if e.strip())
        if not examples or set(examples) - set(_state_accuracy.EXAMPLES):
            raise SystemExit(f"--examples takes digits and/or lm, comma-separated; got {args.examples!r}")
        names = {"digits": "digits MLP", "lm": "character transformer"}
        print(f"\naccuracy (O2 bf16, {' and '.join(names[e] for e in examples)}), seeds 0..{seeds - 1}:")
        configs = _state_accuracy.configurations(bnb, ao_adamw8bit, has_state_precision(), args.no_torchao)
        rows = _state_accuracy.run(configs, args.quick, seeds, examples)
        print("\n" + _state_accuracy.render(rows))
        print(f"the targets below compare the means over the {seeds} seeds")
        print_targets("issue 27, accuracy", _state_accuracy.targets(rows))
        payload["accuracy"] = rows
    finish_run(started, args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
