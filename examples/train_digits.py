"""Train a small MLP on scikit-learn's bundled digits at O0, O1, O2 and O3 with apex_amp (no downloads).

    python examples/train_digits.py                        # all four levels, bf16, FusedAdam, into runs/digits
    python examples/train_digits.py --opt-level O2 --epochs 5 --out runs/o2
    python examples/train_digits.py --half-dtype float16   # fp16: a tiny model on CPU (no fast fp16 there)
    python examples/train_digits.py --opt-level O0 O2 --fp8   # fp32, bf16 O2 and O2 with fp8 GEMMs

With --fp8 every O1/O2 level is trained a second time with fp8 GEMMs in its
eligible Linears (a row "O2 fp8"), and the fp8 GEMMs' relative errors next to
the half-precision ones are printed for one test batch.

Each level trains a fresh model from the same initial weights and data order. The
script prints a table (test accuracy, seconds per epoch, memory, skipped steps,
final loss scale per level) and writes it with the per-step curves to the --out
folder: results.md, results.json and results.png (loss, accuracy and loss scale).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

from apex_amp import amp
from apex_amp.amp import casting
from apex_amp.optimizers import FusedAdam

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the report helper sits next to this file
from _digits_report import markdown_table, memory_note, write_results  # noqa: E402
from _fp8_report import gemm_error_table, measure_gemm_errors  # noqa: E402

__all__ = ["main", "parse_args", "train_level"]

HALF_NAMES = {"bfloat16": "bf16", "float16": "fp16"}
# CPUs without fp16 matrix units run fp16 matmuls hundreds of times slower than fp32:
# the fp16 run on CPU uses a tiny network so that it still finishes in seconds.
HIDDEN_DEFAULT = (256, 128)
HIDDEN_FP16_ON_CPU = (32,)


def load_data(seed: int, device: torch.device):
    """The 1797 8x8 digits shipped with scikit-learn, scaled to [0, 1], split 80/20 with a fixed seed."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order].to(device), y[order].to(device)
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def make_model(hidden: Sequence[int]) -> nn.Sequential:
    """64 pixels -> [Linear, BatchNorm, ReLU] per hidden width -> 10 classes (batchnorm shows O2 vs O3)."""
    layers: list[nn.Module] = []
    width = 64
    for size in hidden:
        layers += [nn.Linear(width, size), nn.BatchNorm1d(size), nn.ReLU()]
        width = size
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "FusedAdam":
        return FusedAdam(params, lr=lr, weight_decay=1e-4)
    if name == "Adam":
        return torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    return torch.optim.SGD(params, lr=lr * 50, momentum=0.9)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def train_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, buffers, gradients, fp32 masters and optimizer state (each storage once)."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [p.grad for p in list(tensors) if isinstance(p, torch.Tensor) and p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {_storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class SavedActivationBytes:
    """Counts the bytes autograd saves for backward (parameters excluded: they are in the train state)."""

    def __init__(self, model: nn.Module) -> None:
        self._seen = {_storage_key(t) for t in [*model.parameters(), *model.buffers()]}
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> "SavedActivationBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def train_level(opt_level: str, args: argparse.Namespace, data, device: torch.device,
                fp8: bool = False) -> dict[str, Any]:
    """Train a fresh model at one opt level (with fp8 GEMMs if ``fp8``); return its curves and summary numbers."""
    (x_train, y_train), (x_test, y_test) = data
    torch.manual_seed(args.seed)  # same initial weights and batch order at every level
    model = make_model(args.hidden).to(device)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    overrides = {} if args.loss_scale is None else {"loss_scale": args.loss_scale}
    if fp8:
        overrides["fp8"] = True
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                      half_dtype=getattr(torch, args.half_dtype), verbosity=0, **overrides)
    steps_per_epoch = -(-len(x_train) // args.batch_size)
    # Created after amp.initialize, so that it schedules the optimizer amp has prepared.
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    precision = "fp32" if opt_level == "O0" else HALF_NAMES[args.half_dtype]
    if fp8:
        precision = f"fp8 + {precision}"
    step_loss, step_scale, step_skipped = [], [], []
    epoch_loss, epoch_accuracy, epoch_seconds = [], [], []
    activation_bytes = 0
    bar = tqdm(total=args.epochs * steps_per_epoch, desc=f"{opt_level} {precision}", unit="step",
               disable=not args.progress, leave=True, dynamic_ncols=True)
    for epoch in range(args.epochs):
        start = time.perf_counter()
        model.train()
        total = 0.0
        for batch in torch.randperm(len(x_train), device=device).split(args.batch_size):
            optimizer.zero_grad()
            counter = SavedActivationBytes(model) if not step_loss else None  # first step only
            with counter or contextlib.nullcontext():
                loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            if counter is not None:
                activation_bytes = counter.bytes
            # One host read per value per step: fine for an example, and what the plot needs.
            step_loss.append(loss.item())
            step_skipped.append(amp.step_was_skipped(optimizer))
            if not step_skipped[-1]:  # a skipped step did not train: do not advance the schedule either
                scheduler.step()
            step_scale.append(amp.loss_scale())
            total += step_loss[-1] * len(batch)
            bar.update()
            bar.set_postfix(loss=f"{step_loss[-1]:.3f}", scale=f"{step_scale[-1]:g}", refresh=False)
        epoch_seconds.append(time.perf_counter() - start)
        epoch_loss.append(total / len(x_train))
        model.eval()
        with torch.no_grad():
            epoch_accuracy.append((model(x_test).argmax(1) == y_test).float().mean().item())
    bar.close()

    if device.type == "cuda":
        memory_bytes = torch.cuda.max_memory_allocated(device)
    else:
        memory_bytes = train_state_bytes(model, optimizer) + activation_bytes
    gemm_errors = measure_gemm_errors(
        model, x_test[:args.batch_size], y_test[:args.batch_size], half_dtype=getattr(torch, args.half_dtype),
        loss_fn=lambda m, x, y: nn.functional.cross_entropy(m(x), y)) if fp8 else []
    return {
        "opt_level": opt_level, "precision": precision, "fp8": fp8, "gemm_errors": gemm_errors,
        "test_accuracy": epoch_accuracy[-1], "seconds_per_epoch": statistics.median(epoch_seconds),
        "memory_bytes": memory_bytes, "activation_bytes": activation_bytes,
        "skipped_steps": sum(step_skipped), "final_loss_scale": step_scale[-1],
        "epoch_loss": epoch_loss, "epoch_accuracy": epoch_accuracy, "epoch_seconds": epoch_seconds,
        "step_loss": step_loss, "step_loss_scale": step_scale, "step_skipped": step_skipped,
    }


def _process_peak_rss_mib() -> Optional[float]:
    try:
        import resource  # Unix only
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def _loss_scale_arg(text: str) -> Any:
    if text == "dynamic":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--loss-scale must be 'dynamic' or a number, got {text!r}") from None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", nargs="+", default=list(amp.OPT_LEVELS), choices=amp.OPT_LEVELS,
                        help="one or more levels, trained one after another (default: all four)")
    parser.add_argument("--half-dtype", default="bfloat16", choices=sorted(HALF_NAMES),
                        help="half precision of O1-O3 (default: %(default)s; CPUs have no fast fp16)")
    parser.add_argument("--optimizer", default="FusedAdam", choices=["FusedAdam", "Adam", "SGD"],
                        help="default: %(default)s (Adam is torch's AdamW; SGD uses 50x the learning rate)")
    parser.add_argument("--epochs", type=int, default=30, help="default: %(default)s")
    parser.add_argument("--batch-size", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak of the cosine schedule (default: %(default)s)")
    parser.add_argument("--hidden", type=int, nargs="+", default=None,
                        help=f"hidden widths (default {HIDDEN_DEFAULT}; {HIDDEN_FP16_ON_CPU} for fp16 on CPU)")
    parser.add_argument("--loss-scale", type=_loss_scale_arg, default=None,
                        help="'dynamic' or a number (default: the level's own; with bf16 a static 1.0)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: %(default)s")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (this network's matrices are too small to gain from more, "
                             "and extra threads stall when the cores are busy; default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--out", type=Path, default=Path("runs/digits"),
                        help="folder for the results (default: %(default)s)")
    parser.add_argument("--fp8", action="store_true",
                        help="also train each O1/O2 level with fp8 GEMMs (amp.initialize(..., fp8=True))")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    args = parser.parse_args(argv)
    if min(args.epochs, args.batch_size, args.threads, *(args.hidden or [1])) < 1:
        parser.error("--epochs, --batch-size, --threads and --hidden widths must be at least 1")
    if args.hidden is None:
        slow_fp16 = args.half_dtype == "float16" and torch.device(args.device).type == "cpu"
        args.hidden = HIDDEN_FP16_ON_CPU if slow_fp16 else HIDDEN_DEFAULT
    args.opt_level = list(dict.fromkeys(args.opt_level))  # each level once, in the order given
    return args


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """Train every requested level, print the table, write results.{md,json,png}; return the per-level results."""
    args = parse_args(argv)
    device = torch.device(args.device)
    data = load_data(args.seed, device)
    model_text = "MLP 64-" + "-".join(map(str, args.hidden)) + "-10 with BatchNorm"
    print(f"digits: {len(data[0][0])} train / {len(data[1][0])} test images, {model_text}, "
          f"{args.optimizer}, half dtype {args.half_dtype}, levels {' '.join(args.opt_level)}, on {device}")

    o1_was_active = casting.is_active()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    runs = [(level, False) for level in args.opt_level]
    if args.fp8:
        runs += [(level, True) for level in args.opt_level if level in ("O1", "O2")]
    results = []
    try:
        for opt_level, fp8 in runs:
            results.append(train_level(opt_level, args, data, device, fp8=fp8))
            gc.collect()  # free this level's model before the next one is measured
    finally:
        torch.set_num_threads(threads_before)
        # O1's casting is process-wide: leave the process as we found it (matters when main() is imported).
        if casting.is_active() and not o1_was_active:
            casting.deactivate()

    config = {
        "model": model_text, "optimizer": args.optimizer, "half_dtype": args.half_dtype,
        "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
        "loss_scale": args.loss_scale, "fp8": args.fp8, "device": str(device), "device_type": device.type,
        "torch": torch.__version__, "threads": args.threads,
        "process_peak_rss_mib": _process_peak_rss_mib(),  # whole process, all levels together
    }
    paths = write_results(results, config, args.out)
    print()
    print(markdown_table(results, device.type))
    print()
    print(memory_note(device.type))
    for result in results:
        if result["gemm_errors"]:
            print()
            print(f"{result['opt_level']} {result['precision']}: relative error of the GEMMs on one test batch "
                  f"(vs fp64), fp8 as trained and in {args.half_dtype}")
            print(gemm_error_table(result["gemm_errors"], HALF_NAMES[args.half_dtype]))
    print(f"results: {paths['table']}, {paths['json']}, {paths['plot']}")
    return results


if __name__ == "__main__":
    main()
