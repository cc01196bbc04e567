"""``amp.scale_loss``: one backward pass, on a scaled loss, whose new gradients are then checked and unscaled.

What happens to the gradients is the gradient lifecycle's (``gradients.py``);
the accounting of the checked pass is the session's (``AmpSession.account``).

``scale_loss`` checks its arguments and returns one of two context managers,
classes rather than ``contextlib.contextmanager`` generators: this runs on
every step, and a generator-based manager costs several Python calls more on
entry and exit (``benchmarks/README.md``, ``bench_overhead.py``). Each
``__exit__`` undoes what ``__enter__`` began when the block raised.
"""

from __future__ import annotations

import contextlib
import logging
from typing import ContextManager, Optional, Sequence, Union

import torch
from torch import Tensor

from . import casting, sessions
from .gradients import GradLifecycle
from .pass_records import PassRecord, PassScale
from .session import AmpSession

__all__ = ["scale_loss"]

logger = logging.getLogger("apex_amp")


def _skips_grad_sync(model: Optional[torch.nn.Module]) -> bool:
    # DDP inside no_sync(): this backward's gradients are not all-reduced.
    ddp = torch.nn.parallel.DistributedDataParallel
    return isinstance(model, ddp) and not model.require_backward_grad_sync


def scale_loss(
    loss: Tensor,
    optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
    loss_id: int = 0,
    model: Optional[torch.nn.Module] = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> ContextManager[Tensor]:
    """Context manager yielding ``loss.float() * loss_scale``; call ``backward()`` on it inside.

    On exit the gradients this backward produced are checked for inf/NaN and
    unscaled (into the fp32 master gradients under O2), and added to any
    gradients that already existed (several backward passes, even with
    different scales, accumulate correctly). On overflow the next
    ``optimizer.step()`` of every optimizer passed here is skipped and this
    loss's scale is reduced; the message ``Gradient overflow.  Skipping step,
    loss scaler 0 reducing loss scale to 32768.0`` is logged (rate-limited).

    Args:
        loss: the loss tensor to scale.
        optimizers: the optimizer(s), returned by ``amp.initialize``, whose
            parameters this backward reaches.
        loss_id: which loss scaler to use, in ``[0, num_losses)``.
        model: the model this backward runs through. Pass the
            ``DistributedDataParallel`` wrapper when accumulating under
            ``no_sync()``: those passes then keep their gradients scaled and in
            place (as ``delay_unscale=True``), so the next synchronising
            backward all-reduces the whole sum and every rank checks the same
            gradients and takes the same skip decision. The first time a
            wrapper is seen, here or as the one the model's forward ran under,
            rank 0's fp32 masters are broadcast (a collective; see
            ``amp.sync_masters``).
        delay_unscale: leave the gradients scaled (accumulation over several
            backward passes with the same loss and scale); the last pass before
            ``optimizer.step()`` must use ``delay_unscale=False``. Ignored when
            gradients from an earlier, unscaled pass exist (they are merged now).
            Set by itself for a model sharded by FSDP2 under
            ``set_requires_gradient_sync(False)``, whose gradients stay inside
            FSDP2 until the synchronising backward.
        delay_overflow_check: apex's overflow check by hand (NVIDIA's BERT
            ``--allreduce_post_accumulation``): the gradients are checked and
            unscaled as usual, but this loss's scale is not updated at the exit:
            the client reads its own overflow buffer and calls
            ``amp._amp_state.loss_scalers[loss_id].update_scale()`` once per
            step, which updates the scale and says whether to skip. A step is
            still skipped while gradients this pass found non-finite are there;
            the client may instead skip by not stepping and setting the
            gradients to None (masters and model) or zero, which ends them.

    .. note::
        Nothing in this context manager syncs with the host. With a
        non-fused optimizer the following ``optimizer.step()`` reads the
        overflow flag (one sync per step, like ``torch.amp.GradScaler``);
        :class:`apex_amp.optimizers.FusedAdam` decides on the device.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> loss = criterion(model(x), y)
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
    """
    resolved = sessions.resolve(optimizers, "scale_loss")
    session = resolved.session
    if not session.enabled:
        return contextlib.nullcontext(loss)
    if not isinstance(loss, Tensor):
        raise TypeError(f"amp.scale_loss expects the loss as a tensor, got {type(loss).__name__}")
    num_losses = len(session.scalers)
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < num_losses:
        raise ValueError(
            f"loss_id={loss_id!r} is out of range: amp.initialize was called with num_losses={num_losses}, "
            f"so loss_id must be in [0, {num_losses - 1}]; pass num_losses=N to amp.initialize for N losses"
        )
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if not loss.requires_grad:
        raise RuntimeError(
            "amp.scale_loss got a loss that does not require grad (computed under torch.no_grad(), "
            "detached, or from frozen parameters only), so its backward cannot reach the parameters; "
            "compute the loss from the model's outputs with autograd enabled"
        )
    scaler = session.scalers[loss_id]
    lifecycles = resolved.lifecycles
    if scaler.static_value == 1.0 and not scaler.check_finite:
        for lifecycle in lifecycles:  # (a loop, not all() over a generator: this runs on every pass)
            if not lifecycle.can_pass_in_place():
                break
        else:
            return _PassInPlace(loss, session, lifecycles)
    return _CheckedPass(loss, session, lifecycles, loss_id, model, delay_unscale, delay_overflow_check)


def _abort(lifecycles: Sequence[GradLifecycle]) -> None:
    for lifecycle in lifecycles:
        lifecycle.abort_pass()


class _PassInPlace:
    # A static scale of 1, no check, no masters, nothing kept scaled (O0, O3): the backward's sum is
    # the true gradient and amp has nothing to do, as apex's short cut had it. Only the lifecycle's
    # state moves, so a step inside the block is still refused.
    __slots__ = ("_loss", "_session", "_lifecycles", "_casts_off")

    def __init__(self, loss: Tensor, session: AmpSession, lifecycles: list[GradLifecycle]) -> None:
        self._loss, self._session, self._lifecycles, self._casts_off = loss, session, lifecycles, None

    def __enter__(self) -> Tensor:
        lifecycles = self._lifecycles
        begun = 0
        try:
            for lifecycle in lifecycles:
                lifecycle.begin_pass_in_place()
                begun += 1
        except BaseException:
            _abort(lifecycles[:begun])
            raise
        loss = self._loss
        if self._session.properties.patch_torch_functions:
            self._casts_off = casting.disable_casts()  # see _CheckedPass
            self._casts_off.__enter__()
        # loss.float() of an fp32 loss is the loss itself: the same object, without a dispatcher call.
        return loss if loss.dtype is torch.float32 else loss.float()

    def __exit__(self, exc_type, exc, traceback) -> bool:
        if self._casts_off is not None:
            self._casts_off.__exit__(exc_type, exc, traceback)
        if exc_type is not None:
            _abort(self._lifecycles)
            return False  # the block's exception goes on
        session = self._session
        if not session.warned_unreached:
            _warn_if_unreached(session, self._lifecycles)
        for lifecycle in self._lifecycles:
            lifecycle.end_pass(None, None, delay_unscale=False)
        if session.properties.patch_torch_functions:
            casting.clear_cache()
        return False


def _warn_if_unreached(session: AmpSession, lifecycles: list[GradLifecycle]) -> None:
    for lifecycle in lifecycles:
        if lifecycle.has_new_grads():
            return
    session.warned_unreached = True
    logger.warning(
        "amp.scale_loss: the backward pass produced no gradient for any parameter of the optimizer(s) "
        "passed to it, so optimizer.step() will not change anything. The loss probably comes from a "
        "model whose parameters these optimizers do not hold (a model created or re-created after "
        "amp.initialize?); train the models and optimizers that amp.initialize returned"
    )


class _CheckedPass:
    # Every other pass: the loss is scaled, the backward writes fresh gradients beside those already
    # there (begin_pass stashes them), and the exit checks, unscales and accounts them.
    __slots__ = ("_loss", "_session", "_lifecycles", "_loss_id", "_model", "_delay_unscale", "_client_checks",
                 "_local_accumulation", "_casts_off")

    def __init__(
        self, loss: Tensor, session: AmpSession, lifecycles: list[GradLifecycle], loss_id: int,
        model: Optional[torch.nn.Module], delay_unscale: bool, client_checks: bool,
    ) -> None:
        self._loss, self._session, self._lifecycles, self._loss_id = loss, session, lifecycles, loss_id
        self._model, self._delay_unscale, self._client_checks = model, delay_unscale, client_checks
        self._local_accumulation, self._casts_off = False, None

    def __enter__(self) -> Tensor:
        session, lifecycles, loss_id, loss = self._session, self._lifecycles, self._loss_id, self._loss
        scaler = session.scalers[loss_id]
        session.flush_logs(check_collapse=True)  # raises once a loss scale has collapsed
        session.loaded_values.forget()  # a resume's loads are done once training runs
        session.follow_ddp_wrappers(self._model, lifecycles)  # once per wrapper: rank 0's masters
        local_accumulation = self._local_accumulation = _skips_grad_sync(self._model) or session.accumulates_in_fsdp2()
        if local_accumulation:
            # Checking these local gradients now would let ranks disagree on the
            # skip; unscaling them would keep them out of DDP's next all-reduce.
            # FSDP2 keeps them inside itself until a synchronising backward.
            self._delay_unscale = True
        session.settle_for_pass(lifecycles, loss_id)
        key = (loss_id, scaler.scale_epoch)
        begun = 0
        try:
            for lifecycle in lifecycles:
                lifecycle.begin_pass(key, local_accumulation)
                begun += 1
        except BaseException:
            _abort(lifecycles[:begun])
            raise

        if scaler.static_value == 1.0:
            scaled_loss = loss.float()
        elif scaler.static_value is not None:
            scaled_loss = loss.float() * scaler.static_value
        else:
            scaled_loss = loss.float() * scaler.scale_for_loss().to(loss.device)
        # Backward runs with O1's casts off: autograd replays each op's backward
        # under the caller's autocast state, and our Python-level O1 kernels would
        # otherwise be re-entered for every backward call. The gradients are the same.
        if session.properties.patch_torch_functions:
            self._casts_off = casting.disable_casts()
            self._casts_off.__enter__()
        return scaled_loss

    def __exit__(self, exc_type, exc, traceback) -> bool:
        if self._casts_off is not None:
            self._casts_off.__exit__(exc_type, exc, traceback)
        session, lifecycles, loss_id = self._session, self._lifecycles, self._loss_id
        if exc_type is not None:
            _abort(lifecycles)
            return False  # the block's exception goes on
        scaler = session.scalers[loss_id]
        if not self._local_accumulation and not session.warned_unreached:
            _warn_if_unreached(session, lifecycles)
        found_inf = scaler.found_inf_for_pass()  # zeroed; nothing keeps it past this exit
        client_checks = self._client_checks
        scale = PassScale(
            loss_id=loss_id, epoch=scaler.scale_epoch, inv_scale=scaler.inv_scale(),  # the scale these gradients carry
            unit=scaler.static_value == 1.0, checked=scaler.check_finite, client_checks=client_checks,
        )
        checked = [lifecycle for lifecycle in lifecycles if lifecycle.end_pass(scale, found_inf, self._delay_unscale)]
        if checked:
            # Accounting ends this scale's accumulation: optimizers an earlier delay_unscale pass of it
            # covered but this pass did not are taken in now, under the same flag (one update).
            others = session.take_in_accumulation(scale.key, found_inf)
            if others is not None:
                checked += [lifecycle for lifecycle in others.lifecycles if lifecycle not in checked]
            session.account(PassRecord(loss_id, found_inf, tuple(checked), scale.inv_scale, client_checks))
        if session.properties.patch_torch_functions:
            casting.clear_cache()
        return False
