"""apex's unwritten contract: what third-party code written for NVIDIA apex relies on without apex's docs saying so.

Each behaviour comes from a client's integration code or from apex's own
``apex/amp/*.py`` (commit e13873de): ``amp.master_params`` callable anywhere
(a grad-norm logger inside ``optimizer.step()``), checkpoints NVIDIA apex can
load, masters for groups added after ``initialize`` (a resume that re-adds a
param group), apex's custom-batch protocol under O2, ``optimizer._amp_stash``
and ``amp._amp_state``, and clear errors where apex failed later or silently.
"""

from __future__ import annotations

import collections
import copy
import io
import subprocess
import sys
import types
from typing import NamedTuple

import pytest
import torch
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import LARC, FusedAdam

from _misuse import BF16, batch, small_model
from test_o2_client_patterns import make_optimizer

OVERFLOW = 1e38  # times a loss: inf once scaled, at every half dtype


def step(model, optimizer, seed=0, factor=1.0):
    optimizer.zero_grad()
    loss = model(batch(seed)).float().pow(2).mean() * factor
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def trained_state(model, optimizer, buffers=False):
    """Weights (the masters under O2), optimizer state and optionally buffers, as exact copies.

    A skipped step still ran its forward, which moves BatchNorm's running statistics.
    """
    names = {name for name, _ in model.named_parameters()}
    return {
        "model": {name: value.clone() for name, value in model.state_dict().items() if buffers or name in names},
        "params": [p.detach().clone() for group in optimizer.param_groups for p in group["params"]],
        "state": copy.deepcopy([optimizer.state.get(p, {}) for group in optimizer.param_groups
                                for p in group["params"]]),
    }


def assert_equal_trees(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_equal_trees(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal_trees(x, y)
    else:
        assert a == b


# ---- amp.master_params anywhere ----------------------------------------------------------------
def _read_master_params(optimizer, *unused):
    # What a grad-norm logger in a step hook does.
    params = list(amp.master_params(optimizer))
    torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("hook", ["pre-hook after initialize", "pre-hook before initialize",
                                  "post-hook after initialize", "post-hook before initialize"])
def test_master_params_inside_optimizer_step_keeps_an_overflowed_step_skipped(opt_level, kind, hook):
    model = small_model()
    optimizer = make_optimizer(kind, model.parameters())
    register = optimizer.register_step_pre_hook if hook.startswith("pre") else optimizer.register_step_post_hook
    if hook.endswith("before initialize"):
        register(_read_master_params)
    amp.initialize(model, optimizer, opt_level=opt_level, half_dtype=BF16, loss_scale="dynamic", verbosity=0)
    if hook.endswith("after initialize"):
        register(_read_master_params)
    step(model, optimizer)  # a clean step: moments and momentum exist
    before = trained_state(model, optimizer)
    step(model, optimizer, seed=1, factor=OVERFLOW)  # raised AttributeError and corrupted the weights
    assert amp.step_was_skipped(optimizer)
    assert_equal_trees(before, trained_state(model, optimizer))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    step(model, optimizer, seed=2)  # and training goes on
    assert not amp.step_was_skipped(optimizer)
    assert not torch.equal(before["params"][0], list(amp.master_params(optimizer))[0])


def test_issue_reproducer_master_params_in_a_step_pre_hook_under_o1_fp16():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: (list(amp.master_params(opt)), None)[1])
    weights = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(model(torch.randn(3, 4)).sum(), optimizer) as scaled:  # 65536 overflows fp16
        scaled.backward()
    optimizer.step()
    assert amp.step_was_skipped(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_master_params_before_any_initialize_yields_the_optimizers_parameters():
    # A fresh interpreter: no initialize of this process has run there.
    code = ("import torch; from apex_amp import amp; m = torch.nn.Linear(2, 2); "
            "o = torch.optim.SGD(m.parameters(), lr=0.1); "
            "assert [id(p) for p in amp.master_params(o)] == [id(p) for p in m.parameters()]; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_master_params_of_an_optimizer_amp_never_saw_yields_its_parameters():
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = small_model(2)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    amp.initialize(other, other_optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
    assert [id(p) for p in amp.master_params(optimizer)] == [id(p) for p in model.parameters()]
    assert len(list(amp.master_params(LARC(optimizer)))) == len(list(model.parameters()))


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
def test_master_params_between_delay_unscale_passes_changes_nothing(kind):
    # apex's master_params was a plain generator: reading it mid-accumulation neither unscaled nor
    # accounted anything. A run that calls it there ends bitwise where a run that does not ends.
    def run(read_between: bool):
        model = small_model()
        optimizer = make_optimizer(kind, model.parameters())
        amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, loss_scale="dynamic", verbosity=0)
        for seed in range(3):
            optimizer.zero_grad()
            for micro in range(3):
                loss = model(batch(10 * seed + micro)).float().pow(2).mean()
                with amp.scale_loss(loss, optimizer, delay_unscale=micro < 2) as scaled:
                    scaled.backward()
                if read_between and micro < 2:
                    list(amp.master_params(optimizer))
            optimizer.step()
        return trained_state(model, optimizer, buffers=True), amp.state_dict()

    assert_equal_trees(run(False), run(True))


def test_master_params_inside_a_scale_loss_block_changes_nothing():
    model = small_model()
    optimizer = make_optimizer("FusedAdam", model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
    step(model, optimizer)
    before = trained_state(model, optimizer)
    with amp.scale_loss(model(batch(1)).float().sum(), optimizer) as scaled:
        scaled.backward()
        amp.master_params(optimizer)
        masters = optimizer._amp_stash.all_fp32_from_fp16_params
        assert masters and all(p.grad is None for p in masters)  # the pass is not taken in yet
    assert all(p.grad is not None for p in masters)  # taken in at the block's exit, as always
    assert_equal_trees(before, trained_state(model, optimizer))


# ---- checkpoints NVIDIA apex loads -------------------------------------------------------------
def nvidia_apex_load_state_dict(state_dict, loss_scalers):
    """NVIDIA apex's ``amp.load_state_dict`` rule (apex/amp/frontend.py, e13873de), restated."""
    unexpected = [key for key in state_dict if "loss_scaler" not in key]
    if unexpected:
        raise RuntimeError(f"Unexpected key(s) in state_dict: {unexpected}")
    for index, key in enumerate(state_dict):
        if index < len(loss_scalers):
            loss_scalers[index]["_loss_scale"] = state_dict[key]["loss_scale"]
            loss_scalers[index]["_unskipped"] = state_dict[key]["unskipped"]


def test_amp_state_dict_loads_in_nvidia_apex():
    model = small_model()
    optimizer = make_optimizer("SGD", model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, loss_scale="dynamic", num_losses=2,
                   verbosity=0)
    step(model, optimizer)
    saved = torch.load(io.BytesIO(_saved(amp.state_dict())), weights_only=True)  # through a real checkpoint
    apex_scalers = [{}, {}]
    nvidia_apex_load_state_dict(saved, apex_scalers)
    assert apex_scalers == [{"_loss_scale": 65536.0, "_unskipped": 1}, {"_loss_scale": 65536.0, "_unskipped": 0}]
    assert all(isinstance(s["_loss_scale"], float) and isinstance(s["_unskipped"], int) for s in apex_scalers)


def _saved(state) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_the_settings_check_travels_inside_each_loss_scaler_entry():
    model = small_model()
    amp.initialize(model, make_optimizer("SGD", model.parameters()), opt_level="O2", half_dtype=BF16,
                   verbosity=0)
    saved = amp.state_dict()
    assert saved["loss_scaler0"]["amp_config"]["opt_level"] == "O2"
    other = small_model()
    amp.initialize(other, make_optimizer("SGD", other.parameters()), opt_level="O1", half_dtype=BF16,
                   verbosity=0)
    with pytest.raises(ValueError, match="saved with opt_level='O2' but this run uses opt_level='O1'"):
        amp.load_state_dict(saved)


# ---- param groups added after initialize (O2) ------------------------------------------------
def _two_layer_run(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = make_optimizer(kind, model[0].parameters())
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
    return model, optimizer


def _lm_step(model, optimizer, index):
    g = torch.Generator().manual_seed(100 + index)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    optimizer.zero_grad()
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def _add_head(model, optimizer):
    optimizer.add_param_group({"params": list(model[2].parameters()), "lr": 5e-3})


@pytest.mark.parametrize("kind", ["Adam", "FusedAdam"])
@pytest.mark.parametrize("order", ["add the group, then load", "load the model, then add the group"])
def test_a_resume_that_re_adds_a_param_group_is_bitwise_the_uninterrupted_run(kind, order):
    model, optimizer = _two_layer_run(kind)
    for index in range(6):
        if index == 2:
            _add_head(model, optimizer)  # e.g. a head unfrozen after warm-up
        _lm_step(model, optimizer, index)
        if index == 3:
            checkpoint = torch.load(io.BytesIO(_saved({
                "model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()})),
                weights_only=True)
    uninterrupted = trained_state(model, optimizer, buffers=True)

    model, optimizer = _two_layer_run(kind)
    if order.startswith("add"):
        _add_head(model, optimizer)
        model.load_state_dict(checkpoint["model"])
    else:
        model.load_state_dict(checkpoint["model"])
        _add_head(model, optimizer)
    optimizer.load_state_dict(checkpoint["optimizer"])  # the new group's moments stay fp32
    assert all(value.dtype == torch.float32 for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor) and value.dim())
    amp.load_state_dict(checkpoint["amp"])
    for index in (4, 5):
        _lm_step(model, optimizer, index)
    assert_equal_trees(uninterrupted, trained_state(model, optimizer, buffers=True))


def test_lazy_init_entry_point_makes_masters_for_an_added_group_at_once():
    model, optimizer = _two_layer_run("SGD")
    _add_head(model, optimizer)
    optimizer._lazy_init_maybe_master_weights()  # what NVIDIA's BERT recipe calls before loading
    head = optimizer.param_groups[1]["params"]
    assert [p.dtype for p in head] == [torch.float32, torch.float32]
    assert head[0] is not model[2].weight and torch.equal(head[0].to(BF16), model[2].weight)


# ---- custom batch types under O2 (apex's advanced.rst, "Custom data batch types") -----------
class CustomBatch:
    """A batch class with apex's protocol: ``to(dtype)`` casts its floating fields."""

    def __init__(self, x, ids):
        self.x, self.ids = x, ids

    def to(self, dtype):
        return CustomBatch(self.x.to(dtype), self.ids)


class Encoding(collections.UserDict):
    """Like Hugging Face's BatchEncoding: a UserDict with attributes whose ``to`` takes devices only."""

    def __init__(self, data, source):
        super().__init__(data)
        self.source = source

    def to(self, device):
        if isinstance(device, torch.dtype):
            raise AssertionError("a Mapping's own to() must not be called with a dtype")
        return self


class Pair(NamedTuple):
    x: torch.Tensor
    ids: torch.Tensor


class Reader(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)
        self.seen = []

    def forward(self, batch, scale_module=None):
        if isinstance(batch, CustomBatch):
            x, ids = batch.x, batch.ids
        elif isinstance(batch, Pair):
            x, ids = batch.x, batch.ids
        else:
            x, ids = batch["x"], batch["ids"]
        self.seen.append((type(batch), x.dtype, ids.dtype))
        return self.linear(x) + ids.float().unsqueeze(1)


def _batches():
    x, ids = torch.randn(5, 4, generator=torch.Generator().manual_seed(3)), torch.arange(5)
    return {
        "CustomBatch": CustomBatch(x, ids),
        "UserDict": collections.UserDict(x=x, ids=ids),
        "Encoding": Encoding({"x": x, "ids": ids}, source="tokenizer"),
        "MappingProxy": types.MappingProxyType({"x": x, "ids": ids}),
        "namedtuple": Pair(x, ids),
    }


@pytest.mark.parametrize("kind", list(_batches()))
def test_custom_batch_types_train_at_o2(kind):
    model = Reader()
    optimizer = make_optimizer("SGD", model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
    given = _batches()[kind]
    before = model.linear.weight.detach().clone()
    optimizer.zero_grad()
    with amp.scale_loss(model(given).pow(2).mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    batch_type, x_dtype, ids_dtype = model.seen[-1]
    assert x_dtype == BF16 and ids_dtype == torch.int64
    assert batch_type is type(given) or (kind == "MappingProxy" and batch_type is dict)
    assert not torch.equal(before, model.linear.weight)
    if kind == "Encoding":
        assert given["x"].dtype == torch.float32  # the caller's batch is not changed in place


def test_a_module_passed_to_forward_is_not_cast():
    model = Reader()
    other = nn.Linear(2, 2)
    amp.initialize(model, make_optimizer("SGD", model.parameters()), opt_level="O2", half_dtype=BF16, verbosity=0)
    model(_batches()["CustomBatch"], scale_module=other)
    assert other.weight.dtype == torch.float32


# ---- errors at once, where apex failed later or silently ------------------------------------
def test_sparse_gradients_with_fused_adam_get_fused_adams_own_message():
    embedding = nn.Embedding(10, 4, sparse=True)
    optimizer = FusedAdam(embedding.parameters())
    amp.initialize(embedding, optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
    with amp.scale_loss(embedding(torch.tensor([1, 2])).float().sum(), optimizer) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="FusedAdam does not support sparse gradients; use torch.optim.SparseAdam"):
        optimizer.step()


def _sparse_run(opt_level, opt_cls, factors, **options):
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 4, sparse=True)
    optimizer = opt_cls(embedding.parameters(), lr=0.1)
    if opt_level is not None:
        amp.initialize(embedding, optimizer, opt_level=opt_level, half_dtype=BF16, verbosity=0, **options)
    skipped = []
    for index, factor in enumerate(factors):
        optimizer.zero_grad()
        for micro in range(2):  # two passes: sparse gradients with different indices add up
            loss = embedding(torch.tensor([index, micro + 3, 7])).float().pow(2).sum() * factor
            if opt_level is None:
                loss.backward()
            else:
                with amp.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
        if opt_level is not None or factor == 1.0:
            optimizer.step()
        skipped.append(opt_level is not None and amp.step_was_skipped(optimizer))
    return embedding.weight.detach().float(), skipped


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.SparseAdam])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_sparse_gradients_train_with_torch_optimizers_and_skip_an_overflow(opt_cls, opt_level):
    factors = [1.0, OVERFLOW, 1.0]
    reference, _ = _sparse_run(None, opt_cls, factors)
    weight, skipped = _sparse_run(opt_level, opt_cls, factors, loss_scale="dynamic")
    assert skipped == [False, True, False]
    # O1 keeps the embedding fp32 (exact); O2 looks rows up in bf16.
    tolerance = 0.0 if opt_level == "O1" else 2e-2
    torch.testing.assert_close(weight, reference, atol=tolerance, rtol=tolerance)


def test_a_model_on_the_meta_device_is_refused_at_initialize():
    with torch.device("meta"):
        model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"'weight' of model 0 is on the meta device .*model.to_empty"):
        amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert model.weight.dtype == torch.float32  # nothing was cast


def test_an_optimizer_over_another_models_parameters_is_refused_at_initialize():
    model, other = small_model(), small_model(1)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="holds no parameter of the model.* built over another model"):
        amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
    assert next(model.parameters()).dtype == torch.float32


def test_free_tensors_trained_beside_the_models_in_their_own_optimizer_are_accepted():
    # A GAN's two models plus a learned temperature in a third optimizer: every model is trained.
    generator, discriminator = small_model(), small_model(1)
    temperature = nn.Parameter(torch.ones(1))
    optimizers = [make_optimizer("SGD", generator.parameters()), make_optimizer("SGD", discriminator.parameters()),
                  torch.optim.SGD([temperature], lr=0.1)]
    amp.initialize([generator, discriminator], optimizers, opt_level="O2", half_dtype=BF16, verbosity=0)


# ---- optimizer._amp_stash and amp._amp_state -------------------------------------------------
def test_amp_stash_marks_an_enabled_initialize_only():
    model = small_model()
    optimizer = make_optimizer("SGD", model.parameters())
    for _ in range(3):  # mmengine calls initialize(enabled=False) at every step, as apex allowed
        amp.initialize(model, optimizer, enabled=False)
        assert not hasattr(optimizer, "_amp_stash")
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
    assert hasattr(optimizer, "_amp_stash") and optimizer._amp_stash.lazy_init_called
    with pytest.raises(RuntimeError, match="already passed to amp.initialize"):
        amp.initialize(model, optimizer, enabled=False)


def test_amp_stash_lists_apex_fields_and_follows_added_groups():
    model = small_model()
    optimizer = make_optimizer("SGD", list(model[0].parameters()) + list(model[1].parameters()))
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
    stash = optimizer._amp_stash
    assert [p.dtype for p in stash.all_fp16_params] == [BF16, BF16]  # Linear(4, 8); BatchNorm stays fp32
    assert [p.dtype for p in stash.all_fp32_from_fp16_params] == [torch.float32] * 2
    assert stash.all_fp32_from_fp32_params == list(model[1].parameters())
    optimizer.add_param_group({"params": list(model[3].parameters())})
    optimizer._amp_lazy_init()
    assert len(stash.fp16_groups) == 2 and len(stash.all_fp16_params) == 4
    assert not stash.params_have_scaled_gradients
    with amp.scale_loss(model(batch()).float().sum(), optimizer, delay_unscale=True) as scaled:
        scaled.backward()
    assert stash.params_have_scaled_gradients


def test_amp_stash_is_on_the_wrapper_a_client_holds_too():
    model = small_model()
    wrapped = LARC(make_optimizer("SGD", model.parameters()))
    amp.initialize(model, wrapped, opt_level="O1", half_dtype=BF16, verbosity=0)
    assert wrapped._amp_stash is wrapped.optim._amp_stash


def test_amp_state_loss_scalers_set_the_scale_as_nvidias_recipes_do():
    model = small_model()
    optimizer = make_optimizer("SGD", model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0, num_losses=2)
    amp._amp_state.loss_scalers[0]._loss_scale = 2**20
    assert amp.loss_scale(0) == 2.0**20 and amp._amp_state.loss_scalers[0].loss_scale() == 2.0**20
    assert amp.loss_scale(1) == 65536.0
    seen = []
    with amp.scale_loss(model(batch()).float().mean(), optimizer) as scaled:
        seen.append(scaled.item() / model(batch()).float().mean().item())
        scaled.backward()
    assert seen[0] == pytest.approx(2.0**20, rel=1e-3)
    amp._amp_state.loss_scalers[1]._unskipped = 7
    assert amp.state_dict()["loss_scaler1"]["unskipped"] == 7
    with pytest.raises(ValueError, match="positive finite number"):
        amp._amp_state.loss_scalers[0]._loss_scale = float("inf")


def test_amp_state_opt_properties_reads_the_latest_initialize():
    model = small_model()
    amp.initialize(model, make_optimizer("SGD", model.parameters()), opt_level="O2", verbosity=0)
    options = amp._amp_state.opt_properties.options
    assert options["opt_level"] == "O2" and options["master_weights"] is True and options["loss_scale"] == "dynamic"
    assert amp._amp_state.opt_properties.keep_batchnorm_fp32 is True
    from apex_amp.amp._amp_state import _amp_state
    assert _amp_state is amp._amp_state
    with pytest.raises(AttributeError, match="amp.disable_casts"):
        amp._amp_state.handle
