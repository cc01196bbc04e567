"""apex_amp.memory_report: bytes per parameter by category, measured from the tensors (apex_amp/memory.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from _diag_models import BAD_SPECS
from apex_amp import amp, memory_report
from apex_amp.__main__ import main
from apex_amp.optimizers import FusedAdam

TESTS = Path(__file__).resolve().parent


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


# ---- python -m apex_amp memory -------------------------------------------------------------


def test_cli_memory_prints_the_report_of_int8_state_and_remainder_masters_in_a_subprocess():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "apex_amp", "memory", "_diag_models:wide_linears", "--state-precision", "int8",
         "--master-weights", "remainder", "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["parameters"] == 2 * 512 * 512
    per = data["bytes_per_parameter"]
    assert per["weights"] == 2.0 and per["grads"] == 2.0 and per["masters"] == 2.0
    assert per["optimizer state"] == pytest.approx(2 * (1 + 4 / 256), abs=1e-4)  # codes + absmaxes (+ step)
    assert data["total_bytes_per_parameter"] <= 8.1


def built_by_hand(optimizer_factory, opt_level, master_weights):
    # What the command measures, built the documented way: a real batch, a step, a second backward.
    import _diag_models

    torch.manual_seed(0)
    model = _diag_models.wide_linears()
    model, optimizer = amp.initialize(model, optimizer_factory(model.parameters()), opt_level=opt_level,
                                      half_dtype=torch.bfloat16, master_weights=master_weights, verbosity=0)
    for step in range(2):
        optimizer.zero_grad()
        with amp.scale_loss(model(torch.randn(4, 512)).float().sum(), optimizer) as loss:
            loss.backward()
        if step == 0:
            optimizer.step()
    return memory_report(model, optimizer)


@pytest.mark.parametrize("options, factory, opt_level, master_weights, expected_total", [
    ([], lambda p: FusedAdam(p, lr=1e-3), "O2", None, 16.0),
    (["--state-precision", "bf16"], lambda p: FusedAdam(p, lr=1e-3, state_precision="bf16"), "O2", None, 12.0),
    (["--master-weights", "false"], lambda p: FusedAdam(p, lr=1e-3), "O2", False, 8.0),  # bf16 state in place
    (["--opt-level", "O0"], lambda p: FusedAdam(p, lr=1e-3), "O0", None, 16.0),
    (["--optimizer", "FusedSGD", "--optimizer-arg", "momentum=0.9", "--state-precision", "int8"],
     lambda p: __import__("apex_amp").optimizers.FusedSGD(p, lr=1e-3, momentum=0.9, state_precision="int8"),
     "O2", None, 2 + 2 + 4 + 1 + 4 / 256),
    # A non-fused optimizer steps fp32 masters with fp32 master gradients (4 bytes, not the model's 2).
    (["--optimizer", "torch.optim.AdamW"], lambda p: torch.optim.AdamW(p, lr=1e-3), "O2", None, 18.0),
])
def test_cli_memory_reports_what_the_same_model_and_optimizer_hold_after_a_real_step(
        options, factory, opt_level, master_weights, expected_total, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["memory", "_diag_models:wide_linears", "--json", *options]) == 0
    data = json.loads(capsys.readouterr().out)
    by_hand = built_by_hand(factory, opt_level, master_weights)
    assert data["bytes"] == by_hand.bytes  # category by category, to the byte
    assert data["total_bytes_per_parameter"] == pytest.approx(expected_total, abs=0.01)


def test_cli_memory_prints_a_table_by_default(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["memory", "_diag_models:wide_linears"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state" in out and "masters" in out and "(524,288 parameters)" in out


@pytest.mark.parametrize("spec, message", [*BAD_SPECS, ("_diag_models:frozen", "no trainable parameters")])
def test_cli_memory_bad_specs_exit_2_with_a_clear_error(spec, message, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["memory", spec]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    (["--optimizer", "Adam"], "unknown optimizer 'Adam': use one of FusedAdam"),
    (["--optimizer", "torch.optim.NoSuchThing"], "unknown optimizer 'torch.optim.NoSuchThing'"),
    (["--optimizer", "torch.optim.AdamW", "--state-precision", "int8"],
     "--state-precision is an option of apex_amp's fused optimizers, not of torch.optim.AdamW"),
    (["--optimizer-arg", "momentum"], "--optimizer-arg expects KEY=VALUE"),
    (["--optimizer-arg", "no_such_argument=1"], "unexpected keyword argument 'no_such_argument'"),
    (["--optimizer-arg", "betas=(0.9, 2.0)"], "FusedAdam(lr, betas) failed"),
    (["--master-weights", "remainder", "--half-dtype", "float16"], "master_weights='remainder' needs a bf16 model"),
    (["--master-weights", "remainder", "--optimizer", "torch.optim.AdamW"], "needs apex_amp's fused optimizers"),
    (["--device", "no_such_device"], "--device 'no_such_device' is not a device"),
])
def test_cli_memory_bad_options_exit_2_with_a_clear_error(options, message, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["memory", "_diag_models:wide_linears", *options]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    (["--state-precision", "int4"], "invalid choice: 'int4'"),
    (["--master-weights", "yes"], "invalid choice: 'yes'"),
    (["--opt-level", "O4"], "invalid choice: 'O4'"),
])
def test_cli_memory_values_outside_the_choices_are_usage_errors(options, message, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    with pytest.raises(SystemExit) as exited:
        main(["memory", "_diag_models:wide_linears", *options])
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.parametrize("options", [
    ["--state-precision", "int8", "--master-weights", "remainder"],
    ["--state-precision", "fp8"],
    ["--optimizer", "torch.optim.AdamW"],
])
def test_cli_memory_on_cuda_counts_the_bytes_it_counts_on_the_cpu(options, capsys, monkeypatch):
    # The same model, optimizer and step on the GPU hold the same tensors: a byte count that differs
    # would be a tensor left on the host, a state made twice, or an allocation counted by device.
    monkeypatch.syspath_prepend(str(TESTS))
    by_device = {}
    for device in ("cpu", "cuda"):
        assert main(["memory", "_diag_models:wide_linears", "--json", "--device", device, *options]) == 0
        by_device[device] = json.loads(capsys.readouterr().out)
    assert by_device["cuda"]["bytes"] == by_device["cpu"]["bytes"]
