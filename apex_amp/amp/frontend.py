"""``amp.initialize``: check the models and optimizers, then a short pipeline over the level's recipe.

The recipe (:mod:`.recipe`, the levels in :mod:`.opt_levels`, the overrides in
:mod:`.overrides`) makes every decision; this module checks the user's
objects, makes the session, and applies the recipe to each model and
optimizer in order: fp32 snapshots for the masters, the model's preparation,
the optimizers' masters and gradient lifecycles, fp8, O1's casting.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch
from torch import nn

from . import sessions
from .apex_private import attach_stash
from .diagnostics import overflow
from .distributed import check_sharded_models, distributed_ready, note_ddp_wrappers, overflow_group
from .fp8_training import plan_fp8, start_fp8
from .fsdp2 import refuse_late_sharding
from .master_weights import attach_masters
from ..optimizers.fused_optimizer import FusedOptimizer
from .._dtypes import HALF_DTYPES
from ..fp8 import Fp8Recipe
from .opt_levels import recipe_for
from .overrides import LEVELS_OWN, parse_flag, resolve
from .recipe import Recipe
from .session import AmpSession

__all__ = ["initialize"]

logger = logging.getLogger("apex_amp")

_WRAPPERS = (nn.DataParallel, nn.parallel.DistributedDataParallel)


def _as_model_list(models: Any) -> list[nn.Module]:
    listed = list(models) if isinstance(models, (list, tuple)) else [models]
    for index, model in enumerate(listed):
        where = f"models[{index}]" if isinstance(models, (list, tuple)) else "models"
        if isinstance(model, _WRAPPERS):
            raise ValueError(
                f"{where} is already wrapped in {type(model).__name__}; call amp.initialize on the bare model "
                "first and wrap the model it returns afterwards"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"{where} must be a torch.nn.Module, got {type(model).__name__}")
    if not listed:
        raise ValueError("amp.initialize needs at least one model")
    return listed


def _check_fp32_params(models: list[nn.Module]) -> None:
    for index, model in enumerate(models):
        for name, param in model.named_parameters():
            if param.dtype in HALF_DTYPES and sessions.was_initialized(model):
                raise ValueError(
                    f"model {index} was already passed to an earlier amp.initialize call, which cast its "
                    f"parameter {name!r} to {param.dtype}; call amp.initialize once, with every model and "
                    "optimizer trained together (to start over, build a fresh fp32 model and optimizer)"
                )
            if param.dtype in HALF_DTYPES:
                raise ValueError(
                    f"parameter {name!r} of model {index} is already {param.dtype}; amp.initialize expects an "
                    "fp32 model and casts it itself. Remove the .half()/.to(dtype) call before amp.initialize"
                )


def _check_materialized(models: list[nn.Module]) -> None:
    # A meta tensor has a shape but no data: casting it, or making a master from it, gives nothing
    # to train, and the failure would surface later inside torch or a kernel.
    for index, model in enumerate(models):
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            if tensor.is_meta:
                raise ValueError(
                    f"{name!r} of model {index} is on the meta device (a shape without data); amp.initialize "
                    "needs real weights. Materialize the model first (model.to_empty(device=...), then "
                    "initialize or load its weights), build the optimizer from its parameters, then call "
                    "amp.initialize"
                )


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _check_optimizers_train_the_models(models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    # An optimizer none of whose parameters belongs to a model given here, while a given model has
    # trainable parameters in no optimizer: the optimizer was built over another model (or a copy),
    # so amp would prepare one model and the step would update the other, whose gradients the
    # training loop never produces. Free tensors trained beside the models (a temperature, a loss
    # weight) in their own optimizer are fine as long as every given model is trained by some optimizer.
    model_params = {p for model in models for p in model.parameters()}
    optimizer_params = {p for optimizer in optimizers for p in _optimizer_params(optimizer)}
    # An optimizer with no parameters yet (groups added later) is not foreign.
    foreign = [index for index, optimizer in enumerate(optimizers)
               if _optimizer_params(optimizer) and not any(p in model_params for p in _optimizer_params(optimizer))]
    untrained = [index for index, model in enumerate(models)
                 if any(p.requires_grad for p in model.parameters())
                 and not any(p in optimizer_params for p in model.parameters())]
    if foreign and untrained:
        where = f"optimizers[{foreign[0]}]" if len(optimizers) > 1 else "the optimizer"
        which = f"models[{untrained[0]}]" if len(models) > 1 else "the model"
        raise ValueError(
            f"{where} holds no parameter of the model(s) passed to amp.initialize, and {which} has trainable "
            "parameters in no optimizer: the optimizer was built over another model (or a copy of it). "
            "Build the optimizer from the parameters of the model you pass, e.g. "
            "`optimizer = torch.optim.SGD(model.parameters(), ...)` and `amp.initialize(model, optimizer)`, "
            "or pass the model whose parameters it holds"
        )


def _check_each_param_in_one_optimizer(models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    # amp unscales each optimizer's gradients (and makes one master per entry):
    # a parameter listed twice would be unscaled twice or get two masters.
    names = {}
    for index, model in enumerate(models):
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(param, f"parameter {name!r} of model {index}")
    owner: dict[torch.Tensor, str] = {}
    for o_index, optimizer in enumerate(optimizers):
        where = f"optimizers[{o_index}]" if len(optimizers) > 1 else "the optimizer"
        for param in (p for group in optimizer.param_groups for p in group["params"]):
            if param in owner:
                what = names.get(param, f"a parameter of shape {tuple(param.shape)}")
                place = "twice in the same optimizer" if owner[param] == where else f"in {owner[param]} and {where}"
                raise ValueError(
                    f"{what} appears {place} (a weight shared between models?); amp checks and unscales "
                    "each optimizer's gradients once per parameter, so list every parameter once in one "
                    "optimizer, e.g. build it from nn.ModuleList([model_a, model_b]).parameters()"
                )
            owner[param] = where


HALF_DTYPE_VARIABLE = "APEX_AMP_HALF_DTYPE"
_HALF_DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _check_remainder_optimizers(optimizers: list[torch.optim.Optimizer]) -> None:
    # Before anything changes: only a fused optimizer keeps remainders and joins them in its step.
    others = [type(o).__name__ for o in optimizers if not isinstance(o, FusedOptimizer)]
    if others:
        raise ValueError(
            f"master_weights='remainder' needs apex_amp's fused optimizers, which keep each master's low half "
            f"in their state and rebuild the exact fp32 master in their step; got {others}. Use "
            "apex_amp.optimizers.FusedAdam (FusedSGD, FusedLAMB, ...), or master_weights=True")


def _half_dtype(half_dtype: Optional[torch.dtype], opt_level: Any) -> Optional[torch.dtype]:
    # An explicit argument wins over the environment; the environment over the level's fp16 (None
    # keeps the recipe's). A Recipe of the user's own states its half dtype: the environment,
    # meant for scripts written for apex's named levels, does not rewrite it.
    if half_dtype is not None or isinstance(opt_level, Recipe):
        return half_dtype
    name = os.environ.get(HALF_DTYPE_VARIABLE)
    if name is None or name == "":
        return None
    if name.strip().lower() not in _HALF_DTYPE_NAMES:
        raise ValueError(
            f"{HALF_DTYPE_VARIABLE}={name!r} is not a half dtype; set it to one of {sorted(_HALF_DTYPE_NAMES)} "
            "(or unset it for float16), or pass half_dtype= to amp.initialize"
        )
    return _HALF_DTYPE_NAMES[name.strip().lower()]


FP8_VARIABLE = "APEX_AMP_FP8"
_FP8_NAMES = {"1": True, "true": True, "delayed": "delayed", "current": "current", "0": None, "false": None}


def _fp8_choice(fp8: Any, opt_level: Any) -> Any:
    # An explicit argument wins; APEX_AMP_FP8 turns fp8 on for scripts that never pass it, except at
    # the levels that cannot take it (an fp32 O0 baseline in the same script keeps running).
    if fp8 is not None or isinstance(opt_level, Recipe):
        return fp8  # a Recipe of the user's own states its fp8 (as its half dtype)
    name = os.environ.get(FP8_VARIABLE, "").strip().lower()
    if name not in _FP8_NAMES and name != "":
        raise ValueError(
            f"{FP8_VARIABLE}={name!r} is not understood; set it to 1 (delayed scaling), 'current' or 0 "
            "(or unset it), or pass fp8= to amp.initialize"
        )
    choice = _FP8_NAMES.get(name)
    if choice is None:
        return None
    try:
        level = recipe_for(opt_level)
    except ValueError:
        return None  # the unknown level is reported by resolve with its own message
    if level.fp8_refusal is not None:
        logger.warning("%s=%s is ignored at %s: %s", FP8_VARIABLE, name, level.opt_level, level.fp8_refusal)
        return None
    return True if choice is True else Fp8Recipe.from_name(choice)


def _master_snapshots(recipe: Recipe, optimizers: list[torch.optim.Optimizer], fsdp2: Any) -> dict[int, torch.Tensor]:
    # Masters start from the user's exact fp32 weights, not from their half rounding.
    return {
        id(p): p.detach().clone()
        for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]
        if recipe.takes_master(p, sharded=fsdp2 is not None and fsdp2.holds_param(p))
    }


def _announce(message: str) -> None:
    # apex printed the chosen opt level and properties (on rank 0). Here it is an INFO record
    # of the "apex_amp" logger; when the program has configured no logging at all, Python's
    # own last-resort handler (stderr) shows it, as Python does for warnings.
    if _world_size() > 1 and torch.distributed.get_rank() != 0:
        return
    if logger.hasHandlers():
        logger.info("%s", message)
    elif logger.getEffectiveLevel() <= logging.WARNING:  # not raised above the default by the user
        logging.lastResort.handle(logger.makeRecord(logger.name, logging.INFO, __file__, 0, "%s", (message,), None))


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _device_of(models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> torch.device:
    for model in models:
        for param in model.parameters():
            return param.device
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                return param.device
    return torch.device("cpu")


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: Optional[torch.dtype] = None,
    patch_torch_functions: Optional[bool] = None,
    keep_batchnorm_fp32: Optional[bool] = None,
    master_weights: Optional[bool | str] = None,
    loss_scale: Any = None,
    cast_model_outputs: Optional[torch.dtype] = None,
    num_losses: Optional[int] = None,
    verbosity: int = 1,
    min_loss_scale: Optional[float] = None,
    max_loss_scale: Optional[float] = None,
    half_dtype: Optional[torch.dtype] = None,
    *,
    skip_nonfinite: bool = False,
    allow_banned: Optional[bool] = None,
    scale_window: Optional[int] = None,
    hysteresis: Optional[int] = None,
    consecutive_hysteresis: Optional[bool] = None,
    sync_overflow: Any = None,
    overflow_report: bool = False,
    collapse_warn_steps: Optional[int] = LEVELS_OWN,
    collapse_raise_steps: Optional[int] = LEVELS_OWN,
    fp8: Any = None,
) -> Any:
    """Prepare models and optimizers for mixed precision; returns the same objects.

    Args:
        models: a ``torch.nn.Module`` or a list of them (not yet wrapped in DDP/DataParallel;
            already sharded by FSDP2's ``fully_shard``, whose fp32 shards are then the masters, or
            under ``master_weights="remainder"`` become bf16 shards beside int16 remainders).
        optimizers: a ``torch.optim.Optimizer`` (or a wrapper holding one in ``.optim``, such as
            :class:`apex_amp.optimizers.LARC`), a list of them, or None.
        enabled: False returns everything untouched and makes ``scale_loss`` a pass-through.
        opt_level: "O0" (fp32), "O1" (per-op casts), "O2" (half model, fp32 masters), "O3" (half everything),
            or a :class:`apex_amp.amp.recipe.Recipe` of your own (a level is one recipe; see opt_levels.py).
            Every argument below left at its default keeps the level's (the recipe's) value; only the
            arguments you pass replace fields, each checked against the level.
        cast_model_type: override of the dtype the model is cast to (O0/O2/O3).
        patch_torch_functions: override of O1's per-op casting (only O1 may enable it).
        keep_batchnorm_fp32: keep batchnorm layers fp32 in a half model (O2/O3).
        master_weights: keep fp32 master weights for the optimizer (O2/O3); ``"remainder"`` (O2 with
            ``half_dtype=torch.bfloat16``, fused optimizers only): no fp32 copies, each bf16 weight is
            the high half of its fp32 master and the optimizer keeps the low half in its state.
        loss_scale: "dynamic" or a number (strings of numbers too).
        cast_model_outputs: dtype the model's floating outputs are cast to.
        num_losses: number of losses, each with its own scaler (``loss_id`` in ``scale_loss``); 1 at O0-O3.
        verbosity: 0 silences amp's log messages; >= 1 logs the chosen properties once.
        min_loss_scale: floor of a dynamic scale (default 1.0); a normal float32 (not 0, not a denormal).
        max_loss_scale: cap of a dynamic scale (2**24 at O0-O3).
        half_dtype: torch.float16 or torch.bfloat16 for every level; with bf16 the
            default scale is a static 1.0, with the gradient checks kept on. None (the
            default): the environment variable ``APEX_AMP_HALF_DTYPE`` ("bfloat16" or
            "float16") if set, else torch.float16 (apex's half), so third-party apex code
            trains in bf16 without an edit; a ``Recipe`` passed as ``opt_level`` keeps its own.
        skip_nonfinite: check gradients and skip non-finite steps at every level,
            static ones included (O0/O3 do not check by default, as in apex).
        allow_banned: let O1 run functions it bans in half precision (binary_cross_entropy).
        scale_window: clean steps before a dynamic scale doubles (apex: 2000, at O0-O3).
        hysteresis: overflows tolerated before a dynamic scale backs off (1, at O0-O3: at once).
        consecutive_hysteresis: True (apex's rule): only overflows in a row spend the hysteresis,
            which refills after every clean step; False (Megatron's, DeepSpeed's default): it
            refills only when the scale grows. The same with hysteresis=1. O0-O3: True.
        sync_overflow: True (or a ProcessGroup) MAX-reduces each pass's found-inf flag over the
            default (or that) group, for gradients DDP does not reduce (parameters outside the
            wrapper or ignored by it); plain DDP needs no sync. None: on only for FSDP models.
        overflow_report: record which parameters had non-finite gradients on each overflow
            (``amp.last_overflow()``, and DEBUG log lines); costs a host read per backward pass.
        collapse_warn_steps: scale-collapse guard: after this many overflows in a row with the
            scale at its floor (a dynamic scale left at ``min_loss_scale``, or any static scale),
            log a WARNING naming the likely causes (NaN/inf in the data, a loss computed in half
            precision, a learning rate too high); also at verbosity 0. O0-O3: 25; None: never.
        collapse_raise_steps: after this many such overflows in a row (counted from the first,
            >= collapse_warn_steps), the next ``scale_loss`` raises RuntimeError (that
            overflow's step is still skipped as usual). O0-O3: 500; None: never. A clean
            step resets the count; the guard reads the overflow log's values (no host sync).

    Returns:
        ``models`` (and ``optimizers`` when given) as passed in: same objects, same list shape.

    .. note::
        O1's per-op casting is process-wide; the latest ``initialize`` call
        turns it on (O1) or off (other levels).

    Example::

        >>> model = torch.nn.Linear(10, 2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16)
        >>> with amp.scale_loss(model(x).sum(), optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
    """
    model_list = _as_model_list(models)
    optimizer_list = [] if optimizers is None else sessions.as_optimizer_list(optimizers)
    for optimizer in optimizer_list:
        earlier = sessions.session_for(optimizer)
        # A disabled initialize did nothing to the optimizer: another call may follow, as in apex
        # (mmengine calls amp.initialize(enabled=False) at every step).
        if earlier is not None and earlier.enabled:
            raise RuntimeError(
                f"this {type(optimizer).__name__} was already passed to amp.initialize; call amp.initialize "
                "once per optimizer (create a fresh optimizer to start over)"
            )
    if len({id(optimizer) for optimizer in optimizer_list}) != len(optimizer_list):
        raise ValueError("the same optimizer appears twice in optimizers; pass each optimizer once")
    if isinstance(verbosity, bool) or not isinstance(verbosity, int):
        raise TypeError(f"verbosity must be an int, got {type(verbosity).__name__}")
    enabled = parse_flag("enabled", enabled)
    overflow_report = parse_flag("overflow_report", overflow_report)

    def result() -> Any:
        return models if optimizers is None else (models, optimizers)

    device = _device_of(model_list, optimizer_list)
    if not enabled:
        sessions.register(AmpSession(None, device, verbosity), optimizer_list, model_list)
        return result()

    recipe = resolve(
        recipe_for(opt_level), half_dtype=_half_dtype(half_dtype, opt_level), cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions, keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights, loss_scale=loss_scale, cast_model_outputs=cast_model_outputs,
        num_losses=num_losses, min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
        scale_window=scale_window, hysteresis=hysteresis, consecutive_hysteresis=consecutive_hysteresis,
        skip_nonfinite=skip_nonfinite, allow_banned=allow_banned, collapse_warn_steps=collapse_warn_steps,
        collapse_raise_steps=collapse_raise_steps, fp8=_fp8_choice(fp8, opt_level),
    )
    if overflow_report and not recipe.check_finite:
        raise ValueError(
            f"overflow_report=True needs gradient checks, which {recipe.opt_level} with a static loss "
            "scale leaves off; pass skip_nonfinite=True too (or use O1/O2)"
        )
    _check_materialized(model_list)
    _check_fp32_params(model_list)
    if recipe.remainder_masters:
        _check_remainder_optimizers(optimizer_list)
    _check_each_param_in_one_optimizer(model_list, optimizer_list)
    sharded_group, fsdp2 = check_sharded_models(model_list, optimizer_list, recipe)
    _check_optimizers_train_the_models(model_list, optimizer_list)
    fp8_plan = plan_fp8(recipe, model_list, optimizer_list) if recipe.fp8 is not None else None
    # FSDP: each rank checks only its gradient shard, so the ranks must agree unless told otherwise.
    sync_group = sharded_group if sync_overflow is None else overflow_group(sync_overflow)
    if verbosity >= 1:
        _announce(recipe.describe())
        notice = fp8_plan.notice(str(recipe.half_dtype)) if fp8_plan is not None else None
        if notice is not None:
            _announce(notice)

    fp32_values = _master_snapshots(recipe, optimizer_list, fsdp2)
    # master_weights="remainder": the fp32 values the bf16 weights and remainders are split from.
    remainder_masters = {p: p.detach().clone() for o in optimizer_list for p in _optimizer_params(o)
                         if p.dtype == torch.float32} if recipe.remainder_masters else {}
    session = AmpSession(recipe, device, verbosity)
    session.overflow_group = sync_group
    session.fsdp2 = fsdp2
    for index, model in enumerate(model_list):
        sharded = fsdp2 is not None and fsdp2.holds(model)
        recipe.prepare_model(model, session, sharded=sharded)
        if not sharded and distributed_ready():
            refuse_late_sharding(model, index)
        if recipe.master_weights and _world_size() > 1:
            note_ddp_wrappers(model, session.ddp_wrappers)  # to follow DDP's broadcast, as apex did
    given = list(optimizers) if isinstance(optimizers, (list, tuple)) else [] if optimizers is None else [optimizers]
    wrapper_of = {id(sessions.unwrap(o)): o for o in given if not isinstance(o, torch.optim.Optimizer)}
    for optimizer in optimizer_list:
        links = attach_masters(optimizer, fp32_value_of=lambda p: fp32_values.get(id(p))) \
            if recipe.master_weights else []
        if recipe.remainder_masters:
            optimizer.use_remainder_masters(remainder_masters)
        wrapper = wrapper_of.get(id(optimizer))
        session.add_optimizer(optimizer, links, wrapped=wrapper is not None)
        attach_stash(optimizer, session.lifecycle_of(optimizer), recipe.master_weights, also_on=wrapper)
    fp32_values.clear()  # the snapshots now live on as masters, or not at all
    remainder_masters.clear()
    if fp8_plan is not None:
        # The data-parallel ranks agree on the amaxes over the group they agree on skips, else all ranks.
        fp8_group = sync_group if sync_group is not None else (
            torch.distributed.group.WORLD if distributed_ready() else None)
        session.fp8 = start_fp8(fp8_plan, recipe, optimizer_list, session.lifecycle_of, device, fp8_group)

    recipe.apply_op_casting()
    sessions.register(session, optimizer_list, model_list)
    if overflow_report:
        overflow.enable(session, model_list)
    return result()
