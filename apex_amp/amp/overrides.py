"""apex's overrides as validated replacements of a level's recipe.

:func:`resolve` takes a level (a :class:`~apex_amp.amp.recipe.Recipe` of
:mod:`.opt_levels`, or one of the user's own) and the user's ``initialize``
arguments, checks each one against the level (an override that makes no sense
for it raises a ``ValueError`` saying why), and returns the replaced recipe.
Only the arguments the user passed replace fields: one left at its default
(None, or :data:`LEVELS_OWN` where None has a meaning) keeps the recipe's
value, so a custom recipe arrives whole. The order is fixed: the half dtype
first (the fields that follow it follow it), then the model's dtype, O1's
casting, batchnorm, masters, loss scaling, the scaler's settings, fp8.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import torch

from .._dtypes import HALF_DTYPES
from ..fp8 import Fp8Recipe
from .recipe import Recipe

__all__ = ["resolve", "parse_flag", "LEVELS_OWN", "SMALLEST_SCALE", "LARGEST_SCALE", "MODEL_DTYPES", "DYNAMIC"]

# A loss scale must be a normal float32: 0 or a denormal would make 1/scale inf (or lose the gradients).
SMALLEST_SCALE = torch.finfo(torch.float32).tiny
LARGEST_SCALE = torch.finfo(torch.float32).max
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DYNAMIC = "dynamic"
DYNAMIC_INITIAL_SCALE = 2.0**16


class _LevelsOwn:
    """The default of an override whose None means something (collapse_*_steps=None: never)."""

    def __repr__(self) -> str:
        return "<the level's>"


# Left at this, an override keeps the level's (the recipe's) value.
LEVELS_OWN: Any = _LevelsOwn()


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


# ---- one replacement per override, applied in this order -------------------------------
def _half_dtype(level: Recipe, half_dtype: Any) -> dict[str, Any]:
    if half_dtype is None:
        return {}
    if half_dtype not in HALF_DTYPES:
        raise ValueError(f"half_dtype must be torch.float16 or torch.bfloat16, got {half_dtype!r}")
    changes: dict[str, Any] = {"half_dtype": half_dtype}
    if level.cast_model_type == level.half_dtype:
        changes["cast_model_type"] = half_dtype  # "half" in apex's table
    if level.dynamic_loss_scale and half_dtype == torch.bfloat16:
        # bf16 has fp32's exponent range: no scaling needed; the checks stay on.
        changes.update(dynamic_loss_scale=False, loss_scale=1.0)
    return changes


def _cast_model_type(level: Recipe, recipe: Recipe, cast_model_type: Any) -> dict[str, Any]:
    if cast_model_type is False:  # "do not cast the model", as in apex
        return {"cast_model_type": None}
    _check_dtype("cast_model_type", cast_model_type, MODEL_DTYPES)
    if cast_model_type is None:
        return {}
    if level.patch_torch_functions and cast_model_type != torch.float32:
        raise ValueError(
            f"cast_model_type={cast_model_type} cannot be set with {level.opt_level}: {level.opt_level} leaves "
            "the model in fp32 and casts per op; use O2 or O3 to cast the whole model (or cast_model_type=False/None)"
        )
    if cast_model_type in HALF_DTYPES and cast_model_type != recipe.half_dtype:
        raise ValueError(
            f"cast_model_type={cast_model_type} contradicts half_dtype={recipe.half_dtype}; "
            f"pass half_dtype={cast_model_type} instead"
        )
    return {"cast_model_type": cast_model_type}


def _patch(level: Recipe, patch_torch_functions: Any) -> dict[str, Any]:
    patch = _parse_bool_or_none("patch_torch_functions", patch_torch_functions)
    if patch is None:
        return {}
    if patch and not level.patch_torch_functions:
        raise ValueError(
            f"patch_torch_functions=True is only valid with O1 (per-op casting); {level.opt_level} casts the "
            "model as a whole. Use opt_level='O1'"
        )
    return {"patch_torch_functions": patch}


def _keep_batchnorm(level: Recipe, recipe: Recipe, keep_batchnorm_fp32: Any) -> dict[str, Any]:
    keep_bn = _parse_bool_or_none("keep_batchnorm_fp32", keep_batchnorm_fp32)
    if keep_bn is None:
        return {}
    if not recipe.casts_model_to_half:
        raise ValueError(
            f"keep_batchnorm_fp32 must be None with {level.opt_level} (model dtype {recipe.cast_model_type}): "
            "it only says whether batchnorm stays fp32 when the model is cast to half (O2/O3)"
        )
    return {"keep_batchnorm_fp32": keep_bn}


def _master_weights(level: Recipe, recipe: Recipe, master_weights: Any) -> dict[str, Any]:
    if isinstance(master_weights, str) and master_weights == "remainder":
        return _remainder_masters(level, recipe)
    masters = _parse_bool_or_none("master_weights", master_weights)
    if masters is None:
        return {}
    if masters and level.patch_torch_functions:
        raise ValueError(
            f"master_weights=True is not valid with {level.opt_level}: {level.opt_level} keeps the model in fp32, "
            "so the optimizer already updates fp32 weights; use O2 for fp32 master weights over a half model"
        )
    if masters and not recipe.casts_model_to_half:
        raise ValueError(
            f"master_weights=True needs a half model, but {level.opt_level} keeps it in "
            f"{recipe.cast_model_type}; use O2"
        )
    return {"master_weights": masters}


def _remainder_masters(level: Recipe, recipe: Recipe) -> dict[str, Any]:
    if level.patch_torch_functions or not recipe.casts_model_to_half:
        raise ValueError(
            f"master_weights='remainder' is not valid with {level.opt_level}: it keeps the fp32 masters of a "
            "bf16 model as the model's weights plus 16-bit remainders; use opt_level='O2' with "
            "half_dtype=torch.bfloat16")
    if recipe.cast_model_type != torch.bfloat16:
        raise ValueError(
            f"master_weights='remainder' needs a bf16 model, got {recipe.cast_model_type}: a bf16 weight is the "
            "high half of its fp32 master (the remainder is the low half), but fp16 is not the high half of "
            "fp32; pass half_dtype=torch.bfloat16, or master_weights=True for fp16")
    return {"master_weights": False, "remainder_masters": True}


def _loss_scaling(
    level: Recipe, recipe: Recipe, loss_scale: Any, min_loss_scale: Any, max_loss_scale: Any, skip_nonfinite: bool,
) -> dict[str, Any]:
    dynamic, scale, check_finite = recipe.dynamic_loss_scale, recipe.loss_scale, recipe.check_finite
    if loss_scale is not None:
        chosen = _parse_loss_scale(loss_scale)
        dynamic = chosen == DYNAMIC
        scale = DYNAMIC_INITIAL_SCALE if dynamic else chosen
    if loss_scale is not None or skip_nonfinite:
        # O1/O2 check gradients by default (the levels whose own scale is dynamic).
        check_finite = dynamic or level.check_finite or skip_nonfinite
    min_scale = recipe.min_loss_scale if min_loss_scale is None else _check_min_loss_scale(min_loss_scale)
    max_scale = recipe.max_loss_scale if max_loss_scale is None else float(max_loss_scale)
    if not (0 < min_scale <= max_scale <= LARGEST_SCALE):
        raise ValueError(
            f"need 0 < min_loss_scale <= max_loss_scale <= float32 max, got {min_scale!r} and {max_scale!r}"
        )
    if dynamic:
        scale = min(max(scale, min_scale), max_scale)
    return {
        "dynamic_loss_scale": dynamic, "loss_scale": float(scale), "min_loss_scale": min_scale,
        "max_loss_scale": max_scale, "check_finite": check_finite,
    }


def _scaler_settings(recipe: Recipe, passed: dict[str, Any]) -> dict[str, Any]:
    changes = {}
    for name in ("num_losses", "scale_window", "hysteresis"):
        value = passed[name]
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        changes[name] = value
    for name in ("consecutive_hysteresis", "allow_banned"):
        if passed[name] is not None:
            changes[name] = parse_flag(name, passed[name])
    for name in ("collapse_warn_steps", "collapse_raise_steps"):
        if passed[name] is not LEVELS_OWN:
            changes[name] = passed[name]
    _check_collapse_steps(changes.get("collapse_warn_steps", recipe.collapse_warn_steps),
                          changes.get("collapse_raise_steps", recipe.collapse_raise_steps))
    if passed["cast_model_outputs"] is not None:
        _check_dtype("cast_model_outputs", passed["cast_model_outputs"], MODEL_DTYPES)
        changes["cast_model_outputs"] = passed["cast_model_outputs"]
    return changes


def _check_model_dtype_follows_half_dtype(recipe: Recipe) -> None:
    # A recipe built with dataclasses.replace(O2, half_dtype=torch.bfloat16) keeps O2's float16
    # model: "half" in apex's table is a dtype in a recipe, so both fields must be replaced.
    if recipe.casts_model_to_half and recipe.cast_model_type != recipe.half_dtype:
        raise ValueError(
            f"the recipe {recipe.opt_level!r} has half_dtype={recipe.half_dtype} but casts the model to "
            f"{recipe.cast_model_type}; a recipe's fields are taken as they are, so replace both: "
            f"dataclasses.replace(..., half_dtype={recipe.half_dtype}, cast_model_type={recipe.half_dtype}) "
            f"(or start from opt_levels.resolve_properties('O2', half_dtype={recipe.half_dtype}), which moves "
            "every field that follows the half dtype)"
        )


def _fp8(level: Recipe, recipe: Recipe, fp8: Any) -> dict[str, Any]:
    if fp8 is None:
        return {}
    if fp8 is False:
        return {"fp8": None}
    if fp8 is True:
        fp8 = Fp8Recipe()
    if not isinstance(fp8, Fp8Recipe):
        raise TypeError(f"fp8 must be True, False, None or an amp.Fp8Recipe, got {type(fp8).__name__}")
    if level.fp8_refusal is not None:
        raise ValueError(f"fp8=True is not valid with {level.opt_level}: {level.fp8_refusal}")
    return {"fp8": fp8}


def resolve(
    level: Recipe,
    *,
    half_dtype: Any = None,
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: Any = None,
    cast_model_outputs: Any = None,
    num_losses: Any = None,
    min_loss_scale: Any = None,
    max_loss_scale: Any = None,
    scale_window: Any = None,
    hysteresis: Any = None,
    consecutive_hysteresis: Any = None,
    skip_nonfinite: bool = False,
    allow_banned: Any = None,
    collapse_warn_steps: Any = LEVELS_OWN,
    collapse_raise_steps: Any = LEVELS_OWN,
    fp8: Any = None,
) -> Recipe:
    """``level`` with the user's overrides applied, each checked against the level; raises with the reason.

    An argument left at its default (None, or :data:`LEVELS_OWN`) keeps ``level``'s value, so a
    recipe of your own passes through whole; the named levels hold apex's defaults.

    Args:
        level: the opt level's recipe (``opt_levels.O2``, ...), or one of your own.
        half_dtype: and every other argument: as for :func:`apex_amp.amp.initialize`.

    Example::

        >>> from apex_amp.amp import opt_levels
        >>> resolve(opt_levels.O2, half_dtype=torch.bfloat16, loss_scale="dynamic").dynamic_loss_scale
        True
        >>> mine = dataclasses.replace(opt_levels.O2, opt_level="mine", scale_window=500)
        >>> resolve(mine, hysteresis=2).scale_window
        500
    """
    skip_nonfinite = parse_flag("skip_nonfinite", skip_nonfinite)
    recipe = dataclasses.replace(level, **_half_dtype(level, half_dtype))
    recipe = dataclasses.replace(recipe, **_cast_model_type(level, recipe, cast_model_type))
    recipe = dataclasses.replace(recipe, **_patch(level, patch_torch_functions))
    recipe = dataclasses.replace(recipe, **_keep_batchnorm(level, recipe, keep_batchnorm_fp32))
    recipe = dataclasses.replace(recipe, **_master_weights(level, recipe, master_weights))
    recipe = dataclasses.replace(
        recipe, **_loss_scaling(level, recipe, loss_scale, min_loss_scale, max_loss_scale, skip_nonfinite))
    recipe = dataclasses.replace(recipe, **_scaler_settings(recipe, {
        "num_losses": num_losses, "scale_window": scale_window, "hysteresis": hysteresis,
        "consecutive_hysteresis": consecutive_hysteresis, "allow_banned": allow_banned,
        "collapse_warn_steps": collapse_warn_steps, "collapse_raise_steps": collapse_raise_steps,
        "cast_model_outputs": cast_model_outputs}))
    recipe = dataclasses.replace(recipe, **_fp8(level, recipe, fp8))
    _check_model_dtype_follows_half_dtype(recipe)
    return recipe
