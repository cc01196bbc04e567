"""What every fused optimizer shares, and its contract with amp and with ``torch.amp.GradScaler``.

A fused optimizer is a subclass of :class:`FusedOptimizer` that declares its
per-element state (``STATE_KEYS``), whether it counts steps, and one method,
``_fused_step``, which makes one op call for a :class:`FusedBatch`: the
tensors of one param group on one device. The base class owns everything
else: grouping by device and by whether a half model copy is written, the
state and the group's step count, the O2 model copy written in the same pass,
optimizer-owned fp32 masters (``master_weights=True``), sparse-gradient
refusal, ``zero_grad`` and ``load_state_dict``, and how the state is stored: the param
groups' ``state_precision`` (apex_amp/optimizers/_state_storage.py) and ``master_weights=
"remainder"`` (a bf16 param plus an int16 ``master_remainder`` is the exact fp32 master).

The contract with amp is typed: amp's gradient lifecycle recognises a
``FusedOptimizer`` and passes :class:`AmpStepArgs` to ``step(amp=...)``
(the overflow flag, the inverse scale of gradients left scaled, the half
model parameters of the fp32 masters), so the step unscales as it reads and
skips on the device. ``grad_clears`` / ``clears_to_none`` (how many
``zero_grad`` calls, and how many of them set the gradients to None) tell amp
what a sequence of clears did to the gradients it keeps off the params.
``torch.amp.GradScaler`` drives the same step through its own protocol
(``_step_supports_amp_scaling``: it sets ``grad_scale`` and ``found_inf`` on
the optimizer), and apex's ``step(grad_scaler=...)`` works too: both become an
``AmpStepArgs`` in apex_amp/optimizers/_step_args.py.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Union

import torch
from torch import Tensor

from .._dtensor import is_dtensor, local_tensor, sharded_like
from .._dtypes import HALF_DTYPES
from . import _state_rounding as rounding
from . import _state_storage as storage
from ._batch_plan import BatchPlan, FusedBatch, copy_of_step, merge_fp32_into_copy_batches
from ._step_args import AmpStepArgs, leave_grads_unscaled, resolve
from .state_conversion import adopt_loaded_state
from .state_formats import split_master

__all__ = ["AmpStepArgs", "FusedBatch", "FusedOptimizer"]

class FusedOptimizer(torch.optim.Optimizer):
    """Base of apex_amp's fused optimizers (see the module docstring for the contract).

    Args:
        params: parameters or param groups.
        defaults: the group hyper-parameters.
        set_grad_none: ``zero_grad()`` sets gradients to None (else zeroes them).
        master_weights: keep fp32 masters of fp16/bf16 params in the state (``master_param``),
            updated in their place, the half param rewritten in the same pass (without amp);
            ``"remainder"``: bf16 params only, the state keeps the int16 low half of each fp32
            master (``master_remainder``), the param its high half: the exact master in 2 more
            bytes instead of 4 (fp16 params are refused: fp16 is not the high half of fp32).
        master_dtypes: which param dtypes get such masters (default: fp16 and bf16).
        state_precision: how per-element state is stored: ``"fp32"`` (default), ``"bf16"``,
            ``"fp8"`` or ``"int8"`` (apex_amp/optimizers/state_formats.py); also a param-group key.
        state_block_size: the largest block of fp8/int8 state sharing one absmax (a power of two
            in [32, 4096]); also a param-group key.
        min_quantized_numel: parameters with fewer elements (counted on the global, unsharded
            shape) keep fp32 state; also a param-group key.
        state_rounding: how bf16 state is rounded: ``"nearest"`` (even; default) or ``"stochastic"``
            (unbiased, with a seeded counter-based generator; needs ``state_precision="bf16"``);
            also a param-group key.
        state_rounding_seed: the seed of stochastic rounding: an int, a ``torch.Generator`` (one
            draw), or None (drawn from torch's default generator); also a param-group key.

    Example::

        >>> class MyFused(FusedOptimizer):
        ...     STATE_KEYS = ("exp_avg",)
        ...     def _fused_step(self, group, batch, amp):
        ...         ops.my_op_(batch.params, batch.grads, batch.states["exp_avg"], batch.model_params,
        ...                    lr=group["lr"], inv_scale=amp.inv_scale, found_inf=amp.found_inf)
    """

    STATE_KEYS: ClassVar[tuple[str, ...]] = ()  # per-element state, shaped and laid out like the param
    # The per-element states that are never negative: int8 precision stores them with the unsigned map.
    NONNEGATIVE_STATE_KEYS: ClassVar[frozenset[str]] = frozenset()
    # The step count lives in param_groups[i]["step"], as apex's FusedAdam/LAMB/NovoGrad kept it:
    # one float32 tensor per group, on the group's device, incremented by the op on the device
    # (not on a skipped step), readable and writable by LR schedulers, saved in state_dict().
    COUNTS_STEPS: ClassVar[bool] = False
    initial_step: float = 0.0  # the step count a group starts from
    # torch.amp.GradScaler's protocol: it sets self.grad_scale / self.found_inf and calls step().
    _step_supports_amp_scaling: ClassVar[bool] = True

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        set_grad_none: bool = True,
        master_weights: Union[bool, str] = False,
        master_dtypes: tuple[torch.dtype, ...] = HALF_DTYPES,
        state_precision: str = "fp32",
        state_block_size: int = storage.DEFAULT_BLOCK_SIZE,
        min_quantized_numel: int = storage.DEFAULT_MIN_QUANTIZED_NUMEL,
        state_rounding: str = "nearest",
        state_rounding_seed: Union[int, torch.Generator, None] = None,
    ) -> None:
        if master_weights not in (True, False, "remainder"):
            raise ValueError(f"master_weights must be True, False or 'remainder', got {master_weights!r}")
        # Read by add_param_group, which torch's constructor calls.
        self.remainder_masters = master_weights == "remainder"
        self.master_weights = bool(master_weights) and not self.remainder_masters
        self.master_dtypes = tuple(master_dtypes)
        defaults = {**defaults, "state_precision": state_precision, "state_block_size": state_block_size,
                    "min_quantized_numel": min_quantized_numel, "state_rounding": state_rounding,
                    "state_rounding_seed": state_rounding_seed}
        storage.check_group(defaults)
        rounding.check_group(defaults)
        super().__init__(params, defaults)
        self._group_keys = tuple(defaults)  # torch's load_state_dict adds its own keys to self.defaults
        self.set_grad_none = bool(set_grad_none)
        # amp keeps gradients it left scaled for the fused step off the params, where zero_grad
        # cannot reach them; it follows these two counts to clear them as the clears would have
        # (any clear to None since amp took them leaves None, as PyTorch's would: see grad_clears.py).
        self.grad_clears = 0
        self.clears_to_none = 0
        self._batch_plans: dict[int, BatchPlan] = {}  # id(param group) -> its batches (a cache)

    def __getstate__(self) -> dict[str, Any]:
        # torch's keeps defaults, state and param_groups only; a copy must keep our settings too
        # (set_grad_none, master_weights, adam_w_mode, ...), but not the hooks or the plan cache.
        state = {key: value for key, value in vars(self).items()
                 if not key.startswith("_optimizer_") and key != "_batch_plans"}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._batch_plans = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's; the group's state precision keys are validated and fp16 params refused under
        ``master_weights="remainder"``."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        storage.check_group(group)
        rounding.check_group(group)
        if self.remainder_masters:
            _refuse_fp16_remainders(group)

    def use_remainder_masters(self, masters: Optional[Mapping[Tensor, Tensor]] = None) -> None:
        """Keep bf16 params' fp32 masters as remainders from now on (amp's ``master_weights="remainder"``).

        Args:
            masters: ``{param: its fp32 value}`` for params just cast to bf16 (amp's O2 casts the
                model after taking these): the param becomes the high half of that value and its
                remainder the low half, so the master starts exactly where an fp32 copy would.
                Under FSDP2 both are DTensors placed alike: each rank splits its own shard, and
                the remainder is an int16 DTensor sharded like the param.

        Example::

            >>> optimizer.use_remainder_masters()   # as FusedAdam(..., master_weights="remainder")
        """
        if any("master_param" in state for state in self.state.values()):
            raise RuntimeError(f"{type(self).__name__} already holds fp32 masters (master_weights=True); "
                               "build it with master_weights='remainder' instead")
        for group in self.param_groups:
            _refuse_fp16_remainders(group)
        self.remainder_masters, self.master_weights = True, False
        self._batch_plans = {}
        with torch.no_grad():
            for param, master in (masters or {}).items():
                if self._keeps_remainder(param):
                    weight, remainder = split_master(local_tensor(master))
                    local_tensor(param).copy_(weight)
                    self.state[param]["master_remainder"] = sharded_like(remainder, param)

    # ---- what a subclass writes ---------------------------------------------------------------
    def _fused_step(self, group: dict[str, Any], batch: FusedBatch, amp: AmpStepArgs) -> None:
        """One op call updating ``batch`` with ``group``'s hyper-parameters."""
        raise NotImplementedError(f"{type(self).__name__} must implement _fused_step")

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The per-element state lists of ``group``'s op call (default: ``STATE_KEYS``)."""
        return self.STATE_KEYS

    def _new_state(self, target: Tensor, group: dict[str, Any],
                   layout: Optional[storage.StateLayout]) -> dict[str, Tensor]:
        """The state of a param seen for the first time (``target``: what is updated; ``layout``: how
        its per-element state is stored, None for ``target``'s dtype)."""
        return storage.new_state(target, self._state_keys(group), self.NONNEGATIVE_STATE_KEYS, layout)

    def _keeps_master(self, param: Tensor) -> bool:
        """Whether ``param`` is updated through an fp32 master in its state (``master_weights``)."""
        return self.master_weights and param.dtype in self.master_dtypes

    def _keeps_remainder(self, param: Tensor) -> bool:
        """Whether ``param`` (bf16) is the high half of an fp32 master whose low half is in its state."""
        return self.remainder_masters and param.dtype == torch.bfloat16

    def _before_groups(self, batches: list[tuple[dict[str, Any], FusedBatch]], amp: AmpStepArgs) -> None:
        """Called once per step with every batch, before the first op call (LAMB's global norm)."""

    # ---- zero_grad -------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Clear gradients: to None when ``set_to_none`` (default: the ``set_grad_none`` flag), else to 0."""
        set_to_none = self.set_grad_none if set_to_none is None else bool(set_to_none)
        super().zero_grad(set_to_none=set_to_none)
        self.grad_clears += 1
        self.clears_to_none += set_to_none

    # ---- step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, amp: Optional[AmpStepArgs] = None,
             **apex_arguments: Any) -> Any:
        """One fused step of every param group.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            amp: what amp hands the step (:class:`AmpStepArgs`); given by amp's step hook.
            apex_arguments: ``grad_scaler=`` (apex's way of passing a ``torch.amp.GradScaler``);
                apex's old ``grads``, ``output_params``, ``scale`` and ``grad_norms`` raise, as in apex.
        """
        from_scaler = amp is None and (apex_arguments.get("grad_scaler") is not None
                                       or getattr(self, "found_inf", None) is not None)
        amp = resolve(self, amp, apex_arguments)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batches = [(group, batch) for group in self.param_groups for batch in self._batches(group, amp)]
        rounding.prepare_batches(self.param_groups, batches)
        self._before_groups(batches, amp)
        for group, batch in batches:
            self._fused_step(group, batch, amp)
        if from_scaler and amp.inv_scale is not None:
            leave_grads_unscaled(batches, amp)
        for _, batch in batches:
            batch.grads = []  # a reused plan's batches must not keep this step's gradients alive
        return loss

    # ---- batching --------------------------------------------------------------------------------
    def _batches(self, group: dict[str, Any], amp: AmpStepArgs) -> list[FusedBatch]:
        if torch.compiler.is_compiling():
            return self._build_batches(group, amp)  # traced once into the graph, guarded by dynamo
        params, keys, settings = group["params"], self._plan_keys(group), self._plan_settings()
        plan = self._batch_plans.get(id(group))
        if (plan is not None and plan.group is group and plan.state_keys == keys and plan.settings == settings
                and plan.group_step is group.get("step")):  # a step count written by a scheduler rebuilds
            grads = plan.grads(params, amp.model_params)
            if grads is not None and BatchPlan.signature(self.state, params, keys) == plan.state_ids:
                return plan.fill(grads)
        batches = self._build_batches(group, amp)
        self._remember_plan(group, keys, settings, batches, amp)
        return batches

    def _plan_settings(self) -> tuple[Any, ...]:
        """What besides the state decides the batches (a subclass's setting read by every step)."""
        return ()

    def _plan_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        # The state a group's batches hold: a plan is stale once any of these tensors is replaced.
        keys = self._state_keys(group)
        return (*keys, *map(storage.absmax_key, keys), *(("master_param",) if self.master_weights else ()),
                *(("master_remainder",) if self.remainder_masters else ()))

    def _remember_plan(self, group: dict[str, Any], keys: tuple[str, ...], settings: tuple[Any, ...],
                       batches: list[FusedBatch], amp: AmpStepArgs) -> None:
        params = group["params"]
        self._batch_plans.pop(id(group), None)
        if any(is_dtensor(p) for p in params):
            return  # FSDP2 may hand out other local shards: built every step
        position = {id(p): i for i, p in enumerate(params)}
        model_of = [amp.model_params.get(p) for p in params] if amp.model_params else None
        grads = [p.grad for p in params]
        if model_of is not None:
            grads = [g if g is not None or m is None else m.grad for g, m in zip(grads, model_of)]
        self._batch_plans[id(group)] = BatchPlan(
            group=group,
            batches=[dataclasses.replace(batch, grads=[], new_state=[False] * len(batch.owners))
                     for batch in batches],
            grad_positions=[[position[id(p)] for p in batch.owners] for batch in batches],
            group_step=group.get("step") if self.COUNTS_STEPS and batches else None,
            param_ids=[id(p) for p in params],
            model_of=model_of,
            model_params_key=BatchPlan.mapping_key(amp.model_params),
            has_grad=[g is not None for g in grads],
            state_keys=keys,
            state_ids=BatchPlan.signature(self.state, params, keys),
            settings=settings,
        )

    def _build_batches(self, group: dict[str, Any], amp: AmpStepArgs) -> list[FusedBatch]:
        # (device, writes a model copy, has remainder masters) -> one batch, in param order.
        batches: dict[tuple[torch.device, bool, bool], FusedBatch] = {}
        keys = self._state_keys(group)
        for p in group["params"]:
            model_param = amp.model_params.get(p) if amp.model_params else None
            grad = p.grad
            if grad is None and model_param is not None:
                grad = model_param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients; use torch.optim.SparseAdam "
                    "or torch.optim.SGD for sparse parameters (e.g. nn.Embedding(sparse=True))")
            state, target, model_param, remainder, created = self._param_state(p, group, model_param)
            key = (p.device, model_param is not None, remainder)
            batch = batches.get(key)
            if batch is None:  # not setdefault: that would build a fresh batch for every param
                batch = batches[key] = FusedBatch(p.device, states={name: [] for name in keys},
                                                  absmaxes={name: [] for name in keys})
            batch.owners.append(p)
            batch.params.append(local_tensor(target))
            batch.grads.append(local_tensor(grad))
            for name in keys:
                batch.states[name].append(local_tensor(state[name]))
                absmax = state.get(storage.absmax_key(name))
                batch.absmaxes[name].append(None if absmax is None else local_tensor(absmax))
            if model_param is not None:
                batch.model_params.append(local_tensor(model_param))
            if remainder:
                batch.master_remainders.append(local_tensor(state["master_remainder"]))
            batch.new_state.append(created)
        merged = merge_fp32_into_copy_batches(batches)
        if self.COUNTS_STEPS and merged:
            step = self._group_step(group, merged[0].device)
            for index, batch in enumerate(merged):
                batch.step = copy_of_step(step, batch.device) if index else step
        return merged

    def _param_state(self, p: Tensor, group: dict[str, Any], model_param: Optional[Tensor]
                     ) -> tuple[dict[str, Any], Tensor, Optional[Tensor], bool, bool]:
        # p's state, made where it is missing, and how p is updated: (state, the tensor updated,
        # the half copy written, whether through a remainder, whether the per-element state is new).
        state = self.state[p]
        target = p
        if model_param is None and self._keeps_master(p):
            if "master_param" not in state:
                state["master_param"] = p.detach().to(torch.float32)
            target, model_param = state["master_param"], p
        remainder = model_param is None and self._keeps_remainder(p)
        if remainder and "master_remainder" not in state:
            # 0: the master starts as the bf16 weight itself, as master_weights=True's copy does.
            state["master_remainder"] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
        keys = self._state_keys(group)
        created = not all(key in state for key in keys)
        if created:
            layout = storage.layout_of(p, target, group, remainder)
            for key, value in self._new_state(target, group, layout).items():
                state.setdefault(key, value)
        return state, target, model_param, remainder, created

    @torch.no_grad()
    def init_state(self) -> None:
        """Make the state a first step would (zeros), where a trainable param has none, and each group's step counts.

        ``torch.distributed.checkpoint`` loads into the tensors ``state_dict()`` holds, so a
        fresh optimizer must have its state first (``amp.checkpoint_state`` calls this). torch's
        ``get_state_dict`` makes it by a step of zero gradients for an optimizer with no state at
        all, but a remainder master's state exists from ``amp.initialize`` on. The counts are the
        group's ``step`` and, under stochastic rounding, its ``state_rounding_step``. State made here is
        not new to the first step (FusedSGD then damps its first momentum, as after torch's step).

        Example::

            >>> optimizer.init_state()
            >>> sorted(optimizer.state[param])            # FusedAdam
            ['exp_avg', 'exp_avg_sq']
        """
        for group in self.param_groups:
            trainable = [p for p in group["params"] if p.requires_grad]
            for p in trainable:
                self._param_state(p, group, model_param=None)
            if self.COUNTS_STEPS and trainable:
                self._group_step(group, trainable[0].device)
            if rounding.stochastic(group) and trainable:
                rounding.counter_of(group)  # stochastic rounding's counter, which DCP loads into too
        self._batch_plans = {}

    def _group_step(self, group: dict[str, Any], device: torch.device) -> Tensor:
        # The group's one step count as the ops take it: a float32 scalar on ``device``. A count
        # written by a scheduler or loaded from apex (an int, apex's one-element int32 tensor,
        # a tensor on another device) becomes such a tensor here, once; the group then holds it.
        step = group.get("step")
        if isinstance(step, Tensor) and step.dtype == torch.float32 and step.dim() == 0 and step.device == device:
            return step
        group["step"] = step = as_step(self.initial_step if step is None else step, device)
        return step

    # ---- state_dict ------------------------------------------------------------------------------
    def _take_group_step(self, index: int, group: dict[str, Any]) -> None:
        # One counter per group: apex's checkpoints hold it in the group; ours before it lived
        # there, and torch.optim's layout, hold one per param, which must agree (a host read, once).
        steps = [self.state[p].pop("step") for p in group["params"] if "step" in self.state.get(p, {})]
        if "step" not in group and steps:
            first = as_step(steps[0], torch.device("cpu"))
            different = [float(s) for s in steps if not torch.equal(as_step(s, first.device), first)]
            if different:
                raise RuntimeError(
                    f"{type(self).__name__} keeps one step count per param group (param_groups[i]['step'], as "
                    f"apex), but the loaded state has different step counts ({float(first)} and {different[0]}) "
                    f"within param group {index}; put parameters with different histories in different groups")
            group["step"] = first
        if "step" in group:
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            group["step"] = as_step(group["step"], device)  # ours, not an alias of the caller's

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by ``state_dict()`` (also the matching ``torch.optim`` optimizer's layout).

        A state stored in another format than this optimizer's param groups ask for (another
        ``state_precision``, block size, or torch's fp32) is converted to it (the groups keep
        their own ``state_precision``, ``state_block_size`` and ``min_quantized_numel``)
        (apex_amp/optimizers/state_conversion.py gives the error bound); masters saved as fp32
        copies become remainders under ``master_weights="remainder"`` and back (load the model's
        weights first: a remainder is the low half of the master whose high half is the weight).
        """
        # torch casts loaded state to each param's dtype; fp32 masters, the state of half params
        # with masters and any quantized state keep their stored dtype here, then are converted.
        saved_ids = list(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        stored = {index: {key: value for key, value in state_dict["state"].get(index, {}).items()
                          if key != "step" and isinstance(value, Tensor)}
                  for index in saved_ids}
        # The state is converted to this optimizer's formats: its groups' precision settings win
        # over the checkpoint's (torch's load takes every group key from the checkpoint).
        configured = [{key: group[key] for key in storage.PRECISION_KEYS} for group in self.param_groups]
        # The groups keep their state_rounding; the checkpoint's seed and counter (a resume) win.
        own_rounding = [{key: group.get(key) for key in (*rounding.ROUNDING_KEYS, rounding.COUNTER_KEY)}
                        for group in self.param_groups]
        super().load_state_dict(state_dict)
        self._batch_plans = {}
        for group, settings, own in zip(self.param_groups, configured, own_rounding):
            group.update(settings)
            rounding.adopt_loaded(group, own)
        for group in self.param_groups:  # a torch.optim state may lack some of our group keys
            for key in self._group_keys:
                group.setdefault(key, self.defaults[key])
        if self.COUNTS_STEPS:
            for index, group in enumerate(self.param_groups):
                self._take_group_step(index, group)
        owners = [(p, g) for g in self.param_groups for p in g["params"]]
        for index, (param, group) in zip(saved_ids, owners):
            if param in self.state:
                adopt_loaded_state(
                    self.state[param], param, group, stored.get(index, {}), keys=self._state_keys(group),
                    nonnegative=self.NONNEGATIVE_STATE_KEYS, keeps_master=self._keeps_master(param),
                    keeps_remainder=self._keeps_remainder(param))


def _refuse_fp16_remainders(group: dict[str, Any]) -> None:
    half = [tuple(p.shape) for p in group["params"] if p.dtype == torch.float16]
    if half:
        raise ValueError(
            f"master_weights='remainder' keeps the low 16 bits of an fp32 master beside a bf16 param "
            f"(its high half); fp16 is not the high half of fp32, so fp16 params (shapes {half}) "
            "cannot have remainder masters: cast the model to bf16, or use master_weights=True")


def as_step(value: Any, device: torch.device) -> Tensor:
    """``value`` (a number or a one-element tensor) as a step count: a new float32 scalar on ``device``."""
    if isinstance(value, Tensor) and value.numel() != 1 or not isinstance(value, (Tensor, int, float)):
        raise ValueError(f"a param group's 'step' must be a number or a one-element tensor, got {value!r}")
    return torch.as_tensor(value).to(device=device, dtype=torch.float32, copy=True).reshape(())
