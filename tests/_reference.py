"""Plain-PyTorch references for apex_amp's ops, written from the contract in
csrc/ops.cpp, independently of apex_amp/_fallback.py (one tensor at a time,
textbook formulas, no foreach ops), plus the test inputs the op tests share.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dtype_id(dtype: torch.dtype) -> str:
    """Readable pytest ids: float32, float16, bfloat16."""
    return str(dtype).removeprefix("torch.")


# The kernels cut tensors into pieces: CPU work units of 16384 elements
# (csrc/cpu/list_parallel.h), CUDA chunks of 65536 (csrc/cuda/chunk_packing.h).
# These sizes cover the empty tensor, a single element, odd sizes whose tail
# misses the vector loop, and tensors that span several pieces of both kinds.
CPU_UNIT = 16384
CHUNK = 65536
EDGE_SIZES = (0, 1, 33, 1031)
MULTI_CHUNK_SIZE = 2 * CHUNK + 7


def bad_positions(numel: int) -> list[int]:
    """Where to plant an inf/NaN: first, middle, the first piece boundaries, and
    the last elements (numel-1, numel-3: in the scalar tail after the vector loop)."""
    candidates = {0, numel // 2, numel - 1, numel - 3, CPU_UNIT - 1, CPU_UNIT, CHUNK - 1, CHUNK}
    return sorted(p for p in candidates if 0 <= p < numel)


def random_tensors(
    sizes: Sequence[int], dtypes: Sequence[torch.dtype], *, seed: int, device="cpu", scale: float = 1.0
) -> list[Tensor]:
    """Tensors of standard-normal values times `scale`, dtype cycling through `dtypes`."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for i, size in enumerate(sizes):
        values = torch.randn(size, generator=generator) * scale
        tensors.append(values.to(device=device, dtype=dtypes[i % len(dtypes)]))
    return tensors


def flag(value: float = 0.0, device="cpu") -> Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


def clone_all(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [t.clone() for t in tensors]


def any_nonfinite(tensors: Sequence[Tensor]) -> bool:
    return any(not bool(torch.isfinite(t).all()) for t in tensors)


def unscale(grads: Sequence[Tensor], inv_scale: float) -> list[Tensor]:
    """grads * inv_scale computed in fp32, rounded once to each grad's dtype."""
    factor = torch.tensor(inv_scale, dtype=torch.float32)
    return [(g.float() * factor.to(g.device)).to(g.dtype) for g in grads]


def scale(src: Sequence[Tensor], dst_dtypes: Sequence[torch.dtype], factor: float) -> tuple[list[Tensor], bool]:
    """(results, found_inf): src * factor in fp32 converted to dst dtypes, and
    whether src or a converted result holds an inf/NaN."""
    f = torch.tensor(factor, dtype=torch.float32)
    results = [(s.float() * f.to(s.device)).to(dtype) for s, dtype in zip(src, dst_dtypes)]
    return results, any_nonfinite(src) or any_nonfinite(results)


def axpby(x: Sequence[Tensor], y: Sequence[Tensor], a: float, b: float) -> tuple[list[Tensor], bool]:
    """(new y, found_inf): a*x + b*y in float64, rounded once to y's dtype."""
    results = [(a * xi.double() + b * yi.double()).to(yi.dtype) for xi, yi in zip(x, y)]
    return results, any_nonfinite(x) or any_nonfinite(results)


def l2norm(tensors: Sequence[Tensor]) -> tuple[float, list[float]]:
    """(total, per tensor) L2 norms, accumulated in float64."""
    per_tensor = [math.sqrt(float((t.double() ** 2).sum())) for t in tensors]
    total = math.sqrt(sum(n * n for n in per_tensor))
    return total, per_tensor


@dataclasses.dataclass
class AdamConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw_mode: bool = True
    bias_correction: bool = True

    def op_args(self) -> tuple:
        """The positional hyper-parameters of the fused_adam_ schema, in order."""
        return (self.lr, self.beta1, self.beta2, self.eps, self.weight_decay, self.adamw_mode, self.bias_correction)


def adam_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, cfg: AdamConfig) -> None:
    """One textbook Adam/AdamW step of one tensor in its own dtype, in place.

    ``step`` is the step number after increment (1 on the first step).
    """
    grad = grad.to(param.dtype)
    if cfg.weight_decay != 0.0:
        if cfg.adamw_mode:
            param.mul_(1.0 - cfg.lr * cfg.weight_decay)
        else:
            grad = grad + cfg.weight_decay * param
    exp_avg.mul_(cfg.beta1).add_((1.0 - cfg.beta1) * grad)
    exp_avg_sq.mul_(cfg.beta2).add_((1.0 - cfg.beta2) * grad * grad)
    if cfg.bias_correction:
        m_hat = exp_avg / (1.0 - cfg.beta1**step)
        v_hat = exp_avg_sq / (1.0 - cfg.beta2**step)
    else:
        m_hat, v_hat = exp_avg, exp_avg_sq
    param.sub_(cfg.lr * m_hat / (v_hat.sqrt() + cfg.eps))


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    """The constants of the dynamic loss-scale rule (amp's defaults, apex's hysteresis refill)."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    consecutive_hysteresis: bool = True

    def op_args(self) -> tuple:
        """The update_scale_ schema's arguments after found_inf, in order."""
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))


@dataclasses.dataclass
class ScalerState:
    """The dynamic loss-scale rule in plain Python, written from its contract (csrc/ops.cpp) and from apex's
    update_scale_hysteresis kernel, plus amp's floor and cap.

    The scale is an fp32 value: a product of the scale and a factor is rounded once to fp32 (the
    factor itself is not rounded first, as in apex and torch)."""

    scale: float
    growth_tracker: int = 0
    hysteresis_tracker: int = 1

    def update(self, found_inf: bool, rule: ScaleRule) -> None:
        if found_inf:
            self.growth_tracker = 0
            # apex lets its tracker run below zero; ours stops at 0, which backs off just the same.
            self.hysteresis_tracker = max(self.hysteresis_tracker - 1, 0)
            if self.hysteresis_tracker == 0:
                self.scale = max(_round_fp32(self.scale * rule.backoff_factor), _round_fp32(rule.min_scale))
            return
        self.growth_tracker += 1
        grows = self.growth_tracker == rule.growth_interval
        if grows:
            self.growth_tracker = 0
            grown = _round_fp32(self.scale * rule.growth_factor)
            if math.isfinite(grown):  # a growth to inf keeps the old scale
                cap = _round_fp32(rule.max_scale)
                self.scale = grown if grown <= cap else max(self.scale, cap)
        if rule.consecutive_hysteresis or grows:
            self.hysteresis_tracker = rule.hysteresis


def scale_trajectory(found_infs: Sequence[bool], init_scale: float, rule: ScaleRule) -> list[float]:
    """The scale after each step of a dynamic scaler that starts at ``init_scale`` with full hysteresis."""
    state = ScalerState(init_scale, 0, rule.hysteresis)
    trajectory = []
    for found_inf in found_infs:
        state.update(found_inf, rule)
        trajectory.append(state.scale)
    return trajectory


def _round_fp32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def optional_tensor(value: Optional[float], device="cpu") -> Optional[Tensor]:
    return None if value is None else flag(value, device)
