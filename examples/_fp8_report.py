"""The fp8 GEMM-error measurement shared by the examples: capture each fp8 layer's input and output gradient."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from apex_amp.fp8 import Fp8Linear, gemm_errors

__all__ = ["measure_gemm_errors", "gemm_error_table"]


def _capture(slot: list, x: torch.Tensor, out: torch.Tensor) -> None:
    slot[0] = x.detach()
    out.register_hook(lambda grad: slot.__setitem__(1, grad.detach()))


def measure_gemm_errors(model: nn.Module, *batch: Any, half_dtype: torch.dtype,
                        loss_fn: Callable[..., torch.Tensor]) -> list[dict[str, Any]]:
    """One forward and backward of ``loss_fn(model, *batch)`` (no step), then each fp8 layer's GEMM errors."""
    captured: dict[str, list] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            captured[name] = [None, None]
            handles.append(module.register_forward_hook(
                lambda m, args, out, name=name: _capture(captured[name], args[0], out)))
    was_training = model.training
    model.train()
    try:
        loss_fn(model, *batch).float().backward()
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    rows = []
    modules = dict(model.named_modules())
    for name, (x, grad_out) in captured.items():
        if x is None or grad_out is None:
            continue
        layer = modules[name]
        x2, g2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        for error in gemm_errors(layer, x2, g2, half_dtype):
            rows.append({"layer": name, "gemm": error.gemm, "fp8": error.fp8, "half": error.half})
    return rows


def gemm_error_table(rows: Sequence[dict[str, Any]], half: str) -> str:
    """Markdown: one row per layer and GEMM, the fp8 and half relative errors and their ratio."""
    lines = [f"| layer | GEMM | fp8 rel. error | {half} rel. error | fp8 / {half} |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        ratio = row["fp8"] / row["half"] if row["half"] else float("inf")
        lines.append(f"| {row['layer']} | {row['gemm']} | {row['fp8']:.4f} | {row['half']:.4f} | {ratio:.1f} |")
    return "\n".join(lines)
