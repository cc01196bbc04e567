"""scale_loss reuses one found-inf buffer per loss scaler: an earlier pass's overflow must survive it.

Each checked pass zeroes the scaler's buffer and writes it; the optimizer states keep
their own copies of it until their step. These tests build the case where a later pass's
zeroing would be the only thing wiping an earlier overflow: pass 1 overflows on model A
but also covers optimizer B (finite gradients), pass 2 (same loss_id, B only) is clean,
so B's skip rests on the copy of pass 1's flag alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdam

INF = float("inf")


def _make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    return FusedAdam(params, lr=1e-2) if kind == "FusedAdam" else torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("kind", ["FusedAdam", "SGD"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_overflow_skips_every_optimizer_of_its_pass_despite_a_later_clean_pass(kind, opt_level):
    torch.manual_seed(0)
    model_a, model_b = nn.Linear(4, 3), nn.Linear(4, 3)
    opt_a, opt_b = _make_optimizer(kind, model_a.parameters()), _make_optimizer(kind, model_b.parameters())
    (model_a, model_b), (opt_a, opt_b) = amp.initialize(
        [model_a, model_b], [opt_a, opt_b], opt_level=opt_level, half_dtype=torch.bfloat16,
        loss_scale=128.0, verbosity=0)
    x = torch.randn(5, 4)
    before = [p.detach().clone() for model in (model_a, model_b) for p in model.parameters()]
    masters_before = [p.detach().clone() for opt in (opt_a, opt_b) for p in amp.master_params(opt)]

    loss = (model_a(x).float().sum() + model_b(x).float().sum()) / 10
    with amp.scale_loss(loss, [opt_a, opt_b]) as scaled_loss:
        scaled_loss.backward()
        model_a.weight.grad[0, 0] = INF  # only A's gradients overflow
    with amp.scale_loss(model_b(x).float().sum() / 10, opt_b) as scaled_loss:  # clean, same scaler
        scaled_loss.backward()
    opt_a.step()
    opt_b.step()

    assert amp.step_was_skipped(opt_a) and amp.step_was_skipped(opt_b)
    after = [p.detach() for model in (model_a, model_b) for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    masters_after = [p.detach() for opt in (opt_a, opt_b) for p in amp.master_params(opt)]
    assert all(torch.equal(a, b) for a, b in zip(masters_before, masters_after))
    assert amp.state_dict()["loss_scaler0"]["overflows"] == 1

    # The next step, all clean, is taken by both.
    for opt in (opt_a, opt_b):
        opt.zero_grad(set_to_none=True)
    with amp.scale_loss((model_a(x).float().sum() + model_b(x).float().sum()) / 10, [opt_a, opt_b]) as scaled_loss:
        scaled_loss.backward()
    opt_a.step()
    opt_b.step()
    assert not amp.step_was_skipped(opt_a) and not amp.step_was_skipped(opt_b)
    assert not torch.equal(model_b.weight.detach(), before[2])
