"""Checkpoints of low-precision optimizer state: bitwise round trips, conversions between precisions,
to and from torch.optim.AdamW (apex_amp/optimizers/state_conversion.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from apex_amp.optimizers import FusedAdam, FusedSGD
from apex_amp.optimizers.state_conversion import fp32_state_dict, torch_adamw_state_dict
from apex_amp.optimizers.state_formats import dequantize, join_master, quantize

ROOT = Path(__file__).resolve().parents[1]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 4))


def run(optimizer, model, steps=2, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model.zero_grad()
        x = torch.randn(16, 128, generator=generator).to(model[0].weight.dtype)
        model(x).float().pow(2).mean().backward()
        optimizer.step()


def bits(tensor):
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def assert_same_state(first, second):
    assert first.keys() == second.keys()
    for key in first:
        a, b = first[key], second[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(bits(a), bits(b)), key


@pytest.mark.parametrize("precision", ["bf16", "fp8", "int8"])
def test_state_dict_round_trips_bitwise_and_training_goes_on_identically(precision, tmp_path):
    model = make_model()
    optimizer = FusedAdam(model.parameters(), lr=1e-2, state_precision=precision)
    run(optimizer, model)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt")
    resumed_model = make_model(seed=7)
    resumed_model.load_state_dict(saved["model"])
    resumed = FusedAdam(resumed_model.parameters(), lr=1e-2, state_precision=precision)
    resumed.load_state_dict(saved["optimizer"])
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert_same_state(optimizer.state[p], resumed.state[q])
    run(optimizer, model, seed=2)
    run(resumed, resumed_model, seed=2)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)
        assert_same_state(optimizer.state[p], resumed.state[q])


@pytest.mark.parametrize("saved, loaded, bound", [
    ("int8", "bf16", lambda values, absmax: values.abs() * 2.0 ** -8),
    ("bf16", "int8", lambda values, absmax: absmax / 64),
    ("fp8", "int8", lambda values, absmax: absmax / 64),
    ("int8", "fp8", lambda values, absmax: absmax / 14),
    ("int8", "fp32", lambda values, absmax: torch.zeros_like(values)),
])
def test_a_state_saved_in_one_precision_loads_converted_within_the_new_formats_rounding(saved, loaded, bound):
    model = make_model()
    source = FusedAdam(model.parameters(), lr=1e-2, state_precision=saved)
    run(source, model)
    target = FusedAdam(model.parameters(), lr=1e-2, state_precision=loaded)
    target.load_state_dict(source.state_dict())
    weight = model[0].weight
    for key in ("exp_avg", "exp_avg_sq"):
        values = dequantize(source.state[weight][key], source.state[weight].get(key + "_absmax"))
        codes, absmax = target.state[weight][key], target.state[weight].get(key + "_absmax")
        expected_codes, expected_absmax = quantize(values, codes.dtype, None if absmax is None else 128)
        assert torch.equal(bits(codes), bits(expected_codes))  # exactly the new format's quantization
        assert absmax is None or torch.equal(absmax, expected_absmax)
        rows_absmax = values.abs().amax(dim=1, keepdim=True)
        assert bool(((dequantize(codes, absmax) - values).abs() <= bound(values, rows_absmax)).all())
    assert target.state_dict()["param_groups"][0]["state_precision"] == loaded


def test_an_int8_state_loads_into_torch_adamw_and_an_adamw_state_into_an_int8_fused_adam():
    model = make_model()
    fused = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, state_precision="int8")
    run(fused, model)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    adamw.load_state_dict(torch_adamw_state_dict(fused.state_dict()))
    weight = model[0].weight
    state = fused.state[weight]
    assert torch.equal(adamw.state[weight]["exp_avg"], dequantize(state["exp_avg"], state["exp_avg_absmax"]))
    assert float(adamw.state[weight]["step"]) == 2.0
    assert adamw.param_groups[0]["decoupled_weight_decay"] is True
    # The same next step as FusedAdam from the same (fp32) state.
    twin = make_model()
    twin.load_state_dict(model.state_dict())
    fp32_fused = FusedAdam(twin.parameters(), lr=1e-2, weight_decay=0.1)
    fp32_fused.load_state_dict(fp32_state_dict(fused.state_dict()))
    run(adamw, model, steps=1, seed=4)
    run(fp32_fused, twin, steps=1, seed=4)
    torch.testing.assert_close(model[0].weight, twin[0].weight, rtol=1e-5, atol=1e-6)
    # And back: torch's fp32 state quantized on load.
    again = FusedAdam(model.parameters(), lr=1e-2, state_precision="int8")
    again.load_state_dict(adamw.state_dict())
    codes, absmax = quantize(adamw.state[weight]["exp_avg_sq"], torch.uint8, 128)
    assert torch.equal(again.state[weight]["exp_avg_sq"], codes)
    assert torch.equal(again.state[weight]["exp_avg_sq_absmax"], absmax)
    assert float(again.param_groups[0]["step"]) == 3.0


def test_fp32_masters_load_as_remainders_and_remainders_as_masters():
    torch.manual_seed(0)
    model = make_model().to(torch.bfloat16)
    with_masters = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, master_weights=True)
    run(with_masters, model)
    masters = [with_masters.state[p]["master_param"].clone() for p in model.parameters()]
    with_remainders = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, master_weights="remainder")
    with_remainders.load_state_dict(with_masters.state_dict())
    for p, master in zip(model.parameters(), masters):
        assert "master_param" not in with_remainders.state[p]
        assert torch.equal(join_master(p.detach(), with_remainders.state[p]["master_remainder"]), master)
    back = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, master_weights=True)
    back.load_state_dict(with_remainders.state_dict())
    for p, master in zip(model.parameters(), masters):
        assert torch.equal(back.state[p]["master_param"], master)


@pytest.mark.slow
def test_a_quantized_checkpoint_resumes_bitwise_in_a_new_process(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_state_checkpoints import make_model, run
        from apex_amp.optimizers import FusedAdam
        saved = torch.load(sys.argv[1])
        model = make_model(seed=9)
        model.load_state_dict(saved["model"])
        optimizer = FusedAdam(model.parameters(), lr=1e-2, state_precision="int8")
        optimizer.load_state_dict(saved["optimizer"])
        run(optimizer, model, seed=2)
        torch.save({{"model": model.state_dict(), "optimizer": optimizer.state_dict()}}, sys.argv[2])
    """)
    model = make_model()
    optimizer = FusedAdam(model.parameters(), lr=1e-2, state_precision="int8")
    run(optimizer, model)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "before.pt")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "before.pt"), str(tmp_path / "after.pt")],
                   check=True, cwd=ROOT)
    run(optimizer, model, seed=2)
    after = torch.load(tmp_path / "after.pt")
    for name, value in model.state_dict().items():
        assert torch.equal(after["model"][name], value)
    for index, state in optimizer.state_dict()["state"].items():
        assert_same_state(state, after["optimizer"]["state"][index])
