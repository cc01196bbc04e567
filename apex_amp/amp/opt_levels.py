"""The optimization levels O0-O3: four recipes, apex's table, which users know.

====  ===============  =====================  ===================  ==============  ==========
      cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale
====  ===============  =====================  ===================  ==============  ==========
O0    float32          False                  None                 False           1.0
O1    None             True                   None                 False           "dynamic"
O2    half             False                  True                 True            "dynamic"
O3    half             False                  False                False           1.0
====  ===============  =====================  ===================  ==============  ==========

Each row is a :class:`~apex_amp.amp.recipe.Recipe` below, written for apex's
half, fp16; :func:`~apex_amp.amp.overrides.resolve` replaces its fields with
the user's choices (``half_dtype`` first: bf16 has fp32's exponent range, so
a "dynamic" default becomes a static scale of 1.0 whose gradients are still
checked; an explicit ``loss_scale="dynamic"`` keeps the dynamic scaler).

Adding a level is adding one recipe here: its fields say what it does, and
every part of amp (model preparation, masters, O1 casting, the scaler, FSDP2,
fp8, the printed properties) reads them through the recipe's methods.
"""

from __future__ import annotations

from typing import Any

import torch

from .overrides import DYNAMIC_INITIAL_SCALE, LARGEST_SCALE, SMALLEST_SCALE, parse_flag, resolve
from .recipe import Recipe

__all__ = [
    "O0", "O1", "O2", "O3", "LEVELS", "OPT_LEVELS", "AmpProperties", "recipe_for", "resolve_properties",
    "parse_flag", "SMALLEST_SCALE", "LARGEST_SCALE",
]

_FP16 = torch.float16

O0 = Recipe(
    opt_level="O0", summary="fp32 training, the baseline to compare against", half_dtype=_FP16,
    cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None, master_weights=False,
    dynamic_loss_scale=False, loss_scale=1.0, check_finite=False,
    fp8_refusal="O0 is the fp32 baseline (nothing runs in reduced precision); use O2 (or O1) with fp8=True",
)
O1 = Recipe(
    opt_level="O1", summary="per-op casts: each op in the precision that is safe for it", half_dtype=_FP16,
    cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None, master_weights=False,
    dynamic_loss_scale=True, loss_scale=DYNAMIC_INITIAL_SCALE, check_finite=True,
)
O2 = Recipe(
    opt_level="O2", summary="half model, fp32 batchnorm, fp32 master weights in the optimizer", half_dtype=_FP16,
    cast_model_type=_FP16, patch_torch_functions=False, keep_batchnorm_fp32=True, master_weights=True,
    dynamic_loss_scale=True, loss_scale=DYNAMIC_INITIAL_SCALE, check_finite=True,
)
O3 = Recipe(
    opt_level="O3", summary="half everything, no masters: a speed baseline", half_dtype=_FP16,
    cast_model_type=_FP16, patch_torch_functions=False, keep_batchnorm_fp32=False, master_weights=False,
    dynamic_loss_scale=False, loss_scale=1.0, check_finite=False,
    fp8_refusal=("O3 has no fp32 master weights, so the small updates fp8 training relies on would be rounded "
                 "away in half precision; use O2 (half model, fp32 masters) with fp8=True"),
)

LEVELS: dict[str, Recipe] = {recipe.opt_level: recipe for recipe in (O0, O1, O2, O3)}
OPT_LEVELS = tuple(LEVELS)
# What a session keeps (``session.properties``): the level's recipe after the user's overrides.
AmpProperties = Recipe


def recipe_for(opt_level: Any) -> Recipe:
    """The recipe of ``opt_level`` ("O0" ... "O3", or a :class:`Recipe` itself); a ValueError otherwise.

    Args:
        opt_level: the level's name, as passed to ``amp.initialize``, or a recipe (a level of your own).

    Example::

        >>> recipe_for("O2").master_weights
        True
    """
    if isinstance(opt_level, Recipe):
        return opt_level
    if isinstance(opt_level, str) and opt_level in LEVELS:
        return LEVELS[opt_level]
    hint = ""
    if isinstance(opt_level, str):
        fixed = opt_level.strip().upper().replace("0O", "OO")
        if len(fixed) == 2 and fixed[0] in "O0" and f"O{fixed[1]}" in LEVELS:
            hint = f" Did you mean 'O{fixed[1]}'?"
    valid = ", ".join(f"'{name}'" for name in LEVELS)
    raise ValueError(
        f"unknown opt_level {opt_level!r}; valid levels are {valid} (the letter O, upper case, then a digit).{hint}"
    )


def resolve_properties(opt_level: Any, **overrides: Any) -> Recipe:
    """``opt_level``'s recipe with the ``initialize`` overrides applied (see :func:`.overrides.resolve`).

    Args:
        opt_level: "O0" ... "O3".
        overrides: ``half_dtype``, ``loss_scale``, ... as for ``amp.initialize``.

    Example::

        >>> resolve_properties("O2", half_dtype=torch.bfloat16).cast_model_type
        torch.bfloat16
    """
    return resolve(recipe_for(opt_level), **overrides)
