"""Checkpoints: bitwise resume in a fresh process, fp32 state_dict under O2, malformed amp state."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdam

from _trees import assert_same

REPO = Path(__file__).resolve().parents[1]


# One training run, cut at step K: "full" runs 2K steps and saves a checkpoint
# at K; "resume" loads it in a fresh process and runs steps K..2K-1.
RUN_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    from apex_amp import amp
    from apex_amp.optimizers import FusedAdam

    def main(mode, level, half, kind, checkpoint, result, steps=6):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        optimizer = {
            "SGD": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
            "FusedAdam": lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01),
        }[kind](model.parameters())
        extra = {"skip_nonfinite": True} if level in ("O0", "O3") else {}
        amp.initialize(model, optimizer, opt_level=level, half_dtype=getattr(torch, half), verbosity=0,
                       scale_window=2, **extra)
        first = 0
        if mode == "resume":
            state = torch.load(checkpoint)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            amp.load_state_dict(state["amp"])
            first = steps
        losses = []
        for step in range(first, 2 * steps):
            if mode == "full" and step == steps:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "amp": amp.state_dict()}, checkpoint)
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
                if step in (2, steps + 1):
                    model[0].weight.grad[0, 0] = float("inf")
            optimizer.step()
            if step >= steps:
                losses.append(loss.detach())
        torch.save({"losses": losses,
                    "params": {n: p.detach() for n, p in model.named_parameters()},
                    "buffers": {n: b for n, b in model.named_buffers()},
                    "masters": [p.detach() for p in amp.master_params(optimizer)],
                    "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}, result)

    if __name__ == "__main__":
        main(*sys.argv[1:])
    """
)


def resume_is_bitwise(tmp_path, level, half, kind):
    script = tmp_path / "run.py"
    script.write_text(RUN_SCRIPT)
    checkpoint, full, resumed = tmp_path / "ckpt.pt", tmp_path / "full.pt", tmp_path / "resumed.pt"
    # The uninterrupted run here; the resumed one in a fresh interpreter.
    runpy.run_path(str(script))["main"]("full", level, half, kind, str(checkpoint), str(full))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, str(script), "resume", level, half, kind, str(checkpoint), str(resumed)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert_same(torch.load(full), torch.load(resumed))


def test_resume_in_fresh_process_is_bitwise_o2_fused(tmp_path):
    resume_is_bitwise(tmp_path, "O2", "float16", "FusedAdam")


@pytest.mark.slow
@pytest.mark.parametrize(
    "level, half, kind",
    [("O2", "bfloat16", "Adam"), ("O1", "float16", "SGD"), ("O3", "bfloat16", "FusedAdam"), ("O0", "float16", "Adam")],
)
def test_resume_in_fresh_process_is_bitwise(tmp_path, level, half, kind):
    resume_is_bitwise(tmp_path, level, half, kind)


# ---- model.state_dict under O2 ------------------------------------------------------------
def o2_model(kind="SGD", half=torch.bfloat16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if kind == "SGD" else FusedAdam(model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=half, verbosity=0)
    return model, optimizer


def test_o2_state_dict_is_fp32_and_holds_the_masters():
    model, optimizer = o2_model()
    state = model.state_dict()
    assert all(v.dtype in (torch.float32, torch.int64) for v in state.values())
    masters = list(amp.master_params(optimizer))
    assert torch.equal(state["0.weight"], masters[0]) and torch.equal(state["2.bias"], masters[-1])
    assert model[0].weight.dtype == torch.bfloat16  # the model itself stays half
    # Wrapping afterwards keeps the hook (keys under the wrapper's prefix).
    wrapped = nn.Sequential(model)
    assert wrapped.state_dict()["0.0.weight"].dtype == torch.float32


def test_masters_start_from_exact_fp32_weights():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    original = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    assert torch.equal(next(amp.master_params(optimizer)), original)
    assert torch.equal(model.weight, original.to(torch.bfloat16))


def test_loading_fp32_into_half_model_refreshes_masters_exactly():
    model, optimizer = o2_model("FusedAdam")
    torch.manual_seed(1)
    new_values = {k: (torch.randn_like(v) if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    model.load_state_dict(new_values)
    masters = list(amp.master_params(optimizer))
    assert torch.equal(masters[0], new_values["0.weight"])
    assert torch.equal(model[0].weight, new_values["0.weight"].to(torch.bfloat16))
    assert torch.equal(model[1].weight, new_values["1.weight"])  # fp32 batchnorm is its own master
    assert_same(model.state_dict(), new_values)


def test_existing_optimizer_state_is_carried_over_to_masters():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    exp_avg = optimizer.state[model.weight]["exp_avg"].clone()
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    master = next(amp.master_params(optimizer))
    assert torch.equal(optimizer.state[master]["exp_avg"], exp_avg)
    assert model.weight not in optimizer.state


# ---- amp.state_dict --------------------------------------------------------------------------
def test_amp_state_dict_has_apex_keys_and_round_trips():
    model = nn.Linear(2, 2)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", num_losses=2, verbosity=0)
    state = amp.state_dict()
    assert state["loss_scaler0"]["loss_scale"] == 65536.0 and state["loss_scaler1"]["unskipped"] == 0
    state["loss_scaler1"]["loss_scale"] = 1024.0
    state["loss_scaler1"]["unskipped"] = 7
    amp.load_state_dict(state)
    assert amp.loss_scale(1) == 1024.0 and amp.state_dict()["loss_scaler1"]["unskipped"] == 7
    # an apex checkpoint (only apex's keys) loads too
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1},
                         "loss_scaler1": {"loss_scale": 4.0, "unskipped": 0}})
    assert amp.loss_scale(0) == 8.0


@pytest.mark.parametrize(
    "corrupt, error, message",
    [
        (lambda s: s.pop("loss_scaler0"), ValueError, r"amp state has no loss scalers \(this run has \['loss_scaler0'\]\)"),
        (lambda s: s["loss_scaler0"]["amp_config"].update(opt_level="O1"), ValueError, "saved with opt_level='O1'"),
        (lambda s: s.update(amp_config={"opt_level": "O1"}), ValueError, "saved with opt_level='O1'"),  # older format
        (lambda s: s["loss_scaler0"].update(loss_scale=-2.0), ValueError, "positive finite number"),
        (lambda s: s["loss_scaler0"].update(loss_scale=float("nan")), ValueError, "positive finite number"),
        (lambda s: s["loss_scaler0"].update(unskipped=-1), ValueError, "unskipped must be an integer >= 0"),
        (lambda s: s["loss_scaler0"].pop("unskipped"), ValueError, "has no 'unskipped'"),
        (lambda s: s["loss_scaler0"].update(bogus=1), ValueError, r"unexpected keys \['bogus'\]"),
        (lambda s: s["loss_scaler0"].update(dynamic=False), ValueError, "saved with a static loss scale"),
        (lambda s: s.update(loss_scaler0=[1, 2]), TypeError, "must be a dict"),
    ],
)
def test_malformed_amp_state_raises_and_changes_nothing(corrupt, error, message):
    o2_model(half=torch.float16)
    state = amp.state_dict()
    corrupt(state)
    with pytest.raises(error, match=message):
        amp.load_state_dict(state)
    assert amp.loss_scale() == 65536.0


def test_load_state_dict_rejects_non_dict():
    o2_model()
    with pytest.raises(TypeError, match="expects the dict from amp.state_dict"):
        amp.load_state_dict([("loss_scaler0", {})])
