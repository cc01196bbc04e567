"""The fused optimizers' state precision (state_precision / state_block_size / min_quantized_numel).

The settings are constructor arguments and param-group keys of every fused optimizer; the state
is laid out by state_formats.state_layout from the global shape, fp8/int8 absmaxes live in the
state beside their codes and reach the op in the batches (and in the cached batch plans). The
numerics of the formats are state_formats' (tests/test_state_formats.py); here: that the
optimizers store, pass and keep what that module defines.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from apex_amp.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad,
                                 FusedSGD)
from apex_amp.optimizers.fused_optimizer import AmpStepArgs
from apex_amp.optimizers.state_formats import dequantize, quantize, state_layout

# name -> (factory, {state key: never negative})
FAMILY = {
    "FusedAdam": (lambda params, **kw: FusedAdam(params, lr=1e-2, **kw), {"exp_avg": False, "exp_avg_sq": True}),
    "FusedLAMB": (lambda params, **kw: FusedLAMB(params, lr=1e-2, **kw), {"exp_avg": False, "exp_avg_sq": True}),
    "FusedMixedPrecisionLamb": (lambda params, **kw: FusedMixedPrecisionLamb(params, lr=1e-2, **kw),
                                {"exp_avg": False, "exp_avg_sq": True}),
    "FusedSGD": (lambda params, **kw: FusedSGD(params, lr=0.05, momentum=0.9, **kw), {"momentum_buffer": False}),
    "FusedAdagrad": (lambda params, **kw: FusedAdagrad(params, lr=1e-2, **kw), {"sum": True}),
    "FusedNovoGrad": (lambda params, **kw: FusedNovoGrad(params, lr=1e-2, **kw), {"exp_avg": False}),
}
STORAGE = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
           "fp8": (torch.float8_e4m3fn, torch.float8_e4m3fn), "int8": (torch.int8, torch.uint8)}


def make_model(seed: int = 0) -> nn.Module:
    # model[0].weight: 64 rows of 128 (8192 elements): quantized, one 128-element block per row (blocks
    # never cross a row); the biases and model[2].weight (256 elements) keep fp32 (< min_quantized_numel).
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 4))


def run(optimizer, model, steps=3, seed=1, found_inf_at=()):
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(16, 128, generator=generator)
        model.zero_grad()
        model(x.to(next(model.parameters()).dtype)).float().pow(2).mean().backward()
        if step in found_inf_at:
            optimizer.step(amp=AmpStepArgs(found_inf=torch.ones(1)))
        else:
            optimizer.step()


# ---- the settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_every_fused_optimizer_takes_the_settings_as_arguments_and_group_keys(name):
    factory, _ = FAMILY[name]
    model = make_model()
    optimizer = factory([{"params": model[0].parameters(), "state_precision": "int8"},
                         {"params": model[2].parameters()}],
                        state_precision="bf16", state_block_size=128, min_quantized_numel=100)
    first, second = optimizer.param_groups
    assert (first["state_precision"], second["state_precision"]) == ("int8", "bf16")
    assert first["state_block_size"] == second["state_block_size"] == 128
    assert first["min_quantized_numel"] == 100
    assert optimizer.state_dict()["param_groups"][0]["state_precision"] == "int8"


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_default_is_fp32_state(name):
    factory, _ = FAMILY[name]
    group = factory(make_model().parameters()).param_groups[0]
    assert (group["state_precision"], group["state_block_size"], group["min_quantized_numel"]) == ("fp32", 256, 4096)


@pytest.mark.parametrize("setting, message", [
    (dict(state_precision="int4"), "state_precision must be one of 'fp32', 'bf16', 'fp8', 'int8'"),
    (dict(state_block_size=100), "state_block_size must be a power of two in \\[32, 4096\\]"),
    (dict(state_block_size=8192), "state_block_size must be a power of two"),
    (dict(min_quantized_numel=-1), "min_quantized_numel must be an int >= 0"),
])
@pytest.mark.parametrize("where", ["argument", "param group"])
def test_bad_settings_are_refused_with_what_is_allowed(setting, message, where):
    model = make_model()
    with pytest.raises(ValueError, match=message):
        if where == "argument":
            FusedAdam(model.parameters(), **setting)
        else:
            FusedAdam([{"params": model.parameters(), **setting}])


def test_a_group_added_later_is_validated_too():
    model = make_model()
    optimizer = FusedAdam(model[0].parameters())
    with pytest.raises(ValueError, match="state_precision must be one of"):
        optimizer.add_param_group({"params": model[2].parameters(), "state_precision": "fp4"})


# ---- the state a step makes -------------------------------------------------------------------------


@pytest.mark.parametrize("precision", sorted(STORAGE))
@pytest.mark.parametrize("name", sorted(FAMILY))
def test_state_is_stored_as_the_layout_of_the_global_shape_says(name, precision):
    factory, keys = FAMILY[name]
    model = make_model()
    optimizer = factory(model.parameters(), state_precision=precision)
    run(optimizer, model, steps=1)
    big = model[0].weight
    for key, nonnegative in keys.items():
        codes = optimizer.state[big][key]
        assert codes.dtype == STORAGE[precision][nonnegative]
        assert codes.shape == big.shape and codes.stride() == big.stride()
        absmax = optimizer.state[big].get(key + "_absmax")
        if precision in ("fp8", "int8"):  # 64 rows of 128: one 128-element block per row
            assert absmax.dtype == torch.float32 and absmax.shape == (64, 1)
            # Each row's absmax is its block's largest magnitude (exactly map[-1] = 1 times it for int8).
            largest = dequantize(codes, absmax).abs().amax(dim=1, keepdim=True)
            torch.testing.assert_close(largest, absmax, rtol=0 if precision == "int8" else 1e-6, atol=0)
        else:
            assert absmax is None
        for small in (model[0].bias, model[2].weight, model[2].bias):
            assert optimizer.state[small][key].dtype == torch.float32
            assert key + "_absmax" not in optimizer.state[small]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), row_size=st.sampled_from([24, 32, 48, 64, 96, 160, 256, 384]),
       precision=st.sampled_from(sorted(STORAGE)), block=st.sampled_from([32, 64, 128, 256]),
       minimum=st.sampled_from([0, 100, 4096]))
def test_the_state_of_any_shape_follows_state_layout(rows, row_size, precision, block, minimum):
    weight = nn.Parameter(torch.randn(rows, row_size))
    weight.grad = torch.randn(rows, row_size)
    optimizer = FusedSGD([weight], lr=0.1, momentum=0.9, state_precision=precision, state_block_size=block,
                         min_quantized_numel=minimum)
    optimizer.step()
    layout = state_layout((rows, row_size), precision, block, minimum)
    state = optimizer.state[weight]
    assert state["momentum_buffer"].dtype == STORAGE[layout.precision.value][False]
    if layout.block is None:
        assert "momentum_buffer_absmax" not in state
    else:
        assert state["momentum_buffer_absmax"].shape == (rows, row_size // layout.block)


def test_each_param_group_keeps_its_own_precision_and_block_size():
    model = make_model()
    optimizer = FusedAdam([{"params": [model[0].weight], "state_precision": "int8", "state_block_size": 32},
                           {"params": [model[0].bias, model[2].weight, model[2].bias]}],
                          lr=1e-2, state_precision="bf16", min_quantized_numel=100)
    run(optimizer, model, steps=1)
    assert optimizer.state[model[0].weight]["exp_avg_absmax"].shape == (64, 4)   # 32-element blocks
    assert optimizer.state[model[2].weight]["exp_avg"].dtype == torch.bfloat16   # 256 >= 100
    assert optimizer.state[model[2].bias]["exp_avg"].dtype == torch.float32      # 4 < 100


def test_a_param_whose_rows_are_not_outermost_in_memory_keeps_fp32_state():
    # A transposed weight: blocks in memory order would cross rows (and FSDP2's row shards).
    weight = nn.Parameter(torch.randn(128, 64).t())
    weight.grad = torch.randn(128, 64).t()
    optimizer = FusedAdam([weight], state_precision="int8")
    optimizer.step()
    state = optimizer.state[weight]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].stride() == weight.stride()
    assert "exp_avg_absmax" not in state


@pytest.mark.parametrize("precision, state_bytes", [
    ("fp32", 8.0), ("bf16", 4.0), ("fp8", 2 * (1 + 4 / 256)), ("int8", 2 * (1 + 4 / 256))])
def test_adam_state_bytes_per_parameter(precision, state_bytes):
    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Linear(512, 512, bias=False))
    optimizer = FusedAdam(model.parameters(), state_precision=precision)
    model(torch.randn(2, 512)).sum().backward()
    optimizer.step()
    held = sum(t.nbytes for p in model.parameters() for t in optimizer.state[p].values())
    assert held / sum(p.numel() for p in model.parameters()) == pytest.approx(state_bytes, rel=1e-12)


@pytest.mark.parametrize("precision", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("name", sorted(FAMILY))
def test_a_step_is_the_fp32_step_on_the_dequantized_state_then_quantized(name, precision):
    # The contract of the ops, seen through the optimizers: the quantized step equals an fp32 step
    # from the dequantized state (same backend), whose new state quantized is the stored one.
    from apex_amp.optimizers.state_conversion import fp32_state_dict

    factory, keys = FAMILY[name]
    model = make_model()
    quantized = factory(model.parameters(), state_precision=precision)
    run(quantized, model, steps=2)
    twin = make_model()
    twin.load_state_dict(model.state_dict())
    reference = factory(twin.parameters())
    reference.load_state_dict(fp32_state_dict(quantized.state_dict()))
    run(quantized, model, steps=1, seed=5)
    run(reference, twin, steps=1, seed=5)
    big, twin_big = model[0].weight, twin[0].weight
    for key in keys:
        codes, absmax = quantized.state[big][key], quantized.state[big].get(key + "_absmax")
        expected_codes, expected_absmax = quantize(reference.state[twin_big][key], codes.dtype,
                                                   None if absmax is None else 128)
        assert torch.equal(codes.view(torch.uint8) if codes.element_size() == 1 else codes,
                           expected_codes.view(torch.uint8) if codes.element_size() == 1 else expected_codes)
        assert absmax is None or torch.equal(absmax, expected_absmax)
    if "LAMB" in name or "Lamb" in name:  # the trust ratio's direction is recomputed from the stored moments
        torch.testing.assert_close(big, twin_big, rtol=1e-3, atol=1e-4)
    else:
        assert torch.equal(big, twin_big)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("name", ["FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedAdagrad"])
def test_a_low_precision_second_moment_far_below_its_block_is_never_stored_as_zero(name, precision):
    # One gradient of 1 per 128-element block, the others 1e-5: their squares are 1e-10 of the
    # block's largest, under half the smallest entry of either format (3.25e-7 in int8's unsigned
    # map, 2**-9 / 448 = 4.4e-6 in fp8). Stored as 0, Adam's next step would divide by the current
    # gradient alone (docs/low_precision_state.md).
    factory, keys = FAMILY[name]
    key = next(k for k, never_negative in keys.items() if never_negative)
    param = nn.Parameter(torch.zeros(64, 128))
    optimizer = factory([param], state_precision=precision)
    grad = torch.full((64, 128), 1e-5)
    grad[:, 0] = 1.0
    for _ in range(3):
        param.grad = grad.clone()
        optimizer.step()
    codes = optimizer.state[param][key]
    smallest, largest = {"int8": (1, 255), "fp8": (1, 0x7E)}[precision]
    assert codes.dtype == STORAGE[precision][1]
    codes = codes.view(torch.uint8)
    assert bool((codes[:, 1:] == smallest).all()) and bool((codes[:, 0] == largest).all())
    if name == "FusedAdam":  # the small elements' steps stay under the learning rate
        assert bool((param[:, 1:].abs() <= 3 * 1e-2).all())


def test_a_skipped_step_changes_no_code_and_no_absmax():
    model = make_model()
    optimizer = FusedAdam(model.parameters(), lr=1e-2, state_precision="int8")
    run(optimizer, model, steps=2)
    before = {key: value.clone() for key, value in optimizer.state[model[0].weight].items()}
    run(optimizer, model, steps=1, found_inf_at=(0,))
    for key, value in optimizer.state[model[0].weight].items():
        assert torch.equal(value.view(torch.uint8) if value.element_size() == 1 else value,
                           before[key].view(torch.uint8) if value.element_size() == 1 else before[key])


def test_a_cached_plan_follows_an_absmax_replaced_in_the_state():
    model = make_model()
    optimizer = FusedAdam(model.parameters(), lr=1e-2, state_precision="int8")
    run(optimizer, model, steps=2)  # the second step reused the first one's batches
    state = optimizer.state[model[0].weight]
    replaced = state["exp_avg_sq_absmax"] = state["exp_avg_sq_absmax"].clone()
    before = replaced.clone()
    run(optimizer, model, steps=1, seed=3)
    assert state["exp_avg_sq_absmax"] is replaced and not torch.equal(replaced, before)


def test_an_fsdp2_param_gets_the_layout_of_its_global_shape_and_sharded_absmaxes(process_group):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    model = make_model()
    fully_shard(model)
    optimizer = FusedAdam(model.parameters(), lr=1e-2, state_precision="int8")
    run(optimizer, model, steps=2)
    state = optimizer.state[model[0].weight]
    absmax = state["exp_avg_absmax"]
    assert isinstance(absmax, DTensor) and absmax.shape == (64, 1) and absmax.placements == (Shard(0),)
    assert state["exp_avg"].to_local().dtype == torch.int8
    assert optimizer.state[model[2].weight]["exp_avg"].dtype == torch.float32


def test_a_column_sharded_dtensor_is_refused_for_blocked_state(process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    weight = nn.Parameter(distribute_tensor(torch.randn(64, 128), mesh, [Shard(1)]))
    weight.grad = distribute_tensor(torch.randn(64, 128), mesh, [Shard(1)])
    optimizer = FusedAdam([weight], state_precision="int8")
    with pytest.raises(ValueError, match="sharded on dim 0 only"):
        optimizer.step()


# ---- on a GPU (pytest -m cuda: scripts/gpu_check.sh runs it; skipped without one) ------------------


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(FAMILY))
@pytest.mark.parametrize("precision", ["bf16", "fp8", "int8"])
def test_on_cuda_the_state_is_stored_in_its_format_and_follows_the_cpu_run(name, precision):
    # The same steps on both devices, a skipped one among them: the state keeps its storage dtypes and
    # absmaxes on the GPU, the skipped step changes nothing there either, and the weights follow the
    # CPU run's. Not bit for bit: nvcc contracts multiply-adds that the CPU rounds twice (a few ulp of
    # a moment can move a code by one step: a few hundredths of one lr step for that element), so the
    # bound is on the updates as a whole, which a wrong block scale or code map (off by a factor, or
    # by many codes) moves by a large part of themselves.
    factory, _ = FAMILY[name]
    initial = make_model()
    models = {device: make_model().to(device) for device in ("cpu", "cuda")}
    optimizers = {device: factory(model.parameters(), state_precision=precision, state_block_size=128)
                  for device, model in models.items()}
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.randn(16, 128, generator=generator)
        for device, model in models.items():
            model.zero_grad()
            model(x.to(device)).pow(2).mean().backward()
            if step == 3:
                before = [p.detach().clone() for p in model.parameters()]
                optimizers[device].step(amp=AmpStepArgs(found_inf=torch.ones(1, device=device)))
                assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
            else:
                optimizers[device].step()
    state = optimizers["cuda"].state[models["cuda"][0].weight]
    cpu_state = optimizers["cpu"].state[models["cpu"][0].weight]
    assert state.keys() == cpu_state.keys()
    stored = [key for key, value in state.items() if torch.is_tensor(value) and value.dtype in STORAGE[precision]]
    assert stored  # (NovoGrad's second moment is one norm per tensor: fp32 whatever the precision)
    for key in stored:
        assert state[key].device.type == "cuda" and state[key].dtype == cpu_state[key].dtype
        assert state[key].shape == cpu_state[key].shape
        if precision in ("fp8", "int8"):
            absmax = state[key + "_absmax"]
            assert absmax.device.type == "cuda" and absmax.dtype == torch.float32
    difference = updates = 0.0
    for start, cpu_param, cuda_param in zip(initial.parameters(), models["cpu"].parameters(),
                                            models["cuda"].parameters()):
        assert torch.isfinite(cuda_param).all()
        difference += float((cuda_param.detach().cpu() - cpu_param.detach()).pow(2).sum())
        updates += float((cpu_param.detach() - start.detach()).pow(2).sum())
    assert updates > 0 and (difference / updates) ** 0.5 < 0.02
