"""FusedAdam's op calls: fp32 params without a model copy share the call of O2's half model params.

Under O2 the fp32 BatchNorm params (no half copy) are passed to the same ``fused_adam_`` call
as the masters, each as its own model copy. These tests pin that this is one call, that it
gives bit for bit what separate calls give (a param group per layer: a call each), that a
skipped step still changes nothing, and that the call traces under ``torch.compile``.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from apex_amp import amp
from apex_amp.amp import casting
from apex_amp.optimizers import AmpStepArgs, FusedAdam

INF = float("inf")


@pytest.fixture(autouse=True)
def _o1_off_and_fresh_compiler():
    yield
    torch._dynamo.reset()
    if casting.is_active():
        casting.deactivate()


class _CountAdamCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "fused_adam_" in str(func):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _state(model, optimizer) -> list[torch.Tensor]:
    """Everything a step may change: half weights and buffers, masters, moments, step counts."""
    tensors = [t.detach().clone() for t in model.state_dict(keep_vars=True).values()]
    tensors += [t.detach().clone() for t in model.parameters()]
    tensors += [t.detach().clone() for t in amp.master_params(optimizer)]
    for state in optimizer.state.values():
        tensors += [state[key].clone() for key in ("exp_avg", "exp_avg_sq")]
    # One count per param group: the distinct counts, so one group and three groups line up.
    tensors.append(torch.tensor(sorted({float(group["step"]) for group in optimizer.param_groups if "step" in group})))
    return tensors


def _train(split_groups: bool, steps: int = 4, inject_at: int = -1, step_fn=None, around_skip=None):
    """O2 (bf16, loss scale 128) with FusedAdam; a param group per layer if ``split_groups``.

    ``around_skip``, a list, receives the state just before and just after the step of ``inject_at``.
    """
    model = _bn_model()
    if split_groups:  # the same params in the same order, so the results line up one to one
        groups = [{"params": list(model[i].parameters())} for i in (0, 1, 3)]
        optimizer = FusedAdam(groups, lr=1e-2, weight_decay=0.01)
    else:
        optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                      loss_scale=128.0, verbosity=0)
    step = step_fn(optimizer) if step_fn is not None else optimizer.step
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    skipped, calls = [], []
    for i in range(steps):
        optimizer.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled_loss:
            scaled_loss.backward()
            if i == inject_at:
                model[1].weight.grad[0] = INF  # an fp32 BatchNorm param: checked, and in the merged call
        if i == inject_at and around_skip is not None:
            around_skip.append(_state(model, optimizer))
        if step_fn is None:
            with _CountAdamCalls() as counter:
                step()
            calls.append(counter.calls)
        else:
            step()  # a dispatch mode cannot run under torch.compile
        if i == inject_at and around_skip is not None:
            around_skip.append(_state(model, optimizer))
        skipped.append(amp.step_was_skipped(optimizer))
    return _state(model, optimizer), skipped, calls, model, optimizer


def test_o2_batchnorm_params_share_the_masters_call_and_match_separate_calls():
    merged, skipped, calls, model, optimizer = _train(split_groups=False)
    separate, _, separate_calls, _, _ = _train(split_groups=True)
    assert calls == [1] * 4  # one call: half model params and fp32 BatchNorm params together
    assert separate_calls == [3] * 4  # one per param group
    assert skipped == [False] * 4
    assert len(merged) == len(separate)
    assert all(torch.equal(a, b) for a, b in zip(merged, separate))
    assert all(p.dtype == torch.float32 for p in model[1].parameters())  # the case this test is about
    assert model[0].weight.dtype == torch.bfloat16
    # The group's step count is one tensor, incremented once per step (no second call's copy).
    assert float(optimizer.param_groups[0]["step"]) == 4.0
    assert all("step" not in state for state in optimizer.state.values())


@pytest.mark.parametrize("split_groups", [False, True], ids=["merged", "separate"])
def test_o2_skipped_step_changes_nothing(split_groups):
    around_skip = []
    _, skipped, _, _, _ = _train(split_groups=split_groups, inject_at=1, around_skip=around_skip)
    before, after = around_skip
    changed = [index for index, (a, b) in enumerate(zip(before, after)) if not torch.equal(a, b)]
    assert len(before) == len(after) and not changed
    assert skipped == [False, True, False, False]


def test_o2_merged_and_separate_calls_skip_alike():
    merged, skipped, calls, _, _ = _train(split_groups=False, inject_at=1)
    separate, separate_skipped, _, _, _ = _train(split_groups=True, inject_at=1)
    assert skipped == separate_skipped == [False, True, False, False]
    assert all(torch.equal(a, b) for a, b in zip(merged, separate))
    steps_after_skip = _train(split_groups=False, steps=2, inject_at=1)[4]
    assert float(steps_after_skip.param_groups[0]["step"]) == 1.0


def test_o2_merged_step_compiles_to_one_graph_and_matches_eager():
    eager = _train(split_groups=False, inject_at=1)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = _train(split_groups=False, inject_at=1,
                      step_fn=lambda opt: torch.compile(opt.step, backend=counter, fullgraph=True))
    assert compiled[1] == eager[1] == [False, True, False, False]
    assert all(torch.equal(a, b) for a, b in zip(compiled[0], eager[0]))
    assert counter.frame_count <= 2  # the first step creates the optimizer state: one retrace


def test_half_params_without_masters_keep_their_own_call():
    # A half param cannot be its own (fp32-sourced) model copy: it goes to a second call.
    torch.manual_seed(0)
    half = nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    master_backed = nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    optimizer = FusedAdam([half, master_backed], lr=1e-2)
    master = master_backed.detach().float().requires_grad_()
    optimizer.param_groups[0]["params"] = [half, master]
    half.grad = torch.randn(4, dtype=torch.bfloat16)
    master_backed.grad = torch.randn(4, dtype=torch.bfloat16)
    with _CountAdamCalls() as counter:
        optimizer.step(amp=AmpStepArgs(model_params={master: master_backed}))
    assert counter.calls == 2
    assert float(optimizer.param_groups[0]["step"]) == 1.0  # one count, though two calls read it
    assert torch.equal(master_backed, master.detach().to(torch.bfloat16))
