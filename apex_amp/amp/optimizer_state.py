"""What amp keeps for one optimizer: its gradients' scaling state and its step hooks.

Skipping a step, the fused path and master weights are all driven from the
optimizer's own step pre/post hooks (``register_step_pre_hook``) rather than
from a replaced ``step`` or a generated subclass, because:

* the optimizer keeps its exact type and identity, so pickling, DDP and
  ``isinstance`` see nothing new;
* an LR scheduler created *before* ``initialize`` wraps ``optimizer.step`` on
  the instance and calls the class's original ``step`` directly, which would
  bypass a generated subclass; the hooks run inside that original ``step``
  whoever wraps it;
* ``step()`` is always called, so the scheduler never sees a "missing"
  optimizer step and never warns about the call order when a step is skipped.

How a step is skipped:

* an optimizer that understands amp's step keywords (class attribute
  ``_apex_amp_step_kwargs = True``, e.g. :class:`apex_amp.optimizers.FusedAdam`)
  receives ``found_inf`` (and ``inv_scale``/``model_params``) and turns the step
  into a no-op on the device: no host sync;
* any other optimizer needs the flag on the host: the pre-hook reads it (one
  sync per step, as with ``torch.amp.GradScaler``) and, on overflow, hides the
  gradients (``grad = None``) for the duration of the step. torch optimizers
  skip parameters without gradients entirely (weights, moments and step
  counts stay untouched); the post-hook puts the gradients back.

Gradient states between backward passes (see ``GradState``) make several
backward passes with different scales accumulate correctly: gradients that
already exist when a new ``scale_loss`` starts are stashed, the new backward
writes fresh tensors, and on exit the two are merged with ``axpby_``
(``stash += inv_scale * new``).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from . import _multi_tensor as mt
from .distributed import agree_on_overflow, check_masters_match_model
from .master_weights import MasterLink, attach_masters

if TYPE_CHECKING:
    from .loss_scaler import LossScaler
    from .state import AmpSession

__all__ = ["GradState", "OptimizerAmpState"]


class GradState(enum.Enum):
    EMPTY = "no amp gradients since the last step"
    UNSCALED = "gradients hold their true (unscaled) values"
    SCALED = "gradients still carry the loss scale; a fused step consumes them with inv_scale"
    DELAYED = "scaled gradients accumulating across delay_unscale=True passes"


class OptimizerAmpState:
    """Master links, gradient state and step flags of one optimizer (never stored on the optimizer)."""

    def __init__(self, optimizer: torch.optim.Optimizer, session: "AmpSession", links: list[MasterLink]) -> None:
        self.session = session
        self.fused = bool(getattr(type(optimizer), "_apex_amp_step_kwargs", False))
        self.links: list[MasterLink] = []
        self.model_param_of: dict[Tensor, Tensor] = {}  # master -> half model param, for fused steps
        self.direct_params: list[Tensor] = []  # params updated through their own .grad
        self.num_groups = 0
        self.grad_state = GradState.EMPTY
        self.pending_inv_scale: Optional[Tensor] = None  # scale carried by SCALED/DELAYED grads
        self.delayed_key: Optional[tuple[int, int]] = None  # (loss_id, scaler.updates) of DELAYED grads
        self.step_found_inf: Optional[Tensor] = None  # OR of the checked passes since the last step
        self.last_step_found_inf: Optional[Tensor] = None
        self._continuing_delayed = False
        self._stash: list[Optional[Tensor]] = []
        self._hidden_grads: list[tuple[Tensor, Tensor]] = []
        self._casts_disabled: Any = None
        self._masters_checked = False  # once, at the first step of a distributed run
        self._add_links(links)
        self._refresh_params(optimizer)
        self.handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    # ---- parameters -------------------------------------------------------
    def _add_links(self, links: list[MasterLink]) -> None:
        self.links.extend(links)
        for link in links:
            self.model_param_of[link.master] = link.model_param
        self.session.register_masters(links)

    def _refresh_params(self, optimizer: torch.optim.Optimizer) -> None:
        self.num_groups = len(optimizer.param_groups)
        self.direct_params = [
            p for group in optimizer.param_groups for p in group["params"] if p not in self.model_param_of
        ]

    def sync_param_groups(self, optimizer: torch.optim.Optimizer) -> None:
        """Take in groups added by ``add_param_group`` after initialize (masters under O2)."""
        if len(optimizer.param_groups) == self.num_groups:
            return
        if self.session.properties.master_weights:
            self._add_links(attach_masters(optimizer, first_group=self.num_groups))
        self._refresh_params(optimizer)

    def all_params(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    # ---- around a backward pass -----------------------------------------
    def prepare_backward(self, optimizer: torch.optim.Optimizer, scaler: "LossScaler", loss_id: int) -> None:
        self.sync_param_groups(optimizer)
        self._recover_from_interrupted_step()
        if self.grad_state is GradState.DELAYED and self.delayed_key == (loss_id, scaler.updates):
            # Same loss, same scale: keep accumulating scaled gradients in place.
            self._continuing_delayed = True
            return
        self._continuing_delayed = False
        if self.grad_state in (GradState.SCALED, GradState.DELAYED):
            self.unscale_pending()
        self._stash = [p.grad for p in self.direct_params]
        for p in self.direct_params:
            p.grad = None
        for link in self.links:
            link.model_param.grad = None  # O2 model grads are amp's: masters hold the accumulated values

    def check_local_accumulation(self, optimizer: torch.optim.Optimizer, scaler: "LossScaler", loss_id: int) -> None:
        """Refuse a DDP ``no_sync`` pass whose gradients could not stay scaled in place."""
        self.sync_param_groups(optimizer)
        self._recover_from_interrupted_step()
        if self.grad_state is GradState.DELAYED and self.delayed_key == (loss_id, scaler.updates):
            return
        # A SCALED state after a fused step holds no gradients: only real tensors count.
        existing = any(p.grad is not None for p in self.direct_params) or any(
            link.master.grad is not None or link.model_param.grad is not None for link in self.links
        )
        if existing:
            raise RuntimeError(
                "amp.scale_loss under DistributedDataParallel.no_sync() found gradients it cannot accumulate "
                "in place (zeroed rather than set to None, left by another loss_id, or from a pass with a "
                "different loss scale); merging them would leave rank-local values out of DDP's all-reduce. "
                "Call optimizer.zero_grad(set_to_none=True) before the first no_sync pass and use one loss_id "
                "per accumulated step"
            )

    def has_new_grads(self) -> bool:
        """Whether the backward since ``prepare_backward`` reached a parameter of this optimizer."""
        if self._continuing_delayed:
            return True  # accumulated in place: new and old gradients are indistinguishable
        return self._holds_model_or_direct_grads()

    def _holds_model_or_direct_grads(self) -> bool:
        # The gradients _absorb reads: direct params' and half model params' (not the masters').
        return any(p.grad is not None for p in self.direct_params) or any(
            link.model_param.grad is not None for link in self.links
        )

    def abort_backward(self) -> None:
        """The user's block raised: drop the partial new gradients, put the stashed ones back."""
        if not self._continuing_delayed:
            for p, old in zip(self.direct_params, self._stash):
                p.grad = old
            for link in self.links:
                link.model_param.grad = None
        self._stash = []

    def finish_backward(
        self, scaler: "LossScaler", loss_id: int, inv_scale: Tensor, found_inf: Tensor, delay_unscale: bool
    ) -> bool:
        """Check/unscale the new gradients. Returns whether ``found_inf`` now covers them."""
        stash = [None] * len(self.direct_params) if self._continuing_delayed else self._stash
        self._stash = []
        has_old = any(s is not None for s in stash) or any(link.master.grad is not None for link in self.links)
        unit_scale = scaler.static_value == 1.0
        if delay_unscale and not has_old:
            self.grad_state = GradState.DELAYED
            self.delayed_key = (loss_id, scaler.updates)
            self.pending_inv_scale = inv_scale
            return False
        if self.fused and not has_old:
            # Leave the gradients scaled: the fused step unscales them in its single pass.
            if scaler.check_finite:
                mt.check_finite(self._new_grads(), found_inf)
            self.grad_state = GradState.SCALED
            self.pending_inv_scale = None if unit_scale else inv_scale
            return scaler.check_finite
        self._absorb(stash, inv_scale, found_inf, unit_scale, scaler.check_finite)
        self.grad_state = GradState.UNSCALED
        self.pending_inv_scale = None
        return scaler.check_finite

    def note_found_inf(self, found_inf: Tensor) -> None:
        if self.step_found_inf is None:
            self.step_found_inf = found_inf.clone()  # private: found_inf is shared by the loss's optimizers
        else:
            torch.maximum(self.step_found_inf, found_inf.to(self.step_found_inf.device), out=self.step_found_inf)

    def _new_grads(self) -> list[Tensor]:
        grads = [p.grad for p in self.direct_params if p.grad is not None]
        grads += [link.model_param.grad for link in self.links if link.model_param.grad is not None]
        return grads

    def _absorb(
        self, stash: list, inv_scale: Tensor, found_inf: Tensor, unit_scale: bool, check: bool
    ) -> None:
        # Direct params: unscale fresh grads in place, or fold them into the stashed ones.
        fresh, new, old_acc = [], [], []
        for p, old in zip(self.direct_params, stash):
            grad = p.grad
            if grad is None:
                p.grad = old
            elif old is None:
                fresh.append(grad)
            else:
                new.append(grad)
                old_acc.append(old)
                p.grad = old
        if fresh:
            if not unit_scale:
                mt.unscale_(fresh, found_inf, inv_scale)
            elif check:
                mt.check_finite(fresh, found_inf)  # read-only: half the traffic of an unscale by 1
        if new:
            self._accumulate(new, old_acc, inv_scale, found_inf, check)
        # Masters: half model grads -> fp32 master grads (written, or accumulated).
        src, dst, new, old_acc = [], [], [], []
        for link in self.links:
            grad = link.model_param.grad
            if grad is None:
                continue
            if link.master.grad is None:
                link.master.grad = torch.empty_like(link.master)
                src.append(grad)
                dst.append(link.master.grad)
            else:
                new.append(grad)
                old_acc.append(link.master.grad)
            link.model_param.grad = None
        if src:
            mt.scale_(src, dst, inv_scale, found_inf)
        if new:
            self._accumulate(new, old_acc, inv_scale, found_inf, check)

    def _accumulate(self, new: list, old_acc: list, inv_scale: Tensor, found_inf: Tensor, check: bool) -> None:
        # old_acc += inv_scale * new. found_inf belongs to this pass's loss (it backs off that loss's
        # scale and skips all of its optimizers), so only the new gradients may set it: stashed ones
        # were flagged by their own pass, and axpby_'s flag also covers the sum. The sum's flag
        # still skips this optimizer's step.
        if not check:
            mt.axpby_(new, old_acc, inv_scale, 1.0, found_inf)
            return
        mt.check_finite(new, found_inf)
        sum_found_inf = torch.zeros(1, device=found_inf.device)
        mt.axpby_(new, old_acc, inv_scale, 1.0, sum_found_inf)
        self.note_found_inf(sum_found_inf)

    def unscale_pending(self) -> None:
        # SCALED/DELAYED gradients -> UNSCALED, before another backward adds to them.
        if self.grad_state is GradState.SCALED and not self._holds_model_or_direct_grads():
            # The usual case after a fused step and zero_grad(set_to_none=True): nothing to unscale,
            # and a SCALED pass was already checked, so no flag is needed (saves two flag tensors
            # and a pass over the params, ~10 us a step).
            self.grad_state = GradState.UNSCALED
            self.pending_inv_scale = None
            self.delayed_key = None
            return
        scratch = torch.zeros(1, device=self.session.device)
        inv_scale = self.pending_inv_scale
        unit_scale = inv_scale is None
        if unit_scale:
            inv_scale = torch.ones(1, device=self.session.device)
        self._absorb([None] * len(self.direct_params), inv_scale, scratch, unit_scale, check=True)
        if self.grad_state is GradState.DELAYED:
            # These passes were never checked: their loss's scaler sees them now.
            loss_id = self.delayed_key[0]
            agree_on_overflow(scratch, self.session.overflow_group)
            self.session.scalers[loss_id].update(scratch)
            self.note_found_inf(scratch)
        self.grad_state = GradState.UNSCALED
        self.pending_inv_scale = None
        self.delayed_key = None

    # ---- around optimizer.step() ------------------------------------------
    def _recover_from_interrupted_step(self) -> None:
        # optimizer.step() raised between our hooks: undo what the pre-hook did.
        if self._casts_disabled is not None:
            self._casts_disabled.__exit__(None, None, None)
            self._casts_disabled = None
        for p, grad in self._hidden_grads:
            p.grad = grad
        self._hidden_grads = []

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Optional[tuple]:
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is not None:
            raise RuntimeError(
                "apex_amp does not support optimizer.step(closure) for an optimizer passed to amp.initialize: "
                "the closure's backward would run outside amp.scale_loss. Compute the loss and call "
                "backward inside `with amp.scale_loss(loss, optimizer) as scaled_loss:`, then optimizer.step()"
            )
        if self.grad_state is GradState.DELAYED:
            raise RuntimeError(
                "optimizer.step() was called while the gradients are still scaled by "
                "amp.scale_loss(..., delay_unscale=True); the last backward pass before a step must use "
                "delay_unscale=False so that the accumulated gradients are checked and unscaled"
            )
        self._recover_from_interrupted_step()
        self.sync_param_groups(optimizer)
        if not self._masters_checked:
            self._masters_checked = True
            check_masters_match_model(self.links)  # DDP may have broadcast other weights into the model
        self.session.flush_logs()
        if self.session.properties.patch_torch_functions:
            from . import casting

            self._casts_disabled = casting.disable_casts()
            self._casts_disabled.__enter__()
        found_inf = self.step_found_inf
        if self.fused:
            step_kwargs = dict(kwargs)
            if found_inf is not None:
                step_kwargs["found_inf"] = found_inf
            if self.grad_state is GradState.SCALED and self.pending_inv_scale is not None:
                step_kwargs["inv_scale"] = self.pending_inv_scale
            if self.model_param_of:
                step_kwargs["model_params"] = self.model_param_of
            return args, step_kwargs
        if found_inf is not None and bool(found_inf.item()):  # the one host sync of non-fused optimizers
            for p in self.all_params(optimizer):
                if p.grad is not None:
                    self._hidden_grads.append((p, p.grad))
                    p.grad = None
        return None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        skipped = bool(self._hidden_grads)
        for p, grad in self._hidden_grads:
            p.grad = grad
        self._hidden_grads = []
        if self.links:
            if self.fused:
                if self.grad_state is GradState.SCALED:
                    for link in self.links:
                        link.model_param.grad = None  # consumed by the fused step
            elif not skipped:
                # Non-fused optimizers update only the masters: refresh the half model copy.
                models = [link.model_param.data for link in self.links]
                masters = [link.master.data for link in self.links]
                mt.scale_(masters, models, self.session.one, torch.zeros(1, device=self.session.device))
        self.last_step_found_inf = self.step_found_inf
        self.step_found_inf = None
        if self.grad_state is GradState.UNSCALED:
            self.grad_state = GradState.EMPTY
        if self._casts_disabled is not None:
            self._casts_disabled.__exit__(None, None, None)
            self._casts_disabled = None
        if self.session.properties.patch_torch_functions:
            from . import casting

            casting.clear_cache()

    def step_was_skipped(self) -> bool:
        flag = self.last_step_found_inf
        return flag is not None and bool(flag.item())
