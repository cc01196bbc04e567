"""apex_amp's fp8 Linears next to torchao's Float8Linear, in the same run: one layer's numerics, then 100 steps.

    pip install torchao==0.18.0            # optional: not a dependency of apex_amp
    python examples/fp8_vs_torchao.py       # ~1 minute on a 2-core CPU

1. Numerics: the same bf16 Linear (256 -> 512, 1024 tokens) and the same input and output gradient
   through apex_amp's Fp8Linear with current (just-in-time) scaling and through torchao's
   Float8Linear (its default recipe: tensorwise dynamic scales, e4m3 forward, e5m2 gradients):
   the largest difference of the output, the input gradient and the weight gradient.
2. Training: examples/transformer.py's language model for 100 optimizer steps at O2 (bf16, fp32
   masters, FusedAdam) four ways: bf16 GEMMs, apex_amp fp8 delayed, apex_amp fp8 current, and
   torchao's Float8Linear in the same Linears (converted before amp.initialize, which then treats
   them as any other layer). Same initial weights and data; the loss every 10 steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdam

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transformer import batch_of_windows, encode, load_text, make_model  # noqa: E402

__all__ = ["main"]


def _torchao():
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as error:
        raise SystemExit(f"torchao is not installed ({error}); pip install torchao==0.18.0") from None
    return convert_to_float8_training


def _same_layers(module: nn.Module, name: str) -> bool:
    # apex_amp converts nn.Linear itself with both dimensions multiples of 16: give torchao the same ones.
    return type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0


def numerics(seed: int) -> list[tuple[str, float, float]]:
    """(tensor, max |apex_amp - torchao|, max |value|) for the output and the two gradients of one layer."""
    convert = _torchao()
    torch.manual_seed(seed)
    x = torch.randn(1024, 256).bfloat16()
    grad_out = torch.randn(1024, 512).bfloat16() * 1e-3
    results = {}
    for which in ("apex_amp", "torchao"):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(256, 512))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        if which == "torchao":
            convert(model, module_filter_fn=_same_layers)
        fp8 = amp.Fp8Recipe(scaling="current") if which == "apex_amp" else None
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                          fp8=fp8, verbosity=0, cast_model_outputs=torch.bfloat16)
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.backward(grad_out)
        results[which] = (out.detach().float(), xi.grad.float(), model[0].weight.grad.float())
    rows = []
    for name, ours, theirs in zip(("output", "input grad", "weight grad"), results["apex_amp"], results["torchao"]):
        rows.append((name, float((ours - theirs).abs().max()), float(theirs.abs().max())))
    return rows


def train(kind: str, steps: int, seed: int, ids: torch.Tensor) -> list[float]:
    """Losses of ``steps`` O2 steps of the transformer example's model, with the GEMMs of ``kind``."""
    torch.manual_seed(seed)
    model = make_model(128, 4, 2, 64)
    if kind == "torchao":
        _torchao()(model, module_filter_fn=_same_layers)
    optimizer = FusedAdam(model.parameters(), lr=3e-3, weight_decay=0.01)
    fp8: Any = {"bf16": None, "torchao": None, "apex_amp delayed": True,
                "apex_amp current": amp.Fp8Recipe(scaling="current")}[kind]
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, fp8=fp8,
                                      verbosity=0)
    windows = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (16,), generator=windows)
        x, y = batch_of_windows(ids, starts, 64)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Print the numerics table and the loss curves; return both."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--threads", type=int, default=1, help="default: %(default)s")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import torchao

    print(f"torch {torch.__version__}, torchao {torchao.__version__}")
    rows = numerics(args.seed)
    print("\n| tensor | max abs difference apex_amp - torchao | max abs value |\n| --- | --- | --- |")
    for name, difference, scale in rows:
        print(f"| {name} | {difference:.3g} | {scale:.3g} |")
    ids = encode(load_text())
    curves = {kind: train(kind, args.steps, args.seed, ids)
              for kind in ("bf16", "apex_amp delayed", "apex_amp current", "torchao")}
    marks = list(range(0, args.steps, 10)) + [args.steps - 1]
    print("\n| step | " + " | ".join(curves) + " |\n| --- |" + " --- |" * len(curves))
    for step in marks:
        print(f"| {step + 1} | " + " | ".join(f"{curve[step]:.4f}" for curve in curves.values()) + " |")
    last = {kind: sum(curve[-10:]) / 10 for kind, curve in curves.items()}
    print("\nmean loss of the last 10 steps: " + ", ".join(f"{kind} {value:.4f}" for kind, value in last.items()))
    gap = max(abs(a - b) for a, b in zip(curves["apex_amp current"], curves["torchao"]))
    print(f"largest per-step loss difference, apex_amp current vs torchao: {gap:.4f}")
    return {"numerics": rows, "curves": curves}


if __name__ == "__main__":
    main()
