"""FusedLAMB and FusedMixedPrecisionLamb: apex's LAMB, one ``fused_lamb_`` op call per param group and device.

The ops are defined in apex_amp/optimizers/_lamb_ops.py. The global gradient norm of the clip is
one ``l2norm`` op call over every gradient of the step, on the device. Under FSDP2 each rank
holds shards: the step runs LAMB's two passes as two op calls (``fused_lamb_moments_``,
``fused_lamb_update_``) and sums the per-tensor squared norms over the ranks between them, so the
trust ratios and the clip are those of the whole tensors.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch
from torch import Tensor

from .. import ops
from .._dtensor import any_dtensor, reduce_over_shards
from . import _lamb_ops  # noqa: F401  defines the ops
from .fused_optimizer import AmpStepArgs, FusedBatch, FusedOptimizer, as_step

__all__ = ["FusedLAMB", "FusedMixedPrecisionLamb"]


class FusedLAMB(FusedOptimizer):
    """LAMB whose update is two fused passes over all tensors of a param group (apex's FusedLAMB).

    Adam's moments with a trust ratio per tensor (||param|| / ||update||), after clipping the
    gradients by their global norm (``max_grad_norm``), all on the device: no host sync in a
    step. State per parameter: ``exp_avg``, ``exp_avg_sq`` and the group's shared ``step``.
    Under ``amp.initialize`` (O2: fp32 masters, the half model copy written in the same pass)
    and ``torch.amp.GradScaler`` the gradients are unscaled as they are read (the clip sees
    the unscaled norm) and an overflowed step is skipped on the device.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        bias_correction: apply Adam's bias correction.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: weight decay factor.
        amsgrad: not supported (raises, as apex's FusedLAMB).
        adam_w_mode: decoupled weight decay (added to the update) instead of L2 (added to the gradient).
        grad_averaging: scale the gradient by (1 - beta1) in the first moment.
        set_grad_none: ``zero_grad()`` sets gradients to None (else zeroes them).
        max_grad_norm: clip the gradients to this global L2 norm (inf: no clipping).
        use_nvlamb: apply the trust ratio also to parameters without weight decay (NVLAMB).
        master_weights: keep fp32 master copies of fp16/bf16 parameters in the
            optimizer state (without amp); the half parameters are rewritten in
            the same pass. ``"remainder"``: for bf16 parameters, keep only the low
            16 bits of each fp32 master (``master_remainder``, int16): the bf16
            parameter is its high half, so the master is exact in 2 bytes instead of 4.
        master_dtypes: which param dtypes get fp32 masters under ``master_weights=True``.
        state_precision: how the per-element state is stored: ``"fp32"`` (default), ``"bf16"``,
            ``"fp8"`` or ``"int8"`` (docs/low_precision_state.md); also a param-group key.
        state_block_size: the largest block of fp8/int8 state sharing one fp32 absmax (a power
            of two in [32, 4096], default 256); also a param-group key.
        min_quantized_numel: parameters with fewer elements (of the global, unsharded shape)
            keep fp32 state (default 4096); also a param-group key.
        state_rounding: how bf16 state is stored: ``"nearest"`` (to nearest even, default) or
            ``"stochastic"`` (unbiased random rounding, seeded: docs/low_precision_state.md); needs
            ``state_precision="bf16"``; also a param-group key.
        state_rounding_seed: the seed of ``"stochastic"``: an int, a ``torch.Generator`` (drawn
            from once) or None (drawn from torch's default generator); also a param-group key.

    Example::

        >>> optimizer = FusedLAMB(model.parameters(), lr=1e-3, weight_decay=0.01)
    """

    STATE_KEYS = ("exp_avg", "exp_avg_sq")
    NONNEGATIVE_STATE_KEYS = frozenset({"exp_avg_sq"})
    COUNTS_STEPS = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: Union[float, Tensor] = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        *,
        master_weights: Union[bool, str] = False,
        master_dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16),
        state_precision: str = "fp32",
        state_block_size: int = 256,
        min_quantized_numel: int = 4096,
        state_rounding: str = "nearest",
        state_rounding_seed: Union[int, torch.Generator, None] = None,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        if float(lr) < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {float(lr)}, {eps}, {weight_decay}")
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Invalid betas: {betas}; both must be in [0, 1)")
        if not max_grad_norm > 0.0:
            raise ValueError(f"max_grad_norm must be > 0 (float('inf') turns clipping off), got {max_grad_norm}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none=set_grad_none, master_weights=master_weights,
                         master_dtypes=master_dtypes, state_precision=state_precision,
                         state_block_size=state_block_size, min_quantized_numel=min_quantized_numel,
                         state_rounding=state_rounding, state_rounding_seed=state_rounding_seed)
        self.adam_w_mode = bool(adam_w_mode)
        self.use_nvlamb = bool(use_nvlamb)
        self._grad_norms: dict[torch.device, Tensor] = {}

    def _before_groups(self, batches: list[tuple[dict[str, Any], FusedBatch]], amp: AmpStepArgs) -> None:
        # apex clips by the norm of every gradient of the step, all groups together.
        per_device: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
        for _, batch in batches:
            grads, owners = per_device.setdefault(batch.device, ([], []))
            grads.extend(batch.grads)
            owners.extend(batch.owners)
        norms = {device: _global_grad_norm(grads, owners) for device, (grads, owners) in per_device.items()}
        if len(norms) > 1:  # several devices: one global norm, on each of them
            first = next(iter(norms.values()))
            total = torch.stack([n.to(first.device) for n in norms.values()]).norm()
            norms = {device: total.to(device) for device in norms}
        self._grad_norms = norms

    def _fused_step(self, group: dict[str, Any], batch: FusedBatch, amp: AmpStepArgs) -> None:
        device = batch.device
        beta1, beta2 = group["betas"]
        lists = (batch.params, batch.grads, batch.states["exp_avg"], batch.states["exp_avg_sq"], batch.model_params)
        grad_norm = self._grad_norms[device].reshape(1)
        inv_scale = None if amp.inv_scale is None else amp.inv_scale.to(device)
        found_inf = None if amp.found_inf is None else amp.found_inf.to(device)
        moments = (beta1, beta2, float(group["eps"]), float(group["weight_decay"]), bool(group["bias_correction"]),
                   bool(group["grad_averaging"]), self.adam_w_mode, float(group["max_grad_norm"]))
        operands = {"master_remainders": batch.master_remainders, "state_absmaxes": batch.state_absmaxes()}
        if not any_dtensor(batch.owners):
            ops.fused_lamb_(*lists, batch.step, grad_norm, float(group["lr"]), *moments, self.use_nvlamb, inv_scale,
                            found_inf, state_rounding=batch.state_rounding(), **operands)
            return
        # FSDP2's shards: the passes apart, the squared norms of the shards summed into the tensors'.
        norm_squares = ops.fused_lamb_moments_(*lists, batch.step, grad_norm, *moments, inv_scale, found_inf,
                                               **operands)
        reduce_over_shards(norm_squares, batch.owners)
        ops.fused_lamb_update_(*lists, batch.step, grad_norm, norm_squares, float(group["lr"]), *moments,
                               self.use_nvlamb, inv_scale, found_inf, state_rounding=batch.state_rounding(),
                               **operands)


def _global_grad_norm(grads: list[Tensor], owners: list[Tensor]) -> Tensor:
    """The L2 norm of all of ``grads`` (``owners``: their params), of the whole tensors under FSDP2."""
    if not any_dtensor(owners):
        return ops.l2norm(grads)[0]
    squares = ops.l2norm(grads, per_tensor=True)[1].square()
    return reduce_over_shards(squares, owners).sum().sqrt()


class FusedMixedPrecisionLamb(FusedLAMB):
    """apex's FusedMixedPrecisionLamb: FusedLAMB for parameters in a reduced precision, with fp32 state.

    Parameters of ``reduced_precision_dtype`` (fp16 or bf16) get fp32 master copies in the
    optimizer state (``master_param``, saved and loaded with it), which the step updates in
    their place, rewriting the reduced-precision parameter in the same pass; their moments are
    fp32. ``lr`` may be a tensor, as in apex (a CUDA tensor is read once per step: a host sync);
    ``step`` sets the step count the groups start from. Driven by ``torch.amp.GradScaler``
    (``scaler.step(optimizer)``, or apex's ``optimizer.step(grad_scaler=scaler)``) it unscales
    the gradients as it reads them and skips an overflowed step on the device.

    Args:
        params: parameters or param groups.
        lr: learning rate (a number or a one-element tensor).
        step: the initial step count.
        bias_correction: as :class:`FusedLAMB` (so are ``betas``, ``eps``, ``weight_decay``,
            ``amsgrad``, ``adam_w_mode``, ``grad_averaging``, ``max_grad_norm`` and ``use_nvlamb``).
        reduced_precision_dtype: the dtype of the parameters that get fp32 masters (None: none).
        state_precision: how the per-element state is stored: ``"fp32"`` (default), ``"bf16"``,
            ``"fp8"`` or ``"int8"`` (docs/low_precision_state.md); also a param-group key.
        state_block_size: the largest block of fp8/int8 state sharing one fp32 absmax (a power
            of two in [32, 4096], default 256); also a param-group key.
        min_quantized_numel: parameters with fewer elements (of the global, unsharded shape)
            keep fp32 state (default 4096); also a param-group key.
        state_rounding: how bf16 state is stored: ``"nearest"`` (to nearest even, default) or
            ``"stochastic"`` (unbiased random rounding, seeded: docs/low_precision_state.md); needs
            ``state_precision="bf16"``; also a param-group key.
        state_rounding_seed: the seed of ``"stochastic"``: an int, a ``torch.Generator`` (drawn
            from once) or None (drawn from torch's default generator); also a param-group key.

    Example::

        >>> model = model.to(torch.bfloat16)
        >>> optimizer = FusedMixedPrecisionLamb(model.parameters(), lr=1e-3,
        ...                                     reduced_precision_dtype=torch.bfloat16)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: Union[float, Tensor] = 1e-3,
        step: int = 0,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        reduced_precision_dtype: Optional[torch.dtype] = None,
        state_precision: str = "fp32",
        state_block_size: int = 256,
        min_quantized_numel: int = 4096,
        state_rounding: str = "nearest",
        state_rounding_seed: Union[int, torch.Generator, None] = None,
    ) -> None:
        _check_reduced_precision_dtype(reduced_precision_dtype)
        self.initial_step = float(step)  # read by add_param_group, which the constructor calls
        super().__init__(
            params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
            amsgrad=amsgrad, adam_w_mode=adam_w_mode, grad_averaging=grad_averaging, set_grad_none=True,
            max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb, master_weights=True, state_precision=state_precision,
                         state_block_size=state_block_size, min_quantized_numel=min_quantized_numel,
                         state_rounding=state_rounding, state_rounding_seed=state_rounding_seed)
        # Read by every step, as apex's did: code that sets it after construction gets its masters.
        self.reduced_precision_dtype = reduced_precision_dtype

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's; the group's step count exists from the start, on its params' device (as apex's)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if "step" not in group:
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            group["step"] = as_step(self.initial_step, device)

    def _plan_settings(self) -> tuple[Any, ...]:
        _check_reduced_precision_dtype(self.reduced_precision_dtype)
        return (self.reduced_precision_dtype,)

    def _keeps_master(self, param: Tensor) -> bool:
        return self.reduced_precision_dtype is not None and param.dtype == self.reduced_precision_dtype


def _check_reduced_precision_dtype(dtype: Optional[torch.dtype]) -> None:
    if dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"reduced_precision_dtype must be torch.float16, torch.bfloat16 or None, got {dtype}")
