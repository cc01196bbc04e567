"""Diagnostics no other mixed-precision tool gives: overflow, underflow and shape reports.

* :func:`last_overflow` / :func:`overflow_reports`: which parameters had
  non-finite gradients when a step overflowed (opt in with
  ``amp.initialize(..., overflow_report=True)``);
* :func:`underflow_report` (and :func:`save_histogram`): the share of gradient
  values a half dtype would flush to zero, with and without the loss scale;
* :func:`inspect`: what an opt level will do to a model, layer by layer
  (Tensor Core alignment, fp32 ops, batchnorm), also ``python -m apex_amp inspect``.

Example::

    >>> report = amp.inspect(model, opt_level="O2", half_dtype=torch.bfloat16)
    >>> print(report)
"""

from .overflow import NonFiniteGrad, OverflowReport, last_overflow, overflow_reports
from .shapes import Finding, FindingKind, InspectReport, inspect
from .underflow import LayerUnderflow, UnderflowReport, save_histogram, underflow_report

__all__ = [
    "last_overflow",
    "overflow_reports",
    "OverflowReport",
    "NonFiniteGrad",
    "underflow_report",
    "save_histogram",
    "UnderflowReport",
    "LayerUnderflow",
    "inspect",
    "InspectReport",
    "Finding",
    "FindingKind",
]
