"""amp on FSDP2 (``fully_shard``): the fp32 shards are the masters, one skip decision, DCP checkpoints.

In-process tests use a 1-rank gloo group (FSDP2's code paths, one shard);
the 2-rank tests run examples/fsdp.py (see tests/_launch.py), which checks
that the ranks agree bitwise, compares with an unsharded single-process run
and prints the per-rank memory table. Each launch costs 7-12 s here, so one
O2 launch is in the fast subset and the rest are marked slow.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _launch import launch
from apex_amp import amp, ops
from apex_amp.optimizers import FusedAdam
from apex_amp.optimizers.state_formats import split_master

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

if dist.is_available():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    FP16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    NO_POLICY = MixedPrecisionPolicy()

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp.py"
AGREE = "RESULT: all 2 ranks agree"


def make_model(norm: type = nn.LayerNorm) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), norm(8), nn.ReLU(), nn.Linear(8, 3))


def shard(model: nn.Module, policy, root_policy=None) -> nn.Module:
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model, mp_policy=policy if root_policy is None else root_policy)
    return model


def train(model, optimizer, steps: int = 3, overflow_at: int = -1) -> None:
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(5, 6, generator=generator), torch.randint(3, (5,), generator=generator)
        loss = nn.functional.cross_entropy(model(x), y) * (float("inf") if step == overflow_at else 1.0)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "FusedAdam":
        return FusedAdam(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _o2(**extra):
    return dict(opt_level="O2", half_dtype=torch.bfloat16, **extra)


# ---- O2: the shards are the masters --------------------------------------------------------------
@pytest.mark.parametrize("optimizer_name", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("half, policy", [("bf16", "BF16"), ("fp16", "FP16")])
def test_o2_on_one_rank_trains_bitwise_like_o2_without_sharding(process_group, optimizer_name, half, policy):
    # Same half compute, same fp32 updates: FSDP2's all-gathered half copy is O2's half model, its
    # fp32 shards are O2's masters. fp16 runs a dynamic scale through an overflow (step 1).
    half_dtype = torch.bfloat16 if half == "bf16" else torch.float16
    results = []
    for sharded in (False, True):
        model = shard(make_model(), globals()[policy]) if sharded else make_model()
        optimizer = make_optimizer(optimizer_name, model)
        amp.initialize(model, optimizer, opt_level="O2", half_dtype=half_dtype, loss_scale="dynamic", verbosity=0)
        train(model, optimizer, steps=4, overflow_at=1)
        results.append(([full(p) for p in amp.master_params(optimizer)], amp.state_dict()["loss_scaler0"]))
    (plain, plain_scaler), (sharded, sharded_scaler) = results
    assert all(torch.equal(a, b) for a, b in zip(plain, sharded))
    assert sharded_scaler == plain_scaler and sharded_scaler["overflows"] == 1


def test_o2_keeps_no_copy_of_its_own_and_computes_in_half(process_group):
    model = shard(make_model(), BF16)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    # The optimizer updates the model's own fp32 DTensors: no master copy, nothing cast.
    masters = list(amp.master_params(optimizer))
    assert len(masters) == len(params) and all(m is p for m, p in zip(masters, params))
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params)
    seen = []
    model[3].register_forward_hook(lambda module, args, out: seen.append((module.weight.dtype, out.dtype)))
    out = model(torch.randn(4, 6))
    assert seen == [(torch.bfloat16, torch.bfloat16)] and out.dtype == torch.float32  # amp's O2 output cast


def test_fused_adam_makes_one_call_over_the_local_shards(process_group, monkeypatch):
    model = shard(make_model(), BF16)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    calls = []
    original = ops.fused_adam_

    def recording(params, grads, exp_avgs, exp_avg_sqs, *args, **kwargs):
        calls.append([params, grads, exp_avgs, exp_avg_sqs, kwargs.get("model_params")])
        return original(params, grads, exp_avgs, exp_avg_sqs, *args, **kwargs)

    monkeypatch.setattr(ops, "fused_adam_", recording)
    train(model, optimizer, steps=2)
    assert len(calls) == 2  # one per step: one param group, one device
    for lists in calls:
        assert all(not isinstance(t, DTensor) for lst in lists[:4] for t in lst)
        assert not lists[4]  # no half copy to write: FSDP2 all-gathers it from the shards
    local = [p.to_local() for p in model.parameters()]
    assert [t.data_ptr() for t in calls[-1][0]] == [t.data_ptr() for t in local]
    state = optimizer.state[next(iter(model.parameters()))]
    assert isinstance(state["exp_avg"], DTensor) and isinstance(state["exp_avg_sq"], DTensor)


@pytest.mark.parametrize("opt_level, policy", [("O1", "NO_POLICY"), ("O2", "BF16")])
def test_found_inf_is_max_reduced_once_per_checked_pass_and_a_skip_changes_nothing(
    process_group, max_reductions, opt_level, policy
):
    model = shard(make_model(), globals()[policy])
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    amp.initialize(model, optimizer, opt_level=opt_level, half_dtype=torch.bfloat16, verbosity=0)
    train(model, optimizer, steps=1)
    before = [full(p) for p in model.parameters()]
    moments = [full(optimizer.state[p]["exp_avg"]) for p in model.parameters()]
    train(model, optimizer, steps=1, overflow_at=0)
    assert [flag.item() for flag in max_reductions] == [0.0, 1.0]
    assert amp.step_was_skipped(optimizer)
    assert all(torch.equal(a, full(p)) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(a, full(optimizer.state[p]["exp_avg"])) for a, p in zip(moments, model.parameters()))


def test_passes_without_gradient_sync_are_checked_once_by_the_synchronising_pass(process_group, caplog):
    # scale_window=1: a clean pass accounted in between would double the scale between the two
    # micro-batches, and the sum FSDP2 keeps would mix two scales.
    model = shard(make_model(), FP16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.float16, loss_scale="dynamic",
                   scale_window=1, verbosity=0)
    reference = make_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=generator), torch.randint(3, (8,), generator=generator)
    with caplog.at_level(logging.WARNING, logger="apex_amp"):
        model.set_requires_gradient_sync(False)
        with amp.scale_loss(nn.functional.cross_entropy(model(x[:4]), y[:4]) / 2, optimizer) as scaled_loss:
            scaled_loss.backward()
        assert amp.loss_scale() == 2.0**16  # not accounted: the scale FSDP2's sum carries is unchanged
        model.set_requires_gradient_sync(True)
        with amp.scale_loss(nn.functional.cross_entropy(model(x[4:]), y[4:]) / 2, optimizer) as scaled_loss:
            scaled_loss.backward()
    assert not [r for r in caplog.records if "produced no gradient" in r.getMessage()]
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 0 and amp.loss_scale() == 2.0**17  # one clean pass
    optimizer.step()
    nn.functional.cross_entropy(reference(x), y).backward()
    reference_optimizer.step()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(full(got), want.detach(), rtol=0, atol=2e-3)  # fp16 compute vs fp32

    # An overflow in a pass without sync surfaces in the synchronising pass: the step is skipped.
    before = [full(p) for p in model.parameters()]
    optimizer.zero_grad(set_to_none=True)
    model.set_requires_gradient_sync(False)
    with amp.scale_loss(model(x[:4]).float().sum() * float("inf"), optimizer) as scaled_loss:
        scaled_loss.backward()
    model.set_requires_gradient_sync(True)
    with amp.scale_loss(model(x[4:]).float().sum(), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    assert amp.step_was_skipped(optimizer)
    assert all(torch.equal(a, full(p)) for a, p in zip(before, model.parameters()))


def test_overflow_reports_count_the_non_finite_values_of_this_ranks_shards(process_group):
    model = shard(make_model(), BF16)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    amp.initialize(model, optimizer, **_o2(), overflow_report=True, verbosity=0)
    loss = model(torch.randn(4, 6)).float().sum()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
        model[3].bias.grad.to_local()[1] = float("nan")
    (entry,) = amp.last_overflow().params
    assert (entry.name, entry.inf, entry.nan, entry.numel) == ("3.bias", 0, 1, 3)


# ---- misconfigurations -------------------------------------------------------------------------
MISCONFIGURATIONS = {
    "O2 without a policy": (
        lambda: shard(make_model(), NO_POLICY), _o2(),
        r"^model was sharded by fully_shard with MixedPrecisionPolicy\(param_dtype=None.*all-gathers it in "
        r"torch.float32, but opt_level=O2 computes in torch.bfloat16.*Pass mp_policy=MixedPrecisionPolicy"
        r"\(param_dtype=torch.bfloat16, reduce_dtype=torch.float32\) to every fully_shard call"),
    "O2 with another half dtype": (
        lambda: shard(make_model(), FP16), _o2(),
        r"all-gathers it in torch.float16, but opt_level=O2 computes in torch.bfloat16"),
    "O2 with a half reduction": (
        lambda: shard(make_model(), MixedPrecisionPolicy(param_dtype=torch.bfloat16)), _o2(),
        r"reduces its gradients in torch.bfloat16, but amp's fp32 masters need fp32 sums.*reduce_dtype=torch.float32"),
    "O2 with the policy on the blocks only": (
        lambda: shard(make_model(), BF16, root_policy=NO_POLICY), _o2(),
        r"^model was sharded by fully_shard with MixedPrecisionPolicy\(param_dtype=None.*torch.float32, but "
        r"opt_level=O2 computes in torch.bfloat16"),
    "O2 with the policy on the root only": (
        lambda: shard(make_model(), NO_POLICY, root_policy=BF16), _o2(),
        r"^model.0 was sharded by fully_shard with MixedPrecisionPolicy\(param_dtype=None.*fully_shard\(model.0, "),
    "O1 with a half policy": (
        lambda: shard(make_model(), BF16), dict(opt_level="O1", half_dtype=torch.bfloat16),
        r"all-gathers it in torch.bfloat16, but opt_level=O1 keeps the model fp32 and casts per op itself.*"
        r"mp_policy=MixedPrecisionPolicy\(reduce_dtype=torch.float32\)"),
    "O3": (
        lambda: shard(make_model(), BF16), dict(opt_level="O3", half_dtype=torch.bfloat16),
        r"opt_level=O3 without master weights .* has no form under fully_shard.*Use opt_level='O2'"),
    "O2 without master weights": (
        lambda: shard(make_model(), BF16), _o2(master_weights=False),
        r"opt_level=O2 without master weights .* Use opt_level='O2'"),
    "BatchNorm in a half group": (
        lambda: shard(make_model(nn.BatchNorm1d), BF16, root_policy=BF16), _o2(),
        r"model was sharded by fully_shard together with the BatchNorm model.1.*keep_batchnorm_fp32=True.*"
        r"fully_shard\(batchnorm, mp_policy=MixedPrecisionPolicy\(reduce_dtype=torch.float32\)\).*"
        r"keep_batchnorm_fp32=False"),
}


def _root_not_sharded():
    model = make_model()
    fully_shard(model[0], mp_policy=BF16)
    return model


MISCONFIGURATIONS["the root not sharded"] = (
    _root_not_sharded, _o2(),
    r"parameter '1.weight' of model 0 is not sharded.*Call fully_shard on the root too, after its submodules: "
    r"fully_shard\(model, mp_policy=MixedPrecisionPolicy\(param_dtype=torch.bfloat16, reduce_dtype=torch.float32\)\)")


@pytest.mark.parametrize("case", sorted(MISCONFIGURATIONS))
def test_each_misconfiguration_is_refused_with_its_fix_and_changes_nothing(process_group, case):
    build, kwargs, message = MISCONFIGURATIONS[case]
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with pytest.raises(ValueError, match=re.compile(message, re.DOTALL)):
        amp.initialize(model, optimizer, verbosity=0, **kwargs)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert [p for group in optimizer.param_groups for p in group["params"]] == params
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())


def test_an_optimizer_built_before_fully_shard_is_refused(process_group):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shard(model, BF16)
    with pytest.raises(ValueError, match=r"optimizers\[0\] holds a parameter of shape \(8, 6\) .* the optimizer "
                                         r"was built before fully_shard. Call fully_shard first"):
        amp.initialize(model, optimizer, **_o2(), verbosity=0)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fully_shard_after_initialize_raises_at_the_first_forward(process_group, opt_level):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level=opt_level, half_dtype=torch.bfloat16, verbosity=0)
    fully_shard(model)
    with pytest.raises(RuntimeError, match=r"model 0 was sharded by fully_shard \(model\) after amp.initialize.*"
                                           r"fully_shard .*then build the optimizer.*then amp.initialize"):
        model(torch.randn(2, 6))


def test_the_late_sharding_check_leaves_an_unsharded_model_after_its_first_forward(process_group):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    hooks = len(model._forward_pre_hooks)
    model(torch.randn(2, 6))
    assert len(model._forward_pre_hooks) == hooks - 1


@pytest.mark.parametrize("setup", ["BatchNorm sharded on its own in fp32", "keep_batchnorm_fp32=False"])
def test_batchnorm_under_o2(process_group, setup):
    model = make_model(nn.BatchNorm1d)
    if setup == "keep_batchnorm_fp32=False":
        shard(model, BF16)
        expected, kwargs = torch.bfloat16, _o2(keep_batchnorm_fp32=False)
    else:
        fully_shard(model[1], mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        shard(model, BF16)
        expected, kwargs = torch.float32, _o2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, verbosity=0, **kwargs)
    seen = []
    model[1].register_forward_hook(lambda module, args, out: seen.append((module.weight.dtype, module.running_mean.dtype)))
    train(model, optimizer, steps=1)
    assert seen == [(expected, expected)]


def test_a_batchnorm_sharded_on_its_own_in_half_is_refused_under_keep_batchnorm_fp32(process_group):
    model = make_model(nn.BatchNorm1d)
    fully_shard(model[1], mp_policy=BF16)
    shard(model, BF16)
    with pytest.raises(ValueError, match=r"model.1 .* all-gathers it in torch.bfloat16, but BatchNorm stays fp32 "
                                         r"under keep_batchnorm_fp32=True.*to this BatchNorm's fully_shard"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), **_o2(), verbosity=0)


# ---- distributed checkpoints (DCP) -------------------------------------------------------------
def _fresh_fp16_run():
    model = shard(make_model(), FP16)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.float16, loss_scale="dynamic",
                   scale_window=1, verbosity=0)
    return model, optimizer


def _snapshot(model, optimizer):
    weights = [full(p) for p in model.parameters()]
    moments = [full(value) for p in model.parameters() for value in optimizer.state[p].values()]
    return weights + moments, amp.state_dict()


def test_checkpoint_state_resumes_bitwise_with_the_scalers(process_group, tmp_path):
    model, optimizer = _fresh_fp16_run()
    train(model, optimizer, steps=3, overflow_at=1)  # the scale backs off, then grows (window 1)
    dcp.save({"train": amp.checkpoint_state(model, optimizer)}, checkpoint_id=str(tmp_path / "ckpt"))
    train(model, optimizer, steps=2)
    expected_tensors, expected_amp = _snapshot(model, optimizer)

    model, optimizer = _fresh_fp16_run()
    dcp.load({"train": amp.checkpoint_state(model, optimizer)}, checkpoint_id=str(tmp_path / "ckpt"))
    assert amp.state_dict()["loss_scaler0"]["overflows"] == 1
    train(model, optimizer, steps=2)
    tensors, amp_state = _snapshot(model, optimizer)
    assert amp_state == expected_amp
    assert len(tensors) == len(expected_tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected_tensors))


def test_checkpoint_state_refuses_a_run_with_other_amp_settings(process_group, tmp_path):
    model, optimizer = _fresh_fp16_run()
    train(model, optimizer, steps=1)
    dcp.save({"train": amp.checkpoint_state(model, optimizer)}, checkpoint_id=str(tmp_path / "ckpt"))
    model = shard(make_model(), BF16)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    amp.initialize(model, optimizer, **_o2(), verbosity=0)
    with pytest.raises(ValueError, match=r"amp state was saved with half_dtype='torch.float16'"):
        dcp.load({"train": amp.checkpoint_state(model, optimizer)}, checkpoint_id=str(tmp_path / "ckpt"))


def test_checkpoint_state_refuses_amps_own_masters_and_several_models():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, **_o2(), verbosity=0)
    with pytest.raises(ValueError, match=r"holds amp's fp32 master copies .* Shard the model with fully_shard"):
        amp.checkpoint_state(model, optimizer)
    with pytest.raises(TypeError, match=r"takes one model .* nn.ModuleList"):
        amp.checkpoint_state([model, model], optimizer)


# ---- 2 ranks: examples/fsdp.py ---------------------------------------------------------------
SMALL = ("--hidden", "64", "--blocks", "2", "--steps", "6")


def run_fsdp_example(*args: str, nproc: int = 2, torchrun: bool = False):
    return launch([str(EXAMPLE), *args], nproc=nproc, torchrun=torchrun)


def assert_agree(result, nproc: int = 2) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert f"RESULT: all {nproc} ranks agree" in result.stdout, output[-4000:]
    return result.stdout


def skipped_steps(stdout: str) -> str:
    (summary,) = [line for line in stdout.splitlines() if line.startswith("FSDP2 ") and "skipped steps" in line]
    return summary.rsplit("skipped steps", 1)[1].strip()


def memory_rows(stdout: str) -> dict[int, dict[str, int]]:
    """The per-rank memory table: rank -> {column: bytes} (a "-" cell is left out)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| rank |"))
    columns = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        cells = dict(zip(columns, (cell.strip() for cell in line.strip("|").split("|"))))
        rows[int(cells.pop("rank"))] = {name: int(value.replace(",", "")) for name, value in cells.items()
                                        if value != "-"}
    return rows


def unsharded_bytes(stdout: str) -> int:
    return int(re.search(r"fp32 weights unsharded: ([\d,]+)", stdout).group(1).replace(",", ""))


def test_two_ranks_o2_fp16_overflow_in_one_shard_skips_on_both_matches_one_process_and_shards_memory():
    # The inf is written into rank 1's own gradient shard, after the backward: no reduction carries
    # it to rank 0, only amp's found-inf MAX-reduce. The unsharded run takes the same skip.
    result = run_fsdp_example("--opt-level", "O2", "--half-dtype", "float16", "--loss-scale", "dynamic",
                              "--optimizer", "SGD", "--inject-overflow", "1:3", "--reference", *SMALL)
    stdout = assert_agree(result)
    assert skipped_steps(stdout) == "[3]" and "loss scale 32768" in stdout
    assert re.search(r"REFERENCE: .*\(within ", stdout), stdout
    rows, total = memory_rows(stdout), unsharded_bytes(stdout)
    assert sorted(rows) == [0, 1]
    for row in rows.values():
        assert row["half weights"] == row["master remainders"] == 0  # FSDP2 all-gathers a half copy per forward
        assert row["fp32 weights (masters)"] == row["gradients"] == total // 2  # fp32 shards and fp32 grad shards
        assert row["optimizer state"] == total // 2  # SGD's momentum shards


@pytest.mark.slow
@pytest.mark.parametrize("half_dtype, extra", [("bfloat16", ()), ("float16", ("--loss-scale", "dynamic"))])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_two_ranks_match_an_unsharded_run(opt_level, half_dtype, extra):
    stdout = assert_agree(run_fsdp_example("--opt-level", opt_level, "--half-dtype", half_dtype, *extra,
                                           "--optimizer", "SGD", "--reference", *SMALL))
    assert re.search(r"REFERENCE: .*\(within ", stdout), stdout


@pytest.mark.slow
def test_two_ranks_fused_adam_with_accumulation_matches_an_unsharded_run():
    stdout = assert_agree(run_fsdp_example("--opt-level", "O2", "--accumulate", "2", "--inject-overflow", "0:2",
                                           "--reference", *SMALL))
    assert skipped_steps(stdout) == "[2]"
    assert re.search(r"REFERENCE: .*\(within ", stdout), stdout


@pytest.mark.slow
def test_two_ranks_with_remainder_masters_keep_bf16_shards_and_match_an_unsharded_run(tmp_path):
    out = tmp_path / "state.pt"
    stdout = assert_agree(run_fsdp_example("--master-weights", "remainder", "--inject-overflow", "1:2",
                                           "--reference", "--state-out", str(out), *SMALL))
    assert skipped_steps(stdout) == "[2]"
    assert re.search(r"REFERENCE: .*\(within ", stdout), stdout
    # What was compared (and saved) are the exact fp32 masters, each the gathered bf16 shard joined
    # with its gathered remainder, not the bf16 weights (whose low 16 bits are all zero).
    state = torch.load(out)["state"]
    for name in [key for key in state if key.endswith(".master_remainder")]:
        master = state["weight " + name[len("optimizer "):-len(".master_remainder")]]
        assert master.dtype == torch.float32 and (master.view(torch.int32) & 0xFFFF).any()
        assert torch.equal(split_master(master)[1], state[name])
    total = unsharded_bytes(stdout)
    for row in memory_rows(stdout).values():
        assert row["fp32 weights (masters)"] == 0  # no fp32 copy on any rank
        assert row["half weights"] == row["master remainders"] == row["gradients"] == total // 4


def test_the_example_refuses_remainder_masters_where_they_cannot_be_exact():
    result = run_fsdp_example("--master-weights", "remainder", "--half-dtype", "float16", *SMALL)
    assert result.returncode != 0 and "--master-weights remainder needs" in result.stderr


@pytest.mark.slow
def test_two_ranks_without_the_overflow_sync_take_different_skips():
    # Proves the check (and the sync) matter: rank 1 alone sees its shard's inf.
    result = run_fsdp_example("--opt-level", "O2", "--inject-overflow", "1:3", "--no-sync-overflow", *SMALL)
    assert result.returncode != 0
    assert "RESULT: ranks differ" in result.stdout, (result.stdout + result.stderr)[-4000:]


def _state(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def _same_state(a: dict, b: dict) -> list[str]:
    assert a["state"].keys() == b["state"].keys()
    return [name for name, value in a["state"].items() if not torch.equal(value, b["state"][name])]


CHECKPOINTED = ("--half-dtype", "float16", "--loss-scale", "dynamic", "--scale-window", "2", "--hidden", "64",
                "--blocks", "2")


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_bitwise_on_two_ranks(tmp_path):
    full_run, resumed = tmp_path / "full.pt", tmp_path / "resumed.pt"
    common = (*CHECKPOINTED, "--steps", "8", "--inject-overflow", "1:1")
    assert_agree(run_fsdp_example(*common, "--save-at", "4", "--checkpoint", str(tmp_path / "ckpt"),
                                  "--state-out", str(full_run)))
    assert_agree(run_fsdp_example(*common, "--resume", str(tmp_path / "ckpt"), "--state-out", str(resumed)))
    a, b = _state(full_run), _state(resumed)
    assert b["first_step"] == 4 and a["skipped"][:2] == [False, True] and b["skipped"] == a["skipped"][4:]
    assert _same_state(a, b) == [] and a["amp"] == b["amp"]
    assert torch.equal(a["losses"][4:], b["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("saved_on, loaded_on", [(2, 1), (1, 2)])
def test_a_checkpoint_loads_on_another_number_of_ranks_with_the_same_values(tmp_path, saved_on, loaded_on):
    saved, loaded = tmp_path / "saved.pt", tmp_path / "loaded.pt"
    common = (*CHECKPOINTED, "--steps", "3")
    result = run_fsdp_example(*common, "--inject-overflow", "0:1", "--save-at", "3", "--checkpoint",
                              str(tmp_path / "ckpt"), "--state-out", str(saved), nproc=saved_on)
    assert_agree(result, saved_on)
    assert_agree(run_fsdp_example(*common, "--resume", str(tmp_path / "ckpt"), "--state-out", str(loaded),
                                  nproc=loaded_on), loaded_on)
    a, b = _state(saved), _state(loaded)
    assert _same_state(a, b) == [] and a["amp"] == b["amp"]
    assert a["amp"]["loss_scaler0"]["overflows"] == 1


@pytest.mark.slow
def test_the_example_under_torchrun_prints_the_memory_table_for_fsdp2_and_ddp():
    fsdp2 = assert_agree(run_fsdp_example("--opt-level", "O2", torchrun=True))
    ddp = assert_agree(run_fsdp_example("--opt-level", "O2", "--ddp", torchrun=True))
    sharded, replicated = memory_rows(fsdp2), memory_rows(ddp)
    assert sorted(sharded) == sorted(replicated) == [0, 1]
    # Per rank: the fp32 weights and the optimizer state are half of DDP's (one step count aside),
    # with no half copy.
    masters, state = "fp32 weights (masters)", "optimizer state"
    assert sharded[0][masters] * 2 == replicated[0][masters] and sharded[0][state] < replicated[0][state] * 0.51
    assert sharded[0]["half weights"] == 0 and replicated[0]["half weights"] > 0
    assert sharded[0]["total"] < replicated[0]["total"] * 0.6
