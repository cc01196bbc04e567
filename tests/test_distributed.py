"""amp under DistributedDataParallel: 2-process runs of examples/distributed.py and no_sync accumulation.

The subprocess tests launch ``python -m torch.distributed.run --standalone
--nproc_per_node=2`` on CPU (gloo); the example compares every rank's master
weights, model weights, optimizer state, amp state and skipped steps with
rank 0's bitwise and exits 1 on any difference. Each launch costs ~12 s here
(three interpreters import torch), so only two run by default.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from apex_amp import amp

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distributed.py"
IDENTICAL = "RESULT: all 2 ranks identical"
TIMEOUT_S = 180

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def run_example(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(EXAMPLE.parents[1]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(EXAMPLE), "--steps", "8", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def assert_identical(result: subprocess.CompletedProcess) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert IDENTICAL in result.stdout, output[-4000:]
    return result.stdout


def skipped_steps_line(stdout: str) -> str:
    (summary,) = [line for line in stdout.splitlines() if "skipped steps" in line]
    return summary.rsplit("skipped steps", 1)[1].strip()


def test_o2_bf16_no_sync_overflow_on_one_rank_is_skipped_by_both():
    # Rank 1 alone sees inf in a no_sync pass; the synced pass all-reduces it, both ranks skip step 2.
    stdout = assert_identical(run_example("--opt-level", "O2", "--half-dtype", "bfloat16",
                                          "--accumulate", "3", "--inject-overflow", "1:2"))
    assert skipped_steps_line(stdout) == "[2]"


def test_o1_bf16_sgd_ranks_stay_identical():
    stdout = assert_identical(run_example("--opt-level", "O1", "--half-dtype", "bfloat16", "--optimizer", "SGD"))
    assert skipped_steps_line(stdout) == "[]"


@pytest.mark.slow
@pytest.mark.parametrize("opt_level", ["O0", "O3"])
def test_other_opt_levels_ranks_stay_identical(opt_level):
    assert_identical(run_example("--opt-level", opt_level, "--accumulate", "2"))


@pytest.mark.slow
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fp16_dynamic_scale_no_sync_overflow_on_rank0(opt_level):
    # fp16 on CPU is slow: a tiny model. The dynamic scale must back off identically on both ranks.
    stdout = assert_identical(run_example("--opt-level", opt_level, "--half-dtype", "float16", "--hidden", "8",
                                          "--batch-size", "8", "--accumulate", "2", "--inject-overflow", "0:3"))
    assert skipped_steps_line(stdout) == "[3]"
    assert "loss scale 32768" in stdout


@pytest.mark.slow
def test_check_fails_when_no_sync_passes_are_not_announced():
    # Without model=ddp amp checks rank-local gradients: rank 1 skips alone and the ranks drift apart.
    # Proves the example's comparison can fail.
    result = run_example("--accumulate", "3", "--inject-overflow", "1:2", "--no-model-arg")
    assert result.returncode != 0
    assert "RESULT: ranks differ" in result.stdout, (result.stdout + result.stderr)[-4000:]


# ---- in-process, world size 1: what scale_loss does under no_sync ---------------------------------


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp_o2(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    return nn.parallel.DistributedDataParallel(model), optimizer


def test_no_sync_pass_defers_the_overflow_check_to_the_synced_pass(process_group):
    ddp, optimizer = _ddp_o2()
    x = torch.randn(4, 6)
    before = [p.detach().clone() for p in amp.master_params(optimizer)]
    with ddp.no_sync():
        with amp.scale_loss(ddp(x).sum() * float("inf"), optimizer, model=ddp) as scaled_loss:
            scaled_loss.backward()
    # Not checked yet: the gradients wait, scaled and in place, for DDP's all-reduce.
    assert amp.state_dict()["loss_scaler0"]["overflows"] == 0
    assert all(p.grad is not None for p in ddp.module.parameters())
    with amp.scale_loss(ddp(x).sum(), optimizer, model=ddp) as scaled_loss:
        scaled_loss.backward()
    assert amp.state_dict()["loss_scaler0"]["overflows"] == 1
    optimizer.step()
    assert amp.step_was_skipped(optimizer)
    for old, new in zip(before, amp.master_params(optimizer)):
        assert torch.equal(old, new)


def test_no_sync_accumulation_matches_one_big_batch(process_group):
    ddp, optimizer = _ddp_o2()
    reference, reference_optimizer = _ddp_o2()
    x = torch.randn(8, 6)
    with ddp.no_sync():
        with amp.scale_loss(ddp(x[:4]).sum(), optimizer, model=ddp) as scaled_loss:
            scaled_loss.backward()
    with amp.scale_loss(ddp(x[4:]).sum(), optimizer, model=ddp) as scaled_loss:
        scaled_loss.backward()
    with amp.scale_loss(reference.module(x[:4]).sum() + reference.module(x[4:]).sum(), reference_optimizer) as scaled_loss:
        scaled_loss.backward()
    for got, expected in zip(amp.master_params(optimizer), amp.master_params(reference_optimizer)):
        torch.testing.assert_close(got.grad, expected.grad, rtol=2e-2, atol=1e-2)


def test_no_sync_refuses_zeroed_gradients_and_changes_nothing(process_group):
    ddp, optimizer = _ddp_o2()
    x = torch.randn(4, 6)
    with amp.scale_loss(ddp(x).sum(), optimizer, model=ddp) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # zeros, not None: they would be merged as rank-local values
    grads = [p.grad.clone() for p in amp.master_params(optimizer)]
    with ddp.no_sync():
        loss = ddp(x).sum()
        with pytest.raises(RuntimeError, match=r"zero_grad\(set_to_none=True\)"):
            with amp.scale_loss(loss, optimizer, model=ddp):
                pass
    for grad, p in zip(grads, amp.master_params(optimizer)):
        assert torch.equal(grad, p.grad)
    optimizer.zero_grad(set_to_none=True)
    with ddp.no_sync():
        with amp.scale_loss(ddp(x).sum(), optimizer, model=ddp) as scaled_loss:
            scaled_loss.backward()
