"""The gradient lifecycle of one optimizer: one state machine, every transition in this file.

How amp handles gradients
-------------------------
``amp.scale_loss`` multiplies the loss by the loss scale, so the backward pass
writes *scaled* gradients. Under O2 the model is half and its optimizer holds
fp32 *masters* instead of the model's parameters (``master_weights.py``);
parameters without a master (fp32 batchnorm under O2, every parameter at
O0/O1/O3) are *direct*: the optimizer reads their own ``.grad``.

The model's gradients are the source of truth. When a ``scale_loss`` block
exits, the gradients its backward pass wrote are checked for inf/NaN and
either

* **unscaled** into fp32: into the masters' ``.grad`` (O2) or in place
  (direct), added to what an earlier pass since the last step left there, so
  several passes with different losses and scales add up; or
* **kept scaled** for an optimizer that unscales as it reads (FusedAdam takes
  ``inv_scale``): a half model gradient is then moved off the model into this
  object, so that nothing the user does to the model (``model.zero_grad()``,
  another loss's backward through the same layers) changes it before the step.

A step, taken or skipped, **consumes** the gradients of the passes since the
previous step: afterwards no master holds a gradient. The masters are not
model parameters, so ``model.zero_grad()`` never reaches them; because the
step consumes them, clearing gradients where training loops do (before the
forward pass or after the step) through the model, through the optimizer, by
``p.grad = None``, or not clearing the masters at all gives the same next
step. Direct parameters keep their ``.grad`` after a step, as in PyTorch,
skipped or not; after a step that may have been skipped, the first event (a
pass, or a step with no pass in between) checks what it left again
(``_carry_leftovers``), so no step applies a gradient amp saw non-finite
until a clear or new gradients replace it.

Between a ``scale_loss`` exit and the step, amp has taken that pass's
gradients in (into the masters' ``.grad``, or held for the fused step), so
clearing the model's gradients there does not discard them, as in apex;
``optimizer.zero_grad()`` does, as in PyTorch. The gradients of a
``delay_unscale=True`` pass are not taken in until a pass without it: they
stay on the model, scaled, and a clear through the model or the optimizer
discards them. What amp keeps where ``optimizer.zero_grad()`` cannot reach
(held for a fused step, or a delayed accumulation on the half model under
O2) follows its clears (``grad_clears.py``), ending where PyTorch's
gradients would after the same clears.

The overflow flag of a pass covers everything the next step will consume:
the new gradients, and the sums they were added to unless an earlier pass
since the last step already reported those. So a step is skipped when a pass
since the previous step reported an overflow, and that pass's scaler backed
off and logged it, or when the gradients a skipped step left are still not
finite (``step_found_inf`` is the OR of those flags). A DELAYED accumulation
is checked when it is taken in, under one flag for every optimizer it covers
(``AmpSession.take_in_accumulation``): one record, one scale update. A
pass with ``delay_overflow_check=True`` leaves its skip and its scale update
to the client (apex's ``update_scale()``, once per step): its gradients are
unscaled onto the masters (never held), and its flag only keeps a step from
applying them; it ends when the client has set them all to None instead of
stepping (``_end_cleared_guard``).

States (``GradState``) and transitions (``_TRANSITIONS``; ``_move`` is the
only writer of ``state``)::

    EMPTY ──begin_pass──> IN_PASS ──end_pass──> UNSCALED | SCALED | DELAYED
      │                     └──abort_pass──> (the state before begin_pass)
      └──before_step──> IN_STEP ──after_step──> EMPTY | SPENT
    UNSCALED ──begin_pass──> IN_PASS          UNSCALED ──before_step──> IN_STEP
    SCALED ──settle──> UNSCALED               SCALED ──before_step──> IN_STEP
    DELAYED ──begin_pass (same loss and scale)──> IN_PASS
    DELAYED ──settle──> UNSCALED              (a step from DELAYED is an error)
    SPENT ──settle──> EMPTY
    IN_STEP ──(the step raised; next event)──> the state before before_step

``begin_pass`` and ``before_step`` settle SCALED, SPENT and a DELAYED
accumulation of another loss or scale first.
"""

from __future__ import annotations

import enum
import weakref
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .._torch_compat import hash_enum_by_identity
from ..optimizers.fused_optimizer import AmpStepArgs, FusedOptimizer
from . import _multi_tensor as mt
from .grad_clears import Cleared, ClearWatch
from .master_weights import Fp32ValueOf, MasterLink, OptimizerParams, follow_model_layouts, reconcile_masters

__all__ = ["GradState", "PassScale", "PassRecord", "GradLifecycle"]


@hash_enum_by_identity  # every transition and state test looks states up
class GradState(enum.Enum):
    EMPTY = "no amp gradients since the last step"
    IN_PASS = "a scale_loss block is open: its backward pass writes new scaled gradients"
    UNSCALED = "the gradients since the last step hold their true values"
    SCALED = "one checked pass, still scaled, kept for a step that unscales as it reads (FusedAdam)"
    DELAYED = "unchecked scaled sums of delay_unscale=True passes of one loss at one scale"
    IN_STEP = "optimizer.step() is running between amp's step hooks"
    SPENT = "a step consumed SCALED gradients; direct parameters' .grad still carry the scale"


_S = GradState
_IN_PLACE_STATES = frozenset({_S.EMPTY, _S.UNSCALED})  # no gradients kept scaled
_TRANSITIONS: dict[GradState, frozenset[GradState]] = {
    _S.EMPTY: frozenset({_S.IN_PASS, _S.IN_STEP}),
    _S.IN_PASS: frozenset({_S.UNSCALED, _S.SCALED, _S.DELAYED, _S.EMPTY}),  # EMPTY/UNSCALED/DELAYED: aborted
    _S.UNSCALED: frozenset({_S.IN_PASS, _S.IN_STEP}),
    _S.SCALED: frozenset({_S.UNSCALED, _S.IN_STEP}),
    _S.DELAYED: frozenset({_S.IN_PASS, _S.UNSCALED}),
    _S.IN_STEP: frozenset({_S.EMPTY, _S.SPENT, _S.UNSCALED, _S.SCALED}),  # UNSCALED/SCALED: the step raised
    _S.SPENT: frozenset({_S.EMPTY}),
}


# The records of a pass or a step are made on every pass and step: named tuples, which cost a
# fraction of a dataclass to build.
class PassScale(NamedTuple):
    """The scale the gradients of one backward pass carry."""

    loss_id: int
    epoch: int  # the loss scaler's scale epoch: passes of one loss in one epoch carry the same scale
    inv_scale: Tensor  # one-element float32 device tensor
    unit: bool  # the static scale 1.0: nothing to multiply
    checked: bool  # check for inf/NaN (and skip the step on overflow)
    # delay_overflow_check=True: the client updates the scale itself (update_scale()), once per step
    client_checks: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.loss_id, self.epoch)


class PassRecord(NamedTuple):
    """A checked backward pass for the session to account (agree across ranks, update the scale, log).

    ``scale_loss`` makes one for the lifecycles ``end_pass`` checked, the session one per DELAYED
    accumulation it takes in (``AmpSession.take_in_accumulation``: one record for every optimizer
    the accumulation covers); the lifecycle never accounts a pass itself.
    """

    loss_id: int
    found_inf: Tensor
    lifecycles: tuple["GradLifecycle", ...]
    inv_scale: Tensor
    # delay_overflow_check=True: the session leaves the scale update to the client's update_scale(), and
    # the flag only keeps the step from applying these gradients (GradLifecycle.note_found_inf)
    client_checks: bool = False


class _OpenPass(NamedTuple):
    resumes: GradState  # where abort_pass returns
    stash: Sequence[Optional[Tensor]]  # the direct params' .grad from before the pass
    continues_delayed: bool  # the backward adds to DELAYED gradients in place
    in_place: bool = False  # begin_pass_in_place: the backward adds to true gradients in place


# A pass in place keeps nothing of its own: one record per state it may start from, made once.
_IN_PLACE_PASSES = {state: _OpenPass(state, (), continues_delayed=False, in_place=True) for state in _IN_PLACE_STATES}


class _OpenStep(NamedTuple):
    resumes: GradState  # where an interrupted step returns
    hidden: list[tuple[Tensor, Tensor]]  # (param, grad) hidden from a skipped non-fused step
    undo: Optional[Callable[[], None]]  # the step hooks' own clean-up, should the step raise
    running: Callable[[], bool]  # whether optimizer.step() is still on the stack (False: it raised)


class GradLifecycle:
    """The gradients of one optimizer between its steps (never stored on the optimizer).

    Args:
        optimizer: the user's optimizer (masters already attached under O2).
        links: the masters ``initialize`` attached.
        device: where the flags live (the session's device).
        make_masters: param groups added later get masters too (O2).
        on_new_links: called with the masters of param groups added later.
        wrapped: the user passed a wrapper (LARC) whose step reads the gradients before this
            optimizer's: they are then never kept scaled.
        fp32_value_of: exact fp32 values known for the parameters of groups added later.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, links: list[MasterLink], *, device: torch.device,
        make_masters: bool, on_new_links: Callable[[list[MasterLink]], None],
        wrapped: bool = False, fp32_value_of: Optional[Fp32ValueOf] = None,
    ) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._device = device
        # A fused optimizer's step takes AmpStepArgs: it unscales as it reads and skips on the device.
        self.fused = isinstance(optimizer, FusedOptimizer)
        # Gradients may stay scaled until the step only if nothing reads them before it.
        self.keeps_scaled = self.fused and not wrapped
        self.params = OptimizerParams(optimizer, links, make_masters=make_masters, on_new_links=on_new_links,
                                      fp32_value_of=fp32_value_of)
        self.state = GradState.EMPTY
        self.steps = 0  # optimizer.step() calls, taken or skipped
        self.kept_scale: Optional[PassScale] = None  # SCALED, DELAYED, SPENT: the scale the kept gradients carry
        self.held: dict[Tensor, Tensor] = {}  # SCALED: master -> its model param's scaled gradient
        # SCALED, DELAYED: the optimizer's zero_grad calls since the gradients were kept off its params.
        self._clears = ClearWatch(optimizer)
        # A step that may have been skipped left gradients on direct params: the next event checks them.
        self._leftovers_suspect = False
        # OR of the checked passes' flags since the last step, and of what _carry_leftovers found.
        self.step_found_inf: Optional[Tensor] = None
        # Every flag in step_found_inf came from passes whose skip is the client's (delay_overflow_check):
        # it guards their gradients only, and ends when they are all cleared (_end_cleared_guard).
        self._flag_guards_only = False
        self.last_step_found_inf: Optional[Tensor] = None
        self._masters_reconciled = False
        self._open_pass: Optional[_OpenPass] = None
        self._open_step: Optional[_OpenStep] = None
        # A zero flag standing for clean passes known on the host; never written (note_found_inf).
        self._clean_flag = torch.zeros(1, device=device)
        # What a fused step gets when no checked pass or kept scale is pending (made once).
        self._unscaled_step_args = AmpStepArgs(None, None, self.params.model_param_of)

    # ---- the one writer of `state` ------------------------------------------------
    def _move(self, to: GradState) -> None:
        if to not in _TRANSITIONS[self.state]:
            raise RuntimeError(
                f"apex_amp internal error: no gradient transition {self.state.name} -> {to.name}; please report "
                "this with the sequence of amp calls that led to it"
            )
        self.state = to

    # ---- queries --------------------------------------------------------------------
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer whose gradients this is (None once it has been freed)."""
        return self._optimizer()

    def must_settle_before(self, key: tuple[int, int]) -> bool:
        """Whether a pass with scale ``key`` must first turn the kept gradients into true values."""
        if self.state is GradState.DELAYED:
            return self.kept_scale.key != key
        return self.state in (GradState.SCALED, GradState.SPENT)

    def has_new_grads(self) -> bool:
        """Whether the open pass's backward reached a parameter of this optimizer."""
        opened = self._open_pass
        if opened is not None and opened.continues_delayed:
            return True  # added in place: new and old gradients are indistinguishable
        # (A pass in place that found gradients there also lands here: they are still there, and
        # as indistinguishable from new ones.)
        return any(p.grad is not None for p in self.params.direct) or any(
            link.model_param.grad is not None for link in self.params.links)

    def pending_grads(self) -> list[tuple[Tensor, Tensor]]:
        """(parameter as the model knows it, gradient) of every gradient the next step consumes, in optimizer order.

        Masters are named by their model parameter; a SCALED or DELAYED gradient is still scaled.
        """
        found = []
        for param in self.params.ordered:
            model_param = self.params.model_param_of.get(param)
            grad = param.grad
            if grad is None and model_param is not None:
                grad = self.held.get(param, model_param.grad)
            if grad is not None:
                found.append((param if model_param is None else model_param, grad))
        return found

    def _new_grads(self) -> list[Tensor]:
        grads = [p.grad for p in self.params.direct if p.grad is not None]
        grads += [link.model_param.grad for link in self.params.links if link.model_param.grad is not None]
        return grads

    def _holds_grads(self) -> bool:
        return (
            bool(self.held)
            or any(p.grad is not None for p in self.params.direct)
            or any(link.master.grad is not None for link in self.params.links)
        )

    # ---- around a backward pass ----------------------------------------------------
    def can_pass_in_place(self) -> bool:
        """Whether a pass with the static scale 1.0 and no check may add to the gradients in place.

        So it may without masters and with no scaled gradients kept (O0 and O3 by default): the
        backward's sum is then the true gradient, and amp has nothing to do (apex's short cut).
        """
        return not self.params.links and not self.params.makes_masters and self.state in _IN_PLACE_STATES

    def begin_pass_in_place(self) -> None:
        """``scale_loss`` entry of a pass that ``can_pass_in_place``: the backward adds to ``.grad`` itself.

        No step is under way and no pass open in the states that allow it, so the checks of
        ``begin_pass`` have nothing to find.
        """
        self.sync_params()
        self._open_pass = _IN_PLACE_PASSES[self.state]
        self._move(GradState.IN_PASS)

    def _check_can_open_pass(self) -> None:
        self._recover_interrupted_step()
        if self.state is GradState.IN_PASS:
            raise RuntimeError(
                "amp.scale_loss was entered for an optimizer whose previous amp.scale_loss block has not exited; "
                "run one backward pass per block, one block after the other"
            )
        if self.state is GradState.IN_STEP:
            raise RuntimeError(
                "amp.scale_loss was entered while optimizer.step() of the same optimizer runs (from a step "
                "hook or a subclass's step?); run the backward pass before optimizer.step(), not inside it"
            )

    def begin_pass(self, key: tuple[int, int], local_accumulation: bool) -> None:
        """``scale_loss`` entry: stash the gradients already there so the backward writes fresh ones.

        Args:
            key: (loss_id, scale epoch) of the pass (after ``AmpSession.settle_for_pass``).
            local_accumulation: DDP ``no_sync()``: this pass's gradients must stay scaled in place.
        """
        self._check_can_open_pass()
        self.sync_params()
        self._reconcile_masters_once()
        self._end_cleared_guard()
        if self.state is GradState.DELAYED:
            self._follow_clears()
        if self.state is GradState.DELAYED and self.kept_scale.key == key:
            self._open_pass = _OpenPass(GradState.DELAYED, [], continues_delayed=True)
            self._move(GradState.IN_PASS)
            return
        if self.settle() is not None:  # settle_for_pass took every DELAYED accumulation in already
            raise RuntimeError("apex_amp internal error: a delayed accumulation reached begin_pass unsettled")
        if local_accumulation and self._holds_grads():
            raise RuntimeError(
                "amp.scale_loss under DistributedDataParallel.no_sync() (or FSDP2's "
                "set_requires_gradient_sync(False)) found gradients it cannot accumulate "
                "in place (zeroed rather than set to None, left by another loss_id, or from a pass with a "
                "different loss scale); merging them would leave rank-local values out of DDP's all-reduce. "
                "Call optimizer.zero_grad(set_to_none=True) before the first no_sync pass and use one loss_id "
                "per accumulated step"
            )
        stash = [p.grad for p in self.params.direct]
        self._carry_leftovers([grad for grad in stash if grad is not None])
        for p in self.params.direct:
            p.grad = None
        for link in self.params.links:
            # Half gradients left by a backward outside this optimizer's passes (another loss through
            # the same layers): not this optimizer's; the masters hold what its passes produced.
            link.model_param.grad = None
        self._open_pass = _OpenPass(self.state, stash, continues_delayed=False)
        self._move(GradState.IN_PASS)

    def abort_pass(self) -> None:
        """The ``scale_loss`` block raised: drop the partial new gradients, put the stashed ones back."""
        opened, self._open_pass = self._open_pass, None
        if opened.in_place:
            # What the backward added before it raised stays, as it would without amp.
            self._move(GradState.UNSCALED if self.has_new_grads() else opened.resumes)
            return
        if not opened.continues_delayed:
            for p, old in zip(self.params.direct, opened.stash):
                p.grad = old
            for link in self.params.links:
                link.model_param.grad = None
        self._move(opened.resumes)

    def end_pass(self, scale: Optional[PassScale], found_inf: Optional[Tensor], delay_unscale: bool) -> bool:
        """``scale_loss`` exit: check, unscale and add up the new gradients; returns whether ``found_inf`` covers them.

        ``found_inf`` is the pass's flag: the caller accounts it (``AmpSession.account``) when this returns True.
        A pass begun in place needs neither it nor ``scale``.
        """
        opened, self._open_pass = self._open_pass, None
        if opened.in_place:
            self._move(GradState.UNSCALED)
            return False
        stash = [None] * len(self.params.direct) if opened.continues_delayed else opened.stash
        has_old = any(s is not None for s in stash) or any(link.master.grad is not None for link in self.params.links)
        if delay_unscale and not has_old:
            self.kept_scale = scale
            self._clears.arm()
            self._move(GradState.DELAYED)
            return False
        # A client that checks the overflow itself (delay_overflow_check) reads and clears the masters'
        # gradients by hand, as under apex: they are unscaled onto the masters, not held off them.
        if self.keeps_scaled and not has_old and not scale.client_checks:
            if scale.checked:
                mt.check_finite(self._new_grads(), found_inf)
            self.held = {}
            for link in self.params.links:
                if link.model_param.grad is not None:
                    self.held[link.master] = link.model_param.grad
                    link.model_param.grad = None
            self._clears.arm()
            self.kept_scale = scale
            self._move(GradState.SCALED)
            return scale.checked
        self._absorb(stash, scale, found_inf)
        self.kept_scale = None
        self._move(GradState.UNSCALED)
        return scale.checked

    def note_found_inf(self, found_inf: Tensor, overflowed: Optional[bool] = None, guards_only: bool = False) -> None:
        """Add an accounted pass's flag to the next step's (no host sync).

        ``overflowed``: the flag's value when the host knows it already (a CPU flag). A clean
        pass then adds nothing, and needs no copy: the shared zero flag stands for it.
        ``guards_only``: the pass left its skip to the client (``delay_overflow_check=True``, apex's
        ``update_scale()`` flow): the flag keeps a step from applying its gradients, and ends when
        the client clears them all instead of stepping (``_end_cleared_guard``).
        """
        first = self.step_found_inf is None
        self._flag_guards_only = guards_only and (first or self._flag_guards_only)
        if overflowed is False:
            if self.step_found_inf is None:
                self.step_found_inf = self._clean_flag
            return
        if self.step_found_inf is None or self.step_found_inf is self._clean_flag:
            self.step_found_inf = found_inf.clone()  # private: the scaler reuses its flag buffer
        else:
            torch.maximum(self.step_found_inf, found_inf.to(self.step_found_inf.device), out=self.step_found_inf)

    def _end_cleared_guard(self) -> None:
        # A client that checks the overflow itself (delay_overflow_check=True) skips an overflowing
        # step by not stepping and dropping the gradients (param.grad = None, as NVIDIA's BERT does):
        # with none of them left, their flag guards nothing and must not skip the next step. (A pass
        # whose skip is amp's keeps it past a clear: apex had patched the step to skip by then.)
        if (self._flag_guards_only and self.step_found_inf is not None
                and self.state in _IN_PLACE_STATES and not self._holds_grads()):
            self.step_found_inf = None
            self._flag_guards_only = False

    def delayed_key(self) -> Optional[tuple[int, int]]:
        """(loss_id, scale epoch) of a DELAYED accumulation (None in the other states)."""
        return self.kept_scale.key if self.state is GradState.DELAYED else None

    def settle(self, found_inf: Optional[Tensor] = None) -> Optional[PassScale]:
        """Turn kept scaled gradients into true values: SCALED/DELAYED -> UNSCALED, SPENT -> EMPTY.

        A DELAYED accumulation was never checked: it is checked now into ``found_inf`` (the flag
        of the accumulation, shared by every optimizer it covers; a private one when None) and its
        scale is returned when checked, for the caller to account once for its own loss
        (``AmpSession.take_in_accumulation``). Called before a pass of another scale, before a
        step, by ``prepare_to_read`` (SCALED and SPENT only) and by the diagnostics; a no-op in
        the other states, and inside a running step.
        """
        self._recover_interrupted_step()
        kept = self.kept_scale
        if self.state is GradState.SPENT:
            grads = [p.grad for p in self.params.direct if p.grad is not None]
            if grads and not kept.unit:
                mt.unscale_(grads, self._scratch_flag(), kept.inv_scale)  # checked by their own pass
            self.kept_scale = None
            self._move(GradState.EMPTY)
            return None
        if self.state is GradState.SCALED:
            self._follow_clears()
            for master, grad in self.held.items():
                self.params.model_param_of[master].grad = grad
            self.held = {}
            self._absorb([None] * len(self.params.direct), kept, self._scratch_flag())  # checked at end_pass
            self.kept_scale = None
            self._move(GradState.UNSCALED)
            return None
        if self.state is GradState.DELAYED:
            self._follow_clears()
            if found_inf is None:
                found_inf = self._scratch_flag()
            self._absorb([None] * len(self.params.direct), kept, found_inf)
            self.kept_scale = None
            self._move(GradState.UNSCALED)
            if kept.checked:
                return kept
        return None

    def prepare_to_read(self) -> None:
        """``amp.master_params``: make the gradients a reader finds on the optimizer's params true values.

        Between a pass and a step: takes in added param groups and settles gradients kept scaled
        for a fused step (the step then computes the same update). Inside a ``scale_loss`` block,
        inside ``optimizer.step()`` or during a ``delay_unscale`` accumulation it changes nothing:
        the reader sees what the step will see, or apex's still-scaled gradients. Never accounts
        a pass or changes a skip.
        """
        self.take_in_param_groups()
        if self.state in (GradState.SCALED, GradState.SPENT):
            self.settle()  # nothing to account: their passes were checked at end_pass

    def _scratch_flag(self) -> Tensor:
        return torch.zeros(1, device=self._device)

    def _absorb(self, stash: Sequence[Optional[Tensor]], scale: PassScale, found_inf: Tensor) -> None:
        # The new gradients (direct params' and half model params' .grad) become true values, added to
        # the stashed direct gradients and to the masters' .grad.
        fresh, new, old = [], [], []
        for p, stashed in zip(self.params.direct, stash):
            grad = p.grad
            if grad is None:
                p.grad = stashed
            elif stashed is None:
                fresh.append(grad)
            else:
                new.append(grad)
                old.append(stashed)
                p.grad = stashed
        if fresh:
            if not scale.unit:
                mt.unscale_(fresh, found_inf, scale.inv_scale)
            elif scale.checked:
                mt.check_finite(fresh, found_inf)  # read-only: half the traffic of an unscale by 1
        src, dst = [], []
        for link in self.params.links:
            grad = link.model_param.grad
            if grad is None:
                continue
            if link.master.grad is None:
                # A sparse gradient gets a sparse master gradient of the same stored elements.
                link.master.grad = grad.to(torch.float32) if grad.is_sparse else torch.empty_like(link.master)
                src.append(grad)
                dst.append(link.master.grad)
            else:
                new.append(grad)
                old.append(link.master.grad)
            link.model_param.grad = None
        if src:
            mt.scale_(src, dst, scale.inv_scale, found_inf)
        if new:
            self._accumulate(new, old, scale, found_inf)

    def _accumulate(self, new: list[Tensor], old: list[Tensor], scale: PassScale, found_inf: Tensor) -> None:
        # old += inv_scale * new. The pass's flag covers the new gradients, and the sums too unless an
        # earlier pass since the last step reported them (its inf would otherwise back off every later
        # loss's scale as well). Without an earlier checked pass, one axpby_ flags both.
        earlier = self.step_found_inf
        if not scale.checked or earlier is None:
            mt.axpby_(new, old, scale.inv_scale, 1.0, found_inf)
            return
        mt.check_finite(new, found_inf)
        sum_found_inf = self._scratch_flag()
        mt.axpby_(new, old, scale.inv_scale, 1.0, sum_found_inf)
        unreported = sum_found_inf * (1.0 - earlier.to(sum_found_inf.device))
        torch.maximum(found_inf, unreported.to(found_inf.device), out=found_inf)

    # ---- around optimizer.step() ---------------------------------------------------------
    def before_step(self, undo: Optional[Callable[[], None]], running: Callable[[], bool]) -> Optional[dict]:
        """The step pre-hook's part: what the step gets, and the skip of a non-fused step.

        Returns the extra keyword arguments of a fused optimizer's step (``amp=AmpStepArgs(...)``;
        None for others, whose skip is decided here on the host). ``undo`` runs if the step raises;
        ``running`` tells whether the step is still under way (False once it has raised).
        """
        self._recover_interrupted_step()
        if self.state is GradState.IN_PASS:
            raise RuntimeError(
                "optimizer.step() was called inside an amp.scale_loss block; call it after the block exits, "
                "when the gradients have been checked and unscaled"
            )
        if self.state is GradState.DELAYED:
            raise RuntimeError(
                "optimizer.step() was called while the gradients are still scaled by "
                "amp.scale_loss(..., delay_unscale=True); the last backward pass before a step must use "
                "delay_unscale=False so that the accumulated gradients are checked and unscaled"
            )
        self.sync_params()
        self._reconcile_masters_once()
        if self.state is GradState.SPENT:
            self.settle()  # leftover scaled direct gradients must not reach the step scaled
        self._end_cleared_guard()
        if self.state is GradState.EMPTY:  # no pass since the last step: it may have been skipped
            self._carry_leftovers([p.grad for p in self.params.direct if p.grad is not None])
        found_inf = self.step_found_inf
        hidden: list[tuple[Tensor, Tensor]] = []
        step_kwargs = None
        if self.fused:
            inv_scale = None
            if self.state is GradState.SCALED:
                self._follow_clears()
                for master, grad in self.held.items():  # where the fused step reads them
                    self.params.model_param_of[master].grad = grad
                if not self.kept_scale.unit:
                    inv_scale = self.kept_scale.inv_scale
            if found_inf is None and inv_scale is None:
                step_kwargs = {"amp": self._unscaled_step_args}
            else:
                step_kwargs = {"amp": AmpStepArgs(found_inf, inv_scale, self.params.model_param_of)}
        elif found_inf is not None and found_inf is not self._clean_flag and bool(found_inf.item()):
            # (the one host sync of non-fused optimizers)
            # torch optimizers skip parameters without a gradient: weights, moments, step counts untouched.
            for p in self.params.ordered:
                if p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None
        self._open_step = _OpenStep(self.state, hidden, undo, running)
        self._move(GradState.IN_STEP)
        return step_kwargs

    def after_step(self) -> bool:
        """The step post-hook's part: the step consumed the gradients. Returns whether it was skipped on the host."""
        opened, self._open_step = self._open_step, None
        for p, grad in opened.hidden:
            p.grad = grad
        for link in self.params.links:
            link.master.grad = None
            link.model_param.grad = None
        self.held = {}
        flag = self.last_step_found_inf = self.step_found_inf
        self.step_found_inf = None
        self._flag_guards_only = False
        # What the step left on direct params is checked again by the next event if it may have been
        # skipped (a non-fused skip; a fused step's flag is looked at then, not in the step's hooks,
        # which torch.compile traces: a tensor compared there would be one more guard).
        self._leftovers_suspect = flag is not None and (self.fused or bool(opened.hidden))
        self.steps += 1
        if opened.resumes is GradState.SCALED and not self.kept_scale.unit and any(
            p.grad is not None for p in self.params.direct
        ):
            self._move(GradState.SPENT)
        else:
            self.kept_scale = None
            self._move(GradState.EMPTY)
        return bool(opened.hidden)

    def _recover_interrupted_step(self) -> None:
        # optimizer.step() raised between the hooks: undo what before_step did. A step still under
        # way (amp called from a step hook or from inside the step) is left alone: its skip stands.
        if self.state is not GradState.IN_STEP or self._open_step.running():
            return
        opened, self._open_step = self._open_step, None
        for p, grad in opened.hidden:
            p.grad = grad
        if opened.resumes is GradState.SCALED:
            for master in self.held:
                self.params.model_param_of[master].grad = None
        if opened.undo is not None:
            opened.undo()
        self._move(opened.resumes)

    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped (a host read)."""
        flag = self.last_step_found_inf
        return flag is not None and bool(flag.item())

    def _follow_clears(self) -> None:
        # optimizer.zero_grad() between scale_loss and the step clears the gradients amp took in
        # (the masters' .grad of a torch optimizer) itself. What amp keeps off the optimizer's params,
        # the gradients held for a fused step (SCALED) and under O2 a delay_unscale accumulation on
        # the half model (DELAYED), follows the clears as PyTorch's gradients would (grad_clears.py).
        cleared = self._clears.cleared()
        if cleared is None:
            return
        if self.state is GradState.DELAYED:
            for link in self.params.links:
                if cleared is Cleared.TO_NONE:
                    link.model_param.grad = None
                elif link.model_param.grad is not None:
                    link.model_param.grad.zero_()
        elif cleared is Cleared.TO_NONE:
            self.held = {}
        else:
            for grad in self.held.values():
                grad.zero_()

    def _carry_leftovers(self, grads: list[Tensor]) -> None:
        # The first event after a step that may have been skipped (a pass or another step): the
        # direct params' gradients it left are checked again, and the next step is skipped while
        # they are not finite (a clear to zero, to None or a replacement ends it). Their pass was
        # accounted already: the flag is the step's only, no pass reports it a second time.
        if not self._leftovers_suspect or self.step_found_inf is not None:
            return
        self._leftovers_suspect = False
        if grads and self.last_step_found_inf is not self._clean_flag:  # (the host's clean flag: taken)
            self._flag_guards_only = False
            self.step_found_inf = self._scratch_flag()
            mt.check_finite(grads, self.step_found_inf)

    # ---- parameters -------------------------------------------------------------------
    def sync_params(self) -> None:
        """Take in param groups added since ``initialize`` (``add_param_group``)."""
        self.params.sync(self._optimizer())

    def take_in_param_groups(self) -> None:
        """Before a ``load_state_dict``: give groups added since their masters, as apex's ``add_param_group`` did.

        So that the optimizer's loaded state lands on the fp32 masters (not cast to half on the
        model's parameters) and the model's loaded weights reach the masters exactly. Not inside
        a pass or a step, where the parameters must stay as they are.
        """
        self._recover_interrupted_step()
        if self.state not in (GradState.IN_PASS, GradState.IN_STEP):
            self.sync_params()

    def _reconcile_masters_once(self) -> None:
        if not self._masters_reconciled:
            self._masters_reconciled = True
            follow_model_layouts(self.params.links, self._optimizer().state)
            reconcile_masters(self.params.links)

