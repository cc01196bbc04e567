"""Low-precision optimizer state the way clients train: channels_last conv nets, gradient accumulation with
clipping and a mid-run checkpoint, DDP wrapped after amp.initialize (issue 27).

The DDP test launches tests/_ddp_quantized_ranks.py on two gloo ranks (see tests/_launch.py).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _launch import launch_two_ranks
from apex_amp import amp
from apex_amp.optimizers import FusedAdam

import _ddp_quantized_ranks as ddp_ranks


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


# ---- channels_last: blocks run over a row in memory order -----------------------------------------


class MemoryOrderConv(nn.Module):
    """A Conv2d whose weight is stored contiguous as (out, kh, kw, in): the memory order of a
    channels_last weight. The conv sees ``weight.permute(0, 3, 1, 2)``, a channels_last tensor with
    the same strides, so forward and backward compute what the channels_last Conv2d computes."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        self.weight = nn.Parameter(conv.weight.detach().permute(0, 2, 3, 1).contiguous())
        self.bias = nn.Parameter(conv.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight.permute(0, 3, 1, 2), self.bias)


def conv_net(layout: str) -> nn.Module:
    torch.manual_seed(0)
    # Conv weights of 32 x 32 x 3 x 3: rows of 288 elements, nine 32-element blocks each.
    model = nn.Sequential(nn.Conv2d(32, 32, 3), nn.ReLU(), nn.Conv2d(32, 32, 3), nn.Flatten(), nn.Linear(512, 8))
    if layout == "channels_last":
        return model.to(memory_format=torch.channels_last)
    if layout == "memory_order":
        model[0], model[2] = MemoryOrderConv(model[0]), MemoryOrderConv(model[2])
    return model


def train_conv(layout: str, level: str, precision: str, steps: int = 3):
    model = conv_net(layout)
    optimizer = FusedAdam(model.parameters(), lr=1e-2, state_precision=precision)
    half = {"half_dtype": torch.bfloat16} if level == "O2" else {}
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0, **half)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 32, 8, 8, generator=generator).contiguous(memory_format=torch.channels_last)
        optimizer.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as loss:
            loss.backward()
        optimizer.step()
    stepped = [p for group in optimizer.param_groups for p in group["params"]]  # the masters at O2
    return model, optimizer, stepped


@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_a_channels_last_conv_weight_is_quantized_in_blocks_of_its_memory_order(level, precision):
    model, optimizer, stepped = train_conv("channels_last", level, precision)
    reference_model, reference, reference_stepped = train_conv("memory_order", level, precision)
    weight, reference_weight = stepped[0], reference_stepped[0]  # the first conv's (master) weight
    assert weight.is_contiguous(memory_format=torch.channels_last) and reference_weight.is_contiguous()
    state, reference_state = optimizer.state[weight], reference.state[reference_weight]
    # The codes keep the weight's strides; one absmax per 32 elements of each 288-element row.
    for key in ("exp_avg", "exp_avg_sq"):
        assert state[key].stride() == weight.stride() and state[key].element_size() == 1
        assert state[f"{key}_absmax"].shape == (32, 9)
    # Blocks in memory order: every absmax, code and weight equals those of the contiguous copy laid
    # out in that order ((out, kh, kw, in)), bitwise.
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[f"{key}_absmax"], reference_state[f"{key}_absmax"]), key
        assert torch.equal(bits(state[key]).permute(0, 2, 3, 1), bits(reference_state[key])), key
    for param, reference_param in zip(model.parameters(), reference_model.parameters()):
        expected = reference_param.permute(0, 3, 1, 2) if reference_param.dim() == 4 else reference_param
        assert torch.equal(param, expected)
    # A contiguous (out, in, kh, kw) copy groups other elements into its blocks: other absmaxes.
    _, contiguous, contiguous_stepped = train_conv("contiguous", level, precision)
    assert not torch.equal(state["exp_avg_absmax"], contiguous.state[contiguous_stepped[0]]["exp_avg_absmax"])


# ---- accumulation, clipping and a mid-run checkpoint with int8 state and remainder masters ---------


def make_run(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01, state_precision="int8")
    return amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, master_weights="remainder",
                          verbosity=0)


def accumulate_clip_step(model, optimizer, step: int, micro_batches: int = 3) -> None:
    optimizer.zero_grad()
    for micro in range(micro_batches):
        generator = torch.Generator().manual_seed(100 * step + micro)
        x = torch.randn(8, 128, generator=generator)
        if step == 4 and micro == 1:
            x[0, 0] = float("inf")  # a non-finite gradient: amp skips step 4
        loss = model(x.bfloat16()).float().pow(2).mean()
        with amp.scale_loss(loss, optimizer, delay_unscale=micro < micro_batches - 1) as scaled:
            scaled.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.05)  # small: it clips every step
    optimizer.step()


def test_accumulation_clipping_and_a_checkpoint_mid_run_resume_bitwise_with_int8_state_and_remainders():
    model, optimizer = make_run(seed=0)
    checkpoint = io.BytesIO()
    for step in range(7):
        if step == 3:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()},
                       checkpoint)
        accumulate_clip_step(model, optimizer, step)
    assert amp.state_dict()["loss_scaler0"]["overflows"] == 1  # step 4 was skipped
    int8 = optimizer.state[model[0].weight]
    assert int8["exp_avg"].dtype == torch.int8 and int8["master_remainder"].dtype == torch.int16

    checkpoint.seek(0)
    saved = torch.load(checkpoint)
    resumed_model, resumed = make_run(seed=9)  # other weights: everything must come from the checkpoint
    resumed_model.load_state_dict(saved["model"])  # first: the weights are the masters' high halves
    resumed.load_state_dict(saved["optimizer"])
    amp.load_state_dict(saved["amp"])
    for step in range(3, 7):
        accumulate_clip_step(resumed_model, resumed, step)

    for param, resumed_param in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(param, resumed_param)
        state, resumed_state = optimizer.state[param], resumed.state[resumed_param]
        assert state.keys() == resumed_state.keys()
        for key in state:
            assert torch.equal(bits(state[key]), bits(resumed_state[key])), key
    assert amp.state_dict()["loss_scaler0"]["overflows"] == 1


# ---- DDP wrapped after amp.initialize, int8 state at O2 bf16, two gloo ranks ------------------------


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_after_initialize_keeps_int8_state_identical_on_both_ranks_and_close_to_one_process(tmp_path):
    result = launch_two_ranks([ddp_ranks.__file__, str(tmp_path)])
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    reference, start = ddp_ranks.train(ddp_ranks.one_process), ddp_ranks.start()
    assert len(ranks[0]) == len(ranks[1]) == len(reference) == ddp_ranks.STEPS
    for step, (first, second, expected) in enumerate(zip(*ranks, reference)):
        assert first.keys() == second.keys() == expected.keys()
        quantized = [name for name, value in first.items() if value.element_size() == 1]
        assert len(quantized) == 4, "the two hidden matrices' moments must be int8"
        for name in first:
            # Both ranks: bitwise the same codes, absmaxes, weights and masters, step after step...
            assert torch.equal(bits(first[name]), bits(second[name])), f"step {step}: {name} differs between ranks"
        # ...and one process on the whole batch, within the rounding of DDP's bf16 reduction.
        errors = ddp_ranks.relative_errors(first, expected, start)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= ddp_ranks.RELATIVE_TOLERANCE, f"step {step}: {worst} is off by {errors[worst]:.1%}"


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_the_rank_comparison_fails_when_the_ranks_step_on_their_own_gradients(tmp_path):
    # Without DDP each rank steps on its half of the batch: the states part, and the check must see it.
    result = launch_two_ranks([ddp_ranks.__file__, str(tmp_path), "--no-ddp"])
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    first, second = (torch.load(tmp_path / f"rank{rank}.pt")[0] for rank in (0, 1))
    assert any(not torch.equal(bits(first[name]), bits(second[name])) for name in first)
    reference = ddp_ranks.train(ddp_ranks.one_process)[0]
    errors = ddp_ranks.relative_errors(first, reference, ddp_ranks.start())
    assert max(errors.values()) > ddp_ranks.RELATIVE_TOLERANCE
