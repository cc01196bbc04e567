"""Bytes per parameter of a model and its optimizer, by category, measured from the tensors themselves.

:func:`memory_report` walks the model's parameters and gradients and the optimizer's params,
gradients and state, and counts each storage once (a tensor sharing storage with one already
counted adds nothing), in the first category that holds it:

* ``weights``: the model's parameters;
* ``masters``: fp32 master weights (params of the optimizer that are not the model's: amp's O2
  masters; ``master_param`` in a fused optimizer's state) and ``master_remainder`` (the low
  halves of ``master_weights="remainder"``);
* ``grads``: the gradients of the model's and the optimizer's params, and those amp holds for
  the next step (under O2 the scaled half gradients a fused step reads, off the model);
* ``optimizer state``: every other tensor of the optimizer's state and param groups (moments,
  fp8/int8 absmaxes, step counts).

Bytes per parameter divide by the number of elements of the model's parameters. Under FSDP2
the counts are this rank's: DTensors count their local shards.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from ._dtensor import local_tensor
from .amp import sessions

__all__ = ["MemoryReport", "memory_report"]

CATEGORIES = ("weights", "grads", "masters", "optimizer state")
_MASTER_STATE_KEYS = ("master_param", "master_remainder")


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What :func:`memory_report` measured.

    Args:
        parameters: elements of the model's parameters (this rank's shards under FSDP2).
        bytes: bytes held per category (``weights``, ``grads``, ``masters``, ``optimizer state``).
    """

    parameters: int
    bytes: dict[str, int]

    @property
    def total_bytes(self) -> int:
        """The bytes of every category together."""
        return sum(self.bytes.values())

    def per_parameter(self, category: Optional[str] = None) -> float:
        """Bytes per parameter of ``category`` (default: all categories together)."""
        held = self.total_bytes if category is None else self.bytes[category]
        return held / self.parameters if self.parameters else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The counts as plain data: parameters, bytes and bytes per parameter per category, and totals.

        Example::

            >>> report = memory_report(torch.nn.Linear(256, 256, bias=False))
            >>> report.to_dict()["bytes_per_parameter"]["weights"]
            4.0
        """
        return {"parameters": self.parameters, "bytes": dict(self.bytes), "total_bytes": self.total_bytes,
                "bytes_per_parameter": {category: self.per_parameter(category) for category in CATEGORIES},
                "total_bytes_per_parameter": self.per_parameter()}

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        lines = [f"{'category':<16}{'bytes':>16}{'bytes/param':>14}"]
        for category in CATEGORIES:
            lines.append(f"{category:<16}{self.bytes[category]:>16,}{self.per_parameter(category):>14.3f}")
        lines.append(f"{'total':<16}{self.total_bytes:>16,}{self.per_parameter():>14.3f}")
        lines.append(f"({self.parameters:,} parameters)")
        return "\n".join(lines)


def memory_report(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> MemoryReport:
    """Bytes per parameter of ``model`` and ``optimizer`` by category (weights, grads, masters, state).

    Measured from the tensors that exist when it is called, each storage counted once: call it
    between ``backward`` and ``step`` (when the gradients exist) after a first step (which
    creates the optimizer's state) to see the peak of a training step.

    Args:
        model: the model whose parameters are counted as weights.
        optimizer: its optimizer (masters, their gradients, the state), or None.

    Example::

        >>> from apex_amp import memory_report
        >>> from apex_amp.optimizers import FusedAdam
        >>> model = torch.nn.Linear(256, 256, bias=False)
        >>> optimizer = FusedAdam(model.parameters(), state_precision="int8")
        >>> model(torch.randn(4, 256)).sum().backward(); optimizer.step()
        >>> round(memory_report(model, optimizer).per_parameter(), 2)   # 4 + 4 + 2 * (1 + 4 / 256)
        10.03
        >>> print(memory_report(model, optimizer))                     # the table
    """
    counted: set[tuple[Any, int]] = set()
    held = dict.fromkeys(CATEGORIES, 0)

    def add(category: str, tensors: Iterable[Any]) -> None:
        for tensor in tensors:
            if not isinstance(tensor, Tensor):
                continue
            storage = local_tensor(tensor).untyped_storage()
            key = (storage.device, storage.data_ptr())
            if storage.nbytes() == 0 or key in counted:
                continue
            counted.add(key)
            held[category] += storage.nbytes()

    model_params = list(model.parameters())
    add("weights", model_params)
    parameters = sum(local_tensor(p).numel() for p in _distinct(model_params))
    if optimizer is None:
        add("grads", [p.grad for p in model_params])
        return MemoryReport(parameters, held)
    optimizer_params = [p for group in optimizer.param_groups for p in group["params"]]
    states = [optimizer.state.get(p, {}) for p in optimizer_params]
    add("masters", optimizer_params)  # those not counted as weights: amp's fp32 masters
    add("masters", [state.get(key) for state in states for key in _MASTER_STATE_KEYS])
    add("grads", [p.grad for p in model_params] + [p.grad for p in optimizer_params] + _amp_grads(optimizer))
    add("optimizer state", [value for state in states for value in state.values()])
    add("optimizer state", [value for group in optimizer.param_groups for value in group.values()])
    return MemoryReport(parameters, held)


def _amp_grads(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    # The gradients amp keeps for the optimizer's next step (held off the model under O2).
    session = sessions.session_for(optimizer)
    if session is None or optimizer not in session.lifecycles:
        return []
    return [grad for _, grad in session.lifecycle_of(optimizer).pending_grads()]


def _distinct(tensors: list[Tensor]) -> list[Tensor]:
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]
