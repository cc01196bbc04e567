"""amp under DDP and FSDP: 2-process runs of examples/distributed.py, no_sync accumulation, sync options.

The subprocess tests launch ``python -m torch.distributed.run --standalone
--nproc_per_node=2`` on CPU (gloo); the example compares every rank's master
weights, model weights, optimizer state, amp state and skipped steps with
rank 0's bitwise and exits 1 on any difference. Each launch costs 7-12 s here
(three interpreters import torch), so the fast tests combine several checks
per launch and the rest are marked slow.
"""

from __future__ import annotations

import ast
import re
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _launch import launch_two_ranks
from apex_amp import amp

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distributed.py"
IDENTICAL = "RESULT: all 2 ranks identical"

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def run_example(*args: str, torchrun: bool = False, script: Path = EXAMPLE) -> subprocess.CompletedProcess:
    """examples/distributed.py with ``--steps 8`` and ``args`` (or ``script`` with ``args``) on 2 ranks."""
    command = [str(script), *args] if script != EXAMPLE else [str(EXAMPLE), "--steps", "8", *args]
    return launch_two_ranks(command, torchrun=torchrun)


def assert_identical(result: subprocess.CompletedProcess) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert IDENTICAL in result.stdout, output[-4000:]
    return result.stdout


def skipped_steps_line(stdout: str) -> str:
    (summary,) = [line for line in stdout.splitlines() if "skipped steps" in line]
    return summary.rsplit("skipped steps", 1)[1].strip()


def per_rank_skipped_steps(stdout: str) -> dict[int, list[int]]:
    # "  rank R skipped steps [...]" lines, printed when the ranks disagree.
    found = re.findall(r"^\s*rank (\d+) skipped steps (\[[\d, ]*\])$", stdout, flags=re.MULTILINE)
    return {int(rank): ast.literal_eval(steps) for rank, steps in found}


def test_o2_bf16_no_sync_overflow_on_one_rank_is_skipped_by_both_and_masters_follow_rank0():
    # Rank 1 alone sees inf in a no_sync pass; the synced pass all-reduces it, both ranks skip step 2.
    # The ranks also start from different weights: DDP broadcasts rank 0's, and scale_loss(model=ddp)
    # broadcasts rank 0's fp32 masters, which initialize had made from each rank's own weights.
    result = run_example("--opt-level", "O2", "--half-dtype", "bfloat16", "--accumulate", "3",
                         "--inject-overflow", "1:2", "--unequal-init")
    stdout = assert_identical(result)
    assert skipped_steps_line(stdout) == "[2]"
    assert "rank 1: amp's fp32 master weights differed from rank 0's" in result.stderr
    assert "rank 0: amp's fp32 master weights differed" not in result.stderr


@pytest.mark.slow
def test_o1_sgd_head_outside_ddp_with_sync_overflow_skips_on_every_rank():
    # The head's gradients are checked per rank (DDP does not reduce them); only rank 1's overflow.
    stdout = assert_identical(run_example("--opt-level", "O1", "--half-dtype", "bfloat16", "--optimizer", "SGD",
                                          "--unwrapped-head", "--sync-overflow", "--inject-overflow", "1:3"))
    assert skipped_steps_line(stdout) == "[3]"


@pytest.mark.slow
def test_head_outside_ddp_without_sync_overflow_ranks_take_different_skips():
    # The same run without sync_overflow: rank 1 skips step 3 alone, rank 0 then steps with the
    # all-reduced inf gradients. Proves that the option (and the comparison) matter.
    result = run_example("--opt-level", "O1", "--half-dtype", "bfloat16", "--optimizer", "SGD",
                         "--unwrapped-head", "--inject-overflow", "1:3")
    assert result.returncode != 0
    assert "RESULT: ranks differ" in result.stdout, (result.stdout + result.stderr)[-4000:]
    skips = per_rank_skipped_steps(result.stdout)
    assert 3 in skips[1] and 3 not in skips[0], result.stdout


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)


def test_checkpoint_on_rank0_resume_on_two_ranks_is_bitwise_identical(tmp_path):
    # O2 with a dynamic scale that backs off (overflow at step 2) and grows again (window 2), two
    # optimizers (a head outside DDP, sync_overflow) and no_sync accumulation: the checkpoint after
    # step 4 must carry the masters, both optimizers' state and the amp state exactly.
    common = ["--opt-level", "O2", "--half-dtype", "bfloat16", "--loss-scale", "dynamic", "--scale-window", "2",
              "--inject-overflow", "1:2", "--unwrapped-head", "--sync-overflow", "--accumulate", "2"]
    checkpoint, full, resumed = tmp_path / "ckpt.pt", tmp_path / "full.pt", tmp_path / "resumed.pt"
    assert_identical(run_example(*common, "--save-at", "4", "--checkpoint", str(checkpoint),
                                 "--state-out", str(full)))
    assert_identical(run_example(*common, "--resume", str(checkpoint), "--state-out", str(resumed)))
    full_run, resumed_run = torch.load(full), torch.load(resumed)
    assert resumed_run["first_step"] == 4
    assert full_run["skipped"] == [False, False, True] + [False] * 5
    assert resumed_run["skipped"] == full_run["skipped"][4:]
    assert torch.equal(_bytes(resumed_run["losses"]), _bytes(full_run["losses"][4:]))
    assert full_run["state"].keys() == resumed_run["state"].keys()
    assert any("master" in name for name in full_run["state"])
    differing = [name for name, value in full_run["state"].items()
                 if not torch.equal(_bytes(value), _bytes(resumed_run["state"][name]))]
    assert differing == []
    assert full_run["state"]["amp loss_scaler0.overflows"].item() == 1
    assert full_run["state"]["amp loss_scaler0.loss_scale"].item() != 65536.0  # the scale did move


@pytest.mark.slow
@pytest.mark.parametrize("opt_level", ["O0", "O3"])
def test_other_opt_levels_ranks_stay_identical_under_torchrun(opt_level):
    assert_identical(run_example("--opt-level", opt_level, "--accumulate", "2", torchrun=True))


@pytest.mark.slow
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fp16_dynamic_scale_no_sync_overflow_on_rank0(opt_level):
    # fp16 on CPU is slow: a tiny model. The dynamic scale must back off identically on both ranks.
    stdout = assert_identical(run_example("--opt-level", opt_level, "--half-dtype", "float16", "--hidden", "8",
                                          "--batch-size", "8", "--accumulate", "2", "--inject-overflow", "0:3"))
    assert skipped_steps_line(stdout) == "[3]"
    assert "loss scale 32768" in stdout


def test_unseeded_apex_script_o2_fp16_trains_every_rank_bitwise_identical():
    # apex's examples/simple/distributed at O2: each rank builds its own weights, initialize, then DDP,
    # plain scale_loss(loss, optimizer) and model.zero_grad(). amp sees the wrapper in the first
    # forward and gives every rank rank 0's fp32 masters, as DDP gave them rank 0's weights.
    result = run_example("--opt-level", "O2", "--half-dtype", "float16", "--optimizer", "SGD", "--hidden", "8",
                         "--batch-size", "8", "--unequal-init", "--no-model-arg", "--clear-through-model",
                         "--inject-overflow", "0:2", torchrun=True)
    stdout = assert_identical(result)
    assert skipped_steps_line(stdout) == "[2]"
    assert "rank 1: amp's fp32 master weights differed from rank 0's" in result.stderr
    assert "rank 0: amp's fp32 master weights differed" not in result.stderr


INNER_FORWARD = """
import os, traceback, torch, torch.distributed as dist
from torch import nn
from apex_amp import amp
dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
ddp = nn.parallel.DistributedDataParallel(model)
loss = ddp.module(torch.randn(3, 4)).float().sum()  # around the wrapper: amp cannot see it
try:
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
except RuntimeError:
    traceback.print_exc()
os._exit(1)  # no clean-up: the other rank may be waiting in a collective
"""


def test_masters_that_do_not_match_the_weights_ddp_broadcast_raise_when_the_wrapper_is_unseen(tmp_path):
    script = tmp_path / "inner_forward.py"
    script.write_text(INNER_FORWARD)
    result = run_example(script=script)
    assert result.returncode != 0
    assert "rank 1: 2 model weights are not the rounding of amp's fp32 master weights" in result.stderr
    assert "amp.sync_masters(ddp_model, optimizer)" in result.stderr


@pytest.mark.slow
def test_fsdp_use_orig_params_o1_overflow_in_one_shard_is_skipped_by_both():
    # The last bias lies in rank 1's gradient shard: only rank 1 sees the inf after the reduce-scatter.
    # amp syncs found-inf by itself for FSDP models, so both ranks skip step 3.
    stdout = assert_identical(run_example("--fsdp", "--opt-level", "O1", "--optimizer", "SGD",
                                          "--inject-overflow", "1:3"))
    assert skipped_steps_line(stdout) == "[3]"


@pytest.mark.slow
def test_fsdp_without_overflow_sync_ranks_take_different_skips():
    result = run_example("--fsdp", "--opt-level", "O1", "--optimizer", "SGD", "--inject-overflow", "1:3",
                         "--no-sync-overflow")
    assert result.returncode != 0
    assert per_rank_skipped_steps(result.stdout) == {0: [], 1: [3]}, (result.stdout + result.stderr)[-4000:]


@pytest.mark.slow
def test_check_fails_when_no_sync_passes_are_not_announced():
    # Without model=ddp amp checks rank-local gradients: rank 1 skips alone and the ranks drift apart.
    # Proves the example's comparison can fail.
    result = run_example("--accumulate", "3", "--inject-overflow", "1:2", "--no-model-arg")
    assert result.returncode != 0
    assert "RESULT: ranks differ" in result.stdout, (result.stdout + result.stderr)[-4000:]


# ---- in-process, world size 1: what scale_loss does under no_sync ---------------------------------


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
    # O1: the optimizer reads the model's own .grad, which zero_grad(set_to_none=False) leaves as zeros.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    ddp = nn.parallel.DistributedDataParallel(model)
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


# ---- in-process, world size 1: sync_overflow, sync_masters and FSDP checks ----------------------


def _train_step_with_overflow(ddp, optimizer, head=None, optimizers=None):
    x = torch.randn(4, 6)
    out = ddp(x)
    loss = (head(out) if head is not None else out).float().sum() * float("inf")
    with amp.scale_loss(loss, optimizers or optimizer, model=ddp) as scaled_loss:
        scaled_loss.backward()
    for each in optimizers or [optimizer]:
        each.step()


def test_plain_ddp_issues_no_overflow_sync(process_group, max_reductions):
    # DDP's all-reduced gradients already agree: amp adds no collective by default.
    ddp, optimizer = _ddp_o2()
    _train_step_with_overflow(ddp, optimizer)
    assert amp.step_was_skipped(optimizer)
    assert max_reductions == []


def test_sync_overflow_reduces_found_inf_once_per_checked_pass(process_group, max_reductions):
    torch.manual_seed(0)
    body, head = nn.Sequential(nn.Linear(6, 5), nn.ReLU()), nn.Linear(5, 3)
    optimizers = [torch.optim.SGD(body.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)]
    amp.initialize([body, head], optimizers, opt_level="O2", half_dtype=torch.bfloat16, sync_overflow=True,
                   verbosity=0)
    ddp = nn.parallel.DistributedDataParallel(body)
    before = [p.detach().clone() for p in amp.master_params(optimizers[1])]
    _train_step_with_overflow(ddp, None, head, optimizers)
    assert [flag.item() for flag in max_reductions] == [1.0]
    assert all(amp.step_was_skipped(each) for each in optimizers)
    assert all(torch.equal(old, new) for old, new in zip(before, amp.master_params(optimizers[1])))
    # A no_sync pass is not checked, so it issues no collective; the synced pass issues one.
    for each in optimizers:
        each.zero_grad(set_to_none=True)
    with ddp.no_sync():
        with amp.scale_loss(head(ddp(torch.randn(4, 6))).sum(), optimizers, model=ddp) as scaled_loss:
            scaled_loss.backward()
    assert len(max_reductions) == 1
    with amp.scale_loss(head(ddp(torch.randn(4, 6))).sum(), optimizers, model=ddp) as scaled_loss:
        scaled_loss.backward()
    assert [flag.item() for flag in max_reductions] == [1.0, 0.0]


@pytest.mark.parametrize("sync_overflow", [False, True])
def test_params_outside_the_ddp_wrapper_are_flagged_unless_overflow_is_synced(process_group, caplog, sync_overflow):
    torch.manual_seed(0)
    body, head = nn.Linear(6, 5), nn.Linear(5, 3)
    optimizer = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.1)
    amp.initialize([body, head], optimizer, opt_level="O1", half_dtype=torch.bfloat16,
                   sync_overflow=sync_overflow, verbosity=0)
    ddp = nn.parallel.DistributedDataParallel(body)
    for _ in range(2):  # said once per wrapper and optimizer
        with amp.scale_loss(head(ddp(torch.randn(4, 6))).sum(), optimizer, model=ddp) as scaled_loss:
            scaled_loss.backward()
    flagged = [r for r in caplog.records if "outside this DistributedDataParallel wrapper" in r.getMessage()]
    if sync_overflow:
        assert flagged == []
    else:
        assert len(flagged) == 1 and "2 of the 4 parameters" in flagged[0].getMessage()
        assert "sync_overflow=True" in flagged[0].getMessage()


def test_sync_overflow_rejects_bad_values_and_a_missing_process_group():
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match="sync_overflow must be False, True"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", sync_overflow="yes",
                       verbosity=0)
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", sync_overflow=True,
                       verbosity=0)


def test_sync_masters_copies_masters_into_a_bare_model_and_checks_its_arguments(process_group):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    masters = list(amp.master_params(optimizer))
    with torch.no_grad():
        masters[0].add_(0.5)  # the model weight is now stale
    amp.sync_masters(model, optimizer)  # world size 1: rank 0's masters are these; the model follows them
    assert torch.equal(model.weight, masters[0].to(torch.bfloat16))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        amp.sync_masters("model", optimizer)
    with pytest.raises(RuntimeError, match="amp.initialize never saw"):
        amp.sync_masters(model, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def _fsdp(module, use_orig_params=True):
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():  # one rank: FSDP says it falls back to NO_SHARD (still FSDP's code paths)
        warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`")
        return FullyShardedDataParallel(module, use_orig_params=use_orig_params, device_id=torch.device("cpu"))


def test_fsdp_o1_syncs_found_inf_by_itself_and_skips(process_group, max_reductions):
    torch.manual_seed(0)
    fsdp = _fsdp(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)))
    optimizer = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    fsdp, optimizer = amp.initialize(fsdp, optimizer, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    before = [p.detach().clone() for p in fsdp.parameters()]
    with amp.scale_loss(fsdp(torch.randn(4, 6)).float().sum() * float("inf"), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    assert [flag.item() for flag in max_reductions] == [1.0]
    assert amp.step_was_skipped(optimizer)
    assert all(torch.equal(old, new) for old, new in zip(before, fsdp.parameters()))


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_fsdp_at_casting_levels_is_refused_naming_the_supported_setups(process_group, opt_level):
    fsdp = _fsdp(nn.Linear(4, 3))
    optimizer = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=rf"opt_level={opt_level} casts the model.*use_orig_params=True.* O0 or O1"):
        amp.initialize(fsdp, optimizer, opt_level=opt_level, verbosity=0)
    assert fsdp.weight.dtype == torch.float32  # refused before anything was cast


def test_fsdp_flat_parameters_are_refused(process_group):
    fsdp = _fsdp(nn.Linear(4, 3), use_orig_params=False)
    optimizer = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="FlatParameters.*use_orig_params=True"):
        amp.initialize(fsdp, optimizer, opt_level="O1", verbosity=0)
