"""apex's ``param_groups[i]["step"]``: the one step count of the fused optimizers that count steps.

apex's FusedAdam, FusedLAMB, FusedNovoGrad and FusedMixedPrecisionLamb keep their step count in
the param group, where LR schedulers read it (DeepLearningExamples' PolyWarmUpScheduler) and
apex's checkpoints hold it; there is no per-parameter step. Ours is that one counter: read and
written through the group, advanced by the op on the device (not on a skipped step), saved in
``state_dict()``, loaded from apex's checkpoints and from ours of before (a step per parameter).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad

COUNTING = {
    "FusedAdam": lambda params: FusedAdam(params, lr=1e-2),
    "FusedLAMB": lambda params: FusedLAMB(params, lr=1e-2),
    "FusedNovoGrad": lambda params: FusedNovoGrad(params, lr=1e-2),
    "FusedMixedPrecisionLamb": lambda params: FusedMixedPrecisionLamb(params, lr=1e-2),
}


class PolyWarmUpScheduler(torch.optim.lr_scheduler.LRScheduler):
    """DeepLearningExamples' BERT scheduler, in its own words: the progress is the optimizer's group step."""

    def __init__(self, optimizer, warmup, total_steps, degree=0.5):
        self.warmup, self.total_steps, self.degree = warmup, total_steps, degree
        super().__init__(optimizer)

    def step(self, epoch=None):
        group = self.optimizer.param_groups[0]
        self.last_epoch = group["step"] + 1 if "step" in group else 1
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = float(lr)

    def get_lr(self):
        progress = self.last_epoch / self.total_steps
        if progress < self.warmup:
            return [base_lr * progress / self.warmup for base_lr in self.base_lrs]
        return [base_lr * (1.0 - progress) ** self.degree for base_lr in self.base_lrs]


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def step_once(net, optimizer, scale=1.0, seed=0):
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    (net(x).float().pow(2).mean() * scale).backward()
    optimizer.step()


@pytest.mark.parametrize("kind", list(COUNTING))
def test_a_poly_warmup_scheduler_reading_the_group_step_moves_the_lr(kind):
    net = model()
    optimizer = COUNTING[kind](net.parameters())
    scheduler = PolyWarmUpScheduler(optimizer, warmup=0.8, total_steps=10)
    lrs = []
    for step in range(4):
        step_once(net, optimizer, seed=step)
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert float(optimizer.param_groups[0]["step"]) == 4.0
    assert lrs == pytest.approx([1e-2 * k / 10 / 0.8 for k in (2, 3, 4, 5)])  # warm-up: it moves
    assert all("step" not in state for state in optimizer.state.values())  # one counter, the group's


@pytest.mark.parametrize("kind", ["FusedAdam", "FusedLAMB", "FusedNovoGrad"])
def test_a_skipped_step_does_not_advance_the_group_step(kind):
    net = model()
    optimizer = COUNTING[kind](net.parameters())
    net, optimizer = amp.initialize(net, optimizer, opt_level="O2", half_dtype=torch.float16, verbosity=0)
    for scale in (1.0, 1e30, 1.0):  # the second pass overflows in fp16
        optimizer.zero_grad()
        with amp.scale_loss(net(torch.randn(5, 4)).float().pow(2).mean() * scale, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    assert float(optimizer.param_groups[0]["step"]) == 2.0


def test_a_step_count_written_into_the_group_is_the_one_the_next_step_uses():
    # Adam's bias correction reads the count: a FusedAdam told it is at step 100 matches a
    # torch.optim.Adam whose state says the same.
    net, reference = model(), model()
    optimizer = FusedAdam(net.parameters(), lr=1e-2, adam_w_mode=False)
    torch_adam = torch.optim.Adam(reference.parameters(), lr=1e-2)
    step_once(net, optimizer)
    optimizer.param_groups[0]["step"] = 100  # as a scheduler or a script may write it
    for state in optimizer.state.values():
        state["exp_avg"].zero_(), state["exp_avg_sq"].zero_()
    reference.load_state_dict(net.state_dict())
    for p in reference.parameters():
        torch_adam.state[p] = {"step": torch.tensor(100.0), "exp_avg": torch.zeros_like(p),
                               "exp_avg_sq": torch.zeros_like(p)}
    step_once(net, optimizer, seed=1)
    step_once(reference, torch_adam, seed=1)
    assert float(optimizer.param_groups[0]["step"]) == 101.0
    for mine, theirs in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("kind", list(COUNTING))
def test_the_group_step_is_in_the_state_dict_and_survives_a_round_trip(kind):
    net = model()
    optimizer = COUNTING[kind](net.parameters())
    for step in range(3):
        step_once(net, optimizer, seed=step)
    saved = copy.deepcopy(optimizer.state_dict())
    assert float(saved["param_groups"][0]["step"]) == 3.0
    assert all("step" not in state for state in saved["state"].values())
    resumed_net = copy.deepcopy(net)
    resumed = COUNTING[kind](resumed_net.parameters())
    resumed.load_state_dict(saved)
    for optimizer_, net_ in ((optimizer, net), (resumed, resumed_net)):
        step_once(net_, optimizer_, seed=7)
    assert float(resumed.param_groups[0]["step"]) == 4.0
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), resumed_net.parameters()))


def _apex_checkpoint(state_dict: dict) -> dict:
    # apex's layout: the group's step a Python int, no step per parameter.
    apex = copy.deepcopy(state_dict)
    for group in apex["param_groups"]:
        group["step"] = int(group["step"])
    return apex


def _older_checkpoint(state_dict: dict) -> dict:
    # apex_amp's layout before: the count repeated in each parameter's state, none in the group.
    older = copy.deepcopy(state_dict)
    for group in older["param_groups"]:
        step = group.pop("step")
        for index in group["params"]:
            older["state"][index]["step"] = step.clone()
    return older


@pytest.mark.parametrize("layout", [_apex_checkpoint, _older_checkpoint], ids=["apex", "apex_amp-before"])
@pytest.mark.parametrize("kind", ["FusedAdam", "FusedLAMB", "FusedNovoGrad"])
def test_checkpoints_of_apex_and_of_older_apex_amp_load_into_the_group_step(kind, layout):
    net = model()
    optimizer = COUNTING[kind](net.parameters())
    for step in range(5):
        step_once(net, optimizer, seed=step)
    resumed_net = copy.deepcopy(net)
    resumed = COUNTING[kind](resumed_net.parameters())
    resumed.load_state_dict(layout(optimizer.state_dict()))
    step = resumed.param_groups[0]["step"]
    assert isinstance(step, torch.Tensor) and step.dtype == torch.float32 and float(step) == 5.0
    assert all("step" not in state for state in resumed.state.values())
    for optimizer_, net_ in ((optimizer, net), (resumed, resumed_net)):
        step_once(net_, optimizer_, seed=9)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), resumed_net.parameters()))


def test_per_parameter_steps_that_disagree_are_refused_with_the_fix():
    net = model()
    optimizer = FusedAdam(net.parameters())
    step_once(net, optimizer)
    older = _older_checkpoint(optimizer.state_dict())
    older["state"][0]["step"] = torch.tensor(9.0)
    with pytest.raises(RuntimeError, match="different step counts .* different groups"):
        FusedAdam(model().parameters()).load_state_dict(older)


def test_mixed_precision_lamb_has_its_group_step_from_the_start_as_apexs():
    optimizer = FusedMixedPrecisionLamb(model().parameters(), lr=1e-2, step=10)
    step = optimizer.param_groups[0]["step"]
    assert isinstance(step, torch.Tensor) and float(step) == 10.0
