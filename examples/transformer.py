"""Train a small decoder-only transformer language model with apex_amp: O2 or O1, FusedAdam, accumulation, clipping.

    python examples/transformer.py                                 # O2, bf16, under a minute on a 2-core CPU
    python examples/transformer.py --opt-level O1 --quick          # a few seconds
    python examples/transformer.py --accumulate 4 --json runs/lm.json
    python examples/transformer.py --half-dtype float16 --quick    # fp16 with dynamic loss scaling (slow on CPU)
    python examples/transformer.py --fp8                           # O2 with fp8 GEMMs in the Linears
    python examples/transformer.py --state-precision int8 --master-weights remainder   # ~8 bytes/param

The model reads characters: its text is the docstrings of the Python standard library,
parsed from the stdlib's source files at run time (every CPython ships them; nothing is
downloaded), or any text file given with --text. Each optimizer step accumulates the
gradients of --accumulate micro-batches (the first ones with ``delay_unscale=True``, as
apex users did), clips their norm on ``amp.master_params(optimizer)`` and steps FusedAdam.
After every epoch it prints the training loss and the held-out loss and perplexity; at the
end, the bytes per parameter of weights, gradients, masters and optimizer state, measured in
the last step (``apex_amp.memory_report``).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from apex_amp import amp, memory_report
from apex_amp.amp import casting
from apex_amp.optimizers import FusedAdam

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the fp8 report helper sits next to this file
from _fp8_report import gemm_error_table, measure_gemm_errors  # noqa: E402

__all__ = ["ALPHABET", "CharTransformer", "encode", "load_text", "main", "make_model", "parse_args", "VOCAB_SIZE"]

# Printable ASCII and newline: 96 symbols, a multiple of 8 like every width below (Tensor Cores need it).
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(ALPHABET)
_CHAR_ID = {c: i for i, c in enumerate(ALPHABET)}
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MIN_TEXT_CHARS = 20_000


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []  # unreadable or not Python 3.x syntax (e.g. test fixtures): skip it
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    return [doc for doc in (ast.get_docstring(n) for n in nodes) if doc]


def load_text(path: Optional[Path] = None, max_chars: int = 300_000) -> str:
    """The training text: ``path``'s contents, or the docstrings of the stdlib's top-level modules.

    Docstrings are parsed from the source files (so ``python -OO`` does not hide them),
    in sorted file order, up to ``max_chars`` characters.
    """
    if path is not None:
        text = path.read_text(encoding="utf-8", errors="replace")
        source = str(path)
    else:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        pieces, total = [], 0
        for file in sorted(stdlib.glob("*.py")):
            for doc in _docstrings(file):
                pieces.append(doc)
                total += len(doc) + 2
            if total >= max_chars:
                break
        text = "\n\n".join(pieces)
        source = f"docstrings of {stdlib}/*.py"
    text = text[:max_chars]
    if len(text) < MIN_TEXT_CHARS:
        raise RuntimeError(
            f"found only {len(text)} characters of text in {source}; at least {MIN_TEXT_CHARS} are needed. "
            "Pass a larger plain-text file with --text PATH."
        )
    return text


def encode(text: str) -> torch.Tensor:
    """Character ids (int64); tabs become spaces, characters outside printable ASCII are dropped."""
    text = text.replace("\t", "    ")
    return torch.tensor([_CHAR_ID[c] for c in text if c in _CHAR_ID], dtype=torch.int64)


class CharTransformer(nn.Module):
    """Token + position embeddings, pre-norm transformer blocks under a causal mask, a linear head."""

    def __init__(self, vocab_size: int, d_model: int, heads: int, layers: int, context: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(context, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        # True above the diagonal: position t attends to positions <= t only. A bool mask has no
        # dtype to get out of step with the half model under O2.
        self.register_buffer("causal_mask", torch.ones(context, context, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        x = self.token(ids) + self.position.weight[:length]
        x = self.blocks(x, mask=self.causal_mask[:length, :length], is_causal=True)
        return self.head(self.norm(x))


def make_model(d_model: int = 128, heads: int = 4, layers: int = 2, context: int = 64,
               vocab_size: int = VOCAB_SIZE) -> CharTransformer:
    """The example's language model (widths multiples of 8); the benchmark builds larger ones."""
    for name, value in (("d_model", d_model), ("vocab_size", vocab_size)):
        if value % 8:
            raise ValueError(f"{name}={value} is not a multiple of 8; half-precision matmuls want multiples of 8")
    if d_model % heads:
        raise ValueError(f"d_model={d_model} must be divisible by heads={heads}")
    return CharTransformer(vocab_size, d_model, heads, layers, context)


def batch_of_windows(ids: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``ids[s : s+context]`` and next-character targets ``ids[s+1 : s+context+1]`` per start."""
    rows = starts[:, None] + torch.arange(context + 1)
    windows = ids[rows]
    return windows[:, :-1], windows[:, 1:]


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


@torch.no_grad()
def held_out_loss(model: nn.Module, ids: torch.Tensor, context: int, windows: int) -> float:
    """Mean next-character loss over ``windows`` windows spread evenly over the held-out text."""
    model.eval()
    starts = torch.linspace(0, len(ids) - context - 1, windows).long()
    total = 0.0
    for chunk in starts.split(64):
        total += lm_loss(model, *batch_of_windows(ids, chunk, context)).item() * len(chunk)
    model.train()
    return total / len(starts)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2"],
                        help="default: %(default)s (O0: the fp32 baseline)")
    parser.add_argument("--half-dtype", default="bfloat16", choices=sorted(HALF_DTYPES),
                        help="default: %(default)s (CPUs have no fast fp16)")
    parser.add_argument("--epochs", type=int, default=6, help="default: %(default)s")
    parser.add_argument("--steps-per-epoch", type=int, default=30, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per micro-batch (default: %(default)s)")
    parser.add_argument("--accumulate", type=int, default=2,
                        help="micro-batches per optimizer step (default: %(default)s)")
    parser.add_argument("--context", type=int, default=64, help="characters per window (default: %(default)s)")
    parser.add_argument("--d-model", type=int, default=128, help="default: %(default)s")
    parser.add_argument("--heads", type=int, default=4, help="default: %(default)s")
    parser.add_argument("--layers", type=int, default=2, help="default: %(default)s")
    parser.add_argument("--lr", type=float, default=3e-3, help="default: %(default)s")
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm (default: %(default)s)")
    parser.add_argument("--eval-windows", type=int, default=256,
                        help="held-out windows scored after each epoch (default: %(default)s)")
    parser.add_argument("--text", type=Path, default=None, help="a plain-text file (default: stdlib docstrings)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default: %(default)s; a second thread gains little at these "
                             "sizes and stalls when other processes keep the cores busy)")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--quick", action="store_true",
                        help="2 epochs of 6 steps, batch 8, context 32, one layer, 64 held-out windows: a smoke test")
    parser.add_argument("--fp8", action="store_true",
                        help="fp8 GEMMs in the feed-forward Linears and the head (amp.initialize(..., fp8=True))")
    parser.add_argument("--state-precision", default="fp32", choices=["fp32", "bf16", "fp8", "int8"],
                        help="FusedAdam's moments (default: %(default)s; docs/low_precision_state.md)")
    parser.add_argument("--master-weights", default="fp32", choices=["fp32", "remainder"],
                        help="O2's masters: fp32 copies, or bf16 weights plus 16-bit remainders (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.steps_per_epoch, args.batch_size, args.context, args.layers = 2, 6, 8, 32, 1
        args.eval_windows = 64
    counts = (args.epochs, args.steps_per_epoch, args.batch_size, args.accumulate, args.context, args.d_model,
              args.heads, args.layers, args.threads, args.eval_windows)
    if min(counts) < 1:
        parser.error("--epochs, --steps-per-epoch, --batch-size, --accumulate, --context, --d-model, --heads, "
                     "--layers, --threads and --eval-windows must be at least 1")
    if args.d_model % 8 or args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of 8 and of --heads {args.heads}")
    if args.clip <= 0 or args.lr <= 0:
        parser.error("--clip and --lr must be positive")
    if args.master_weights == "remainder" and (args.opt_level != "O2" or args.half_dtype != "bfloat16"):
        parser.error("--master-weights remainder needs --opt-level O2 and --half-dtype bfloat16")
    return args


def train(args: argparse.Namespace, train_ids: torch.Tensor, val_ids: torch.Tensor) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    model = make_model(args.d_model, args.heads, args.layers, args.context)
    optimizer = FusedAdam(model.parameters(), lr=args.lr, weight_decay=0.01, state_precision=args.state_precision)
    masters = {"master_weights": "remainder"} if args.master_weights == "remainder" else {}
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      half_dtype=HALF_DTYPES[args.half_dtype], verbosity=0,
                                      **({"fp8": True} if args.fp8 else {}), **masters)
    total_steps = args.epochs * args.steps_per_epoch
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps,
                                                    pct_start=0.1)
    windows = torch.Generator().manual_seed(args.seed)
    last_start = len(train_ids) - args.context - 1
    initial_val = held_out_loss(model, val_ids, args.context, args.eval_windows)
    epochs, skipped = [], 0
    precision = "fp32" if args.opt_level == "O0" else args.half_dtype
    precision = f"fp8 + {precision}" if args.fp8 else precision
    bar = tqdm(total=total_steps, desc=f"{args.opt_level} {precision}", unit="step",
               disable=not args.progress, dynamic_ncols=True)
    for epoch in range(1, args.epochs + 1):
        start, train_loss = time.perf_counter(), torch.zeros(())
        for step_index in range(args.steps_per_epoch):
            for micro in range(args.accumulate):
                starts = torch.randint(0, last_start, (args.batch_size,), generator=windows)
                loss = lm_loss(model, *batch_of_windows(train_ids, starts, args.context)) / args.accumulate
                # The first K-1 passes leave their gradients scaled; the last one unscales the sum.
                with amp.scale_loss(loss, optimizer, delay_unscale=micro < args.accumulate - 1) as scaled_loss:
                    scaled_loss.backward()
                train_loss += loss.detach().float()
            # After scale_loss has exited, the master gradients hold their true values: clip those.
            nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.clip)
            if epoch == args.epochs and step_index == args.steps_per_epoch - 1:
                memory = memory_report(model, optimizer)  # the peak: gradients and state both exist
            optimizer.step()
            optimizer.zero_grad()
            if amp.step_was_skipped(optimizer):
                skipped += 1  # an overflow (fp16): amp lowered the scale; do not advance the schedule
            else:
                scheduler.step()
            bar.update()
        val = held_out_loss(model, val_ids, args.context, args.eval_windows)
        epochs.append({"epoch": epoch, "train_loss": train_loss.item() / args.steps_per_epoch, "val_loss": val,
                       "val_perplexity": math.exp(val), "seconds": time.perf_counter() - start})
        tqdm.write(f"epoch {epoch}: train loss {epochs[-1]['train_loss']:.3f}, held-out loss {val:.3f} "
                   f"(perplexity {math.exp(val):.2f}), {epochs[-1]['seconds']:.1f} s")
    bar.close()
    gemm_errors = []
    if args.fp8:  # the fp8 GEMMs' relative errors next to the half ones, on one held-out batch
        starts = torch.linspace(0, len(val_ids) - args.context - 1, args.batch_size).long()
        # The loss as a training micro-batch computes it, so the gradients have the size the delayed
        # scales were made for (twice as large, 1% of them would saturate at the e5m2 scale).
        gemm_errors = measure_gemm_errors(model, *batch_of_windows(val_ids, starts, args.context),
                                          half_dtype=HALF_DTYPES[args.half_dtype],
                                          loss_fn=lambda m, x, y: lm_loss(m, x, y) / args.accumulate)
    return {"opt_level": args.opt_level, "gemm_errors": gemm_errors, "half_dtype": args.half_dtype, "fp8": args.fp8, "precision": precision,
            "initial_val_loss": initial_val,
            "epochs": epochs, "final_loss_scale": amp.loss_scale(), "skipped_steps": skipped,
            "memory": {"total": memory.per_parameter(), **{k: memory.per_parameter(k) for k in memory.bytes}},
            "memory_table": str(memory),
            "parameters": sum(p.numel() for p in model.parameters())}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Train, print per-epoch and final lines, optionally write --json; return the results."""
    args = parse_args(argv)
    ids = encode(load_text(args.text))
    split = int(0.9 * len(ids))
    train_ids, val_ids = ids[:split], ids[split:]
    threads_before, o1_was_active = torch.get_num_threads(), casting.is_active()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    try:
        result = train(args, train_ids, val_ids)
    finally:
        torch.set_num_threads(threads_before)
        # O1's casting is process-wide: leave the process as we found it (matters when main() is imported).
        if casting.is_active() and not o1_was_active:
            casting.deactivate()
    result.update(seconds=time.perf_counter() - started, train_chars=len(train_ids), val_chars=len(val_ids),
                  config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    first, last = result["epochs"][0], result["epochs"][-1]
    print(f"{result['parameters']:,} parameters, {len(train_ids):,} training characters; "
          f"held-out loss {result['initial_val_loss']:.3f} before training")
    print(f"final: {args.opt_level} {result['precision']}: train loss {first['train_loss']:.3f} -> "
          f"{last['train_loss']:.3f}, held-out loss {result['initial_val_loss']:.3f} -> {last['val_loss']:.3f} "
          f"(perplexity {last['val_perplexity']:.2f}), loss scale {result['final_loss_scale']:g}, "
          f"skipped steps {result['skipped_steps']}, {result['seconds']:.1f} s")
    print(f"bytes per parameter in the last step (FusedAdam state {args.state_precision}, masters "
          f"{args.master_weights}):")
    print(result["memory_table"])
    if result["gemm_errors"]:
        print(f"relative error of the GEMMs on one held-out batch (vs fp64): fp8 as trained, and {args.half_dtype}")
        print(gemm_error_table(result["gemm_errors"], args.half_dtype))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
