"""Overflow reports: which parameters had non-finite gradients when a step overflowed.

Opt in with ``amp.initialize(..., overflow_report=True)``. Without it nothing
here runs: ``scale_loss`` makes one dictionary lookup per backward pass and no
tensor op or host sync. With it, every checked backward pass reads its overflow
flag on the host (one sync per pass on CUDA); only when the flag is set are the
inf and NaN values of each gradient counted (one more sync), and the report is
kept (``amp.last_overflow``) and logged at DEBUG level on the ``"apex_amp"`` logger.

Reported are the passes ``scale_loss`` checks on exit, which includes the
last pass of a ``delay_unscale=True`` accumulation (it checks the whole sum).

Parameter names are the models' ``named_parameters()`` names as
``initialize`` saw them (prefixed ``model{i}.`` when several models were
passed); under O2 an fp32 master is reported under its model parameter's name.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from ..._dtensor import local_tensor
from .. import sessions
from ..gradients import GradLifecycle
from ..session import AmpSession

__all__ = ["NonFiniteGrad", "OverflowReport", "last_overflow", "overflow_reports"]

logger = logging.getLogger("apex_amp")

HISTORY = 64  # reports kept per session; older ones are dropped


@dataclasses.dataclass(frozen=True)
class NonFiniteGrad:
    """One parameter whose gradient held inf or NaN values."""

    name: str
    inf: int
    nan: int
    numel: int
    fp8: bool = False  # a weight or bias of a layer whose GEMMs run in fp8


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """One overflowing backward pass.

    Attributes:
        step: index of the optimizer step this overflow skips (0 for the first
            ``optimizer.step()`` of the run).
        loss_id: the loss scaler whose backward pass overflowed.
        loss_scale: the scale the gradients carried.
        params: the parameters with non-finite gradients, in optimizer order.
            Empty when the flag came from another rank (``sync_overflow``).
        fp8_tensors: the fp8 layers' tensors (``"<layer>.input"``, ``".weight"``,
            ``".grad_output"``) whose amax in this step was inf or NaN (fp8 training only).
    """

    step: int
    loss_id: int
    loss_scale: float
    params: tuple[NonFiniteGrad, ...]
    fp8_tensors: tuple[str, ...] = ()

    @property
    def names(self) -> list[str]:
        """The names of the parameters with non-finite gradients."""
        return [param.name for param in self.params]

    def __str__(self) -> str:
        head = f"overflow at step {self.step}, loss scaler {self.loss_id}, loss scale {self.loss_scale:g}"
        fp8 = f"; non-finite fp8 GEMM inputs: {', '.join(self.fp8_tensors)}" if self.fp8_tensors else ""
        if not self.params:
            return head + ": no local gradient is non-finite (the flag came from another rank)" + fp8
        lines = [head + f": {len(self.params)} parameter(s) with non-finite gradients" + fp8]
        width = max(len(param.name) for param in self.params)
        for param in self.params:
            tag = "  (fp8 layer)" if param.fp8 else ""
            lines.append(f"  {param.name:<{width}}  inf {param.inf:>8}  nan {param.nan:>8}  of {param.numel}{tag}")
        return "\n".join(lines)


class OverflowRecorder:
    """Names of the parameters and the reports of one session."""

    def __init__(self, models: Sequence[nn.Module], fp8: Any = None) -> None:
        self.fp8 = fp8  # the session's fp8_training.Fp8Training, or None
        self.names = WeakIdKeyDictionary()
        for index, model in enumerate(models):
            prefix = f"model{index}." if len(models) > 1 else ""
            for name, param in model.named_parameters(remove_duplicate=False):
                self.names.setdefault(param, prefix + name)
        self.reports: collections.deque[OverflowReport] = collections.deque(maxlen=HISTORY)

    def record(
        self, found_inf: Tensor, loss_id: int, inv_scale: Tensor, lifecycles: Sequence[GradLifecycle]
    ) -> None:
        """Called by ``AmpSession.account`` after each checked pass: counts the non-finite values on overflow."""
        if not bool(found_inf.item()):  # the opt-in host read
            return
        grads = []
        for lifecycle in lifecycles:
            for index, (param, grad) in enumerate(lifecycle.pending_grads()):
                name = self.names.get(param)
                # FSDP2: this rank's shard (each rank reports the non-finite values it holds).
                grads.append((name if name is not None else f"params[{index}]", local_tensor(grad),
                              self.fp8 is not None and self.fp8.holds_param(param)))
        params: list[NonFiniteGrad] = []
        if grads:
            device = found_inf.device
            counts = torch.stack([
                torch.stack((torch.isinf(grad).sum(), torch.isnan(grad).sum())).to(device) for _, grad, _ in grads
            ]).tolist()
            params = [
                NonFiniteGrad(name, int(inf), int(nan), grad.numel(), fp8)
                for (name, grad, fp8), (inf, nan) in zip(grads, counts) if inf or nan
            ]
        report = OverflowReport(
            step=lifecycles[0].steps,
            loss_id=loss_id,
            loss_scale=1.0 / float(inv_scale.reshape(-1)[0].item()),
            params=tuple(params),
            fp8_tensors=tuple(self.fp8.nonfinite_tensors()) if self.fp8 is not None else (),
        )
        self.reports.append(report)
        logger.debug("%s", report)


def enable(session: AmpSession, models: Sequence[nn.Module]) -> None:
    """Turn overflow reports on for ``session`` (called by ``amp.initialize(..., overflow_report=True)``)."""
    session.overflow_recorder = OverflowRecorder(models, session.fp8)


def _recorder(optimizer: Optional[torch.optim.Optimizer], caller: str) -> OverflowRecorder:
    session = sessions.latest_session() if optimizer is None else sessions.session_for(optimizer)
    if session is None:
        what = ("amp.initialize was never called" if optimizer is None
                else "this optimizer was never passed to amp.initialize")
        raise RuntimeError(f"amp.{caller}: {what}; call amp.initialize(model, optimizer, overflow_report=True) first")
    recorder = session.overflow_recorder
    if recorder is None:
        raise RuntimeError(
            f"amp.{caller}: overflow reports are off (they cost a host read per backward pass); "
            "turn them on with amp.initialize(model, optimizer, ..., overflow_report=True)"
        )
    return recorder


def last_overflow(optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[OverflowReport]:
    """The report of the most recent overflowing backward pass, or None if there was none.

    Needs ``amp.initialize(..., overflow_report=True)``; raises ``RuntimeError``
    saying so otherwise.

    Args:
        optimizer: an optimizer passed to ``amp.initialize``, to pick its
            session; default: the latest ``initialize`` call.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O1", overflow_report=True)
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
        >>> report = amp.last_overflow()
        >>> if report is not None:
        ...     print(report.names)   # e.g. ['encoder.0.weight']
    """
    reports = _recorder(optimizer, "last_overflow").reports
    return reports[-1] if reports else None


def overflow_reports(optimizer: Optional[torch.optim.Optimizer] = None) -> list[OverflowReport]:
    """The reports of the last overflowing backward passes (up to 64), oldest first.

    Args:
        optimizer: an optimizer passed to ``amp.initialize``; default: the latest session.

    Example::

        >>> for report in amp.overflow_reports():
        ...     print(report.step, report.names)
    """
    return list(_recorder(optimizer, "overflow_reports").reports)
