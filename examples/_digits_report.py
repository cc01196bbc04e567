"""Tables, JSON and the plot for examples/train_digits.py (kept apart so the training loop reads on its own)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # files only: works without a display, on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot loads)

__all__ = ["markdown_table", "memory_note", "write_results"]

KIB = 2**10
# Levels often trace the same curve (bf16 O1 and O2 round the same values): distinct dashes keep each visible.
STYLES = {"O0": dict(linestyle="-", linewidth=3.0), "O1": dict(linestyle="--", linewidth=2.2),
          "O2": dict(linestyle=":", linewidth=2.2), "O3": dict(linestyle="-.", linewidth=1.6)}


def memory_note(device_type: str) -> str:
    """What the memory column measures, stated under the table (the measure differs per device)."""
    if device_type == "cuda":
        return "memory: torch.cuda.max_memory_allocated over the level's training (peak of live CUDA tensors)."
    return (
        "memory: counted from the tensors, not measured from the process: parameters + gradients + fp32 "
        "masters + optimizer state at the end of training, plus the activations saved for backward in one "
        "training batch. (CPU has no per-level peak counter: the process RSS peak only ever grows, and "
        "tracemalloc does not see torch's allocations.)"
    )


def _memory_header(device_type: str) -> str:
    return "peak CUDA KiB" if device_type == "cuda" else "tensor KiB (counted)"


def markdown_table(results: Sequence[dict[str, Any]], device_type: str) -> str:
    """One row per opt level: the numbers a user compares levels by."""
    header = ["level", "precision", "test accuracy", "final train loss", "s / epoch",
              _memory_header(device_type), "skipped steps", "final loss scale"]
    rows = [header, ["---"] * len(header)]
    for r in results:
        rows.append([
            r["opt_level"], r["precision"], f"{r['test_accuracy']:.4f}", f"{r['epoch_loss'][-1]:.4f}",
            f"{r['seconds_per_epoch']:.3f}", f"{r['memory_bytes'] / KIB:,.0f}", str(r["skipped_steps"]),
            f"{r['final_loss_scale']:g}",
        ])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def _plot(results: Sequence[dict[str, Any]], title: str, path: Path) -> None:
    fig, (ax_loss, ax_acc, ax_scale) = plt.subplots(1, 3, figsize=(16, 4.8), constrained_layout=True)
    for r in results:
        label = f"{r['opt_level']} ({r['precision']})"
        style = STYLES.get(r["opt_level"], {})
        steps = range(1, len(r["step_loss"]) + 1)
        line, = ax_loss.plot(steps, r["step_loss"], alpha=0.25, linewidth=0.8)
        steps_per_epoch = len(r["step_loss"]) / len(r["epoch_loss"])
        epoch_ends = [steps_per_epoch * (i + 1) for i in range(len(r["epoch_loss"]))]
        ax_loss.plot(epoch_ends, r["epoch_loss"], marker="o", markersize=3, color=line.get_color(), label=label,
                     **style)
        ax_acc.plot(range(1, len(r["epoch_accuracy"]) + 1), r["epoch_accuracy"], marker="o", markersize=3,
                    label=label, **style)
        ax_scale.step(steps, r["step_loss_scale"], where="post", label=label, **style)
        skipped = [i + 1 for i, s in enumerate(r["step_skipped"]) if s]
        if skipped:
            ax_scale.plot(skipped, [r["step_loss_scale"][i - 1] for i in skipped], "x", color="red")
    ax_loss.set(title="training loss (faint: per step, dots: epoch mean)", xlabel="step",
                ylabel="cross-entropy", yscale="log")
    ax_acc.set(title="test accuracy", xlabel="epoch", ylabel="accuracy")
    ax_scale.set(title="loss scale after each step (x: skipped step)", xlabel="step", ylabel="loss scale")
    ax_scale.set_yscale("log", base=2)
    scales = [s for r in results for s in r["step_loss_scale"]]
    if scales and max(scales) == min(scales):
        # A flat line (static scale, e.g. bf16's 1.0) would otherwise get a meaningless autoscaled axis.
        centre = math.log2(scales[0])
        ax_scale.set_ylim(2 ** (centre - 4), 2 ** (centre + 4))
        note = f"no level changed its loss scale of {scales[0]:g}"
        if scales[0] == 1 and all(r["precision"] in ("fp32", "bf16") for r in results):
            note += "\n(bf16 has fp32's range: it needs no loss scaling)"
        ax_scale.text(0.5, 0.35, note, transform=ax_scale.transAxes, ha="center", fontsize="small",
                      color="dimgray")
    for ax in (ax_loss, ax_acc, ax_scale):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(results: Sequence[dict[str, Any]], config: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write results.md (table), results.json (everything, per step) and results.png; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device_type = config["device_type"]
    title = (f"apex_amp on sklearn digits: {config['model']}, {config['optimizer']}, "
             f"{config['epochs']} epochs, batch {config['batch_size']}, {config['device']}")
    paths = {"table": out_dir / "results.md", "json": out_dir / "results.json", "plot": out_dir / "results.png"}
    paths["table"].write_text(
        f"{title}\n\n{markdown_table(results, device_type)}\n\n{memory_note(device_type)}\n", encoding="utf-8")
    paths["json"].write_text(json.dumps({"config": config, "results": list(results)}, indent=1) + "\n",
                             encoding="utf-8")
    _plot(results, title, paths["plot"])
    return paths
