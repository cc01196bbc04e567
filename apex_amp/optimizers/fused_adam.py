"""FusedAdam: Adam/AdamW with one ``fused_adam_`` op call per param group and device."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch import Tensor

from .. import ops
from .._dtensor import local_tensor
from .._dtypes import HALF_DTYPES

__all__ = ["FusedAdam"]

_FP32_STATE_KEYS = ("master_param", "exp_avg", "exp_avg_sq")
_GROUP_KEYS = ("lr", "bias_correction", "betas", "eps", "weight_decay")
# The lists of one fused_adam_ call ("owners": the params whose state holds the step).
_CALL_LISTS = ("owners", "params", "grads", "exp_avgs", "exp_avg_sqs", "model_params")


# fp32 params without a model copy join the call of those with one (typically the fp32
# BatchNorm params next to O2's half model params), each passed as its own model copy:
# fused_adam_ allows model_params[i] to be params[i] and writes the same value twice, to
# cache lines it has just written, which costs less than the fixed overhead of a second
# call and a copy of the step (benchmarks/README.md has the measurement).
def _merge_fp32_into_copy_calls(calls: dict[tuple[torch.device, bool], dict[str, list]]) -> None:
    for device in {device for device, _ in calls}:
        with_copy, without = calls.get((device, True)), calls.get((device, False))
        if with_copy is None or without is None:
            continue
        if any(t.dtype != torch.float32 for t in without["params"]):
            continue  # a half param without a master cannot have a model copy: two calls
        for name in _CALL_LISTS[:-1]:
            with_copy[name] += without[name]
        with_copy["model_params"] += without["params"]
        del calls[(device, False)]


def _lay_out_like(state: dict[str, Any], param: Tensor) -> None:
    # fused_adam_ walks a param and its state in memory order, so they must share strides; a
    # checkpoint saved from a contiguous model may be loaded into a channels_last one (once, at load).
    for key in _FP32_STATE_KEYS:
        value = state.get(key)
        if isinstance(value, Tensor) and value.shape == param.shape and value.stride() != param.stride():
            state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


class FusedAdam(torch.optim.Optimizer):
    """Adam and AdamW whose whole update is one fused pass over all tensors of a param group.

    apex's signature; a real ``torch.optim.Optimizer`` (``state_dict``, LR
    schedulers and hooks work as usual). Per parameter the state holds
    ``exp_avg``, ``exp_avg_sq`` and ``step`` as in ``torch.optim.Adam``; the
    ``step`` tensor is shared by the parameters of a group (as apex's group
    step), lives on the parameters' device and is incremented by the op itself,
    so a skipped step never needs the host.

    Under ``amp.initialize`` the step also receives amp's keywords: the
    ``found_inf`` flag (a non-zero flag makes the step a no-op on the device),
    the ``inv_scale`` of gradients left scaled (unscaling folded into the same
    pass) and, under O2, the half model parameters of the fp32 masters, which
    supply the gradients and are rewritten in the same pass.

    Parameters sharded by FSDP2 (``fully_shard``: DTensors) are updated shard
    by shard: each rank's call covers its own shards, with no communication,
    and ``exp_avg``/``exp_avg_sq`` are DTensors sharded like their parameter
    (so ``torch.distributed.checkpoint`` saves and reshards them).

    Args:
        params: parameters or param groups.
        lr: learning rate.
        bias_correction: apply Adam's bias correction.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        adam_w_mode: True for decoupled weight decay (AdamW), False for L2 (Adam).
        weight_decay: weight decay factor.
        amsgrad: not supported (raises, as apex's FusedAdam).
        set_grad_none: ``zero_grad()`` sets gradients to None (else zeroes them).
        capturable: accepted for apex compatibility; the step count always lives
            on the device, which is what apex's capturable mode provides.
        master_weights: keep fp32 master copies of fp16/bf16 parameters in the
            optimizer state (without amp); the half parameters are rewritten in
            the same pass.

    Example::

        >>> optimizer = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> loss_fn(model(x), y).backward()
        >>> optimizer.step()
        >>> optimizer.zero_grad()
    """

    # Tells amp that step() takes found_inf / inv_scale / model_params (no host sync to skip).
    _apex_amp_step_kwargs = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}; it must be >= 0")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}; it must be >= 0")
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Invalid betas: {betas}; both must be in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}; it must be >= 0")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = bool(set_grad_none)
        self.capturable = bool(capturable)
        self.master_weights = bool(master_weights)
        # amp keeps gradients it left scaled for this optimizer's fused step off the params, where
        # zero_grad cannot reach them: it follows these two to clear them as zero_grad would have.
        self.zero_grad_calls = 0
        self.last_zero_grad_set_to_none = True

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Clear gradients: to None when ``set_to_none`` (default: the ``set_grad_none`` flag), else to 0."""
        set_to_none = self.set_grad_none if set_to_none is None else bool(set_to_none)
        super().zero_grad(set_to_none=set_to_none)
        self.zero_grad_calls += 1
        self.last_zero_grad_set_to_none = set_to_none

    def _shared_step(self, params: list[Tensor], device: torch.device) -> Tensor:
        # One step tensor per group and device, referenced by every param's state.
        step = None
        for p in params:
            candidate = self.state.get(p, {}).get("step")
            if isinstance(candidate, Tensor):
                step = candidate
                break
        if step is None:
            return torch.zeros((), dtype=torch.float32, device=device)
        if step.device != device or step.dtype != torch.float32:
            step = step.to(device=device, dtype=torch.float32)
        for p in params:
            own = self.state.get(p, {}).get("step")
            if own is None or own is step:
                continue
            # Loaded state holds one tensor per param: link them (a host read, once after a load).
            if not torch.equal(torch.as_tensor(own, dtype=torch.float32).to(device).reshape(()), step.reshape(())):
                raise RuntimeError(
                    "FusedAdam keeps one step count per param group, but the loaded state has different "
                    f"step counts ({float(own)} and {float(step)}) within one group; put parameters with "
                    "different histories in different param groups"
                )
            self.state[p]["step"] = step
        return step

    @torch.no_grad()
    def step(
        self,
        closure: Optional[Callable[[], Any]] = None,
        *,
        found_inf: Optional[Tensor] = None,
        inv_scale: Optional[Tensor] = None,
        model_params: Optional[Mapping[Tensor, Tensor]] = None,
    ) -> Any:
        """One Adam/AdamW step.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            found_inf: one-element float32 flag; when non-zero nothing changes (decided on the device).
            inv_scale: one-element float32 factor applied to every gradient (fused unscale).
            model_params: ``{master: half model param}``; a master without ``.grad``
                takes the model param's gradient, and the model param is rewritten
                from the updated master in the same pass.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # (device, writes a model copy) -> lists for one op call
            calls: dict[tuple[torch.device, bool], dict[str, list]] = {}
            for p in group["params"]:
                model_param = model_params.get(p) if model_params else None
                grad = p.grad
                if grad is None and model_param is not None:
                    grad = model_param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients; use torch.optim.SparseAdam")
                state = self.state[p]
                target = p
                if model_param is None and self.master_weights and p.dtype in HALF_DTYPES:
                    if "master_param" not in state:
                        state["master_param"] = p.detach().to(torch.float32)
                    target, model_param = state["master_param"], p
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(target, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(target, memory_format=torch.preserve_format)
                key = (p.device, model_param is not None)
                lists = calls.get(key)
                if lists is None:  # not setdefault: that would build a fresh dict for every param
                    lists = calls[key] = {name: [] for name in _CALL_LISTS}
                lists["owners"].append(p)
                # FSDP2's DTensors (the param, its gradient and the moments made like it, all
                # sharded alike): the op updates this rank's shards, with no gather.
                lists["params"].append(local_tensor(target))
                lists["grads"].append(local_tensor(grad))
                lists["exp_avgs"].append(local_tensor(state["exp_avg"]))
                lists["exp_avg_sqs"].append(local_tensor(state["exp_avg_sq"]))
                if model_param is not None:
                    lists["model_params"].append(local_tensor(model_param))
            _merge_fp32_into_copy_calls(calls)
            beta1, beta2 = group["betas"]
            # The op increments the step it is given. With two calls on one
            # device (params with and without a model copy, not merged), the
            # shared step goes to the first and a copy of its old value to the second.
            shared_steps: dict[torch.device, Tensor] = {}
            steps_before: dict[torch.device, Tensor] = {}
            for (device, _), lists in calls.items():
                if device not in shared_steps:
                    on_device = [p for p in group["params"] if p.device == device]
                    step = shared_steps[device] = self._shared_step(on_device, device)
                    if sum(1 for call_device, _ in calls if call_device == device) > 1:
                        steps_before[device] = step.clone()
                else:
                    step = steps_before[device].clone()
                for p in lists["owners"]:
                    self.state[p]["step"] = shared_steps[device]
                ops.fused_adam_(
                    lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"], step,
                    lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw_mode=self.adam_w_mode,
                    bias_correction=group["bias_correction"], model_params=lists["model_params"],
                    inv_scale=None if inv_scale is None else inv_scale.to(device),
                    found_inf=None if found_inf is None else found_inf.to(device),
                )
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by ``state_dict()`` (FusedAdam's or ``torch.optim.Adam``'s layout)."""
        # torch casts loaded state to each param's dtype; the fp32 masters and
        # moments of half params under master_weights=True must stay fp32.
        saved_ids = list(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        keep_fp32 = {
            index: {key: value for key, value in state_dict["state"].get(index, {}).items()
                    if key in _FP32_STATE_KEYS and isinstance(value, Tensor) and value.dtype == torch.float32}
            for index in saved_ids
            if "master_param" in state_dict["state"].get(index, {})
        }
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # a torch.optim.Adam state has no bias_correction
            for key in _GROUP_KEYS:
                group.setdefault(key, self.defaults[key])
        for state in self.state.values():
            # torch keeps the loaded step tensors as they are; the op increments
            # ours in place, so own them rather than alias the caller's dict.
            if isinstance(state.get("step"), Tensor):
                state["step"] = state["step"].clone()
        params = list(itertools.chain.from_iterable(g["params"] for g in self.param_groups))
        for index, param in zip(saved_ids, params):
            for key, value in keep_fp32.get(index, {}).items():
                self.state[param][key] = value.to(param.device)
            if param in self.state:
                _lay_out_like(self.state[param], param)
