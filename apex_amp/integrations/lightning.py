"""apex_amp's opt levels inside Lightning 2.x: a ``Precision`` plugin for ``Trainer(plugins=[...])``.

Lightning 2.x removed its apex backend, and its ``precision="16-mixed"`` is autocast plus
GradScaler (O1's counterpart). This plugin gives a Lightning ``Trainer`` apex_amp's O0-O3:
O2's half model with fp32 master weights and the fused FusedAdam step, dynamic loss scaling
with the scaler saved in Lightning's checkpoints, clipping on the unscaled fp32 master
gradients, and LR schedules held on skipped steps. It is an adapter over the public
``apex_amp.amp`` API: ``connect`` calls ``amp.initialize``, ``backward`` runs inside
``amp.scale_loss``, ``main_params`` is ``amp.master_params``, the checkpoint entry is
``amp.state_dict()``.

Needs ``lightning`` (``pip install apex_amp[lightning]``); this module imports it at the top,
so import it only where Lightning is wanted (``import apex_amp`` does not).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from torch.nn.parallel import DistributedDataParallel

from apex_amp import amp
from apex_amp.amp.opt_levels import resolve_properties
from apex_amp.amp.recipe import Recipe

__all__ = ["ApexAmpPrecision"]

logger = logging.getLogger("apex_amp")



def _lightning_precision(recipe: Recipe) -> str:
    """Lightning's name for what a level does to the model and its step (``trainer.precision``)."""
    bits = "bf16" if recipe.half_dtype == torch.bfloat16 else "16"
    if recipe.patch_torch_functions or recipe.master_weights:
        return f"{bits}-mixed"  # O1, O2: half compute, fp32 weights updated
    if recipe.casts_model_to_half:
        return f"{bits}-true"  # O3
    return "32-true"  # O0

# What the plugin itself passes to amp.initialize; the rest of its keywords may be forwarded.
_OWN_ARGUMENTS = {"models", "optimizers", "opt_level", "half_dtype", "enabled"}
_FORWARDABLE = set(inspect.signature(amp.initialize).parameters) - _OWN_ARGUMENTS


class ApexAmpPrecision(Precision):
    """Lightning 2.x precision plugin running apex_amp's O0-O3 (fp16 or bf16).

    Pass it to ``Trainer(plugins=[...])`` and leave the Trainer's ``precision`` at its
    default. At the start of ``fit`` it calls ``amp.initialize`` on the LightningModule and
    the optimizers of ``configure_optimizers`` (use :class:`apex_amp.optimizers.FusedAdam`
    for O2's fused step); every backward pass runs inside ``amp.scale_loss``; gradient
    clipping (``Trainer(gradient_clip_val=...)``) acts on ``amp.master_params``, the
    unscaled fp32 master gradients under O2, FusedAdam included; a step whose gradients are
    not finite is skipped and the loss scale backs off, as in apex. The loss scalers are saved
    in Lightning's checkpoints under this class's name and restored on resume, so a run
    resumed with ``fit(..., ckpt_path=...)`` continues bit for bit.

    Skipped steps and LR schedules: a scheduler that Lightning steps every optimizer step
    (``"interval": "step"``, not ``ReduceLROnPlateau``) is held on a skipped step, so warm-up
    and decay count only the steps taken. For this the scheduler's class is replaced, for the
    duration of ``fit``, by a generated subclass whose ``step`` does nothing right after a
    skipped step (same object, ``isinstance`` and ``state_dict`` unchanged); ``teardown``
    restores the class. ``hold_lr_on_skipped_steps=False`` leaves the schedulers alone.

    As with apex, O2 and O3 cast the inputs of the LightningModule's ``forward``: a
    ``training_step`` that calls a submodule directly instead of ``self(x)`` must cast its
    inputs itself. One ``fit`` per plugin: ``amp.initialize`` prepares a model once.
    Distributed strategies: at O0 and O1 the model may be wrapped in DDP (amp then takes DDP's
    ``no_sync`` accumulation through ``scale_loss(..., model=ddp_model)``); O2 and O3 raise,
    because Lightning wraps the model in DDP before a precision plugin sees the optimizers,
    while O2 casts the model and makes its masters before the wrap.

    Args:
        opt_level: "O0", "O1", "O2" or "O3", or a :class:`apex_amp.amp.recipe.Recipe` of your own
            (passed to ``amp.initialize`` whole: see ``docs/recipes.md``).
        half_dtype: ``torch.float16`` (apex's half, dynamic loss scaling) or ``torch.bfloat16``
            (a static scale of 1, gradients still checked). None (the default): float16 for a
            named level, the recipe's own for a ``Recipe``.
        hold_lr_on_skipped_steps: hold step-interval LR schedulers on skipped steps.
        **initialize_kwargs: further keyword arguments of :func:`apex_amp.amp.initialize`
            (``loss_scale``, ``keep_batchnorm_fp32``, ``min_loss_scale``, ``verbosity``, ...).

    .. note:: Holding a scheduler reads the step's overflow flag (``amp.step_was_skipped``):
        one host sync per scheduler step on CUDA.

    Example::

        >>> import lightning.pytorch as pl
        >>> from apex_amp.integrations.lightning import ApexAmpPrecision
        >>> trainer = pl.Trainer(max_epochs=3, gradient_clip_val=1.0,
        ...                      plugins=[ApexAmpPrecision("O2", torch.float16)])
        >>> trainer.fit(lit_module, train_loader)   # configure_optimizers returns FusedAdam
    """

    def __init__(self, opt_level: Any = "O2", half_dtype: Optional[torch.dtype] = None, *,
                 hold_lr_on_skipped_steps: bool = True, **initialize_kwargs: Any) -> None:
        if not isinstance(opt_level, Recipe) and opt_level not in ("O0", "O1", "O2", "O3"):
            raise ValueError(f"ApexAmpPrecision: opt_level={opt_level!r} is not one of 'O0', 'O1', 'O2', 'O3' "
                             "or an apex_amp.amp.recipe.Recipe")
        if half_dtype is not None and half_dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"ApexAmpPrecision: half_dtype must be torch.float16 or torch.bfloat16, got {half_dtype!r}")
        unknown = sorted(set(initialize_kwargs) - _FORWARDABLE)
        if unknown:
            raise TypeError(
                f"ApexAmpPrecision got keyword arguments amp.initialize does not take from it: {unknown}. "
                f"opt_level and half_dtype are this plugin's own arguments; the models and optimizers "
                f"are the Trainer's; anything else must be one of {sorted(_FORWARDABLE)}")
        self.opt_level = opt_level
        if half_dtype is None and not isinstance(opt_level, Recipe):
            half_dtype = torch.float16  # apex's half, whatever APEX_AMP_HALF_DTYPE says
        # The overrides initialize will apply to the level: what the Trainer reports and
        # whether DDP can work follow from the recipe amp will train with.
        self._recipe = resolve_properties(opt_level, half_dtype=half_dtype)
        self.half_dtype = self._recipe.half_dtype
        self._given_half_dtype = half_dtype
        self.precision = _lightning_precision(self._recipe)
        self.hold_lr_on_skipped_steps = hold_lr_on_skipped_steps
        self._initialize_kwargs = initialize_kwargs
        self._optimizers: list[torch.optim.Optimizer] = []
        self._ddp_model: Optional[DistributedDataParallel] = None
        self._held_schedulers: list[tuple[Any, type]] = []

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers amp was initialized with (empty before ``fit`` reaches its set-up)."""
        return list(self._optimizers)

    def connect(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                lr_schedulers: list[Any]) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Initializes amp on the model and the optimizers the strategy set up (called by Lightning)."""
        if not optimizers or self._same_optimizers(optimizers):
            # validate / test / predict (before or after fit): nothing to initialize.
            return model, optimizers, lr_schedulers
        if self._optimizers:
            raise RuntimeError(
                "ApexAmpPrecision is already connected to a run: amp.initialize prepares a model once. "
                "Use a new Trainer with a new ApexAmpPrecision (and resume with fit(..., ckpt_path=...)) "
                "for another fit")
        module = model
        if isinstance(model, DistributedDataParallel):
            if self._recipe.casts_model_to_half:
                raise ValueError(
                    f"ApexAmpPrecision({self._recipe.opt_level!r}) with a DDP strategy is not supported: Lightning "
                    "wraps the model in DistributedDataParallel before the precision plugin sees the "
                    "optimizers, and O2/O3 must cast the model (and make O2's fp32 masters) before that wrap. "
                    "Use opt_level='O1' with DDP, or a single-device strategy")
            module, self._ddp_model = model.module, model
        # enabled=True is the plugin's (a disabled plugin is no plugin: drop it from the Trainer).
        _, initialized = amp.initialize(module, list(optimizers), enabled=True, opt_level=self.opt_level,
                                        half_dtype=self._given_half_dtype, **self._initialize_kwargs)
        self._optimizers = list(initialized)
        if self.hold_lr_on_skipped_steps:
            for config in lr_schedulers:
                self._hold_on_skipped_steps(config)
        return model, list(initialized), lr_schedulers

    def _same_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        return len(optimizers) == len(self._optimizers) and all(
            given is ours for given, ours in zip(optimizers, self._optimizers))

    def _hold_on_skipped_steps(self, config: Any) -> None:
        scheduler = config.scheduler
        if config.interval != "step" or config.reduce_on_plateau:
            return
        if not any(scheduler.optimizer is optimizer for optimizer in self._optimizers):
            return
        original = type(scheduler)
        scheduler.__class__ = _held_class(original)
        self._held_schedulers.append((scheduler, original))

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """``model.backward`` of the scaled loss, inside ``amp.scale_loss`` (called by Lightning).

        ``optimizer`` is the optimizer being stepped, or None under manual optimization
        (``manual_backward``): the loss is then scaled for every optimizer of the run.
        """
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        optimizers = [optimizer] if optimizer is not None else self._optimizers
        if not optimizers:
            raise RuntimeError("ApexAmpPrecision.backward ran before the plugin was connected to a fit: "
                               "backward passes belong to trainer.fit")
        with amp.scale_loss(tensor, optimizers, model=self._ddp_model) as scaled_loss:
            model.backward(scaled_loss, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Runs the closure (forward and backward), then the hooks and clipping, then the step.

        The closure runs before ``optimizer.step()`` rather than inside it, because amp's part of
        the step (skip or take, unscale) must see the gradients of the closure's backward pass.
        """
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("ApexAmpPrecision: LBFGS evaluates its closure several times inside one step, "
                             "which a loss-scaled mixed-precision step cannot follow; use another optimizer")
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: no backward pass ran, so there is nothing to step
            # (Lightning's own MixedPrecision plugin does the same).
            return None
        return optimizer.step(**kwargs)

    def main_params(self, optimizer: torch.optim.Optimizer) -> Any:
        """The parameters clipping acts on: ``amp.master_params`` (unscaled fp32 masters under O2)."""
        if isinstance(optimizer, LightningOptimizer):  # manual optimization's self.clip_gradients
            optimizer = optimizer.optimizer
        return amp.master_params(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """``amp.state_dict()`` (every loss scaler) once amp is initialized; empty before."""
        return amp.state_dict() if self._optimizers else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the loss scalers of a checkpoint (Lightning calls it on resume, after ``connect``)."""
        if not self._optimizers:
            logger.debug("ApexAmpPrecision: loss scalers of a checkpoint not restored, no fit is running")
            return
        amp.load_state_dict(state_dict)

    def teardown(self) -> None:
        """Gives the held LR schedulers their own class back (called by Lightning at the end of a run)."""
        for scheduler, original in self._held_schedulers:
            scheduler.__class__ = original
        self._held_schedulers = []
        super().teardown()


_HELD_CLASSES: dict[type, type] = {}


def _held_class(scheduler_class: type) -> type:
    """A subclass of ``scheduler_class`` whose ``step`` does nothing right after a skipped optimizer step."""
    held = _HELD_CLASSES.get(scheduler_class)
    if held is None:
        def step(self, *args: Any, **kwargs: Any) -> None:
            if amp.step_was_skipped(self.optimizer):
                return None
            return scheduler_class.step(self, *args, **kwargs)

        held = type(scheduler_class.__name__, (scheduler_class,), {
            "step": step, "__doc__": scheduler_class.__doc__,
            "__qualname__": f"held_on_skipped_steps({scheduler_class.__qualname__})"})
        _HELD_CLASSES[scheduler_class] = held
    return held
