"""apex_amp.memory_report: bytes per parameter by category, measured from the tensors (apex_amp/memory.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apex_amp import amp, memory_report
from apex_amp.optimizers import FusedAdam


def o2_bf16(state_precision="fp32", master_weights=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    optimizer = FusedAdam(model.parameters(), lr=1e-3, state_precision=state_precision)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                      master_weights=master_weights, verbosity=0)
    for step in range(2):  # measured in the second step, between backward and step: the peak
        with amp.scale_loss(model(torch.randn(4, 512)).float().sum(), optimizer) as loss:
            loss.backward()
        if step == 0:
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizer


def counted_by_hand(model, optimizer):
    # Every tensor of the model and the optimizer, by storage: the figure the report must give.
    from apex_amp.amp import sessions

    tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
    tensors += [g for _, g in sessions.session_for(optimizer).lifecycle_of(optimizer).pending_grads()]
    tensors += [p for g in optimizer.param_groups for p in g["params"]]
    tensors += [p.grad for g in optimizer.param_groups for p in g["params"]]
    tensors += [v for s in optimizer.state.values() for v in s.values()]
    tensors += [v for g in optimizer.param_groups for v in g.values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def test_o2_bf16_with_fp32_adam_state_holds_16_bytes_per_parameter():
    model, optimizer = o2_bf16()
    report = memory_report(model, optimizer)
    per = {category: report.per_parameter(category) for category in report.bytes}
    assert per["weights"] == pytest.approx(2.0) and per["grads"] == pytest.approx(2.0)
    assert per["masters"] == pytest.approx(4.0)
    assert per["optimizer state"] == pytest.approx(8.0, abs=0.01)  # + the group's step count
    assert report.total_bytes == counted_by_hand(model, optimizer)
    assert "optimizer state" in str(report) and "16.0" in str(report)


def test_o2_bf16_with_int8_adam_state_holds_about_10_bytes_per_parameter():
    model, optimizer = o2_bf16("int8")
    report = memory_report(model, optimizer)
    # 2 + 2 + 4 + 2 * (1 + 4 / 256), the biases' fp32 state (1024 of 263,168 params) a little more.
    assert report.per_parameter() == pytest.approx(10.03, abs=0.05)
    assert report.total_bytes == counted_by_hand(model, optimizer)


def test_o2_bf16_with_int8_state_and_remainder_masters_holds_at_most_8_1_bytes_per_parameter():
    model, optimizer = o2_bf16("int8", master_weights="remainder")
    report = memory_report(model, optimizer)
    assert report.per_parameter("masters") == pytest.approx(2.0)
    assert report.per_parameter() <= 8.1
    assert report.total_bytes == counted_by_hand(model, optimizer)


def test_a_storage_shared_by_two_tensors_is_counted_once():
    model = nn.Linear(64, 64, bias=False)
    model.weight.grad = torch.zeros(64, 64)
    alias = nn.Linear(64, 64, bias=False)
    alias.weight = model.weight  # the same parameter twice (tied weights)
    tied = nn.ModuleList([model, alias])
    assert memory_report(tied).total_bytes == 2 * 64 * 64 * 4
