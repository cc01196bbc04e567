"""The same training runs on the compiled extension and on the pure-PyTorch fallback agree.

The backend is chosen once, at import (``APEX_AMP_FORCE_FALLBACK=1`` forces
the fallback), so this process trains on its backend while a second
interpreter (importing this module) trains on the other one at the same time
and prints its record as JSON: the loss of every step, which steps were
skipped, and the loss-scale trajectory. Three runs cover every op amp uses in training:

* O2 bf16 + FusedAdam (``fused_adam_`` writing the bf16 model copy, ``check_finite``);
* O1 bf16 + SGD (``check_finite`` on fp32 grads);
* O2 fp16 with a dynamic scale + SGD, two backward passes per step
  (``scale_`` into the fp32 master grads, ``axpby_`` accumulation,
  ``update_scale_``), with overflows forced at chosen steps.

Losses must agree within a tight tolerance; skip decisions and scales exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from apex_amp import amp, ops
from apex_amp._extension import STATUS
from apex_amp.amp import casting
from apex_amp.optimizers import FusedAdam

REPO = Path(__file__).resolve().parents[1]

# ---- the runs (also executed by the other interpreter, which imports this module) ----------------
def _data(step, features, classes, rows=32):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, features, generator=g), torch.randint(0, classes, (rows,), generator=g)


def _mlp(features, hidden, classes, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, classes))


def _record(model, optimizer, steps, features, classes, passes=1, overflow_at=()):
    losses, skipped, scales = [], [], []
    for step in range(steps):
        optimizer.zero_grad()
        step_loss = 0.0
        for part in range(passes):
            x, y = _data(step * passes + part, features, classes)
            loss = nn.functional.cross_entropy(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
                if step in overflow_at and part == passes - 1:
                    next(model.parameters()).grad.view(-1)[0] = float("inf")
            step_loss += loss.item()
        optimizer.step()
        losses.append(step_loss)
        skipped.append(amp.step_was_skipped(optimizer))
        scales.append(amp.loss_scale())
    return {"losses": losses, "skipped": skipped, "scales": scales}


def _o2_bf16_fused_adam():
    model = _mlp(16, 64, 4)
    optimizer = FusedAdam(model.parameters(), lr=3e-3, weight_decay=0.01)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    return _record(model, optimizer, 30, 16, 4)


def _o1_bf16_sgd():
    model = _mlp(16, 32, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    amp.initialize(model, optimizer, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    try:
        return _record(model, optimizer, 20, 16, 4)
    finally:
        casting.deactivate()  # O1's casting is process-wide


def _o2_fp16_dynamic_two_passes():
    model = _mlp(4, 8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0, scale_window=3)
    return _record(model, optimizer, 16, 4, 2, passes=2, overflow_at=FORCED_OVERFLOWS)


FORCED_OVERFLOWS = (2, 3, 9)


def run_all() -> dict:
    """Every run on the backend this process uses, single-threaded (one reduction order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {"o2_bf16_fused_adam": _o2_bf16_fused_adam(), "o1_bf16_sgd": _o1_bf16_sgd(),
                "o2_fp16_dynamic": _o2_fp16_dynamic_two_passes()}
    finally:
        torch.set_num_threads(threads)
    return {"backend": ops.BACKEND, "reason": STATUS.reason, "runs": runs}


_CHILD = (
    "import json, sys; sys.path.insert(0, sys.argv[1]); "
    "import test_backend_equivalence as t; print(json.dumps(t.run_all()))"
)


def _other_backend_in_a_subprocess(force_fallback: bool) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "APEX_AMP_FORCE_FALLBACK"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if force_fallback:
        env["APEX_AMP_FORCE_FALLBACK"] = "1"
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(Path(__file__).resolve().parent)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def both_backends():
    """(extension runs, fallback runs): this process's backend here, the other one in a subprocess."""
    # Started first so that it runs while this process trains.
    child = _other_backend_in_a_subprocess(force_fallback=ops.BACKEND == "extension")
    try:
        here = run_all()
    finally:
        out, err = child.communicate(timeout=180)
    assert child.returncode == 0, err
    there = json.loads(out.strip().splitlines()[-1])
    sides = {here["backend"]: here, there["backend"]: there}
    if "extension" not in sides:
        pytest.skip(f"compiled extension not built or not loadable: {there['reason']}")
    assert set(sides) == {"extension", "fallback"}
    return sides["extension"]["runs"], sides["fallback"]["runs"]


# The two backends do the same fp32 arithmetic (csrc/amp_math.h, mirrored by the
# fallback), so the losses come out equal here; the tolerance leaves room for a
# different summation order on other CPUs, far below what a wrong op produces.
LOSS_TOLERANCE = {"o2_bf16_fused_adam": 1e-6, "o1_bf16_sgd": 1e-6, "o2_fp16_dynamic": 1e-6}


@pytest.mark.parametrize("run", sorted(LOSS_TOLERANCE))
def test_losses_agree_step_by_step(both_backends, run):
    extension, fallback = (side[run]["losses"] for side in both_backends)
    assert len(extension) == len(fallback) > 0
    for step, (got, want) in enumerate(zip(extension, fallback)):
        assert abs(got - want) <= LOSS_TOLERANCE[run] * max(1.0, abs(want)), (
            f"{run} step {step}: extension loss {got!r}, fallback loss {want!r}"
        )


@pytest.mark.parametrize("run", sorted(LOSS_TOLERANCE))
def test_skip_decisions_and_scales_agree_exactly(both_backends, run):
    extension, fallback = both_backends
    assert extension[run]["skipped"] == fallback[run]["skipped"]
    assert extension[run]["scales"] == fallback[run]["scales"]


def test_the_dynamic_run_really_overflowed_backed_off_and_grew(both_backends):
    # Guards the comparisons above against runs that never exercised the rules.
    run = both_backends[1]["o2_fp16_dynamic"]
    skipped_steps = [step for step, skipped in enumerate(run["skipped"]) if skipped]
    assert set(FORCED_OVERFLOWS) <= set(skipped_steps)
    scales = run["scales"]
    for step in FORCED_OVERFLOWS:
        assert scales[step] == scales[step - 1] / 2  # backed off
    assert max(scales[4:9]) > scales[3]  # grew again after scale_window clean passes
    assert not any(both_backends[1]["o2_bf16_fused_adam"]["skipped"])
