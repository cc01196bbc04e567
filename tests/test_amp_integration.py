"""amp with the rest of PyTorch: LR schedulers, DDP, add_param_group, hooks, FusedAdam standalone."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from apex_amp import amp
from apex_amp.amp import casting
from apex_amp.optimizers import AmpStepArgs, FusedAdam

INF = float("inf")


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def step_once(model, optimizer, seed, inject=None):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
        if inject is not None:
            model[0].weight.grad[0, 0] = inject
    optimizer.step()
    return loss.item()


@pytest.mark.parametrize("created", ["before", "after"])
@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
def test_lr_scheduler_works_and_never_warns_on_skipped_steps(created, kind):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if kind == "SGD" else FusedAdam(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if created == "before":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
        if created == "after":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for step in range(3):
            before = model[0].weight.detach().clone()
            step_once(model, optimizer, step, inject=INF if step == 0 else None)
            # the skip happens even through the scheduler's wrapper of optimizer.step
            assert torch.equal(before, model[0].weight) == (step == 0)
            assert amp.step_was_skipped(optimizer) == (step == 0)
            scheduler.step()
    assert [str(w.message) for w in caught] == []
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_step_was_skipped_lets_user_hold_the_scheduler():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 / (1 + epoch))
    for step in range(4):
        step_once(model, optimizer, step, inject=INF if step in (1, 2) else None)
        if not amp.step_was_skipped(optimizer):
            scheduler.step()
    assert scheduler.last_epoch == 2


def test_add_param_group_after_initialize_gets_masters():
    model = tiny_model()
    optimizer = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    optimizer.add_param_group({"params": list(model[2].parameters()), "lr": 5e-3})
    before = model[2].weight.detach().clone()
    step_once(model, optimizer, 0)
    masters = list(amp.master_params(optimizer))
    assert len(masters) == 4 and all(p.dtype == torch.float32 for p in masters)
    assert masters[2] is not model[2].weight
    assert not torch.equal(before, model[2].weight)
    assert torch.equal(model[2].weight, masters[2].to(torch.bfloat16))  # model = rounded master


def test_fused_adam_o2_writes_model_copy_in_the_same_pass():
    model = tiny_model()
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    for step in range(3):
        step_once(model, optimizer, step)
    for master, param in zip(amp.master_params(optimizer), model.parameters()):
        assert torch.equal(param, master.to(torch.float16))
        assert param.grad is None  # amp's model grads were consumed by the step


def test_user_step_hooks_still_run():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    step_once(model, optimizer, 0)
    assert calls == ["pre", "post"]


def test_ddp_wrapping_after_initialize_trains(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = tiny_model()
        optimizer = FusedAdam(model.parameters(), lr=1e-2)
        amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
        ddp = nn.parallel.DistributedDataParallel(model)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
        losses = []
        for _ in range(8):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
        assert ddp.state_dict()["module.0.weight"].dtype == torch.float32
    finally:
        dist.destroy_process_group()


def test_optimizer_state_dict_round_trips_under_o2():
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    step_once(model, optimizer, 0)
    state = optimizer.state_dict()
    assert all(v["exp_avg"].dtype == torch.float32 for v in state["state"].values())
    optimizer.load_state_dict(state)
    step_once(model, optimizer, 1)


# ---- FusedAdam without amp --------------------------------------------------------------------
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_matches_torch_adam(adam_w_mode):
    reference, fused = tiny_model(), tiny_model()
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_opt = torch_cls(reference.parameters(), lr=1e-2, weight_decay=0.05)
    fused_opt = FusedAdam(fused.parameters(), lr=1e-2, weight_decay=0.05, adam_w_mode=adam_w_mode)
    for step in range(5):
        for model, opt in ((reference, ref_opt), (fused, fused_opt)):
            g = torch.Generator().manual_seed(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(8, 6, generator=g)), torch.randint(0, 3, (8,), generator=g)).backward()
            opt.step()
    for a, b in zip(reference.parameters(), fused.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(fused_opt.param_groups[0]["step"]) == 5.0


def test_fused_adam_loads_torch_adam_state():
    reference, fused = tiny_model(), tiny_model()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    fused_opt = FusedAdam(fused.parameters(), lr=1e-2, adam_w_mode=False)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    nn.functional.cross_entropy(reference(x), y).backward()
    ref_opt.step()
    fused.load_state_dict(reference.state_dict())
    fused_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # as torch.save + torch.load
    for model, opt in ((reference, ref_opt), (fused, fused_opt)):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for a, b in zip(reference.parameters(), fused.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_adam_zero_grad_honours_set_grad_none():
    model = tiny_model()
    model(torch.randn(2, 6)).sum().backward()
    FusedAdam(model.parameters(), set_grad_none=False).zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    FusedAdam(model.parameters()).zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_fused_adam_found_inf_makes_step_a_no_op_without_amp():
    model = tiny_model()
    optimizer = FusedAdam(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step(amp=AmpStepArgs(found_inf=torch.ones(1)))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert float(optimizer.param_groups[0]["step"]) == 0.0


def test_fused_adam_own_master_weights_for_a_half_model():
    torch.manual_seed(0)
    model = nn.Linear(6, 3).to(torch.bfloat16)
    optimizer = FusedAdam(model.parameters(), lr=1e-3, master_weights=True)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 6, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        optimizer.step()
    master = optimizer.state[model.weight]["master_param"]
    assert master.dtype == torch.float32 and torch.equal(model.weight, master.to(torch.bfloat16))
    state = optimizer.state_dict()
    fresh = FusedAdam(model.parameters(), lr=1e-3, master_weights=True)
    fresh.load_state_dict(state)
    assert fresh.state[model.weight]["master_param"].dtype == torch.float32
    assert torch.equal(fresh.state[model.weight]["master_param"], master)


def test_fused_adam_rejects_differing_step_counts_within_a_group():
    # torch.optim.Adam's layout holds a step per param; FusedAdam keeps one per group (apex's).
    model = tiny_model()
    torch_adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    torch_adam.step()
    state = torch_adam.state_dict()
    state["state"][0]["step"] = torch.tensor(7.0)
    with pytest.raises(RuntimeError, match="one step count per param group"):
        FusedAdam(model.parameters()).load_state_dict(state)


def test_o1_optimizer_step_runs_with_casts_disabled():
    seen = []

    class ProbingSGD(torch.optim.SGD):
        def step(self, closure=None):
            probe = torch.ones(2, 2)
            seen.append(torch.mm(probe, probe).dtype)  # half under active O1 casting
            return super().step(closure)

    model = tiny_model()
    optimizer = ProbingSGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    probe = torch.ones(2, 2)
    assert torch.mm(probe, probe).dtype == torch.bfloat16
    step_once(model, optimizer, 0)
    assert seen == [torch.float32]
    assert torch.mm(probe, probe).dtype == torch.bfloat16  # casting back on after the step


def test_master_params_and_step_was_skipped_reject_bad_arguments():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        amp.master_params("adam")
    model = tiny_model()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O0", verbosity=0)
    with pytest.raises(RuntimeError, match="that amp.initialize never saw"):
        amp.step_was_skipped(torch.optim.SGD(tiny_model().parameters(), lr=0.1))
