"""The scales and amax histories of a session's fp8 tensors: one owner, two tensors on the device.

Every fp8 Linear has three scaled tensors (its input, its weight and its
output gradient), each a *column* of two tensors that :class:`Fp8Scales` owns:

* ``amax_history`` (``amax_history_len`` x columns, float32): row 0 collects
  this optimizer step's amaxes (the max over every cast of the step, so all
  micro-batches of an accumulation count), rows 1.. hold the previous steps',
  newest first;
* ``scale`` (columns, float32): the scale every cast of this step multiplies by.

:func:`quantise` reads and records them during the forward and backward passes;
:meth:`Fp8Scales.end_step` runs once per optimizer step: it agrees on row 0
across data-parallel ranks (one MAX all-reduce on the device), computes the
next step's scales, and rolls the history; a skipped step (non-finite
gradients) drops its amaxes and keeps its scales. Nothing here syncs with the
host, and the state round-trips bit for bit through ``state_dict``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor

from .numerics import amax, cast_to_fp8, fp8_max, gemm_inverse_scale, scale_from_amax
from .recipe import Fp8Recipe

__all__ = ["ROLES", "INPUT", "WEIGHT", "GRAD_OUTPUT", "Fp8Scales", "quantise"]

ROLES = ("input", "weight", "grad_output")
INPUT, WEIGHT, GRAD_OUTPUT = range(3)  # a layer's columns are first_column + role


def quantise(
    tensor: Tensor, amax_history: Tensor, scale: Tensor, column: int, dtype: torch.dtype, margin: int,
    delayed: bool, record: bool,
) -> tuple[Tensor, Tensor]:
    """``tensor`` cast to fp8 with its column's scale; returns (fp8 tensor, inverse scale for the GEMM).

    Delayed scaling uses the stored scale (or, while the column's history holds no amax, the
    tensor's own amax, stored so later casts of the step agree); current scaling always uses the
    tensor's own amax. With ``record`` the amax is added to this step's row (a max).
    """
    tensor_amax = amax(tensor)
    top = fp8_max(dtype)
    if delayed:
        stored = scale[column]
        empty = amax_history[:, column].amax() == 0
        used = torch.where(empty, scale_from_amax(tensor_amax, top, margin, stored), stored)
        if record:
            scale[column].copy_(used)
    else:
        used = scale_from_amax(tensor_amax, top, margin, torch.ones_like(tensor_amax))
    if record:
        current = amax_history[0, column]
        current.copy_(torch.maximum(current, tensor_amax))  # NaN stays: the overflow report reads it
    return cast_to_fp8(tensor, used, dtype), gemm_inverse_scale(used, tensor_amax)


class Fp8Scales:
    """The scaling state of every fp8 tensor of one session.

    Args:
        recipe: the :class:`Fp8Recipe` (formats, history length, algorithm, margin).
        layer_names: the fp8 Linears, each owning three columns in this order.
        device: where the state lives (the models' device).

    Example::

        >>> scales = Fp8Scales(Fp8Recipe(), ["fc1", "fc2"], torch.device("cpu"))
        >>> scales.tensor_names()[:3]
        ['fc1.input', 'fc1.weight', 'fc1.grad_output']
    """

    def __init__(self, recipe: Fp8Recipe, layer_names: Sequence[str], device: torch.device) -> None:
        self.recipe = recipe
        self.layer_names = list(layer_names)
        columns = len(ROLES) * len(self.layer_names)
        rows = recipe.amax_history_len if recipe.delayed else 1
        self.amax_history = torch.zeros(rows, columns, dtype=torch.float32, device=device)
        self.scale = torch.ones(columns, dtype=torch.float32, device=device)
        tops = [fp8_max(recipe.backward_dtype if role == GRAD_OUTPUT else recipe.forward_dtype)
                for _ in self.layer_names for role in range(len(ROLES))]
        self._fp8_max = torch.tensor(tops, dtype=torch.float32, device=device)

    def first_column(self, layer_index: int) -> int:
        return len(ROLES) * layer_index

    def tensor_names(self) -> list[str]:
        return [f"{layer}.{role}" for layer in self.layer_names for role in ROLES]

    def end_step(self, columns: slice, found_inf: Optional[Tensor], process_group: Any = None) -> None:
        """One optimizer step is over for ``columns``: agree, update the scales, roll the history (on the device).

        Args:
            columns: the columns of the layers this optimizer trains.
            found_inf: the step's overflow flag (nonzero: the step was skipped), or None.
            process_group: the data-parallel group to MAX-reduce this step's amaxes over, or None.
        """
        history, scale = self.amax_history[:, columns], self.scale[columns]
        if history.shape[1] == 0:
            return
        current = history[0].contiguous()
        if process_group is not None:
            torch.distributed.all_reduce(current, op=torch.distributed.ReduceOp.MAX, group=process_group)
        # A non-finite amax never enters the history (its step was skipped, or it reached no loss).
        current = torch.where(torch.isfinite(current), current, torch.zeros_like(current))
        if not self.recipe.delayed:
            history.zero_()
            return
        older = history[1:]
        if self.recipe.amax_compute_algo == "max" and older.shape[0]:
            window = torch.maximum(current, older.amax(0))
        else:
            window = current
        new_scale = scale_from_amax(window, self._fp8_max[columns], self.recipe.margin, scale)
        zeros = torch.zeros_like(current)[None]
        rolled = torch.cat([zeros, current[None], older])[: history.shape[0]]
        kept = torch.cat([zeros, older])
        if found_inf is not None:
            skipped = found_inf.reshape(-1)[0].to(history.device) > 0
            rolled = torch.where(skipped, kept, rolled)
            new_scale = torch.where(skipped, scale, new_scale)
        history.copy_(rolled)
        scale.copy_(new_scale)

    def nonfinite_tensors(self) -> list[str]:
        """The tensors whose amax this step was inf or NaN (a host read; for overflow reports)."""
        bad = (~torch.isfinite(self.amax_history[0])).nonzero().flatten().tolist()
        names = self.tensor_names()
        return [names[index] for index in bad]

    # ---- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe.config(), "tensors": self.tensor_names(),
                "amax_history": self.amax_history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s tensors; the recipe and the fp8 layers must be the same."""
        if not isinstance(state, Mapping) or not {"recipe", "tensors", "amax_history", "scale"} <= set(state):
            raise ValueError(
                "the fp8 state must be the dict amp.state_dict() saved under 'fp8' (keys 'recipe', 'tensors', "
                "'amax_history', 'scale'); pass checkpoint['amp'] from a run with fp8 on"
            )
        if dict(state["recipe"]) != self.recipe.config():
            raise ValueError(
                f"the fp8 state was saved with the recipe {dict(state['recipe'])} but this run uses "
                f"{self.recipe.config()}; initialize with the saving run's amp.Fp8Recipe"
            )
        if list(state["tensors"]) != self.tensor_names():
            raise ValueError(
                f"the fp8 state holds the layers {sorted({n.rpartition('.')[0] for n in state['tensors']})} but "
                f"this run converts {self.layer_names}; use the same model and Fp8Recipe module_filter"
            )
        for name in ("amax_history", "scale"):
            mine, theirs = getattr(self, name), state[name]
            if not isinstance(theirs, Tensor) or theirs.shape != mine.shape:
                raise ValueError(f"the fp8 state's {name!r} must be a tensor of shape {tuple(mine.shape)}")
        self.amax_history.copy_(state["amax_history"])
        self.scale.copy_(state["scale"])
