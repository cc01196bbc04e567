"""Remainder masters under FSDP2: bf16 shards plus int16 remainders are the exact fp32 masters, per rank.

Under ``fully_shard`` the remainder run's sharded parameters are bf16 DTensors (amp casts them
through FSDP2 at ``initialize``; without amp the model is cast before ``fully_shard``) and each
``master_remainder`` is an int16 DTensor sharded like its parameter: the fused step joins and
splits each rank's own shards, so sharding changes no value. In-process tests use a 1-rank gloo
group; the 2-rank ones run tests/_remainder_fsdp2_ranks.py (several seconds a launch: one in
the fast subset, the 200-step runs marked slow, all the optimizers and precisions of a mode in one launch). FusedLAMB and FusedNovoGrad, whose norms combine
the shards over the ranks: tests/test_norm_optimizers_fsdp2.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _launch import fsdp2_case, launch
from apex_amp import amp, memory_report
from apex_amp.optimizers import FusedAdam
from apex_amp.optimizers.state_formats import join_master

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

if dist.is_available():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

RANKS = Path(__file__).resolve().parent / "_remainder_fsdp2_ranks.py"


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 3))


def shard(model: nn.Module) -> nn.Module:
    fully_shard(model[3], mp_policy=BF16)
    fully_shard(model, mp_policy=BF16)
    return model


def train(model, optimizer, steps: int, overflow_at: int = -1) -> None:
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=generator), torch.randint(3, (8,), generator=generator)
        loss = nn.functional.cross_entropy(model(x).float(), y) * (float("inf") if step == overflow_at else 1.0)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def remainder_o2(precision: str = "fp32"):
    model = shard(make_model())
    optimizer = FusedAdam(model.parameters(), lr=1e-2, state_precision=precision)
    fp32_weights = [p.full_tensor().detach().clone() for p in model.parameters()]
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, master_weights="remainder",
                   verbosity=0)
    return model, optimizer, fp32_weights


# ---- amp on one rank -----------------------------------------------------------------------------
def test_amp_casts_the_shards_to_bf16_and_splits_the_fp32_weights_into_sharded_remainders(process_group):
    model, optimizer, fp32_weights = remainder_o2()
    params = list(model.parameters())
    assert [p for g in optimizer.param_groups for p in g["params"]] == params  # the same objects, cast
    for param, weight in zip(params, fp32_weights):
        assert isinstance(param, DTensor) and param.dtype == torch.bfloat16
        remainder = optimizer.state[param]["master_remainder"]
        assert isinstance(remainder, DTensor) and remainder.dtype == torch.int16
        assert remainder.placements == param.placements and remainder.shape == param.shape
        joined = join_master(param.to_local(), remainder.to_local())
        assert torch.equal(joined.view(torch.int32), weight.view(torch.int32))  # exactly the fp32 weights
    seen = []
    model[3].register_forward_hook(lambda module, args, out: seen.append((module.weight.dtype, out.dtype)))
    train(model, optimizer, steps=2)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2
    assert all(p.dtype == torch.bfloat16 and isinstance(p, DTensor) for p in model.parameters())
    assert not any("master_param" in state for state in optimizer.state.values())


def test_attributes_set_on_the_sharded_params_survive_their_cast(process_group):
    # fully_shard's Module._apply swaps each DTensor parameter's contents, __dict__ included.
    model = shard(make_model())
    model[3].weight.no_weight_decay = True
    amp.initialize(model, FusedAdam(model.parameters()), opt_level="O2", half_dtype=torch.bfloat16,
                   master_weights="remainder", verbosity=0)
    assert model[3].weight.dtype == torch.bfloat16 and model[3].weight.no_weight_decay is True


def test_a_batchnorm_sharded_on_its_own_stays_fp32_and_is_updated_in_place(process_group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 3))
    fully_shard(model[1], mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    shard(model)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, master_weights="remainder",
                   verbosity=0)
    norm = model[1].weight.full_tensor().clone()
    train(model, optimizer, steps=2)
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 2 + [torch.bfloat16] * 2
    assert "master_remainder" not in optimizer.state[model[1].weight]
    assert model[1].weight.dtype == torch.float32 and not torch.equal(model[1].weight.full_tensor(), norm)


def test_amp_remainder_run_skips_an_overflow_without_touching_weights_or_remainders(process_group):
    model, optimizer, _ = remainder_o2("int8")
    train(model, optimizer, steps=1)
    before = {id(p): (p.full_tensor().clone(), {k: v.full_tensor().clone() for k, v in optimizer.state[p].items()})
              for p in model.parameters()}
    train(model, optimizer, steps=1, overflow_at=0)
    assert amp.step_was_skipped(optimizer)
    for param in model.parameters():
        weight, state = before[id(param)]
        assert torch.equal(param.full_tensor(), weight)
        assert all(torch.equal(optimizer.state[param][key].full_tensor(), value) for key, value in state.items())


def test_memory_report_per_rank_counts_two_bytes_each_of_weight_grad_and_master(process_group):
    model, optimizer, _ = remainder_o2("int8")
    train(model, optimizer, steps=1)
    with amp.scale_loss(model(torch.randn(8, 16)).float().sum(), optimizer) as scaled_loss:
        scaled_loss.backward()
    report = memory_report(model, optimizer)
    assert report.per_parameter("weights") == 2.0
    assert report.per_parameter("grads") == 2.0
    assert report.per_parameter("masters") == 2.0  # the remainders: no fp32 copy anywhere


def test_amp_refuses_remainders_once_fully_shard_has_run_a_forward(process_group):
    model = shard(make_model())
    model(torch.randn(2, 16)).float().sum().backward()  # FSDP2 fixes its parameters' dtype at the first forward
    model.zero_grad(set_to_none=True)
    optimizer = FusedAdam(model.parameters())
    with pytest.raises(ValueError, match=r"ran a forward before amp.initialize.*master_weights='remainder'.*"
                                         r"call amp.initialize before the first forward"):
        amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, master_weights="remainder",
                       verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    names = {param: name for name, param in model.named_parameters()}
    state = {f"weight {name}": p.full_tensor().clone() for name, p in model.named_parameters()}
    state.update({f"{names[p]}.{key}": value.full_tensor().clone() if isinstance(value, DTensor) else value.clone()
                  for p, entries in optimizer.state.items() for key, value in entries.items()})
    state["step"] = optimizer.param_groups[0]["step"].clone()
    return state


def test_a_dcp_checkpoint_of_a_remainder_run_loads_every_state_into_a_fresh_run(process_group, tmp_path):
    # A fresh remainder optimizer already holds its remainders (from initialize), so torch's
    # get_state_dict would not make the rest of its state: checkpoint_state makes it (init_state),
    # else DCP would load the remainders only and the moments and step count would start over.
    import torch.distributed.checkpoint as dcp

    model, optimizer, _ = remainder_o2("int8")
    train(model, optimizer, steps=3, overflow_at=1)
    dcp.save({"train": amp.checkpoint_state(model, optimizer)}, checkpoint_id=str(tmp_path / "ckpt"))
    expected = full_state(model, optimizer)
    model, optimizer, _ = remainder_o2("int8")
    dcp.load({"train": amp.checkpoint_state(model, optimizer)}, checkpoint_id=str(tmp_path / "ckpt"))
    loaded = full_state(model, optimizer)
    assert loaded.keys() == expected.keys() and "3.weight.exp_avg_absmax" in loaded
    assert [key for key in expected if not torch.equal(expected[key], loaded[key])] == []
    assert loaded["step"].item() == 2.0


# ---- two ranks -----------------------------------------------------------------------------------
def run_ranks(*args: str, nproc: int = 2) -> str:
    result = launch([str(RANKS), *args], nproc=nproc)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert f"RESULT: bitwise on {nproc} rank(s)" in result.stdout, output[-4000:]
    return result.stdout


def test_two_ranks_fused_adam_remainders_update_bitwise_like_fp32_masters_through_skips():
    stdout = run_ranks("direct", "FusedAdam", "int8", "24")
    assert "skipped [3, 20, 22]" in stdout and "0 mismatches" in stdout


PRECISIONS = ("fp32", "int8")
DIRECT_OPTIMIZERS = ("FusedAdam", "FusedSGD", "FusedAdagrad")
AMP_OPTIMIZERS = ("FusedAdam", "FusedSGD")


def case_of(mode: str, optimizers: tuple[str, ...], optimizer: str, precision: str) -> str:
    """One case's message from the launch of all ``optimizers`` x ``PRECISIONS`` over 200 steps (one start-up)."""
    return fsdp2_case(RANKS, mode, optimizers, PRECISIONS, 200, optimizer, precision)


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("optimizer", DIRECT_OPTIMIZERS)
def test_two_ranks_remainders_update_bitwise_like_fp32_masters_over_200_steps(optimizer, precision):
    message = case_of("direct", DIRECT_OPTIMIZERS, optimizer, precision)
    assert "skipped [3, 20, 37, " in message and "0 mismatches" in message


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("optimizer", AMP_OPTIMIZERS)
def test_two_ranks_amp_o2_remainders_match_o2_fp32_shards_bitwise_over_200_steps(optimizer, precision):
    message = case_of("amp", AMP_OPTIMIZERS, optimizer, precision)
    assert "skipped [3, 20, 37, " in message and "0 mismatches" in message and "['torch.bfloat16']" in message


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_two_ranks_and_one_rank_reach_the_same_weights_remainders_and_state(tmp_path, precision):
    states = {}
    for nproc in (1, 2):
        out = tmp_path / f"{nproc}.pt"
        run_ranks("run", "--remainder", "--precision", precision, "--train", "0:12", "--same-data", "--out",
                  str(out), nproc=nproc)
        states[nproc] = torch.load(out, weights_only=False)["state"]
    one, two = states[1], states[2]
    assert one.keys() == two.keys() and any(key.endswith("master_remainder") for key in one)
    differ = [key for key in one if one[key].dtype != two[key].dtype or not torch.equal(one[key], two[key])]
    assert differ == []


def memory_reports(stdout: str) -> dict[int, dict[str, float]]:
    """Each rank's memory_report as {category: bytes per parameter}, plus its parameter count."""
    reports = {}
    for block in stdout.split("memory_report on rank ")[1:]:
        rank, _, table = block.partition(":")
        rows = re.findall(r"^(weights|grads|masters|optimizer state|total)\s+([\d,]+)\s+([\d.]+)$", table, re.M)
        reports[int(rank)] = {name: float(per) for name, _, per in rows}
        reports[int(rank)]["parameters"] = int(re.search(r"\(([\d,]+) parameters\)", table).group(1).replace(",", ""))
    return reports


@pytest.mark.slow
def test_two_ranks_memory_report_per_rank_remainders_against_o2_fp32_shards():
    # Per rank, of its shards of the 5,571 parameters: O2's fp32 shards are the masters (4 bytes) with
    # fp32 gradient shards (4); remainders keep a bf16 shard (2) + an int16 remainder (2) with bf16
    # gradient shards (2). The state (int8 for the 64x64 weight, fp32 for the small tensors) is alike.
    o2 = memory_reports(run_ranks("run", "--precision", "int8", "--train", "0:2", "--memory"))
    remainder = memory_reports(run_ranks("run", "--remainder", "--precision", "int8", "--train", "0:2", "--memory"))
    assert sorted(o2) == sorted(remainder) == [0, 1]
    # The 3-row Linear: 2 rows on rank 0, 1 on rank 1, whose weight and gradient shards FSDP2 pads
    # to 2 rows (counted: they are held); the remainders and the state are made unpadded.
    assert o2[0]["parameters"] + o2[1]["parameters"] == 5571
    assert (o2[0]["weights"], o2[0]["grads"], o2[0]["masters"]) == (4.0, 4.0, 0.0)
    assert (remainder[0]["weights"], remainder[0]["grads"]) == (2.0, 2.0)
    for rank in (0, 1):
        ours, theirs = remainder[rank], o2[rank]
        assert ours["parameters"] == theirs["parameters"] and (ours["masters"], theirs["masters"]) == (2.0, 0.0)
        assert ours["weights"] == ours["grads"] == theirs["weights"] / 2 == theirs["grads"] / 2
        assert ours["optimizer state"] == theirs["optimizer state"]
        assert ours["total"] == pytest.approx(theirs["total"] - theirs["weights"] + ours["masters"], abs=2e-3)
