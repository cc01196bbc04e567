"""The fused Adam op with low-precision states, driven directly: what bench_state_precision.py times
when the tree's FusedAdam has no ``state_precision`` argument yet (the op and its kernels have it).

``OpLevelAdam`` holds what FusedAdam would (per parameter: codes and absmaxes laid out by
``state_formats.state_layout`` from the parameter's shape, fp32 state below the size threshold or
when no block fits a row, optional remainder masters for bf16 params) and calls
``apex_amp.ops.fused_adam_`` once per step on the whole list, as FusedAdam's step does.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from apex_amp import ops
from apex_amp.optimizers import state_formats

_SIGNED = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
_UNSIGNED = {**_SIGNED, "int8": torch.uint8}


def _zero_state(param: Tensor, dtype: torch.dtype, block: Optional[int]) -> tuple[Tensor, Tensor]:
    codes, absmax = state_formats.quantize(torch.zeros_like(param, dtype=torch.float32), dtype, block)
    return codes, (absmax.reshape(-1) if absmax is not None else torch.zeros(0))


class OpLevelAdam:
    """AdamW through ``ops.fused_adam_`` with ``precision`` states (and remainder masters if asked).

    Example::

        >>> p = torch.nn.Parameter(torch.zeros(64, 256)); p.grad = torch.ones(64, 256)
        >>> opt = OpLevelAdam([p], "int8", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        >>> opt.step(); opt.state[p]["exp_avg"].dtype
        torch.int8
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], precision: str, *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, remainder: bool = False) -> None:
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.state: dict[Tensor, dict[str, Tensor]] = {}
        for p in self.params:
            layout = state_formats.state_layout(p.shape, precision)
            fmt = layout.precision.value
            exp_avg, exp_avg_absmax = _zero_state(p, _SIGNED[fmt], layout.block)
            exp_avg_sq, exp_avg_sq_absmax = _zero_state(p, _UNSIGNED[fmt], layout.block)
            entry = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "exp_avg_absmax": exp_avg_absmax,
                     "exp_avg_sq_absmax": exp_avg_sq_absmax}
            if remainder:
                entry["master_remainder"] = torch.zeros_like(p, dtype=torch.int16)
            self.state[p] = entry
        self.step_count = torch.zeros(1)
        blocked = any(s["exp_avg_absmax"].numel() for s in self.state.values())
        states = [self.state[p] for p in self.params]
        self._absmaxes = ([s["exp_avg_absmax"] for s in states] + [s["exp_avg_sq_absmax"] for s in states]
                          if blocked else [])
        self._remainders = [s["master_remainder"] for s in states] if remainder else []

    def step(self) -> None:
        states = [self.state[p] for p in self.params]
        ops.fused_adam_([p.data for p in self.params], [p.grad for p in self.params],
                        [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], self.step_count,
                        lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                        weight_decay=self.weight_decay, adamw_mode=True, master_remainders=self._remainders,
                        state_absmaxes=self._absmaxes)
