"""Underflow reports: how many gradient values a half dtype would flush to zero, with and without the loss scale.

The rounding is exact. Casting to fp16 rounds to nearest, ties to even. The
smallest fp16 value above zero is the subnormal ``2**-24``; halfway between it
and zero, ``2**-25`` is a tie and goes to the even neighbour, zero. So a value
``x`` flushes to zero exactly when ``|x| <= 2**-25`` (half the smallest
subnormal), and overflows to inf exactly when ``|x| >= 65520`` (the largest
finite value, 65504, plus half its ulp, 16). The same holds for bf16 with its
own constants (``2**-134``; ``max + 2**119``). ``x`` is the gradient times the
loss scale, multiplied in fp32, as a scaled backward would hold it.

This is about the gradient values themselves; a half backward also rounds its
intermediate results, so the real loss can be somewhat larger.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from ..._dtensor import local_tensor
from ..._dtypes import HALF_DTYPES
from .. import sessions
from ..gradients import GradState
from ..run_state import loss_scale as current_loss_scale
from ..run_state import master_params

__all__ = ["LayerUnderflow", "UnderflowReport", "underflow_report", "save_histogram", "flush_threshold",
           "overflow_threshold"]

# Exponent bins of the log2|g| histogram: floor(log2|g|) from fp32's smallest subnormal to its max.
_MIN_EXPONENT = -149
_MAX_EXPONENT = 127


def flush_threshold(dtype: torch.dtype) -> float:
    """Largest magnitude that rounds to zero in ``dtype``: half its smallest subnormal (a tie goes to 0).

    Example::

        >>> flush_threshold(torch.float16) == 2.0**-25
        True
    """
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2


def overflow_threshold(dtype: torch.dtype) -> float:
    """Smallest magnitude that rounds to inf in ``dtype``: its max plus half the ulp at the max.

    Example::

        >>> overflow_threshold(torch.float16)
        65520.0
    """
    info = torch.finfo(dtype)
    _, exponent = math.frexp(info.max)  # max = m * 2**exponent with m in [0.5, 1)
    return info.max + 2.0 ** (exponent - 1) * info.eps / 2


@dataclasses.dataclass(frozen=True)
class LayerUnderflow:
    """The gradient of one parameter, seen through a half dtype."""

    name: str
    numel: int
    nonzero: int  # finite, non-zero gradient values: the ones that can be lost
    flushed: int  # of those, how many round to zero at the loss scale
    flushed_unscaled: int  # ... and without any scaling
    overflowed: int  # finite values whose scaled magnitude rounds to inf
    histogram: tuple[int, ...]  # counts of floor(log2|g|) per bin of UnderflowReport.exponents

    @property
    def fraction(self) -> float:
        """Share of the non-zero values that the loss scale does not save from zero."""
        return self.flushed / self.nonzero if self.nonzero else 0.0

    @property
    def fraction_unscaled(self) -> float:
        """Share of the non-zero values that would become zero without a loss scale."""
        return self.flushed_unscaled / self.nonzero if self.nonzero else 0.0


@dataclasses.dataclass(frozen=True)
class UnderflowReport:
    """Per-parameter flush-to-zero counts and log2|g| histograms (see :func:`underflow_report`)."""

    dtype: torch.dtype
    loss_scale: float
    exponents: tuple[int, ...]  # histogram bins: bin i counts the values with floor(log2|g|) == exponents[i]
    layers: tuple[LayerUnderflow, ...]

    @property
    def histogram(self) -> tuple[int, ...]:
        """The log2|g| histogram of all layers together."""
        return tuple(map(sum, zip(*(layer.histogram for layer in self.layers)))) or (0,) * len(self.exponents)

    @property
    def fraction(self) -> float:
        """Share of all non-zero gradient values flushed to zero at the loss scale."""
        nonzero = sum(layer.nonzero for layer in self.layers)
        return sum(layer.flushed for layer in self.layers) / nonzero if nonzero else 0.0

    @property
    def fraction_unscaled(self) -> float:
        """Share of all non-zero gradient values flushed to zero without scaling."""
        nonzero = sum(layer.nonzero for layer in self.layers)
        return sum(layer.flushed_unscaled for layer in self.layers) / nonzero if nonzero else 0.0

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        header = ("parameter", "values", "non-zero", f"zero in {dtype} unscaled", f"at scale {self.loss_scale:g}",
                  "overflow")
        rows = [(layer.name, str(layer.numel), str(layer.nonzero), f"{layer.fraction_unscaled:.2%}",
                 f"{layer.fraction:.2%}", str(layer.overflowed)) for layer in self.layers]
        rows.append(("all", str(sum(layer.numel for layer in self.layers)),
                     str(sum(layer.nonzero for layer in self.layers)), f"{self.fraction_unscaled:.2%}",
                     f"{self.fraction:.2%}", str(sum(layer.overflowed for layer in self.layers))))
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                           for i, (cell, width) in enumerate(zip(row, widths))) for row in [header, *rows]]
        lines.insert(1, "  ".join("-" * width for width in widths))
        return "\n".join(lines)


def _count(grad: Tensor, scale: float, flush: float, overflow: float) -> Tensor:
    # [nonzero, flushed, flushed_unscaled, overflowed, histogram...] as one int64 tensor.
    values = local_tensor(grad.detach()).float().reshape(-1)  # FSDP2: this rank's shard
    finite = torch.isfinite(values)
    nonzero = finite & (values != 0)
    magnitude = values.abs()
    scaled = (values * scale).abs()  # fp32 multiply, as a scaled backward holds the value
    counts = torch.stack([
        nonzero.sum(),
        (nonzero & (scaled <= flush)).sum(),
        (nonzero & (magnitude <= flush)).sum(),
        (finite & (scaled >= overflow)).sum(),
    ])
    _, exponent = torch.frexp(magnitude[nonzero])  # |g| = m * 2**exponent, m in [0.5, 1): floor(log2|g|) = exponent - 1
    bins = (exponent.to(torch.int64) - 1).clamp(_MIN_EXPONENT, _MAX_EXPONENT) - _MIN_EXPONENT
    histogram = torch.bincount(bins, minlength=_MAX_EXPONENT - _MIN_EXPONENT + 1)
    return torch.cat([counts, histogram]).cpu()


def _named_grads(source: Union[nn.Module, torch.optim.Optimizer]) -> list[tuple[str, Tensor]]:
    if isinstance(source, torch.optim.Optimizer):
        if sessions.session_for(source) is None:
            params = [p for group in source.param_groups for p in group["params"]]
        else:
            params = list(master_params(source))  # unscales gradients a fused step would consume scaled
        return [(f"params[{index}]", p.grad) for index, p in enumerate(params) if p.grad is not None]
    if not isinstance(source, nn.Module):
        raise TypeError(f"underflow_report expects a torch.nn.Module or an optimizer, got {type(source).__name__}")
    session = sessions.latest_session()
    if session is not None and session.enabled:
        for lifecycle in session.lifecycles.values():
            if lifecycle.state is GradState.DELAYED:
                raise RuntimeError("underflow_report: the gradients are still scaled by "
                                   "amp.scale_loss(..., delay_unscale=True); call it after a pass with "
                                   "delay_unscale=False")
            lifecycle.settle()  # kept scaled for a fused step: unscale, as amp.master_params does
    found = []
    for name, param in source.named_parameters():
        master = session.master_of(param) if session is not None and session.enabled else None
        grad = master.grad if master is not None and master.grad is not None else param.grad
        if grad is not None:
            found.append((name, grad))
    return found


def underflow_report(
    source: Union[nn.Module, torch.optim.Optimizer],
    loss_scale: Optional[float] = None,
    dtype: torch.dtype = torch.float16,
    loss_id: int = 0,
) -> UnderflowReport:
    """How many of the current gradient values ``dtype`` would flush to zero, per parameter.

    Call it after ``scale_loss`` exits (the gradients are then unscaled), before
    ``zero_grad``. For each parameter: the share of its finite non-zero gradient
    values ``g`` whose ``g * loss_scale`` rounds to zero in ``dtype`` (exact
    rule: ``|g * loss_scale| <= `` :func:`flush_threshold`), the same without
    scaling, the values that would overflow instead, and a histogram of
    ``floor(log2|g|)``. Exact zeros (ReLU, unused rows) are not counted as lost.

    Args:
        source: a model (named rows; under O2 its fp32 master gradients are read)
            or an optimizer (its ``amp.master_params``, rows named ``params[i]``).
        loss_scale: the scale to evaluate; default: the current scale of ``loss_id``
            in the latest ``amp.initialize`` (a host read).
        dtype: the half dtype, torch.float16 or torch.bfloat16.
        loss_id: which loss scaler's scale is the default.

    .. note:: One host read per call (diagnostics, not for every step).

    Example::

        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> report = amp.underflow_report(model, dtype=torch.float16)
        >>> print(report)   # per parameter: share flushed to zero unscaled / at the scale
        >>> amp.save_histogram(report, "grad_hist.png")
        >>> optimizer.step()
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
    if loss_scale is None:
        session = sessions.latest_session()
        if session is None or not session.enabled:
            raise ValueError("underflow_report needs loss_scale=... when amp.initialize has not been called "
                             "(or was called with enabled=False)")
        loss_scale = current_loss_scale(loss_id)
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not (
            math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"loss_scale must be a positive finite number, got {loss_scale!r}")
    grads = _named_grads(source)
    if not grads:
        raise RuntimeError("underflow_report found no gradients; call it after a backward pass "
                           "(inside the training loop, before optimizer.zero_grad())")
    flush, overflow = flush_threshold(dtype), overflow_threshold(dtype)
    counts = torch.stack([_count(grad, float(loss_scale), flush, overflow) for _, grad in grads]).tolist()
    histograms = [row[4:] for row in counts]
    used = [i for i in range(len(histograms[0])) if any(h[i] for h in histograms)]
    low, high = (used[0], used[-1] + 1) if used else (0, 0)
    layers = tuple(
        LayerUnderflow(name, grad.numel(), row[0], row[1], row[2], row[3], tuple(row[4 + low:4 + high]))
        for (name, grad), row in zip(grads, counts)
    )
    exponents = tuple(range(_MIN_EXPONENT + low, _MIN_EXPONENT + high))
    return UnderflowReport(dtype=dtype, loss_scale=float(loss_scale), exponents=exponents, layers=layers)


def save_histogram(report: UnderflowReport, path: Any, layer: Optional[str] = None) -> None:
    """Plot the log2|g| histogram of ``report`` to a PNG, with the half range shaded.

    The grey band is the magnitudes ``dtype`` represents (smallest subnormal to
    max); the green band the gradient magnitudes that become representable once
    multiplied by the loss scale. Needs matplotlib (``pip install matplotlib``).

    Args:
        report: an :class:`UnderflowReport`.
        path: the file to write (PNG).
        layer: a parameter name of the report to plot alone; default: all together.

    Example::

        >>> report = amp.underflow_report(model, loss_scale=2.0**16)
        >>> amp.save_histogram(report, "grad_hist.png")
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("save_histogram needs matplotlib: pip install matplotlib") from error
    if layer is None:
        counts, title = report.histogram, "all gradients"
    else:
        picked = [item for item in report.layers if item.name == layer]
        if not picked:
            raise ValueError(f"no parameter named {layer!r} in the report; it has "
                             f"{[item.name for item in report.layers]}")
        counts, title = picked[0].histogram, layer
    dtype = str(report.dtype).replace("torch.", "")
    info = torch.finfo(report.dtype)
    low, high = math.log2(info.smallest_normal * info.eps), math.log2(info.max)
    shift = math.log2(report.loss_scale)
    figure, axes = plt.subplots(figsize=(9, 4.5))
    try:
        axes.axvspan(low, high, color="0.85", label=f"{dtype} range (unscaled)")
        axes.axvspan(low - shift, high - shift, color="tab:green", alpha=0.2,
                     label=f"{dtype} range at loss scale {report.loss_scale:g}")
        axes.bar([e + 0.5 for e in report.exponents], counts, width=1.0, color="tab:blue", label="gradient values")
        axes.set_xlabel("log2 |gradient|")
        axes.set_ylabel("values (log scale)")
        if any(counts):
            axes.set_yscale("log")  # the thin tails are what flushes to zero
        axes.set_title(f"{title}: {report.fraction_unscaled:.2%} of non-zero values flush to zero in {dtype} "
                       f"unscaled, {report.fraction:.2%} at scale {report.loss_scale:g}" if layer is None
                       else title)
        axes.legend(loc="upper left", fontsize="small")
        figure.tight_layout()
        figure.savefig(path, dpi=110)
    finally:
        plt.close(figure)
