"""The apex.amp integrations of mmengine, PyTorch Lightning 1.x and ignite, restated and run on apex_amp.

Each client's amp calls are rewritten here from its source (mmengine 0.10.7
``optim/optimizer/apex_optimizer_wrapper.py`` and ``optimizer_wrapper.py``,
Lightning 1.9.5 ``plugins/precision/apex_amp.py``, ignite 0.5.5
``engine/__init__.py::supervised_training_step_apex``): when they call
``initialize`` and what they probe first, how they clear gradients,
accumulate, clip, checkpoint and resume. Each run is compared with a plain
fp32 loop over the same batches that skips the steps amp must skip.
``tests/test_mmengine_apex.py`` runs mmengine itself through the compat
distribution.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

from apex_amp import amp

BF16 = torch.bfloat16
OVERFLOW = 1e38


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x).float(), y)


def weights(model) -> dict:
    return {name: value.detach().float().clone() for name, value in model.state_dict().items()}


def assert_close_weights(a: dict, b: dict, tolerance: float):
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=tolerance, rtol=tolerance, msg=name)


def saved(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ---- mmengine: ApexOptimWrapper -------------------------------------------------------------------
class MmengineStyleWrapper:
    """mmengine's ``ApexOptimWrapper`` as its amp calls run.

    ``optim_context`` (entered around every forward) calls ``amp.initialize`` whenever the
    optimizer has no ``_amp_stash``; ``load_state_dict`` loads the amp state at once when that
    attribute exists and keeps it for the first ``optim_context`` otherwise; ``update_params``
    divides the loss by the accumulation count, clips over ``optimizer.param_groups``, steps and
    zeroes the gradients.
    """

    def __init__(self, optimizer, accumulative_counts=1, clip_grad=None, **amp_kwargs):
        self.optimizer = optimizer
        self.accumulative_counts = accumulative_counts
        self.clip_grad = clip_grad
        self.amp_kwargs = amp_kwargs
        self.inner_count = 0
        self.initialize_calls = 0
        self._pending_amp_state = None

    @contextlib.contextmanager
    def optim_context(self, model):
        if not hasattr(self.optimizer, "_amp_stash"):
            self.initialize_calls += 1
            model, self.optimizer = amp.initialize(model, self.optimizer, **self.amp_kwargs)
            if self._pending_amp_state is not None:
                amp.load_state_dict(self._pending_amp_state)
                self._pending_amp_state = None
        yield

    def update_params(self, loss):
        with amp.scale_loss(loss / self.accumulative_counts, self.optimizer) as scaled_loss:
            scaled_loss.backward()
        self.inner_count += 1
        if self.inner_count % self.accumulative_counts == 0:
            if self.clip_grad is not None:
                params = [p for group in self.optimizer.param_groups for p in group["params"]
                          if p.requires_grad and p.grad is not None]
                nn.utils.clip_grad_norm_(params, **self.clip_grad)
            self.optimizer.step()
            self.optimizer.zero_grad()

    def state_dict(self):
        state = self.optimizer.state_dict()
        state["apex_amp"] = amp.state_dict()
        return state

    def load_state_dict(self, state):
        state = dict(state)
        if "apex_amp" in state:
            if hasattr(self.optimizer, "_amp_stash"):
                amp.load_state_dict(state.pop("apex_amp"))
            else:
                self._pending_amp_state = state.pop("apex_amp")
        self.optimizer.load_state_dict(state)


def mmengine_run(opt_level, data, wrapper=None, model=None, **options):
    model = model if model is not None else make_model()
    if wrapper is None:
        wrapper = MmengineStyleWrapper(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       opt_level=opt_level, verbosity=0, **options)
    for x, y in data:
        with wrapper.optim_context(model):
            loss = loss_of(model, x, y)
        wrapper.update_params(loss)
    return model, wrapper


def fp32_run(data, accumulate=1, skip=(), clip=None, lr=0.05):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for index, (x, y) in enumerate(data):
        (loss_of(model, x, y) / accumulate).backward()
        if (index + 1) % accumulate == 0:
            if index // accumulate not in skip:
                if clip is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), **clip)
                optimizer.step()
            optimizer.zero_grad()
    return model


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_mmengine_wrapper_initializes_once_and_trains_like_fp32(opt_level):
    data = batches(8)
    model, wrapper = mmengine_run(opt_level, data, half_dtype=BF16)
    assert wrapper.initialize_calls == 1  # before _amp_stash: RuntimeError at the second iteration
    assert_close_weights(weights(model), weights(fp32_run(data)), tolerance=3e-2)


def test_mmengine_wrapper_with_amp_disabled_initializes_every_iteration_and_trains_in_fp32():
    data = batches(6)
    model, wrapper = mmengine_run("O2", data, enabled=False)
    assert wrapper.initialize_calls == len(data)
    assert_close_weights(weights(model), weights(fp32_run(data)), tolerance=0.0)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("load", ["before initialize (Runner.resume)", "after initialize"])
def test_mmengine_wrapper_resume_continues_bitwise(opt_level, load):
    options = dict(half_dtype=BF16, loss_scale="dynamic")
    data = batches(8)
    model_full, _ = mmengine_run(opt_level, data, **options)

    model_half, wrapper_half = mmengine_run(opt_level, data[:4], **options)
    checkpoint = saved({"model": model_half.state_dict(), "optimizer": wrapper_half.state_dict()})
    assert checkpoint["optimizer"]["apex_amp"]["loss_scaler0"]["unskipped"] == 4

    model = make_model(seed=5)  # other weights: everything must come from the checkpoint
    wrapper = MmengineStyleWrapper(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   opt_level=opt_level, verbosity=0, **options)
    model.load_state_dict(checkpoint["model"])
    if load.startswith("after"):
        with wrapper.optim_context(model):
            pass
    wrapper.load_state_dict(checkpoint["optimizer"])
    mmengine_run(opt_level, data[4:], wrapper=wrapper, model=model)
    assert wrapper.initialize_calls == 1
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 8
    for name, value in model_full.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def test_mmengine_wrapper_accumulates_and_clips_over_param_groups_at_o2():
    data = batches(8)
    clip = {"max_norm": 0.5}
    model = make_model()
    wrapper = MmengineStyleWrapper(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   accumulative_counts=2, clip_grad=clip, opt_level="O2", verbosity=0,
                                   half_dtype=BF16, loss_scale="dynamic")
    mmengine_run("O2", data, wrapper=wrapper, model=model)
    assert_close_weights(weights(model), weights(fp32_run(data, accumulate=2, clip=clip)), tolerance=3e-2)


# ---- PyTorch Lightning 1.x: ApexMixedPrecisionPlugin ----------------------------------------------
class LightningStyleApexPlugin:
    """Lightning 1.9.5's ``ApexMixedPrecisionPlugin`` as its amp calls run.

    ``dispatch`` initializes the LightningModule with the trainer's list of optimizers;
    ``backward`` scales the closure's loss with the optimizer being stepped (the whole list
    under manual optimization); clipping reads ``main_params`` = ``amp.master_params``, after
    the closure and before ``optimizer.step(**kwargs)``; checkpoints hold ``amp.state_dict()``.
    """

    def __init__(self, amp_level="O2", **amp_kwargs):
        self.amp_level = amp_level
        self.amp_kwargs = amp_kwargs

    def dispatch(self, module, optimizers):
        _, optimizers = amp.initialize(module, optimizers, opt_level=self.amp_level, **self.amp_kwargs)
        return optimizers

    def backward(self, loss, optimizer):
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()

    def main_params(self, optimizer):
        return amp.master_params(optimizer)

    def optimizer_step(self, optimizer, closure, gradient_clip_val=None):
        closure()
        if gradient_clip_val is not None:
            nn.utils.clip_grad_norm_(self.main_params(optimizer), gradient_clip_val)
        return optimizer.step()

    def state_dict(self):
        return amp.state_dict()


def test_lightning_plugin_trains_clips_logs_grad_norms_and_skips_an_overflow_like_fp32():
    data = batches(6)
    factors = [1.0, 1.0, OVERFLOW, 1.0, 1.0, 1.0]
    module = make_model()
    optimizers = [torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)]
    plugin = LightningStyleApexPlugin("O2", half_dtype=BF16, loss_scale="dynamic", verbosity=0)
    optimizers = plugin.dispatch(module, optimizers)
    optimizer = optimizers[0]
    norms = []  # a callback's grad-norm logger, run inside optimizer.step()
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: norms.append(
        float(torch.nn.utils.get_total_norm([p.grad for p in plugin.main_params(opt) if p.grad is not None]))))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    skipped = []
    for (x, y), factor in zip(data, factors):
        def closure():
            optimizer.zero_grad()
            loss = loss_of(module, x, y) * factor
            plugin.backward(loss, optimizer)
            return loss
        plugin.optimizer_step(optimizer, closure, gradient_clip_val=1.0)
        skipped.append(amp.step_was_skipped(optimizer))
        scheduler.step()
    assert skipped == [False, False, True, False, False, False]
    # Inside the skipped step the optimizer sees no gradients (amp hides them from a torch optimizer).
    assert len(norms) == 6 and norms[2] == 0.0 and all(0.0 < norm < 1e4 for i, norm in enumerate(norms) if i != 2)
    reference = make_model()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_optimizer, step_size=2, gamma=0.5)
    for index, (x, y) in enumerate(data):
        ref_optimizer.zero_grad()
        loss_of(reference, x, y).backward()
        nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        if index != 2:
            ref_optimizer.step()
        ref_scheduler.step()
    # Running statistics differ: the skipped step's forward moved them in both runs alike.
    assert_close_weights(weights(module), weights(reference), tolerance=3e-2)
    assert plugin.state_dict()["loss_scaler0"]["loss_scale"] == 32768.0


def test_lightning_manual_optimization_scales_with_the_list_of_optimizers():
    # With manual optimization Lightning passes trainer.optimizers (a list) to scale_loss.
    generator, discriminator = make_model(0), make_model(1)
    optimizers = [torch.optim.SGD(generator.parameters(), lr=0.05), torch.optim.SGD(discriminator.parameters(), lr=0.05)]
    plugin = LightningStyleApexPlugin("O1", half_dtype=BF16, verbosity=0)
    _, optimizers = amp.initialize([generator, discriminator], optimizers, opt_level="O1", half_dtype=BF16,
                                   verbosity=0)
    before = [weights(generator), weights(discriminator)]
    for x, y in batches(2):
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = loss_of(generator, x, y) + loss_of(discriminator, x, y)
        plugin.backward(loss, optimizers)
        for optimizer in optimizers:
            optimizer.step()
    after = [weights(generator), weights(discriminator)]
    assert all(not torch.equal(b["0.weight"], a["0.weight"]) for b, a in zip(before, after))


# ---- ignite: supervised_training_step_apex ---------------------------------------------------------
def ignite_update(model, optimizer, loss_fn, accumulation_steps):
    """ignite 0.5.5's apex update function: zero_grad at a window's start, loss / steps, step at its end."""
    def update(iteration, batch):
        if (iteration - 1) % accumulation_steps == 0:
            optimizer.zero_grad()
        model.train()
        x, y = batch
        loss = loss_fn(model(x), y)
        if accumulation_steps > 1:
            loss = loss / accumulation_steps
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        if iteration % accumulation_steps == 0:
            optimizer.step()
        return loss.item() * accumulation_steps
    return update


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_ignite_accumulation_skips_a_window_with_an_overflow_like_fp32(opt_level):
    data = batches(12)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    amp.initialize(model, optimizer, opt_level=opt_level, half_dtype=BF16, loss_scale="dynamic", verbosity=0)
    poisoned = 6  # iteration 6 is inside the second window (iterations 5-8)

    def loss_fn(output, target):
        loss = nn.functional.cross_entropy(output.float(), target)
        return loss * OVERFLOW if loss_fn.iteration == poisoned else loss

    update = ignite_update(model, optimizer, loss_fn, accumulation_steps=4)
    skipped = []
    for iteration, batch in enumerate(data, start=1):
        loss_fn.iteration = iteration
        update(iteration, batch)
        if iteration % 4 == 0:
            skipped.append(amp.step_was_skipped(optimizer))
    assert skipped == [False, True, False]
    assert_close_weights(weights(model), weights(fp32_run(data, accumulate=4, skip={1})), tolerance=3e-2)
