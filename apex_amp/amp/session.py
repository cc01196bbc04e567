"""``AmpSession``: everything one ``amp.initialize`` call made, and the one place each pass is accounted.

A session owns its loss scalers, the gradient lifecycle and step hooks of each
optimizer, the master lookup, the DDP wrappers its models ran under, and the
overflow recorder when reports are on. How amp finds a session from a user's
optimizer is :mod:`apex_amp.amp.sessions`.
"""

from __future__ import annotations

import logging
import re
import weakref
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from . import distributed
from .fsdp2 import ShardedModels
from .gradients import GradLifecycle
from .loss_scaler import LossScaler
from .master_weights import LoadedValues, MasterLink
from .opt_levels import AmpProperties
from .pass_records import PassRecord
from .step_hooks import StepHooks

__all__ = ["AmpSession"]

logger = logging.getLogger("apex_amp")

_CONFIG_KEY = "amp_config"  # the settings a checkpoint was saved with (see AmpSession.state_dict)
_FP8_KEY = "fp8"  # the fp8 scales and amax histories, when fp8 is on


class AmpSession:
    """The scalers, optimizer states and master weights created by one ``initialize`` call."""

    def __init__(self, properties: Optional[AmpProperties], device: torch.device, verbosity: int) -> None:
        self.properties = properties
        self.enabled = properties is not None
        self.device = torch.device(device)
        self.verbosity = verbosity
        # Process group whose ranks must agree on every skip (initialize's sync_overflow; distributed.py).
        self.overflow_group: Any = None
        self.fsdp2: Optional[ShardedModels] = None  # the models fully_shard shards (fsdp2.py)
        self.warned_unreached = False  # the "backward reached no parameter" warning is logged once
        self.scalers: list[LossScaler] = []
        if properties is not None:
            self.scalers = [
                LossScaler(
                    loss_id,
                    self.device,
                    init_scale=properties.loss_scale,
                    dynamic=properties.dynamic_loss_scale,
                    check_finite=properties.check_finite,
                    min_scale=properties.min_loss_scale,
                    max_scale=properties.max_loss_scale,
                    scale_window=properties.scale_window,
                    hysteresis=properties.hysteresis,
                    consecutive_hysteresis=properties.consecutive_hysteresis,
                    log_enabled=verbosity >= 1,
                    collapse_warn_steps=properties.collapse_warn_steps,
                    collapse_raise_steps=properties.collapse_raise_steps,
                )
                for loss_id in range(properties.num_losses)
            ]
        self.lifecycles: "weakref.WeakKeyDictionary[torch.optim.Optimizer, GradLifecycle]" = weakref.WeakKeyDictionary()
        self._master_of = WeakIdKeyDictionary()  # half model param -> fp32 master
        self.loaded_values = LoadedValues()  # fp32 values loaded into half params without a master yet
        # DistributedDataParallel wrappers the models ran under (noted by a forward pre-hook), and
        # for each wrapper the lifecycles whose masters were synchronised over it (distributed.py).
        # A list, in the order the forwards met them: every rank broadcasts in that same order.
        self.ddp_wrappers: "list[weakref.ref[torch.nn.Module]]" = []
        self.synced_wrappers: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet]" = (
            weakref.WeakKeyDictionary()
        )
        self.overflow_recorder: Any = None  # diagnostics.overflow.OverflowRecorder when reports are on
        self.fp8: Any = None  # fp8_training.Fp8Training when fp8 is on: its scales and amax histories

    # ---- masters ------------------------------------------------------------
    def register_masters(self, links: Iterable[MasterLink]) -> None:
        for link in links:
            self._master_of[link.model_param] = link.master

    def master_of(self, param: Tensor) -> Optional[Tensor]:
        return self._master_of.get(param)

    # model.load_state_dict of a half model (model_casting.add_fp32_state_dict_hooks).
    def before_model_load(self) -> None:
        """Give param groups added since ``initialize`` their masters, so the load reaches them."""
        for lifecycle in list(self.lifecycles.values()):
            lifecycle.take_in_param_groups()

    def loaded_without_master(self, param: Tensor, value: Tensor) -> None:
        """A loaded fp32 ``value`` of a half ``param`` with no master: a master made later starts from it."""
        if self.properties.master_weights:
            self.loaded_values.remember(param, value)

    # ---- optimizers ---------------------------------------------------------
    def add_optimizer(self, optimizer: torch.optim.Optimizer, links: list[MasterLink], wrapped: bool = False) -> None:
        lifecycle = GradLifecycle(
            optimizer, links, device=self.device, make_masters=bool(self.properties.master_weights),
            on_new_links=self.register_masters, wrapped=wrapped,
            fp32_value_of=self.loaded_values.take,
        )
        self.lifecycles[optimizer] = lifecycle
        # Kept alive by the hooks it registers on the optimizer.
        StepHooks(optimizer, lifecycle, logs=[scaler.log for scaler in self.scalers],
                  casts_off_in_step=self.properties.patch_torch_functions)
        # optimizer.load_state_dict casts each loaded state to its parameter's dtype: a group added
        # since initialize must hold its fp32 masters by then, or its moments would be rounded to half.
        optimizer.register_load_state_dict_pre_hook(lambda _optimizer, _state: lifecycle.take_in_param_groups())

    def lifecycle_of(self, optimizer: torch.optim.Optimizer) -> GradLifecycle:
        return self.lifecycles[optimizer]

    # ---- one checked backward pass -----------------------------------------------------
    def account(self, record: PassRecord) -> None:
        """The one place a checked backward pass is accounted (no host sync unless reports are on).

        The ranks agree on its flag, its loss's scale is updated (and an overflow logged) unless
        the pass left that to the client (``delay_overflow_check=True``: ``update_scale()``), each
        optimizer whose gradients it checked notes the flag for its next step, and an overflow
        report is recorded when the user asked for them.
        """
        distributed.agree_on_overflow(record.found_inf, self.overflow_group)
        # delay_overflow_check=True: the client updates the scale once per step (update_scale()).
        overflowed = None if record.client_checks else self.scalers[record.loss_id].update(record.found_inf)
        for lifecycle in record.lifecycles:
            lifecycle.skip.note(record.found_inf, overflowed, guards_only=record.client_checks)
        if self.overflow_recorder is not None:
            self.overflow_recorder.record(record.found_inf, record.loss_id, record.inv_scale, record.lifecycles)

    def settle_for_pass(self, lifecycles: Sequence[GradLifecycle], loss_id: int) -> None:
        """Before a pass of ``loss_id``: settle every lifecycle that cannot add to its kept gradients in place.

        Taking a DELAYED accumulation in checks it, and accounting it updates its loss's scale,
        which can change the key of this very pass: so this repeats until none needs it.
        """
        while True:
            key = (loss_id, self.scalers[loss_id].scale_epoch)
            stale = [lifecycle for lifecycle in lifecycles if lifecycle.must_settle_before(key)]
            if not stale:
                return
            for lifecycle in stale:
                delayed = lifecycle.delayed_key()
                if delayed is None:
                    lifecycle.settle()
                    continue
                record = self.take_in_accumulation(delayed, torch.zeros(1, device=self.device))
                if record is not None:
                    self.account(record)

    def take_in_accumulation(self, key: tuple[int, int], found_inf: Tensor) -> Optional[PassRecord]:
        """Check and unscale every DELAYED accumulation of ``key`` (loss_id, scale epoch) into ``found_inf``.

        The passes of one loss between two updates of its scale are one accumulation, however
        many optimizers they covered, so every optimizer still holding one is taken in at once and
        the accumulation is accounted once (by the caller, with the returned record; None when
        nothing checked was taken in).
        """
        taken, kept_scale = [], None
        for lifecycle in list(self.lifecycles.values()):
            if lifecycle.delayed_key() == key:
                kept = lifecycle.settle(found_inf)
                if kept is not None:
                    taken.append(lifecycle)
                    kept_scale = kept
        if not taken:
            return None
        return PassRecord(key[0], found_inf, tuple(taken), kept_scale.inv_scale, kept_scale.client_checks)

    def accumulates_in_fsdp2(self) -> bool:
        """Whether a backward now leaves its gradients inside FSDP2 (``set_requires_gradient_sync(False)``)."""
        return self.fsdp2 is not None and self.fsdp2.skips_grad_sync()

    # ---- DistributedDataParallel -----------------------------------------------------
    def follow_ddp_wrappers(self, model: Optional[nn.Module], lifecycles: Sequence[GradLifecycle]) -> None:
        """At a pass: give ``lifecycles`` rank 0's masters over each DDP wrapper not yet followed.

        The wrappers are ``model`` (``scale_loss(model=...)``) and those the models' forwards ran under,
        in the order they were met, which is the same on every rank (each broadcast is a collective).
        """
        self._follow(model, lifecycles, warn_outside=True)
        for wrapper_ref in self.ddp_wrappers:
            self._follow(wrapper_ref(), lifecycles, warn_outside=False)

    def _follow(self, wrapper: Optional[nn.Module], lifecycles: Sequence[GradLifecycle], warn_outside: bool) -> None:
        if not isinstance(wrapper, nn.parallel.DistributedDataParallel):
            return
        done = self.synced_wrappers.setdefault(wrapper, weakref.WeakSet())
        for lifecycle in lifecycles:
            if lifecycle in done:
                continue
            done.add(lifecycle)
            distributed.broadcast_masters(wrapper, lifecycle.params.links)
            if warn_outside and self.overflow_group is None:
                distributed.warn_if_outside(wrapper, lifecycle.params)

    def sync_masters(self, model: nn.Module, lifecycles: Sequence[GradLifecycle]) -> None:
        """``amp.sync_masters``: rank 0's masters now, over ``model``'s group (a wrapper is then followed)."""
        for lifecycle in lifecycles:
            distributed.broadcast_masters(model, lifecycle.params.links)
            if isinstance(model, nn.parallel.DistributedDataParallel):
                self.synced_wrappers.setdefault(model, weakref.WeakSet()).add(lifecycle)

    def flush_logs(self, block: bool = False, check_collapse: bool = False) -> None:
        for scaler in self.scalers:
            scaler.log.flush(block=block)
        if check_collapse:  # only where nothing is half-done: the start of scale_loss
            for scaler in self.scalers:
                scaler.log.raise_if_collapsed()

    # ---- checkpoints ----------------------------------------------------------
    # The settings a checkpoint was saved with ride inside each loss scaler's entry: NVIDIA apex's
    # amp.load_state_dict raises on any top-level key without "loss_scaler" in its name and reads
    # only "loss_scale" and "unskipped" from each entry, so this format loads there too. Older
    # checkpoints of ours carry the same dict at the top level; both load here.
    def _config(self) -> dict[str, Any]:
        return {
            "opt_level": self.properties.opt_level,
            "half_dtype": str(self.properties.half_dtype),
            "num_losses": self.properties.num_losses,
        }

    def state_dict(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        state = {f"loss_scaler{i}": {**scaler.state_dict(), _CONFIG_KEY: self._config()}
                 for i, scaler in enumerate(self.scalers)}
        if self.fp8 is not None:
            state[_FP8_KEY] = self.fp8.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"amp.load_state_dict expects the dict from amp.state_dict(), got {type(state_dict).__name__}")
        if not self.enabled:
            return
        state_dict, fp8_state = self._split_fp8_state(state_dict)
        expected = {f"loss_scaler{i}" for i in range(len(self.scalers))}
        given = set(state_dict) - {_CONFIG_KEY}
        foreign = sorted(str(key) for key in given if not re.fullmatch(r"loss_scaler\d+", str(key)))
        if foreign:
            raise ValueError(
                f"amp.load_state_dict got keys {foreign}, which amp.state_dict() never writes (it writes "
                f"{sorted(expected)}); pass the amp part of the checkpoint, e.g. "
                "amp.load_state_dict(checkpoint['amp']), not the whole checkpoint"
            )
        if not given:
            raise ValueError(
                f"amp state has no loss scalers (this run has {sorted(expected)}); pass the dict that "
                "amp.state_dict() returned, e.g. amp.load_state_dict(checkpoint['amp'])"
            )
        if given != expected:
            # apex loaded what fits and said so; a run may add or drop a loss between checkpoints.
            logger.warning(
                "amp.load_state_dict: the state has loss scalers %s but this run has %s (num_losses=%d); "
                "loading the ones both have%s%s",
                sorted(given), sorted(expected), len(self.scalers),
                f", skipping {sorted(given - expected)}" if given - expected else "",
                f", {sorted(expected - given)} keep their current state" if expected - given else "",
            )
        configs = [("amp state", state_dict.get(_CONFIG_KEY))]
        entries = {}
        for key in sorted(given):
            entry = state_dict[key]
            if isinstance(entry, Mapping) and _CONFIG_KEY in entry:
                configs.append((f"amp state {key!r}", entry[_CONFIG_KEY]))
                entry = {name: value for name, value in entry.items() if name != _CONFIG_KEY}
            entries[key] = entry
        for where, config in configs:
            self._check_config(where, config)
        # Validate every scaler before changing any, so a bad entry changes nothing.
        loaded = [(scaler, entries[f"loss_scaler{i}"]) for i, scaler in enumerate(self.scalers)
                  if f"loss_scaler{i}" in entries]
        for scaler, state in loaded:
            scaler.checked_state(state)
        if fp8_state is not None:
            self.fp8.load_state_dict(fp8_state)  # validates everything before it copies
        for scaler, state in loaded:
            scaler.load_state_dict(state)

    # ---- fp8 (fp8_training.py): the scales and amax histories ride under one key --------------
    def _split_fp8_state(self, state_dict: Mapping[str, Any]) -> tuple[Mapping[str, Any], Optional[Mapping]]:
        fp8_state = state_dict.get(_FP8_KEY)
        if fp8_state is None:
            if self.fp8 is not None:
                logger.warning("amp.load_state_dict: the state has no fp8 scales (saved without fp8); "
                               "this run's fp8 scales start afresh")
            return state_dict, None
        if self.fp8 is None:
            raise ValueError(
                "amp state holds fp8 scales (saved with fp8=True) but this run has fp8 off; initialize with "
                "fp8=True (and the same amp.Fp8Recipe), or drop the 'fp8' entry to resume without fp8"
            )
        return {key: value for key, value in state_dict.items() if key != _FP8_KEY}, fp8_state

    def _check_config(self, where: str, config: Any) -> None:
        if config is None:
            return  # apex's checkpoints carry no settings
        if not isinstance(config, Mapping):
            raise TypeError(
                f"{where}: {_CONFIG_KEY!r} must be a dict, got {type(config).__name__}; "
                "was the checkpoint saved by amp.state_dict()?"
            )
        for key, value in self._config().items():
            if key != "num_losses" and config.get(key) != value:
                raise ValueError(
                    f"amp state was saved with {key}={config.get(key)!r} but this run uses {key}={value!r}; "
                    "initialize with the settings of the run that saved the checkpoint"
                )
