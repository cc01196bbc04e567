"""The gradient lifecycle of one optimizer: one state machine, every transition in this file.

``amp.scale_loss`` multiplies the loss by the loss scale, so the backward pass
writes *scaled* gradients. Under O2 the optimizer holds fp32 *masters* in
place of the half model's parameters (``master_weights.py``); parameters
without a master (every parameter at O0/O1/O3, fp32 batchnorm under O2) are
*direct*: the optimizer reads their own ``.grad``. The rules the states keep
are written for users in ``docs/o2_gradients.md``; in short:

* The model's gradients are the source of truth. When a ``scale_loss`` block
  exits, the gradients its backward wrote are checked and either **unscaled**
  into fp32 (onto the masters or in place, added to what earlier passes since
  the last step left: ``grad_accumulation.py``), or **kept scaled** off the
  model (``held``) for a fused optimizer that unscales as it reads, so that
  nothing the user does to the model changes them before the step.
* A step, taken or skipped, **consumes** them: afterwards no master holds a
  gradient, however the user clears. Direct parameters keep their ``.grad``,
  as in PyTorch; whether a step is skipped, and what a skipped one left, is
  the step's flag (``step_skip.py``).
* ``delay_unscale=True`` passes stay on the model, scaled (DELAYED), until a
  pass without it; the session checks such an accumulation once for every
  optimizer it covers (``AmpSession.take_in_accumulation``). What amp keeps
  where ``optimizer.zero_grad()`` cannot reach follows its clears
  (``grad_clears.py``). A ``delay_overflow_check=True`` pass's gradients are
  unscaled onto the masters (never held) and its flag ends when the client
  has set them all to None or zero instead of stepping (``_review_guard``).

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
from . import grad_accumulation as acc
from .grad_clears import ClearWatch
from .master_weights import Fp32ValueOf, MasterLink, OptimizerParams, follow_model_layouts, reconcile_masters
from .pass_records import PassScale
from .step_skip import StepSkip

__all__ = ["GradState", "GradLifecycle"]


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


# The records of an open pass or step are made on every pass and step: named tuples, which cost a
# fraction of a dataclass to build.
class _OpenPass(NamedTuple):
    resumes: GradState  # where abort_pass returns
    stash: Sequence[Optional[Tensor]]  # the direct params' .grad from before the pass
    continues_delayed: bool  # the backward adds to DELAYED gradients in place
    in_place: bool = False  # begin_pass_in_place: the backward adds to true gradients in place


# A pass in place keeps nothing of its own: one record per state it may start from, made once.
_IN_PLACE_PASSES = {state: _OpenPass(state, (), continues_delayed=False, in_place=True) for state in _IN_PLACE_STATES}


_NOTHING_HIDDEN: list = []  # the hidden gradients of a step that is not skipped on the host (never written)


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
        self.skip = StepSkip(device)  # whether the next step is skipped, and whether the last one was
        self._masters_reconciled = False
        self._open_pass: Optional[_OpenPass] = None
        self._open_step: Optional[_OpenStep] = None
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
        # as indistinguishable from new ones.) Loops, not any() over generators: this runs on every pass.
        for p in self.params.direct:
            if p.grad is not None:
                return True
        for link in self.params.links:
            if link.model_param.grad is not None:
                return True
        return False

    def pending_grads(self) -> list[tuple[Tensor, Tensor]]:
        """(parameter as the model knows it, gradient) of every gradient the next step consumes, in optimizer order.

        Masters are named by their model parameter; a SCALED or DELAYED gradient is still scaled.
        """
        return acc.pending_grads(self.params, self.held)

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
        self.params.sync(self._optimizer())  # (sync_params, one call less: this runs on every pass)
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
        if not self._masters_reconciled:
            self._reconcile_masters()
        self._review_guard(at_step=False)
        if self.state is GradState.DELAYED:
            self._follow_clears()
        if self.state is GradState.DELAYED and self.kept_scale.key == key:
            self._open_pass = _OpenPass(GradState.DELAYED, [], continues_delayed=True)
            self._move(GradState.IN_PASS)
            return
        if self.settle() is not None:  # settle_for_pass took every DELAYED accumulation in already
            raise RuntimeError("apex_amp internal error: a delayed accumulation reached begin_pass unsettled")
        if local_accumulation and acc.holds_grads(self.params, self.held):
            raise RuntimeError(
                "amp.scale_loss under DistributedDataParallel.no_sync() (or FSDP2's "
                "set_requires_gradient_sync(False)) found gradients it cannot accumulate "
                "in place (zeroed rather than set to None, left by another loss_id, or from a pass with a "
                "different loss scale); merging them would leave rank-local values out of DDP's all-reduce. "
                "Call optimizer.zero_grad(set_to_none=True) before the first no_sync pass and use one loss_id "
                "per accumulated step"
            )
        stash = acc.stash_for_pass(self.params)
        self.skip.carry_leftovers([grad for grad in stash if grad is not None])
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
            acc.restore_stash(self.params, opened.stash)
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
        has_old = acc.has_old_grads(self.params, stash)
        if delay_unscale and not has_old:
            self.kept_scale = scale
            self._clears.arm()
            self._move(GradState.DELAYED)
            return False
        # A client that checks the overflow itself (delay_overflow_check) reads and clears the masters'
        # gradients by hand, as under apex: they are unscaled onto the masters, not held off them.
        if self.keeps_scaled and not has_old and not scale.client_checks:
            self.held = acc.hold_new_grads(self.params, scale, found_inf)
            self._clears.arm()
            self.kept_scale = scale
            self._move(GradState.SCALED)
            return scale.checked
        acc.absorb(self.params, stash, scale, found_inf, self.skip.found_inf)
        self.kept_scale = None
        self._move(GradState.UNSCALED)
        return scale.checked

    def _review_guard(self, at_step: bool) -> None:
        # A client that checks the overflow itself (delay_overflow_check=True) skips an overflowing
        # step by not stepping and dropping the gradients (param.grad = None, as NVIDIA's BERT does)
        # or clearing them to zero: with none of them left, their flag guards nothing and must not
        # skip the next step; at the step, the guard is what the step would apply (one read of the
        # gradients). (A pass whose skip is amp's keeps it past a clear: apex had patched the step.)
        if self.skip.guard is None or self.state not in _IN_PLACE_STATES:
            return
        if not acc.holds_grads(self.params, self.held):
            self.skip.end_guard()
        elif at_step:
            self.skip.recheck_guard(acc.step_grads(self.params))

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
            acc.unscale_direct(self.params, kept, self._scratch_flag())  # checked by their own pass
            self.kept_scale = None
            self._move(GradState.EMPTY)
            return None
        if self.state is GradState.SCALED:
            self._follow_clears()
            acc.return_held(self.params, self.held)
            self.held = {}
            acc.absorb(self.params, [None] * len(self.params.direct), kept, self._scratch_flag(),  # checked at end_pass
                       self.skip.found_inf)
            self.kept_scale = None
            self._move(GradState.UNSCALED)
            return None
        if self.state is GradState.DELAYED:
            self._follow_clears()
            if found_inf is None:
                found_inf = self._scratch_flag()
            acc.absorb(self.params, [None] * len(self.params.direct), kept, found_inf, self.skip.found_inf)
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

    # ---- around optimizer.step() ---------------------------------------------------------
    def before_step(self, undo: Optional[Callable[[], None]], running: Callable[[], bool]) -> Optional[dict]:
        """The step pre-hook's part: what the step gets, and the skip of a non-fused step.

        Returns the extra keyword arguments of a fused optimizer's step (``amp=AmpStepArgs(...)``;
        None for others, whose skip is decided here on the host). ``undo`` runs if the step raises;
        ``running`` tells whether the step is still under way (False once it has raised).
        """
        # This runs on every step: the usual case (EMPTY or UNSCALED, nothing pending) takes no call
        # that cannot change anything.
        if self.state not in _IN_PLACE_STATES:
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
        self.params.sync(self._optimizer())  # (sync_params)
        if not self._masters_reconciled:
            self._reconcile_masters()
        if self.state is GradState.SPENT:
            self.settle()  # leftover scaled direct gradients must not reach the step scaled
        skip = self.skip
        if skip.guard is not None:
            self._review_guard(at_step=True)
        if skip.leftovers_suspect and self.state is GradState.EMPTY:  # no pass since a step that may have been skipped
            skip.carry_leftovers([p.grad for p in self.params.direct if p.grad is not None])
        found_inf = skip.found_inf
        hidden: list[tuple[Tensor, Tensor]] = _NOTHING_HIDDEN
        step_kwargs = None
        if self.fused:
            inv_scale = None
            if self.state is GradState.SCALED:
                self._follow_clears()
                acc.return_held(self.params, self.held)  # where the fused step reads them
                if not self.kept_scale.unit:
                    inv_scale = self.kept_scale.inv_scale
            if found_inf is None and inv_scale is None:
                step_kwargs = {"amp": self._unscaled_step_args}
            else:
                step_kwargs = {"amp": AmpStepArgs(found_inf, inv_scale, self.params.model_param_of)}
        elif found_inf is not None and skip.skips_on_host():  # (the one host sync of non-fused optimizers)
            hidden = acc.hide_grads(self.params)
        # tuple.__new__: a NamedTuple's own __new__ is Python code, one call more on every step.
        self._open_step = tuple.__new__(_OpenStep, (self.state, hidden, undo, running))
        self._move(GradState.IN_STEP)
        return step_kwargs

    def after_step(self) -> bool:
        """The step post-hook's part: the step consumed the gradients. Returns whether it was skipped on the host."""
        opened, self._open_step = self._open_step, None
        for p, grad in opened.hidden:
            p.grad = grad
        if self.params.links:
            acc.drop_consumed(self.params)
        if self.held:
            self.held = {}
        self.skip.step_done(self.fused or bool(opened.hidden))
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

    def _follow_clears(self) -> None:
        # What amp keeps off the optimizer's params (held for a fused step; a DELAYED accumulation
        # on the half model under O2) follows optimizer.zero_grad() as PyTorch's gradients would.
        self.held = acc.follow_clears(self._clears.cleared(), self.params, self.held,
                                      delayed=self.state is GradState.DELAYED)

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

    def _reconcile_masters(self) -> None:
        # Once, before the first pass or step (callers check _masters_reconciled).
        self._masters_reconciled = True
        follow_model_layouts(self.params.links, self._optimizer().state)
        reconcile_masters(self.params.links)

