"""A catalogue of misuse of amp's API: each case raises an error naming the problem and the fix.

Every error case also checks that nothing was half-updated: the snapshot of
tests/_misuse.py (weights, grads, dtypes, masters, optimizer state, amp's hooks
and loss scalers) taken before the failing call must equal the one after it.

Sections: bad arguments to ``initialize``; calls in the wrong order; bad
arguments to ``scale_loss``; corrupted or foreign amp checkpoints. Bad tensors
handed to the ops are in tests/test_misuse_ops.py, and awkward setups that
must simply work (frozen or tied parameters, empty optimizers) in
tests/test_misuse_setups.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from _misuse import assert_same, batch, clone_tree, o2_trained, sgd, small_model, snapshot, train_step
from apex_amp import amp
from apex_amp.amp import casting, sessions

F16, BF16 = torch.float16, torch.bfloat16


# ==== 1. bad arguments to initialize ===========================================================
def _tied_pair():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    return a, b


def _dup_in_one_optimizer():
    a, b = _tied_pair()
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch's own warning
        optimizer = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    return [a, b], optimizer, {"opt_level": "O2"}


def _shared_by_two_optimizers():
    model = small_model()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    second = torch.optim.SGD(model[0].parameters(), lr=0.1)
    return model, [first, second], {"opt_level": "O1"}


def _default(**kwargs):
    def build():
        model = small_model()
        return model, sgd(model), kwargs
    return build


def _twice_listed():
    model = small_model()
    optimizer = sgd(model)
    return model, [optimizer, optimizer], {"opt_level": "O2"}


def _module_as_optimizer():
    model = small_model()
    return model, [sgd(model), model], {"opt_level": "O2"}


def _half_model():
    model = small_model().half()
    return model, sgd(model), {"opt_level": "O2"}


def _wrapped_model():
    model = small_model()
    return nn.DataParallel(model), sgd(model), {"opt_level": "O2"}


# (id, build() -> (models, optimizers, kwargs), error, message fragment)
INITIALIZE_ERRORS = [
    ("model-is-a-function", lambda: (lambda x: x, None, {}), TypeError,
     "models must be a torch.nn.Module, got function"),
    ("models-list-holds-a-string", lambda: ([small_model(), "net"], None, {}), TypeError,
     r"models\[1\] must be a torch.nn.Module, got str"),
    ("models-empty-list", lambda: ([], None, {}), ValueError, "needs at least one model"),
    ("optimizer-is-a-dict", lambda: (small_model(), {"lr": 0.1}, {}), TypeError,
     r"optimizers must be a torch.optim.Optimizer \(or a wrapper holding one in .optim, such as LARC\) or a list of them, got dict"),
    ("optimizers-list-holds-a-module", _module_as_optimizer, TypeError,
     r"optimizers\[1\] must be a torch.optim.Optimizer \(or a wrapper.*\), got Sequential"),
    ("same-optimizer-listed-twice", _twice_listed, ValueError, "appears twice in optimizers; pass each optimizer once"),
    ("model-already-wrapped-in-DataParallel", _wrapped_model, ValueError,
     "already wrapped in DataParallel; call amp.initialize on the bare model first"),
    ("model-already-half", _half_model, ValueError, r"already torch.float16.*Remove the .half\(\)"),
    ("opt_level-lowercase", _default(opt_level="o2"), ValueError, r"unknown opt_level 'o2'.*Did you mean 'O2'\?"),
    ("opt_level-digit-zero", _default(opt_level="02"), ValueError, r"Did you mean 'O2'\?"),
    ("opt_level-O4", _default(opt_level="O4"), ValueError, r"valid levels are 'O0', 'O1', 'O2', 'O3'"),
    ("opt_level-int", _default(opt_level=2), ValueError, r"unknown opt_level 2; valid levels"),
    ("enabled-string", _default(enabled="yes"), ValueError, r"enabled must be True or False .*got 'yes'"),
    ("skip_nonfinite-string", _default(opt_level="O3", skip_nonfinite="no"), ValueError,
     r"skip_nonfinite must be True or False .*got 'no'"),
    ("verbosity-string", _default(verbosity="high"), TypeError, "verbosity must be an int, got str"),
    ("loss_scale-bool", _default(opt_level="O2", loss_scale=True), ValueError,
     "loss_scale must be 'dynamic' or a positive number, got True"),
    ("loss_scale-zero", _default(opt_level="O2", loss_scale=0), ValueError, "positive finite number, got 0"),
    ("loss_scale-misspelled", _default(opt_level="O2", loss_scale="dynamc"), ValueError,
     "loss_scale must be 'dynamic' or a positive number, got 'dynamc'"),
    ("num_losses-zero", _default(opt_level="O1", num_losses=0), ValueError,
     "num_losses must be an integer >= 1, got 0"),
    ("num_losses-float", _default(opt_level="O1", num_losses=2.0), ValueError, "num_losses must be an integer >= 1"),
    ("half_dtype-string", _default(opt_level="O2", half_dtype="bfloat16"), ValueError,
     "half_dtype must be torch.float16 or torch.bfloat16, got 'bfloat16'"),
    ("O1-with-master_weights", _default(opt_level="O1", master_weights=True), ValueError,
     "master_weights=True is not valid with O1.*use O2"),
    ("O2-with-patch_torch_functions", _default(opt_level="O2", patch_torch_functions=True), ValueError,
     "patch_torch_functions=True is only valid with O1.*Use opt_level='O1'"),
    ("O1-with-cast_model_type", _default(opt_level="O1", cast_model_type=F16), ValueError,
     "cast_model_type=torch.float16 cannot be set with O1.*use O2 or O3"),
    ("O0-with-keep_batchnorm_fp32", _default(opt_level="O0", keep_batchnorm_fp32=True), ValueError,
     "keep_batchnorm_fp32 must be None with O0"),
    ("cast_model_type-contradicts-half_dtype", _default(opt_level="O3", cast_model_type=BF16), ValueError,
     r"contradicts half_dtype=torch.float16; pass half_dtype=torch.bfloat16 instead"),
    ("min_loss_scale-above-max", _default(opt_level="O2", min_loss_scale=8.0, max_loss_scale=2.0), ValueError,
     "need 0 < min_loss_scale <= max_loss_scale"),
    ("unknown-keyword", _default(opt_lvl="O2"), TypeError, "unexpected keyword argument 'opt_lvl'"),
    ("tied-weight-twice-in-one-optimizer", _dup_in_one_optimizer, ValueError,
     r"parameter 'weight' of model 0 appears twice in the same optimizer.*list every parameter once"),
    ("parameter-shared-by-two-optimizers", _shared_by_two_optimizers, ValueError,
     r"parameter '0.weight' of model 0 appears in optimizers\[0\] and optimizers\[1\].*in one optimizer"),
]


@pytest.mark.parametrize(("build", "error", "message"), [c[1:] for c in INITIALIZE_ERRORS],
                         ids=[c[0] for c in INITIALIZE_ERRORS])
def test_initialize_rejects_bad_arguments_and_touches_nothing(build, error, message):
    models, optimizers, kwargs = build()
    model_list = [m for m in (models if isinstance(models, list) else [models]) if isinstance(m, nn.Module)]
    optimizer_list = [o for o in (optimizers if isinstance(optimizers, list) else [optimizers])
                      if isinstance(o, torch.optim.Optimizer)]
    latest = sessions.latest_session()
    before = snapshot(model_list, optimizer_list)
    kwargs.setdefault("verbosity", 0)
    with pytest.raises(error, match=message):
        amp.initialize(models, optimizers, **kwargs)
    assert_same(before, snapshot(model_list, optimizer_list))
    assert sessions.latest_session() is latest and not casting.is_active()


@pytest.mark.parametrize(("call", "error", "message"), [
    pytest.param(lambda o: amp.master_params("adam"), TypeError,
                 r"optimizer must be a torch.optim.Optimizer \(or a wrapper.*\) or a list of them, got str", id="master_params-string"),
    pytest.param(lambda o: amp.master_params([o, o]), TypeError,
                 r"amp.master_params takes one optimizer, got a list of 2; call it once per optimizer",
                 id="master_params-list-of-two"),
    pytest.param(lambda o: amp.master_params(o.param_groups), TypeError,
                 r"optimizer\[0\] must be a torch.optim.Optimizer \(or a wrapper.*\), got dict", id="master_params-param_groups"),
    pytest.param(lambda o: amp.step_was_skipped([]), TypeError,
                 r"amp.step_was_skipped takes one optimizer, got a list of 0", id="step_was_skipped-empty-list"),
])
def test_master_params_and_step_was_skipped_take_exactly_one_optimizer(call, error, message):
    model, optimizer = o2_trained()
    before = snapshot([model], [optimizer])
    with pytest.raises(error, match=message):
        call(optimizer)
    assert_same(before, snapshot([model], [optimizer]))


def test_initialize_with_an_empty_optimizer_list_returns_it():
    model = small_model()
    returned = amp.initialize(model, [], opt_level="O2", half_dtype=BF16, verbosity=0)
    assert returned[0] is model and returned[1] == [] and model[0].weight.dtype == BF16


# ==== 2. calls in the wrong order ==============================================================
BEFORE_INITIALIZE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from _misuse import assert_same, batch, sgd, small_model, snapshot
from apex_amp import amp
calls = {
    "scale_loss": lambda m, o: amp.scale_loss(m(batch()).sum(), o).__enter__(),
    "state_dict": lambda m, o: amp.state_dict(),
    "load_state_dict": lambda m, o: amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}}),
    "loss_scale": lambda m, o: amp.loss_scale(),
    "step_was_skipped": lambda m, o: amp.step_was_skipped(o),
}
results = {}
for name, call in calls.items():
    model = small_model().eval()
    optimizer = sgd(model)
    before = snapshot([model], [optimizer])
    try:
        call(model, optimizer)
        results[name] = "no error"
    except RuntimeError as error:
        results[name] = str(error)
    assert_same(before, snapshot([model], [optimizer]))
print(json.dumps(results))
"""


def test_amp_calls_before_initialize_raise_and_say_what_to_call_first():
    # In a fresh interpreter: nothing of this process's earlier initialize calls is there.
    tests = str(Path(__file__).resolve().parent)
    result = subprocess.run([sys.executable, "-c", BEFORE_INITIALIZE, tests], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    fix = "was called before amp.initialize; first call `model, optimizer = amp.initialize"
    for name, message in json.loads(result.stdout).items():
        assert message.startswith(f"amp.{name} {fix}"), (name, message)


def test_initialize_twice_on_the_same_optimizer_raises_and_keeps_the_first_session():
    model, optimizer = o2_trained()
    other = small_model(1)
    before = snapshot([model, other], [optimizer])
    with pytest.raises(RuntimeError, match="already passed to amp.initialize; call amp.initialize once per optimizer"):
        amp.initialize(other, optimizer, opt_level="O1", verbosity=0)
    assert_same(before, snapshot([model, other], [optimizer]))
    train_step(model, optimizer, 5)  # the first session still works


def test_initialize_twice_on_the_same_model_names_the_earlier_call():
    model, optimizer = o2_trained()
    fresh_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built on the half model
    before = snapshot([model], [optimizer, fresh_optimizer])
    with pytest.raises(ValueError, match=r"model 0 was already passed to an earlier amp.initialize call.*call "
                                         r"amp.initialize once"):
        amp.initialize(model, fresh_optimizer, opt_level="O2", verbosity=0)
    assert_same(before, snapshot([model], [optimizer, fresh_optimizer]))


def test_optimizer_created_after_initialize_is_refused_by_scale_loss():
    model, optimizer = o2_trained()
    late_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # not returned by initialize
    model.eval()
    before = snapshot([model], [optimizer, late_optimizer])
    for call in (lambda: amp.scale_loss(model(batch()).sum(), late_optimizer).__enter__(),
                 lambda: amp.step_was_skipped(late_optimizer)):
        with pytest.raises(RuntimeError, match=r"got an optimizer \(SGD\) that amp.initialize never saw; pass every "
                                               r"optimizer to amp.initialize"):
            call()
    assert_same(before, snapshot([model], [optimizer, late_optimizer]))


def test_model_created_after_initialize_is_reported_and_changes_nothing(caplog):
    model, optimizer = o2_trained()
    replacement = small_model(3)  # e.g. the model re-created after initialize; its params are in no optimizer
    optimizer.zero_grad()
    before = snapshot([model], [optimizer])
    with caplog.at_level(logging.WARNING, logger="apex_amp"):
        train_step(replacement, optimizer)
        train_step(replacement, optimizer, 1)
    warnings = [r.getMessage() for r in caplog.records if "produced no gradient" in r.getMessage()]
    assert len(warnings) == 1  # once per initialize, not once per step
    assert "for any parameter of the optimizer(s)" in warnings[0]
    assert "created or re-created after amp.initialize" in warnings[0]
    after = snapshot([model], [optimizer])
    # The step changed no weight, master or moment (the scaler counted one clean pass, as it should).
    assert_same(before["models"], after["models"])
    assert_same(before["optimizers"], after["optimizers"])


def test_scale_loss_with_optimizers_of_two_initialize_calls_raises():
    model_a, opt_a = o2_trained()
    model_b = small_model(1)
    opt_b = sgd(model_b)
    amp.initialize(model_b, opt_b, opt_level="O2", verbosity=0)
    loss = model_a(batch()).sum() + model_b(batch()).sum()
    before = snapshot([model_a, model_b], [opt_a, opt_b])
    with pytest.raises(RuntimeError, match="from different amp.initialize calls; pass all models and optimizers"):
        amp.scale_loss(loss, [opt_a, opt_b]).__enter__()
    assert_same(before, snapshot([model_a, model_b], [opt_a, opt_b]))


# ==== 3. bad arguments to scale_loss ===========================================================
def _model_loss(model):
    return model(batch(9)).float().pow(2).mean()


SCALE_LOSS_ERRORS = [
    ("loss-is-a-float", lambda m, o: amp.scale_loss(1.5, o), TypeError,
     "expects the loss as a tensor, got float"),
    ("optimizers-is-the-model", lambda m, o: amp.scale_loss(_model_loss(m), m), TypeError,
     r"optimizers must be a torch.optim.Optimizer \(or a wrapper.*\) or a list of them, got Sequential"),
    ("optimizers-empty-list", lambda m, o: amp.scale_loss(_model_loss(m), []), ValueError,
     "needs at least one optimizer, got an empty list"),
    ("loss_id-equals-num_losses", lambda m, o: amp.scale_loss(_model_loss(m), o, loss_id=1), ValueError,
     r"loss_id=1 is out of range.*num_losses=1.*pass num_losses=N to amp.initialize"),
    ("loss_id-negative", lambda m, o: amp.scale_loss(_model_loss(m), o, loss_id=-1), ValueError,
     r"loss_id=-1 is out of range"),
    ("loss_id-bool", lambda m, o: amp.scale_loss(_model_loss(m), o, loss_id=True), ValueError,
     r"loss_id=True is out of range"),
    ("loss_id-string", lambda m, o: amp.scale_loss(_model_loss(m), o, loss_id="0"), ValueError,
     r"loss_id='0' is out of range"),
    ("model-is-a-string", lambda m, o: amp.scale_loss(_model_loss(m), o, model="ddp"), TypeError,
     "model must be a torch.nn.Module or None, got str"),
    ("loss-computed-under-no_grad", lambda m, o: amp.scale_loss(_no_grad_loss(m), o), RuntimeError,
     r"got a loss that does not require grad .*compute the loss from the model's outputs with autograd enabled"),
    ("loss-detached", lambda m, o: amp.scale_loss(_model_loss(m).detach(), o), RuntimeError,
     "got a loss that does not require grad"),
    ("loss_scale-of-missing-loss_id", lambda m, o: amp.loss_scale(3), ValueError,
     r"loss_id must be in \[0, 0\], got 3"),
]


def _no_grad_loss(model):
    with torch.no_grad():
        return _model_loss(model)


@pytest.mark.parametrize(("call", "error", "message"), [c[1:] for c in SCALE_LOSS_ERRORS],
                         ids=[c[0] for c in SCALE_LOSS_ERRORS])
def test_scale_loss_rejects_bad_arguments_and_keeps_pending_gradients(call, error, message):
    model, optimizer = o2_trained()
    # Pending, unscaled master gradients of a first backward: a failed call must keep them as they are.
    with amp.scale_loss(_model_loss(model), optimizer) as scaled:
        scaled.backward()
    model.eval()  # the calls below run forwards: keep batchnorm's statistics still
    before = snapshot([model], [optimizer])
    with pytest.raises(error, match=message):
        result = call(model, optimizer)
        if hasattr(result, "__enter__"):
            result.__enter__()
    assert_same(before, snapshot([model], [optimizer]))
    optimizer.step()  # and the pending gradients are still usable


def test_non_scalar_loss_with_implicit_backward_raises_and_is_rolled_back():
    model, optimizer = o2_trained()
    with amp.scale_loss(_model_loss(model), optimizer) as scaled:
        scaled.backward()
    model.eval()
    before = snapshot([model], [optimizer])
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        with amp.scale_loss(model(batch()), optimizer) as scaled:
            scaled.backward()
    assert_same(before, snapshot([model], [optimizer]))


def test_non_scalar_loss_with_explicit_gradient_matches_its_sum():
    grads = []
    for reduce in (True, False):
        model = small_model()
        optimizer = sgd(model)
        amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, loss_scale="dynamic", verbosity=0)
        output = model(batch())
        with amp.scale_loss(output.sum() if reduce else output, optimizer) as scaled:
            scaled.backward() if reduce else scaled.backward(torch.ones_like(scaled))
        grads.append([p.grad.clone() for p in amp.master_params(optimizer)])
    for summed, explicit in zip(*grads):
        assert torch.equal(summed, explicit)


# ==== 4. corrupted and foreign checkpoints ====================================================
def _set(key, value, scaler="loss_scaler0"):
    def corrupt(s):
        s[scaler][key] = value
        return s
    return corrupt


class _SavedBy:
    """The amp state of another initialize call (made before the test's own, which stays the latest)."""

    def __init__(self, **init):
        self.init = init
        self.state = None

    def prepare(self):
        model = small_model()
        amp.initialize(model, sgd(model), verbosity=0, **self.init)
        if casting.is_active():
            casting.deactivate()
        self.state = amp.state_dict()

    def __call__(self, _saved):
        return self.state


def _saved_by(**init):
    return _SavedBy(**init)


CHECKPOINT_ERRORS = [
    ("whole-checkpoint-instead-of-its-amp-part", lambda s: {"model": {}, "optimizer": {}, "amp": s}, ValueError,
     r"got keys \['amp', 'model', 'optimizer'\].*amp.load_state_dict\(checkpoint\['amp'\]\)"),
    ("list-of-pairs", lambda s: list(s.items()), TypeError, "expects the dict from amp.state_dict\\(\\), got list"),
    ("None", lambda s: None, TypeError, "expects the dict from amp.state_dict\\(\\), got NoneType"),
    ("scaler-entry-is-a-float", lambda s: {**s, "loss_scaler1": 2.0}, TypeError,
     "amp state 'loss_scaler1' must be a dict, got float"),
    ("missing-loss_scale", lambda s: (s["loss_scaler0"].pop("loss_scale"), s)[1], ValueError,
     "has no 'loss_scale'; was it saved by amp.state_dict"),
    ("loss_scale-nan", _set("loss_scale", float("nan")), ValueError,
     "loss_scale must be a positive finite number, got nan"),
    ("loss_scale-negative", _set("loss_scale", -4.0), ValueError, "positive finite number, got -4.0"),
    ("loss_scale-zero", _set("loss_scale", 0.0), ValueError, "positive finite number, got 0.0"),
    ("loss_scale-inf", _set("loss_scale", float("inf")), ValueError, "positive finite number, got inf"),
    ("loss_scale-string", _set("loss_scale", "65536"), ValueError, "positive finite number, got '65536'"),
    ("loss_scale-tensor", _set("loss_scale", torch.tensor(8.0)), ValueError, "positive finite number"),
    ("unskipped-float", _set("unskipped", 2.5), ValueError, "unskipped must be an integer >= 0, got 2.5"),
    ("unskipped-negative", _set("unskipped", -1), ValueError, "unskipped must be an integer >= 0, got -1"),
    ("overflows-string", _set("overflows", "3"), ValueError, "overflows must be an integer >= 0, got '3'"),
    ("hysteresis_tracker-negative", _set("hysteresis_tracker", -2), ValueError,
     "hysteresis_tracker must be an integer >= 0, got -2"),
    ("unknown-key-in-a-scaler", _set("scale", 2.0), ValueError, r"unexpected keys \['scale'\]"),
    # The second scaler is bad: the first must not be loaded either.
    ("second-scaler-corrupt", _set("loss_scale", -1.0, "loss_scaler1"), ValueError,
     "'loss_scaler1': loss_scale must be a positive finite number"),
    ("amp_config-not-a-dict", lambda s: {**s, "amp_config": "O2"}, TypeError,
     "'amp_config' must be a dict, got str"),
    ("from-another-opt_level", _saved_by(opt_level="O1", half_dtype=BF16, loss_scale="dynamic", num_losses=2),
     ValueError,
     r"saved with opt_level='O1' but this run uses opt_level='O2'"),
    ("from-another-half_dtype", _saved_by(opt_level="O2", num_losses=2),
     ValueError, r"saved with half_dtype='torch.float16' but this run uses half_dtype='torch.bfloat16'"),
    ("static-scale-into-dynamic-run", _saved_by(opt_level="O2", half_dtype=BF16, num_losses=2), ValueError,
     "was saved with a static loss scale but this run's scale is dynamic"),
]


@pytest.mark.parametrize(("corrupt", "error", "message"), [c[1:] for c in CHECKPOINT_ERRORS],
                         ids=[c[0] for c in CHECKPOINT_ERRORS])
def test_corrupt_or_foreign_amp_state_raises_and_loads_nothing(corrupt, error, message):
    if isinstance(corrupt, _SavedBy):
        corrupt.prepare()
    model, optimizer = o2_trained(num_losses=2)
    with amp.scale_loss(_model_loss(model) * float("inf"), optimizer, loss_id=1) as scaled:
        scaled.backward()  # scaler 1 backs off: the two scalers differ
    optimizer.step()
    current = sessions.latest_session()
    saved = amp.state_dict()
    assert saved["loss_scaler0"]["unskipped"] > 0 and saved["loss_scaler1"]["loss_scale"] == 32768.0
    bad = corrupt(clone_tree(saved))
    assert sessions.latest_session() is current
    before = snapshot([model], [optimizer])
    with pytest.raises(error, match=message):
        amp.load_state_dict(bad)
    assert_same(before, snapshot([model], [optimizer]))
    amp.load_state_dict(saved)  # the good state still loads
