"""Precision recipes: one frozen object per opt level that owns every decision amp makes for that level.

A :class:`Recipe` says how the model is prepared (the dtype its parameters are
stored in, batchnorm, the casts of its inputs and outputs, fp32 checkpoints of
a half model), which parameters get fp32 masters, the compute dtype of each op
category, whether O1's per-op casting runs, what the loss scaler does, the
FSDP2 policy the level needs, whether fp8 GEMMs may be added, and the
properties as apex printed them. ``amp.initialize`` is a short pipeline over
the chosen recipe; apex's overrides are validated replacements of its fields
(:mod:`.overrides`). The levels O0-O3 are the four instances in
:mod:`.opt_levels`; a new level is one more instance there.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import casting
from .._dtypes import HALF_DTYPES
from ..fp8 import Fp8Recipe
from .model_casting import MasterStore, add_cast_hooks, add_fp32_state_dict_hooks, cast_model_
from .overflow_log import DEFAULT_COLLAPSE_RAISE_STEPS, DEFAULT_COLLAPSE_WARN_STEPS

__all__ = ["OpCategory", "Recipe"]

_FP32 = torch.float32


class OpCategory(enum.Enum):
    """The op categories whose compute dtype a recipe decides (O1's rule table refines them per op)."""

    MATMUL = "matmul"  # linear, conv, matmul, bmm, addmm, einsum, SDPA
    FP32_OP = "fp32-op"  # O1's fp32 rows: softmax, exp/log/pow, norms, reductions, losses
    BATCHNORM = "batchnorm"
    FP8_LINEAR = "fp8-linear"  # the nn.Linear layers that fp8 training converts


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything amp decides for one opt level, after the user's overrides.

    Fields are apex's properties (``cast_model_type`` ... ``loss_scale``) and the
    loss-scaling settings; the methods are the decisions made from them. Build
    one with :func:`apex_amp.amp.overrides.resolve` (which validates), never by
    editing a field of a level.

    Example::

        >>> from apex_amp.amp.opt_levels import resolve_properties
        >>> recipe = resolve_properties("O2", half_dtype=torch.bfloat16)
        >>> recipe.compute_dtype(OpCategory.MATMUL), recipe.loss_scale
        (torch.bfloat16, 1.0)
    """

    opt_level: str
    summary: str  # what the level is for, one line
    half_dtype: torch.dtype
    cast_model_type: Optional[torch.dtype]  # None: the model is not cast (O1)
    patch_torch_functions: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: bool
    dynamic_loss_scale: bool
    loss_scale: float  # initial scale when dynamic, the scale itself when static
    check_finite: bool  # check gradients and skip non-finite steps
    cast_model_outputs: Optional[torch.dtype] = None
    min_loss_scale: float = 1.0
    max_loss_scale: float = 2.0**24
    scale_window: int = 2000
    hysteresis: int = 1
    num_losses: int = 1
    allow_banned: bool = False
    # Scale-collapse guard: overflows in a row at the floor before a warning / a RuntimeError.
    collapse_warn_steps: Optional[int] = DEFAULT_COLLAPSE_WARN_STEPS
    collapse_raise_steps: Optional[int] = DEFAULT_COLLAPSE_RAISE_STEPS
    # The hysteresis refills after every clean step (apex) or only when the scale grows (Megatron).
    consecutive_hysteresis: bool = True
    fp8: Optional[Fp8Recipe] = None  # fp8 GEMMs for the eligible nn.Linear layers
    fp8_refusal: Optional[str] = None  # why this level cannot train with fp8 (None: it can)
    # master_weights="remainder": no fp32 copies; each bf16 weight is the high half of its fp32
    # master and the fused optimizer keeps the low half (state "master_remainder").
    remainder_masters: bool = False

    # ---- the model -------------------------------------------------------------------
    @property
    def casts_model_to_half(self) -> bool:
        """Whether the model's parameters are stored in the half dtype (O2, O3)."""
        return self.cast_model_type in HALF_DTYPES

    def param_dtype(self, module: nn.Module) -> torch.dtype:
        """The dtype ``module``'s own floating parameters are stored in once the model is prepared."""
        if self.cast_model_type is None:
            return _FP32
        if self.keep_batchnorm_fp32 and isinstance(module, _BatchNorm):
            return _FP32
        return self.cast_model_type

    @property
    def model_output_dtype(self) -> Optional[torch.dtype]:
        """The dtype the model's floating outputs are cast to (fp32 for a half model, as apex)."""
        if self.cast_model_outputs is None and self.casts_model_to_half:
            return _FP32
        return self.cast_model_outputs

    def prepare_model(self, model: nn.Module, masters: MasterStore, sharded: bool = False) -> None:
        """Cast ``model`` in place and add its input/output casts (and fp32 checkpoints of a half model).

        Under FSDP2 (``sharded``) the policy casts the parameters for compute and only buffers are
        cast, except under remainder masters: the shards themselves become bf16 (``fsdp2_shard_dtype``).
        """
        if self.cast_model_type is not None:
            cast_model_(model, self.cast_model_type, bool(self.keep_batchnorm_fp32),
                        cast_params=not sharded or self.fsdp2_shard_dtype(batchnorm=False) != _FP32)
        add_cast_hooks(model, self.cast_model_type, self.model_output_dtype)
        if self.casts_model_to_half:  # O2 and O3 (as apex): checkpoints hold fp32, the masters where there are any
            add_fp32_state_dict_hooks(model, masters)

    def takes_master(self, param: Tensor, sharded: bool) -> bool:
        """Whether the optimizer entry ``param`` (fp32, before casting) gets an fp32 master.

        FSDP2's fp32 shards are masters themselves, so they get none.
        """
        return self.master_weights and param.dtype == _FP32 and not sharded

    # ---- compute ---------------------------------------------------------------------
    def compute_dtype(self, category: OpCategory) -> torch.dtype:
        """The dtype ops of ``category`` compute in (fp8 Linears: the dtype of their GEMM inputs)."""
        if category is OpCategory.FP8_LINEAR and self.fp8 is not None:
            return self.fp8.forward_dtype
        if category in (OpCategory.MATMUL, OpCategory.FP8_LINEAR):
            return self.half_dtype if self.patch_torch_functions else self.cast_model_type or _FP32
        if category is OpCategory.FP32_OP:
            return _FP32 if self.patch_torch_functions else self.cast_model_type or _FP32
        if self.keep_batchnorm_fp32 or not self.casts_model_to_half:  # BATCHNORM
            return _FP32
        return self.cast_model_type

    def apply_op_casting(self) -> None:
        """Turn O1's per-op casting on (levels that patch torch functions) or off (the others)."""
        if self.patch_torch_functions:
            casting.activate(self.compute_dtype(OpCategory.MATMUL), allow_banned=self.allow_banned)
        elif casting.is_active():
            casting.deactivate()

    # ---- FSDP2 -----------------------------------------------------------------------
    def fsdp2_refusal(self) -> Optional[str]:
        """Why this recipe has no form under ``fully_shard``, or None."""
        if self.casts_model_to_half and not self.master_weights and not self.remainder_masters:
            return (
                f"opt_level={self.opt_level} without master weights (half weights, no fp32 copy) has no form under "
                "fully_shard: FSDP2 keeps the sharded parameters in fp32 and all-gathers them in half for compute, "
                "so they are fp32 masters already, at 1/world of the model per rank. Use opt_level='O2' (same half "
                "compute, fp32 updates, no extra copy) with fully_shard(..., mp_policy=MixedPrecisionPolicy("
                f"param_dtype={self.half_dtype}, reduce_dtype=torch.float32))"
            )
        return None

    def fsdp2_shard_dtype(self, batchnorm: bool) -> torch.dtype:
        """The dtype FSDP2's sharded parameters are stored in once the model is prepared.

        fp32: they are the masters (FSDP2 all-gathers them in ``fsdp2_param_dtype``). Under
        remainder masters, the half dtype: each bf16 shard is the high half of its fp32 master,
        whose low half the fused optimizer keeps beside it (FSDP2 then all-gathers it as it is,
        and rounds the fp32 sum of the gradients to bf16).
        """
        return self.fsdp2_param_dtype(batchnorm) if self.remainder_masters else _FP32

    def fsdp2_param_dtype(self, batchnorm: bool) -> torch.dtype:
        """The ``MixedPrecisionPolicy.param_dtype`` FSDP2 must all-gather with (fp32: no cast)."""
        if not self.casts_model_to_half:
            return _FP32  # O0, O1: fp32 weights (O1 casts per op itself)
        if batchnorm and self.keep_batchnorm_fp32:
            return _FP32
        return self.cast_model_type

    # ---- what is shown ---------------------------------------------------------------
    def apex_options(self) -> dict[str, Any]:
        """apex's ``amp._amp_state.opt_properties.options``."""
        return {
            "enabled": True,
            "opt_level": self.opt_level,
            "cast_model_type": self.cast_model_type,
            "patch_torch_functions": self.patch_torch_functions,
            "keep_batchnorm_fp32": self.keep_batchnorm_fp32,
            "master_weights": self.master_weights,
            "loss_scale": "dynamic" if self.dynamic_loss_scale else self.loss_scale,
        }

    def describe(self) -> str:
        """The properties as apex printed them at ``initialize``."""
        scale = f"dynamic (initial {self.loss_scale})" if self.dynamic_loss_scale else str(self.loss_scale)
        lines = [
            f"apex_amp: optimization level {self.opt_level} with half dtype {self.half_dtype}",
            f"  cast_model_type       : {self.cast_model_type}",
            f"  patch_torch_functions : {self.patch_torch_functions}",
            f"  keep_batchnorm_fp32   : {self.keep_batchnorm_fp32}",
            f"  master_weights        : {'remainder' if self.remainder_masters else self.master_weights}",
            f"  loss_scale            : {scale}",
            f"  gradient checks       : {'on (non-finite steps are skipped)' if self.check_finite else 'off'}",
        ]
        if self.fp8 is not None:
            lines.append(f"  fp8                   : {self.fp8.describe()}")
        return "\n".join(lines)
