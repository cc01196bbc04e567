"""The optimization levels O0-O3 and the validation of user overrides.

The table is apex.amp's, which users know:

====  ===============  =====================  ===================  ==============  ==========
      cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale
====  ===============  =====================  ===================  ==============  ==========
O0    float32          False                  None                 False           1.0
O1    None             True                   None                 False           "dynamic"
O2    half             False                  True                 True            "dynamic"
O3    half             False                  False                False           1.0
====  ===============  =====================  ===================  ==============  ==========

"half" is ``half_dtype`` (fp16 unless the user asks for bf16). bf16 has fp32's
exponent range, so with bf16 a "dynamic" default becomes a static scale of 1.0
whose gradients are still checked (a non-finite step is skipped); an explicit
``loss_scale="dynamic"`` keeps the dynamic scaler.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import torch

from .._dtypes import HALF_DTYPES
from .overflow_log import DEFAULT_COLLAPSE_RAISE_STEPS, DEFAULT_COLLAPSE_WARN_STEPS

__all__ = ["OPT_LEVELS", "AmpProperties", "resolve_properties", "SMALLEST_SCALE", "LARGEST_SCALE"]

OPT_LEVELS = ("O0", "O1", "O2", "O3")
# A loss scale must be a normal float32: 0 or a denormal would make 1/scale inf (or lose the gradients).
SMALLEST_SCALE = torch.finfo(torch.float32).tiny
LARGEST_SCALE = torch.finfo(torch.float32).max
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DYNAMIC = "dynamic"

# Sentinel for "the table's value": None is a meaningful value for some fields.
_HALF = "half"

_TABLE: dict[str, dict[str, Any]] = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=DYNAMIC),
    "O2": dict(cast_model_type=_HALF, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale=DYNAMIC),
    "O3": dict(cast_model_type=_HALF, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}


@dataclasses.dataclass(frozen=True)
class AmpProperties:
    """Everything :func:`apex_amp.amp.initialize` decided, after overrides."""

    opt_level: str
    half_dtype: torch.dtype
    cast_model_type: Optional[torch.dtype]  # None: the model is not cast (O1)
    patch_torch_functions: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: bool
    dynamic_loss_scale: bool
    loss_scale: float  # initial scale when dynamic, the scale itself when static
    check_finite: bool  # check gradients and skip non-finite steps
    cast_model_outputs: Optional[torch.dtype]
    min_loss_scale: float
    max_loss_scale: float
    scale_window: int
    hysteresis: int
    num_losses: int
    allow_banned: bool
    # Scale-collapse guard: overflows in a row at the floor before a warning / a RuntimeError.
    collapse_warn_steps: Optional[int] = DEFAULT_COLLAPSE_WARN_STEPS
    collapse_raise_steps: Optional[int] = DEFAULT_COLLAPSE_RAISE_STEPS
    # The hysteresis refills after every clean step (apex) or only when the scale grows (Megatron).
    consecutive_hysteresis: bool = True

    def describe(self) -> str:
        scale = f"dynamic (initial {self.loss_scale})" if self.dynamic_loss_scale else str(self.loss_scale)
        lines = [
            f"apex_amp: optimization level {self.opt_level} with half dtype {self.half_dtype}",
            f"  cast_model_type       : {self.cast_model_type}",
            f"  patch_torch_functions : {self.patch_torch_functions}",
            f"  keep_batchnorm_fp32   : {self.keep_batchnorm_fp32}",
            f"  master_weights        : {self.master_weights}",
            f"  loss_scale            : {scale}",
            f"  gradient checks       : {'on (non-finite steps are skipped)' if self.check_finite else 'off'}",
        ]
        return "\n".join(lines)


def _check_opt_level(opt_level: Any) -> str:
    if opt_level in OPT_LEVELS:
        return opt_level
    hint = ""
    if isinstance(opt_level, str):
        fixed = opt_level.strip().upper().replace("0O", "OO")
        if len(fixed) == 2 and fixed[0] in "O0" and fixed[1] in "0123":
            hint = f" Did you mean 'O{fixed[1]}'?"
    raise ValueError(
        f"unknown opt_level {opt_level!r}; valid levels are 'O0', 'O1', 'O2', 'O3' "
        f"(the letter O, upper case, then a digit).{hint}"
    )


def _parse_bool_or_none(name: str, value: Any) -> Optional[bool]:
    # apex accepted the strings "True"/"False" from command lines; so do we.
    if value is None or isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ValueError(f"{name} must be True, False, None or the strings 'True'/'False', got {value!r}")


def parse_flag(name: str, value: Any) -> bool:
    """A boolean option: True/False (or apex's strings 'True'/'False'), never any truthy object."""
    if isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ValueError(f"{name} must be True or False (or the strings 'True'/'False'), got {value!r}")


def _parse_loss_scale(value: Any) -> Union[str, float]:
    if value == DYNAMIC:
        return DYNAMIC
    if isinstance(value, bool):
        raise ValueError(f"loss_scale must be 'dynamic' or a positive number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"loss_scale must be 'dynamic' or a positive number, got {value!r}") from None
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"loss_scale must be 'dynamic' or a positive finite number, got {value!r}")
    if not SMALLEST_SCALE <= number <= LARGEST_SCALE:
        raise ValueError(
            f"loss_scale={value!r} is not a normal float32 number (in [{SMALLEST_SCALE:g}, {LARGEST_SCALE:g}]): "
            "float32 would hold it as 0, a denormal or inf; use loss_scale='dynamic' or a power of two such as 1024"
        )
    return number


def _check_min_loss_scale(value: Any) -> float:
    # The floor is the one bound a backing-off scale reaches: 0 or a denormal there would
    # turn every scaled gradient into 0 and 1/scale into inf.
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not SMALLEST_SCALE <= number <= LARGEST_SCALE:
        raise ValueError(
            f"min_loss_scale must be a positive number that float32 holds as a normal value "
            f"(>= {SMALLEST_SCALE:g}, the smallest normal float32), got {value!r}; a scale of 0, a negative "
            "or a denormal one destroys the gradients. Leave it at the default 1.0, or for losses that "
            "overflow even unscaled use a power of two such as 2**-14"
        )
    return number


def _check_collapse_steps(warn_steps: Any, raise_steps: Any) -> None:
    for name, value in (("collapse_warn_steps", warn_steps), ("collapse_raise_steps", raise_steps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None (never) or an integer >= 1, got {value!r}")
    if warn_steps is not None and raise_steps is not None and raise_steps < warn_steps:
        raise ValueError(
            f"collapse_raise_steps={raise_steps} is below collapse_warn_steps={warn_steps}: the warning "
            "comes first; pass collapse_raise_steps >= collapse_warn_steps (or None)"
        )


def _check_dtype(name: str, value: Any, allowed: tuple) -> None:
    if value is not None and value not in allowed:
        names = ", ".join(str(d) for d in allowed)
        also = " or False (do not cast)" if name == "cast_model_type" else ""
        raise ValueError(f"{name} must be None{also} or one of {names}, got {value!r}")


def resolve_properties(
    opt_level: Any,
    *,
    half_dtype: Any = torch.float16,
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: Any = None,
    cast_model_outputs: Any = None,
    num_losses: Any = 1,
    min_loss_scale: Any = None,
    max_loss_scale: Any = 2.0**24,
    scale_window: Any = 2000,
    hysteresis: Any = 1,
    consecutive_hysteresis: Any = True,
    skip_nonfinite: bool = False,
    allow_banned: bool = False,
    collapse_warn_steps: Any = DEFAULT_COLLAPSE_WARN_STEPS,
    collapse_raise_steps: Any = DEFAULT_COLLAPSE_RAISE_STEPS,
) -> AmpProperties:
    """Apply the user's overrides to the level's defaults, rejecting nonsense with the reason."""
    level = _check_opt_level(opt_level)
    skip_nonfinite = parse_flag("skip_nonfinite", skip_nonfinite)
    consecutive_hysteresis = parse_flag("consecutive_hysteresis", consecutive_hysteresis)
    allow_banned = parse_flag("allow_banned", allow_banned)
    if half_dtype not in HALF_DTYPES:
        raise ValueError(f"half_dtype must be torch.float16 or torch.bfloat16, got {half_dtype!r}")
    table = dict(_TABLE[level])
    if table["cast_model_type"] == _HALF:
        table["cast_model_type"] = half_dtype

    # cast_model_type: False means "do not cast the model", as in apex
    if cast_model_type is False:
        table["cast_model_type"] = None
        cast_model_type = None
    _check_dtype("cast_model_type", cast_model_type, MODEL_DTYPES)
    if cast_model_type is not None:
        if level == "O1" and cast_model_type != torch.float32:
            raise ValueError(
                f"cast_model_type={cast_model_type} cannot be set with O1: O1 leaves the model in fp32 and "
                "casts per op; use O2 or O3 to cast the whole model (or cast_model_type=False/None)"
            )
        if cast_model_type in HALF_DTYPES and cast_model_type != half_dtype:
            raise ValueError(
                f"cast_model_type={cast_model_type} contradicts half_dtype={half_dtype}; "
                f"pass half_dtype={cast_model_type} instead"
            )
        table["cast_model_type"] = cast_model_type
    model_is_half = table["cast_model_type"] in HALF_DTYPES

    # patch_torch_functions
    patch = _parse_bool_or_none("patch_torch_functions", patch_torch_functions)
    if patch is not None:
        if patch and level != "O1":
            raise ValueError(
                f"patch_torch_functions=True is only valid with O1 (per-op casting); {level} casts the "
                "model as a whole. Use opt_level='O1'"
            )
        table["patch_torch_functions"] = patch

    # keep_batchnorm_fp32
    keep_bn = _parse_bool_or_none("keep_batchnorm_fp32", keep_batchnorm_fp32)
    if keep_bn is not None:
        if not model_is_half:
            raise ValueError(
                f"keep_batchnorm_fp32 must be None with {level} (model dtype {table['cast_model_type']}): "
                "it only says whether batchnorm stays fp32 when the model is cast to half (O2/O3)"
            )
        table["keep_batchnorm_fp32"] = keep_bn

    # master_weights
    masters = _parse_bool_or_none("master_weights", master_weights)
    if masters is not None:
        if masters and level == "O1":
            raise ValueError(
                "master_weights=True is not valid with O1: O1 keeps the model in fp32, so the optimizer "
                "already updates fp32 weights; use O2 for fp32 master weights over a half model"
            )
        if masters and not model_is_half:
            raise ValueError(
                f"master_weights=True needs a half model, but {level} keeps it in "
                f"{table['cast_model_type']}; use O2"
            )
        table["master_weights"] = masters

    # loss scaling
    user_loss_scale = None if loss_scale is None else _parse_loss_scale(loss_scale)
    chosen = table["loss_scale"] if user_loss_scale is None else user_loss_scale
    level_checks = table["loss_scale"] == DYNAMIC  # O1/O2 check gradients by default
    if chosen == DYNAMIC and user_loss_scale is None and half_dtype == torch.bfloat16:
        chosen = 1.0  # bf16 needs no scaling; the checks stay on (level_checks)
    dynamic = chosen == DYNAMIC
    if min_loss_scale is None:
        min_loss_scale = 1.0
    min_scale, max_scale = _check_min_loss_scale(min_loss_scale), float(max_loss_scale)
    if not (0 < min_scale <= max_scale <= torch.finfo(torch.float32).max):
        raise ValueError(
            f"need 0 < min_loss_scale <= max_loss_scale <= float32 max, got {min_loss_scale!r} and {max_loss_scale!r}"
        )
    initial_scale = 2.0**16 if dynamic else chosen
    if dynamic:
        initial_scale = min(max(initial_scale, min_scale), max_scale)
    for name, value in (("num_losses", num_losses), ("scale_window", scale_window), ("hysteresis", hysteresis)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    _check_collapse_steps(collapse_warn_steps, collapse_raise_steps)
    _check_dtype("cast_model_outputs", cast_model_outputs, MODEL_DTYPES)

    return AmpProperties(
        opt_level=level,
        half_dtype=half_dtype,
        cast_model_type=table["cast_model_type"],
        patch_torch_functions=bool(table["patch_torch_functions"]),
        keep_batchnorm_fp32=table["keep_batchnorm_fp32"],
        master_weights=bool(table["master_weights"]),
        dynamic_loss_scale=dynamic,
        loss_scale=float(initial_scale),
        check_finite=dynamic or level_checks or bool(skip_nonfinite),
        cast_model_outputs=cast_model_outputs,
        min_loss_scale=min_scale,
        max_loss_scale=max_scale,
        scale_window=scale_window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
        num_losses=num_losses,
        allow_banned=bool(allow_banned),
        collapse_warn_steps=collapse_warn_steps,
        collapse_raise_steps=collapse_raise_steps,
    )
