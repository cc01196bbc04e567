"""apex_amp.integrations.lightning: a Lightning 2.x Trainer trains with ApexAmpPrecision at O1-O3.

Every run trains the same tiny classifier (16-32-2 with BatchNorm) from the same weights on the
same batches (no shuffling), with a Trainer on CPU, and is compared with the same Trainer in fp32.
"""

from __future__ import annotations

import copy
import dataclasses

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from apex_amp import amp
from apex_amp.amp import opt_levels, sessions
from apex_amp.integrations.lightning import ApexAmpPrecision
from apex_amp.optimizers import FusedAdam

HALF_DTYPES = [torch.float16, torch.bfloat16]
STEPS_PER_EPOCH = 8
CLIP = 0.05


def batches() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS_PER_EPOCH * 32, 16, generator=generator)
    y = (x[:, :4].sum(1) > 0).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


class Classifier(pl.LightningModule):
    """A 16-32-2 MLP with BatchNorm; FusedAdam and a step-interval StepLR schedule.

    ``overflow_at``: global steps whose loss is multiplied by ``overflow_factor`` (1e30: fp16
    gradients overflow at any loss scale; inf: so do bf16 ones), so the step must be skipped. ``record``: per step, the loss scale,
    whether the step was skipped, the learning rate and the gradient norms around clipping.
    """

    def __init__(self, overflow_at=(), manual=False, optimizer="FusedAdam", overflow_factor=1e30):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 2))
        self.overflow_at = set(overflow_at)
        self.overflow_factor = overflow_factor
        self.automatic_optimization = not manual
        self.optimizer_name = optimizer
        self.record = {"loss": [], "loss_scale": [], "skipped": [], "lr": [], "norm_before_clip": [],
                       "norm_after_clip": [], "master_dtypes": set()}

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.record["loss"].append(loss.item())
        if self.global_step in self.overflow_at:
            loss = loss * self.overflow_factor
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        optimizer.step()
        self.lr_schedulers().step()
        return None

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        params = list(self.trainer.precision_plugin.main_params(optimizer))  # what Lightning clips
        self.record["master_dtypes"] |= {p.dtype for p in params}
        self.record["norm_before_clip"].append(grad_norm(params))
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.record["norm_after_clip"].append(grad_norm(params))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).float(), y))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        optimizer = self.trainer.optimizers[0]
        self.record["lr"].append(optimizer.param_groups[0]["lr"])
        if isinstance(self.trainer.precision_plugin, ApexAmpPrecision):
            self.record["loss_scale"].append(amp.loss_scale())
            self.record["skipped"].append(amp.step_was_skipped(optimizer))

    def configure_optimizers(self):
        if self.optimizer_name == "FusedAdam":
            optimizer = FusedAdam(self.parameters(), lr=1e-2)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def grad_norm(params) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params if p.grad is not None])).item()


def trainer(max_epochs=2, plugin=None, **kwargs) -> pl.Trainer:
    return pl.Trainer(max_epochs=max_epochs, plugins=[plugin] if plugin else None, accelerator="cpu",
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


def fit(module, max_epochs=2, plugin=None, **kwargs) -> Classifier:
    trainer(max_epochs, plugin, **kwargs).fit(module, batches())
    return module


def fp32_weights(module) -> dict[str, torch.Tensor]:
    return {name: value.float() for name, value in module.state_dict().items() if value.is_floating_point()}


def relative_update_difference(trained, reference, initial) -> float:
    """|| (w - w0) - (w_ref - w0) || / || w_ref - w0 || over every floating tensor of the state."""
    w, w_ref, w0 = fp32_weights(trained), fp32_weights(reference), fp32_weights(initial)
    diff = sum(((w[k] - w_ref[k]) ** 2).sum() for k in w0)
    update = sum(((w_ref[k] - w0[k]) ** 2).sum() for k in w0)
    return (diff / update).sqrt().item()


@pytest.fixture(scope="module")
def fp32_reference():
    initial = Classifier()
    return initial, fit(copy.deepcopy(initial))


# Measured (weights, biases and batchnorm statistics after 16 steps): O1 and O2 8.2% from fp32's
# updates in fp16 and 7.7% in bf16 (O1 and O2 bitwise equal here), O3 7.6% in bf16. O3 in fp16
# keeps no fp32 copy at all: its weights drift far from fp32's (its loss still falls).
@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_trainer_with_the_plugin_trains_like_fp32(fp32_reference, opt_level, half_dtype):
    initial, reference = fp32_reference
    module = fit(copy.deepcopy(initial), plugin=ApexAmpPrecision(opt_level, half_dtype))

    first_layer, batchnorm = module.net[0].weight, module.net[1].weight
    assert first_layer.dtype == (torch.float32 if opt_level == "O1" else half_dtype)
    assert batchnorm.dtype == {"O1": torch.float32, "O2": torch.float32, "O3": half_dtype}[opt_level]
    losses = module.record["loss"]
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4])
    assert not any(module.record["skipped"])
    if (opt_level, half_dtype) != ("O3", torch.float16):
        difference = relative_update_difference(module, reference, initial)
        assert difference < 0.15, f"{opt_level} moved the weights {difference:.1%} away from fp32's"


def test_o2_masters_are_fp32_and_the_trainer_reports_the_precision():
    plugin = ApexAmpPrecision("O2", torch.bfloat16)
    run = trainer(1, plugin)
    module = Classifier()
    run.fit(module, batches())
    assert run.precision == "bf16-mixed"
    assert plugin.optimizers[0] is run.optimizers[0]
    assert {p.dtype for group in run.optimizers[0].param_groups for p in group["params"]} == {torch.float32}
    assert module.net[0].weight.dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 for k, v in module.state_dict().items() if v.is_floating_point())
    # After fit the module still evaluates (half model, its forward casting the inputs).
    validated = run.validate(module, batches(), verbose=False)[0]["val_loss"]
    with torch.no_grad():
        module.eval()
        losses = [F.cross_entropy(module(x).float(), y) for x, y in batches()]
    assert validated == pytest.approx(torch.stack(losses).mean().item(), rel=1e-6)
    assert validated < losses[0].new_tensor(module.record["loss"][:4]).mean().item()


def test_the_plugin_trains_a_recipe_of_your_own_whole():
    # O2 in bf16 with a static scale of 4, a scaler window of 3 and half batchnorm: every field
    # reaches amp's session as written (no plugin or initialize default rewrites one).
    mine = dataclasses.replace(opt_levels.O2, opt_level="O2-bf16-own", half_dtype=torch.bfloat16,
                               cast_model_type=torch.bfloat16, keep_batchnorm_fp32=False,
                               dynamic_loss_scale=False, loss_scale=4.0, scale_window=3, hysteresis=2)
    plugin = ApexAmpPrecision(mine, verbosity=0)
    run = trainer(2, plugin)
    module = Classifier()
    run.fit(module, batches())
    assert run.precision == "bf16-mixed"
    assert sessions.session_for(run.optimizers[0]).properties == mine
    assert module.net[0].weight.dtype == module.net[1].weight.dtype == torch.bfloat16
    assert set(module.record["loss_scale"]) == {4.0}
    losses = module.record["loss"]
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4])


def test_a_recipe_sets_the_precision_lightning_reports():
    o3_bf16 = opt_levels.resolve_properties("O3", half_dtype=torch.bfloat16)
    assert ApexAmpPrecision(dataclasses.replace(o3_bf16, opt_level="mine")).precision == "bf16-true"
    assert ApexAmpPrecision(opt_levels.O1).precision == "16-mixed"
    assert ApexAmpPrecision(opt_levels.O0, torch.bfloat16).precision == "32-true"


@pytest.mark.parametrize("optimizer", ["FusedAdam", "SGD"])
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_clipping_acts_on_the_unscaled_fp32_master_gradients(manual, optimizer):
    initial = Classifier(optimizer=optimizer)
    reference = fit(copy.deepcopy(initial), max_epochs=1, gradient_clip_val=CLIP)
    kwargs = {} if manual else {"gradient_clip_val": CLIP}
    module = copy.deepcopy(initial)
    module.automatic_optimization = not manual
    fit(module, max_epochs=1, plugin=ApexAmpPrecision("O2", torch.float16), **kwargs)

    if not manual:
        # The first step's gradient is fp32's (same weights, same batch), not 65536 times larger;
        # FusedAdam keeps it scaled until its fused step, so this is amp.master_params' unscaling.
        before, before_fp32 = module.record["norm_before_clip"][0], reference.record["norm_before_clip"][0]
        assert before == pytest.approx(before_fp32, rel=0.02)
        assert before > 2 * CLIP
        assert module.record["master_dtypes"] == {torch.float32}
        assert max(module.record["norm_after_clip"]) <= CLIP * 1.001
    if optimizer == "SGD":
        # Adam's step hardly depends on the gradient's scale; SGD's shows the clipping: the clipped
        # fp16 run follows the clipped fp32 run, the unclipped one does not.
        unclipped = fit(copy.deepcopy(initial), max_epochs=1, plugin=ApexAmpPrecision("O2", torch.float16))
        assert relative_update_difference(module, reference, initial) < 0.1
        assert relative_update_difference(unclipped, reference, initial) > 0.3


@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=["fp16", "bf16"])
def test_an_overflow_skips_the_step_backs_off_the_scale_and_holds_the_lr_schedule(half_dtype):
    module = Classifier(overflow_at={3}, overflow_factor=1e30 if half_dtype == torch.float16 else float("inf"))
    weights_before_overflow = {}

    class Snapshot(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                weights_before_overflow.update(copy.deepcopy(pl_module.state_dict()))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 4:  # the overflowing step has run
                for name, value in pl_module.state_dict().items():
                    if name.endswith("weight") or name.endswith("bias"):
                        assert torch.equal(value, weights_before_overflow[name]), name

    fit(module, max_epochs=2, plugin=ApexAmpPrecision("O2", half_dtype), callbacks=[Snapshot()])
    record = module.record
    assert record["skipped"] == [step == 3 for step in range(2 * STEPS_PER_EPOCH)]
    first_scale = 65536.0 if half_dtype == torch.float16 else 1.0
    assert record["loss_scale"][:3] == [first_scale] * 3
    if half_dtype == torch.float16:
        assert record["loss_scale"][3:] == [32768.0] * (2 * STEPS_PER_EPOCH - 3)
    # StepLR(step_size=5) counts the 15 steps taken, not the 16 optimizer calls.
    # Lightning steps the scheduler before on_train_batch_end: step s has seen s + 1 calls.
    taken = [step + 1 if step < 3 else step for step in range(2 * STEPS_PER_EPOCH)]
    assert record["lr"] == [1e-2 * 0.5 ** (count // 5) for count in taken]
    assert type(module.trainer.lr_scheduler_configs[0].scheduler) is torch.optim.lr_scheduler.StepLR


def test_without_holding_the_schedule_advances_on_skipped_steps():
    module = fit(Classifier(overflow_at={3}), plugin=ApexAmpPrecision("O2", torch.float16,
                                                                     hold_lr_on_skipped_steps=False))
    assert module.record["lr"] == [1e-2 * 0.5 ** ((step + 1) // 5) for step in range(2 * STEPS_PER_EPOCH)]


@pytest.mark.parametrize("optimizer", ["FusedAdam", "SGD"])
def test_resume_from_a_lightning_checkpoint_is_bitwise_at_o2_fp16_through_an_overflow(tmp_path, optimizer):
    overflows = {3, 21}  # one before the checkpoint (epoch 2 ends at step 16), one after it
    straight = fit(Classifier(overflows, optimizer=optimizer), max_epochs=4,
                   plugin=ApexAmpPrecision("O2", torch.float16))
    straight_amp = amp.state_dict()
    straight_optimizer = straight.trainer.optimizers[0].state_dict()

    first_half = trainer(2, ApexAmpPrecision("O2", torch.float16))
    first_half.fit(Classifier(overflows, optimizer=optimizer), batches())
    checkpoint = tmp_path / "half.ckpt"
    first_half.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["ApexAmpPrecision"]["loss_scaler0"]["loss_scale"] == 32768.0

    resumed = Classifier(overflows, optimizer=optimizer)
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # the checkpoint, not the fresh weights, must decide
    trainer(4, ApexAmpPrecision("O2", torch.float16)).fit(resumed, batches(), ckpt_path=checkpoint)

    assert resumed.record["skipped"] == [step == 21 for step in range(16, 32)]
    assert straight.record["skipped"][16:] == resumed.record["skipped"]
    assert amp.state_dict() == straight_amp
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 16384.0
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert straight.record["lr"][16:] == resumed.record["lr"]
    resumed_optimizer = resumed.trainer.optimizers[0].state_dict()
    for index, state in straight_optimizer["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(resumed_optimizer["state"][index][key])), key


def test_bad_arguments_raise_with_the_fix():
    with pytest.raises(ValueError, match="'O4' is not one of .* or an apex_amp.amp.recipe.Recipe"):
        ApexAmpPrecision("O4")
    with pytest.raises(TypeError, match="torch.float16 or torch.bfloat16"):
        ApexAmpPrecision("O2", torch.float32)
    with pytest.raises(TypeError, match=r"\['optimizers'\]"):
        ApexAmpPrecision("O2", optimizers=[])
    with pytest.raises(TypeError, match=r"\['init_scale'\]"):
        ApexAmpPrecision("O2", init_scale=2.0**10)
    assert ApexAmpPrecision("O2", loss_scale=128.0, verbosity=0)._initialize_kwargs == {
        "loss_scale": 128.0, "verbosity": 0}


def test_a_plugin_connects_to_one_fit_only():
    plugin = ApexAmpPrecision("O2", torch.bfloat16)
    fit(Classifier(), max_epochs=1, plugin=plugin)
    with pytest.raises(RuntimeError, match="new Trainer with a new ApexAmpPrecision"):
        fit(Classifier(), max_epochs=1, plugin=plugin)


def test_o2_under_ddp_is_refused_with_the_reason(process_group):
    model = torch.nn.parallel.DistributedDataParallel(Classifier())
    optimizer = FusedAdam(model.parameters())
    with pytest.raises(ValueError, match="before that wrap. Use opt_level='O1' with DDP"):
        ApexAmpPrecision("O2").connect(model, [optimizer], [])
    assert model.module.net[0].weight.dtype == torch.float32


def test_o1_under_ddp_initializes_the_wrapped_module_and_steps_like_without_ddp(process_group):
    # One gloo rank in this process: the plugin's DDP path (initialize the module inside the wrapper,
    # scale_loss with model=the wrapper) against the same steps on the bare module.
    x, y = next(iter(batches()))
    weights = []
    for wrap in (False, True):
        module = Classifier()
        model = torch.nn.parallel.DistributedDataParallel(module) if wrap else module
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        plugin = ApexAmpPrecision("O1", torch.bfloat16, verbosity=0)
        connected, optimizers, _ = plugin.connect(model, [optimizer], [])
        assert connected is model and optimizers == [optimizer]
        for _ in range(3):
            optimizer.zero_grad()
            plugin.backward(F.cross_entropy(connected(x).float(), y), module, optimizer)
            optimizer.step()
        weights.append(module.state_dict())
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name


def test_lbfgs_is_refused():
    module = Classifier()
    with pytest.raises(ValueError, match="LBFGS"):
        ApexAmpPrecision("O1").optimizer_step(torch.optim.LBFGS(module.parameters()), module, lambda: None)
