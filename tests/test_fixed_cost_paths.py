"""The shortcuts that cut amp's fixed cost per step, each against the long way it stands for.

* ``FusedOptimizer``'s batch plans (``optimizers/_batch_plan.py``): a step reuses the batches of
  the last one while a cheap check finds nothing changed. Every change a client makes between
  steps (a state tensor replaced, a param without a gradient, a param group added or edited, a
  checkpoint loaded, a copy of the optimizer) must give bitwise what building afresh gives.
* passes in place (``scale_loss`` at a static scale of 1 with no check and no masters: O0, O3):
  the backward adds to ``.grad`` itself, as apex's short cut did; accumulation, the refusals and
  the warnings must be those of the long way.
* flags known on the host (a CPU overflow flag is read by the scaler anyway): a clean pass adds
  a shared zero flag to the step, which must never be written.
* the resolution of ``scale_loss``'s optimizer argument, remembered per argument: a new
  ``amp.initialize`` must be seen.
* the input cast hook passes plain tensors that need no cast on without walking them: what the
  forward receives must be what the walk would have given.
* the step's flag is made when amp's flag or the client's guard changes, not when every step reads
  it: it must be their OR after any sequence of changes.
"""

from __future__ import annotations

import copy
import gc
import io
import logging
import pickle
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from apex_amp import amp
from apex_amp.amp.gradients import GradState
from apex_amp.amp.sessions import session_for
from apex_amp.amp.step_skip import StepSkip
from apex_amp.optimizers import FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD


class _AlwaysRebuilt:
    """Mixin: build the batches afresh on every step (what the plans stand for)."""

    def _batches(self, group, amp):
        self.builds = getattr(self, "builds", 0) + 1
        return self._build_batches(group, amp)


class _Counting:
    """Mixin: count how often the batches are built."""

    def _build_batches(self, group, amp):
        self.builds = getattr(self, "builds", 0) + 1
        return super()._build_batches(group, amp)


def _pair(base, **options):
    planned = type(f"Counting{base.__name__}", (_Counting, base), {})
    rebuilt = type(f"Rebuilt{base.__name__}", (_AlwaysRebuilt, base), {})
    return planned, rebuilt, options


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.ReLU(), nn.Linear(3, 2))


def _set_grads(model: nn.Module, step: int, skip: tuple[int, ...] = ()) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for index, p in enumerate(model.parameters()):
        p.grad = None if index in skip else torch.randn(p.shape, generator=generator)


def _state(optimizer) -> list[torch.Tensor]:
    return [value.clone() for state in optimizer.state.values() for value in state.values()
            if isinstance(value, torch.Tensor)]


def _assert_same_run(planned, rebuilt, planned_model, rebuilt_model):
    for a, b in zip(planned_model.parameters(), rebuilt_model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(_state(planned), _state(rebuilt)):
        assert torch.equal(a, b)


# (what a client does between steps, applied to both optimizers and their models)
def _replace_a_state_tensor(optimizer, model, step):
    p = next(iter(model.parameters()))
    key = next(k for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor) and v.shape == p.shape)
    optimizer.state[p][key] = torch.full_like(optimizer.state[p][key], 0.25)


def _clear_the_state(optimizer, model, step):
    optimizer.state.clear()


def _delete_one_params_state(optimizer, model, step):
    del optimizer.state[list(model.parameters())[2]]


def _new_params_list(optimizer, model, step):
    optimizer.param_groups[0]["params"] = list(reversed(optimizer.param_groups[0]["params"]))


def _reload_own_checkpoint(optimizer, model, step):
    saved = copy.deepcopy(optimizer.state_dict())
    for state in saved["state"].values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value * 0.5  # a different checkpoint: must be used
    optimizer.load_state_dict(saved)


PERTURBATIONS = {
    "nothing": None,
    "a state tensor replaced": _replace_a_state_tensor,
    "state cleared": _clear_the_state,
    "one param's state deleted": _delete_one_params_state,
    "params list replaced": _new_params_list,
    "checkpoint loaded": _reload_own_checkpoint,
}

OPTIMIZERS = {
    "FusedAdam": _pair(FusedAdam, lr=1e-2, weight_decay=0.01),
    "FusedSGD": _pair(FusedSGD, lr=0.1, momentum=0.9),
    "FusedSGD without state": _pair(FusedSGD, lr=0.1),
    "FusedNovoGrad": _pair(FusedNovoGrad, lr=1e-2),
    "FusedLAMB": _pair(FusedLAMB, lr=1e-2),
}


@pytest.mark.parametrize("perturbation", list(PERTURBATIONS))
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_planned_step_is_bitwise_a_step_built_afresh(kind, perturbation):
    if kind == "FusedSGD without state" and perturbation == "a state tensor replaced":
        pytest.skip("SGD without momentum keeps no per-element state")
    planned_cls, rebuilt_cls, options = OPTIMIZERS[kind]
    models = [_model(), _model()]
    planned, rebuilt = planned_cls(models[0].parameters(), **options), rebuilt_cls(models[1].parameters(), **options)
    change = PERTURBATIONS[perturbation]
    for step in range(7):
        skip = (1,) if step == 1 else ()  # a param without a gradient on one step
        for model, optimizer in zip(models, (planned, rebuilt)):
            if change is not None and step == 4:  # between two steps that reuse the plan
                change(optimizer, model, step)
            _set_grads(model, step, skip)
            optimizer.step()
        _assert_same_run(planned, rebuilt, *models)
    if change is None:
        # Built on the first step, again after the step without a gradient and the one after: reused the rest.
        assert planned.builds == 3 and rebuilt.builds == 7


def test_plans_follow_added_and_edited_param_groups():
    planned_cls, rebuilt_cls, _ = OPTIMIZERS["FusedSGD"]
    models = [_model(), _model()]
    optimizers = []
    for model, cls in zip(models, (planned_cls, rebuilt_cls)):
        params = list(model.parameters())
        optimizers.append(cls(params[:4], lr=0.1, momentum=0.0))
    for step in range(5):
        for model, optimizer in zip(models, optimizers):
            if step == 2:
                optimizer.add_param_group({"params": list(model.parameters())[4:], "lr": 0.05})
            if step == 3:
                optimizer.param_groups[0]["momentum"] = 0.9  # its state keys change: momentum buffers appear
            _set_grads(model, step)
            optimizer.step()
        _assert_same_run(*optimizers, *models)
    assert "momentum_buffer" in optimizers[0].state[list(models[0].parameters())[0]]


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_plan_keeps_no_gradient_alive_after_its_step(kind):
    # zero_grad(set_to_none=True) must free the gradients' memory, as with any torch optimizer.
    planned_cls, _, options = OPTIMIZERS[kind]
    model = _model()
    optimizer = planned_cls(model.parameters(), **options)
    for step in range(3):  # built, then reused
        _set_grads(model, step)
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert all(ref() is None for ref in grads)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_fused_optimizer_keeps_its_settings_and_steps_like_the_original(how):
    model = _model()
    optimizer = FusedAdam(model.parameters(), lr=1e-2, adam_w_mode=False, weight_decay=0.1, set_grad_none=False)
    _set_grads(model, 0)
    optimizer.step()
    twin_model = copy.deepcopy(model)
    if how == "deepcopy":
        twin = copy.deepcopy(optimizer)
        twin.param_groups[0]["params"] = list(twin_model.parameters())
        twin.state = {new: optimizer.state[old] for old, new in zip(model.parameters(), twin_model.parameters())}
        twin.state = type(optimizer.state)(dict, {p: copy.deepcopy(s) for p, s in twin.state.items()})
    else:
        buffer = io.BytesIO()
        pickle.dump((model, optimizer), buffer)
        twin_model, twin = pickle.loads(buffer.getvalue())
    assert (twin.adam_w_mode, twin.set_grad_none) == (False, False)
    for step in (1, 2):
        for m, o in ((model, optimizer), (twin_model, twin)):
            _set_grads(m, step)
            o.step()
    for a, b in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(a, b)


# ---- passes in place ------------------------------------------------------------------------------
def _amp_setup(opt_level: str, optimizer_cls=torch.optim.SGD, **init):
    model = _model()
    optimizer = optimizer_cls(model.parameters(), lr=0.1)
    return amp.initialize(model, optimizer, opt_level=opt_level, half_dtype=torch.bfloat16, verbosity=0, **init)


def _loss(model, seed):
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))
    return model(x.to(next(model.parameters()).dtype)).float().pow(2).sum()


def _lifecycle(optimizer):
    return session_for(optimizer).lifecycle_of(optimizer)


@pytest.mark.parametrize("opt_level", ["O0", "O3"])
def test_in_place_passes_accumulate_exactly_as_a_plain_backward(opt_level):
    model, optimizer = _amp_setup(opt_level)
    plain = copy.deepcopy(model)
    optimizer.zero_grad(set_to_none=False)  # zeroed gradients first: added to in place
    for seed in (1, 2, 3):
        with amp.scale_loss(_loss(model, seed), optimizer) as scaled_loss:
            assert _lifecycle(optimizer)._open_pass.in_place
            scaled_loss.backward()
        _loss(plain, seed).backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad if b.grad is not None else torch.zeros_like(a))


@pytest.mark.parametrize("opt_level", ["O0", "O3"])
def test_a_step_inside_an_in_place_block_is_still_refused(opt_level):
    model, optimizer = _amp_setup(opt_level)
    with pytest.raises(RuntimeError, match="optimizer.step\\(\\) was called inside an amp.scale_loss block"):
        with amp.scale_loss(_loss(model, 1), optimizer) as scaled_loss:
            scaled_loss.backward()
            optimizer.step()
    assert _lifecycle(optimizer).state is not GradState.IN_PASS


def test_an_in_place_block_that_raises_leaves_a_usable_optimizer():
    model, optimizer = _amp_setup("O0")
    with pytest.raises(ValueError, match="boom"):
        with amp.scale_loss(_loss(model, 1), optimizer):
            raise ValueError("boom")
    assert _lifecycle(optimizer).state is GradState.EMPTY
    with amp.scale_loss(_loss(model, 2), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()


def test_a_model_recreated_after_training_is_reported_by_an_in_place_pass(caplog):
    model, optimizer = _amp_setup("O0")
    for seed in (1, 2):
        optimizer.zero_grad(set_to_none=True)
        with amp.scale_loss(_loss(model, seed), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with caplog.at_level(logging.WARNING, logger="apex_amp"):
        with amp.scale_loss(_loss(_model(5), 3), optimizer) as scaled_loss:
            scaled_loss.backward()
    assert [r for r in caplog.records if "produced no gradient" in r.getMessage()]


@pytest.mark.parametrize("opt_level", ["O0", "O3"])
def test_a_trainer_loop_over_zeroed_gradients_trains_as_plain_torch_and_warns_of_nothing(opt_level, caplog):
    # The Hugging Face Trainer's way: gradients cleared through the model to zeros (not None),
    # two accumulated passes per step, clipping through amp.master_params, then the step. The
    # passes add to gradients that were there before them: never "no gradient reached".
    model, optimizer = _amp_setup(opt_level, torch.optim.SGD)
    plain = copy.deepcopy(model)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="apex_amp"):
        for step in range(3):
            model.zero_grad(set_to_none=False)
            plain.zero_grad(set_to_none=False)
            for seed in (2 * step, 2 * step + 1):
                with amp.scale_loss(_loss(model, seed), optimizer) as scaled_loss:
                    assert _lifecycle(optimizer)._open_pass.in_place
                    scaled_loss.backward()
                _loss(plain, seed).backward()
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.5)
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
            optimizer.step()
            plain_optimizer.step()
    assert not [r for r in caplog.records if "produced no gradient" in r.getMessage()]
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_a_scale_set_on_an_o0_run_leaves_the_in_place_path_and_unscales():
    model, optimizer = _amp_setup("O0", loss_scale=128.0)
    reference = copy.deepcopy(model)
    with amp.scale_loss(_loss(model, 1), optimizer) as scaled_loss:
        assert not _lifecycle(optimizer)._open_pass.in_place
        scaled_loss.backward()
    _loss(reference, 1).backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


# ---- flags known on the host ------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer_cls", [torch.optim.SGD, FusedAdam])
def test_a_clean_pass_then_an_overflow_skips_and_the_next_clean_step_is_taken(optimizer_cls):
    model, optimizer = _amp_setup("O2", optimizer_cls, num_losses=2, loss_scale="dynamic")
    masters = lambda: [p.detach().clone() for p in amp.master_params(optimizer)]  # noqa: E731
    for poisoned, taken in ((False, True), (True, False), (False, True), (False, True)):
        before = masters()
        optimizer.zero_grad()
        with amp.scale_loss(_loss(model, 1), optimizer, loss_id=0) as scaled_loss:
            scaled_loss.backward()  # clean: its flag is known on the host
        loss = _loss(model, 2) * (float("inf") if poisoned else 1.0)
        with amp.scale_loss(loss, optimizer, loss_id=1) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        assert amp.step_was_skipped(optimizer) is not taken
        assert any(not torch.equal(a, b) for a, b in zip(before, masters())) is taken
    assert not _lifecycle(optimizer).skip.clean.any()


_FLAG_CHANGES = st.lists(st.one_of(
    # a pass noted: its flag's value, whether its skip is the client's, whether the host knows the value
    st.tuples(st.just("note"), st.booleans(), st.booleans(), st.booleans()),
    st.tuples(st.just("end_guard")),
    st.tuples(st.just("recheck_guard"), st.booleans()),  # whether the gradients are finite now
), max_size=8)


@settings(max_examples=60, deadline=None)
@given(changes=_FLAG_CHANGES)
def test_the_step_flag_made_on_write_is_the_or_of_amps_and_the_clients(changes):
    skip = StepSkip(torch.device("cpu"))
    own = guard = None  # the long way: each flag's value, or None
    guard_known_clean = False  # a guard the host knows is clean is not checked again
    for change in changes:
        if change[0] == "note":
            _, value, guards_only, on_host = change
            skip.note(torch.tensor([float(value)]), value if on_host else None, guards_only=guards_only)
            if guards_only:
                guard_known_clean = (guard is None or guard_known_clean) and on_host and not value
                guard = bool(guard) or value
            else:
                own = bool(own) or value
        elif change[0] == "end_guard":
            skip.end_guard()
            guard, guard_known_clean = None, False
        else:
            skip.recheck_guard([torch.tensor([1.0 if change[1] else float("inf")])])
            if guard is not None and not guard_known_clean:
                guard = not change[1]
        flags = [flag for flag in (own, guard) if flag is not None]
        if not flags:
            assert skip.found_inf is None
        else:
            assert bool(skip.found_inf.item()) == any(flags)
    assert not skip.clean.any()


# ---- the resolution of scale_loss's optimizer argument -------------------------------------------------
def test_scale_loss_sees_a_new_initialize_of_the_same_optimizer():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, enabled=False, verbosity=0)
    with amp.scale_loss(_loss(model, 1), optimizer) as scaled_loss:
        assert scaled_loss.requires_grad
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale=64.0, verbosity=0)
    loss = _loss(model, 1)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert torch.equal(scaled_loss.detach(), loss.detach().float() * 64.0)
        scaled_loss.backward()


@pytest.mark.parametrize("opt_level", ["O0", "O2"])
def test_a_remembered_resolution_keeps_no_optimizer_or_model_alive(opt_level):
    # Training code that builds a model and optimizer per trial must get their memory back.
    def trial():
        model, optimizer = _amp_setup(opt_level)
        with amp.scale_loss(_loss(model, 1), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        return weakref.ref(model), weakref.ref(optimizer)

    refs = trial()
    gc.collect()
    assert all(ref() is None for ref in refs)


# ---- the input cast hook's short cut -------------------------------------------------------------
class _Recorder(torch.nn.Module):
    """Keeps what its forward received, so a test sees what the input hook passed on."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))

    def forward(self, *args, **kwargs):
        self.seen = (args, kwargs)
        return self.weight.sum()


@pytest.mark.parametrize("opt_level", ["O0", "O2"])
def test_inputs_the_hook_passes_unwalked_are_exactly_the_walk_s(opt_level):
    from apex_amp.amp.model_casting import cast_floating_tensors

    model = _Recorder()
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level,
                              half_dtype=torch.bfloat16, verbosity=0)
    dtype = torch.float32 if opt_level == "O0" else torch.bfloat16
    other = torch.bfloat16 if opt_level == "O0" else torch.float32
    calls = [
        (torch.ones(3, dtype=dtype),),  # the short cut: already the dtype
        (torch.ones(3, dtype=dtype), torch.arange(3)),  # with an integer tensor
        (torch.ones(3, dtype=other),),  # one to cast
        (torch.ones(3, dtype=dtype), torch.ones(3, dtype=other)),  # the second one to cast
        (torch.nn.Parameter(torch.ones(3, dtype=other)),),  # a subclass: the long way
        ([torch.ones(3, dtype=other)],),  # a container
        (torch.ones(3, dtype=dtype), 2.0),  # not a tensor
        (),
    ]
    for args in calls:
        model(*args)
        received, _ = model.seen
        expected = cast_floating_tensors(args, dtype)
        assert len(received) == len(expected) == len(args)
        for got, want, given in zip(received, expected, args):
            assert type(got) is type(want)
            assert (got is given) == (want is given)  # passed on as it is exactly where the walk does
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got.float(), want.float())
            elif isinstance(want, list):
                assert [t.dtype for t in got] == [t.dtype for t in want] == [dtype]
    model(torch.ones(3, dtype=dtype), x=torch.ones(3, dtype=other))
    assert model.seen[1]["x"].dtype == dtype  # keyword arguments: the walk
