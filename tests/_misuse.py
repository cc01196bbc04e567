"""Shared helpers of the misuse tests: a small model, a trained O2 run, and state snapshots.

A failed call must leave everything as it was; :func:`snapshot` records what
that means (weights, grads and dtypes of the models, the optimizer's params
(the masters under O2), their grads and state, amp's hooks and session, the
loss scalers) and :func:`assert_same` compares two snapshots exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from apex_amp import amp
from apex_amp.amp import sessions
from apex_amp.optimizers import FusedAdam

from _trees import assert_same  # noqa: F401  (re-exported for the misuse tests)

BF16 = torch.bfloat16


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))


def train_step(model, optimizer, seed=0, loss_id=0):
    optimizer.zero_grad()
    loss = model(batch(seed)).float().pow(2).mean()
    with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
        scaled.backward()
    optimizer.step()
    return loss.detach()


def o2_trained(kind="SGD", num_losses=1):
    """An O2 model and optimizer after two steps: non-trivial weights, moments and scaler counters.

    bf16 (fast on CPU) with an explicitly dynamic scale, so the scalers behave as under fp16.
    """
    model = small_model()
    optimizer = sgd(model) if kind == "SGD" else FusedAdam(model.parameters(), lr=1e-2)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, loss_scale="dynamic", verbosity=0,
                   num_losses=num_losses)
    for seed in range(2):
        train_step(model, optimizer, seed)
    return model, optimizer


# ---- snapshots ------------------------------------------------------------------------------
def clone_tree(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: clone_tree(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_tree(item) for item in value)
    return value


def snapshot(models=(), optimizers=()):
    """Everything a failed call must leave alone."""
    snap = {"models": [], "optimizers": [], "amp": None}
    for model in models:
        snap["models"].append({
            "params": {name: (p.dtype, p.detach().clone(), None if p.grad is None else p.grad.clone())
                       for name, p in model.named_parameters()},
            "buffers": {name: b.clone() for name, b in model.named_buffers()},
            "hooks": (len(model._forward_pre_hooks), len(model._forward_hooks), len(model._state_dict_hooks)),
            "initialized": sessions.was_initialized(model),
        })
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        snap["optimizers"].append({
            # The masters under O2: the tensors the optimizer updates.
            "params": [(id(p), p.dtype, p.detach().clone(), None if p.grad is None else p.grad.clone())
                       for p in params],
            "state": [clone_tree(optimizer.state.get(p, {})) for p in params],
            "hooks": (len(optimizer._optimizer_step_pre_hooks), len(optimizer._optimizer_step_post_hooks)),
            "session": id(sessions.session_for(optimizer)),
        })
    if sessions.latest_session() is not None:
        snap["amp"] = amp.state_dict()
    return snap


