"""The reference of the optimizer-state formats and remainder masters (apex_amp/optimizers/state_formats.py)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apex_amp.optimizers.state_formats import (
    FP8_MAX, StatePrecision, dequantize, dynamic_map, join_master, quantize, split_master, state_layout)

BLOCKED = (torch.int8, torch.uint8, torch.float8_e4m3fn)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_maps_are_ascending_in_the_unit_range_and_hold_zero_and_one(signed):
    table = dynamic_map(signed)
    assert len(table) == (255 if signed else 256)
    assert bool((table.diff() > 0).all())
    assert table[-1] == 1.0 and (0.0 in table.tolist())
    assert table[0] == (-1.0 if signed else 0.0)
    if signed:
        assert torch.equal(table, -table.flip(0))


@pytest.mark.parametrize("shape, precision, expected", [
    ((1024, 768), "int8", ("int8", 256)),
    ((64, 64, 3, 3), "fp8", ("fp8", 64)),      # rows of 576 = 64 * 9 elements: 64-element blocks
    ((8192,), "int8", ("fp32", None)),         # a 1-D tensor's dim-0 shards could cut any block
    ((10, 10), "int8", ("fp32", None)),        # under min_quantized_numel
    ((100, 100), "bf16", ("bf16", None)),
    ((4096, 24), "int8", ("fp32", None)),      # no power-of-two block of >= 32 divides a row of 24
    ((1024, 768), "fp32", ("fp32", None)),
])
def test_layout_is_decided_from_the_global_shape(shape, precision, expected):
    layout = state_layout(shape, precision)
    assert (layout.precision.value, layout.block) == expected


@pytest.mark.parametrize("bad", [0, 16, 48, 8192, 256.0, True])
def test_block_sizes_other_than_powers_of_two_in_range_are_refused(bad):
    with pytest.raises(ValueError, match="state_block_size must be a power of two"):
        state_layout((64, 64), "int8", block_size=bad)


def test_unknown_precision_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'fp32', 'bf16', 'fp8', 'int8'"):
        StatePrecision.parse("int4")


@pytest.mark.parametrize("dtype", BLOCKED)
def test_blocked_round_trip_error_is_bounded_by_the_format_step(dtype):
    torch.manual_seed(0)
    values = torch.randn(32, 512) * torch.logspace(-3, 3, 32)[:, None]
    if dtype == torch.uint8:
        values = values.abs()
    codes, absmax = quantize(values, dtype, 128)
    assert codes.dtype == dtype and codes.shape == values.shape and absmax.shape == (32, 4)
    blocks = values.reshape(-1, 128)
    assert torch.equal(absmax.reshape(-1), blocks.abs().amax(dim=1))
    error = (dequantize(codes, absmax) - values).reshape(-1, 128).abs()
    # e4m3: 3 mantissa bits, half a step is 1/16 relative; the top decade of the maps: < 1/64 of absmax.
    bound = absmax.reshape(-1, 1) * (FP8_MAX / 14 / FP8_MAX if dtype == torch.float8_e4m3fn else 1 / 64)
    assert bool((error <= bound).all())


def test_int8_codes_are_the_nearest_map_entry_ties_to_the_lower():
    table = dynamic_map(True)
    i = 200
    middle = ((table[i] + table[i + 1]) * 0.5).item()
    values = torch.zeros(32)
    values[0] = 1.0  # absmax 1: x is the value itself
    values[1] = table[i]
    values[2] = middle
    values[3] = torch.nextafter(torch.tensor(middle), torch.tensor(2.0)).item()
    codes, absmax = quantize(values, torch.int8, 32)
    assert codes[1:4].long().add(127).tolist() == [i, i, i + 1]


def test_positive_values_of_a_never_negative_state_keep_the_smallest_entry():
    # The unsigned map (exp_avg_sq, Adagrad's sum): a second moment stored as 0 would make Adam divide
    # by the current gradient alone. Below half the smallest entry (1.6e-7 of the absmax) a positive
    # value keeps that entry; zero stays zero. The signed map rounds to its nearest entry, 0 included.
    smallest = dynamic_map(False)[1].item()
    values = torch.zeros(32)
    values[0] = 1.0  # absmax 1: x is the value itself
    values[1:6] = torch.tensor([smallest * 0.49, 1e-20, 1e-38, 1e-44, smallest * 0.51])
    codes, _ = quantize(values, torch.uint8, 32)
    assert codes[1:7].tolist() == [1, 1, 1, 1, 1, 0]
    signed, _ = quantize(values, torch.int8, 32)
    assert signed[1:5].tolist() == [0, 0, 0, 0]


def test_nonzero_fp8_values_keep_the_smallest_subnormal_of_their_sign():
    # fp8 has one format for every state, the second moments' too: a nonzero value under half the
    # smallest subnormal (2**-10 of absmax / 448) keeps that subnormal, with its sign; zero and -0
    # stay; every other value is c10's nearest-even code.
    values = torch.zeros(64)
    values[0] = 1.0  # absmax 1: x * 448 is the value times 448
    half_step = 2.0**-10 / 448
    tiny = torch.tensor([half_step, half_step * 0.99, 1e-20, 1e-38, 1e-44, half_step * 1.01])
    values[1:7], values[7:13], values[13] = tiny, -tiny, -0.0
    values[14:63] = torch.arange(-24, 25) / 24  # values[63] stays 0
    codes, _ = quantize(values, torch.float8_e4m3fn, 64)
    bits = codes.view(torch.uint8)
    assert bits[1:7].tolist() == [1] * 6 and bits[7:13].tolist() == [0x81] * 6
    assert bits[13] == 0x80 and bits[63] == 0  # -0 and 0 stay
    plain = (values * 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(bits[14:], plain[14:]) and bits[0] == plain[0]
    # What nearest-even alone makes of them: 0 up to half the subnormal (ties to even), 1 past it.
    assert (plain[1:13] & 0x7F).tolist() == [0, 0, 0, 0, 0, 1] * 2


@pytest.mark.parametrize("dtype", BLOCKED)
def test_special_blocks_zero_tiny_and_nonfinite(dtype):
    values = torch.zeros(4, 32)
    values[1, 5] = 1e-39                # below the smallest normal: flushed to zero
    values[2, 7] = float("inf")         # the whole block reads NaN
    values[3, 9] = float("nan")
    if dtype == torch.float8_e4m3fn or dtype == torch.int8:
        values[1, 6] = -1e-39
    codes, absmax = quantize(values, dtype, 32)
    back = dequantize(codes, absmax).reshape(4, 32)
    assert torch.equal(back[0], torch.zeros(32)) and torch.equal(back[1], torch.zeros(32))
    assert absmax[0] == 0 and absmax[1] == 0
    assert bool(back[2].isnan().all()) and bool(back[3].isnan().all())


@pytest.mark.parametrize("dtype", BLOCKED)
def test_blocks_follow_memory_order_and_codes_keep_the_layout(dtype):
    torch.manual_seed(1)
    values = torch.randn(8, 16, 3, 3).abs().to(memory_format=torch.channels_last)
    codes, absmax = quantize(values, dtype, 16)  # rows of 144 elements: 9 blocks each
    assert codes.stride() == values.stride()
    in_memory = values.permute(0, 2, 3, 1).reshape(-1, 16)
    assert absmax.shape == (8, 9)
    assert torch.equal(absmax.reshape(-1), in_memory.abs().amax(dim=1))


def test_bf16_and_fp32_formats_are_plain_casts():
    values = torch.randn(100)
    codes, absmax = quantize(values, torch.bfloat16)
    assert absmax is None and torch.equal(codes, values.to(torch.bfloat16))
    assert torch.equal(dequantize(codes), values.to(torch.bfloat16).float())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_split_master_gives_the_master_back_bit_for_bit(patterns):
    bits = torch.tensor([p - 2**32 if p >= 2**31 else p for p in patterns], dtype=torch.int32)
    master = bits.view(torch.float32)
    weight, remainder = split_master(master)
    assert torch.equal(join_master(weight, remainder).view(torch.int32), bits)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=64))
def test_split_master_weight_is_the_nearest_bf16(values):
    master = torch.tensor(values, dtype=torch.float32)
    weight, _ = split_master(master)
    nearest = master.to(torch.bfloat16)  # ties to even; split_master ties away from zero
    differs = weight != nearest
    if bool(differs.any()):
        low_bits = master.view(torch.int32)[differs] & 0xFFFF
        assert bool((low_bits == 0x8000).all()), "only exact ties may round differently"
    assert bool((weight.float() - master).abs().le((nearest.float() - master).abs()).all())


@pytest.mark.parametrize("dtype", BLOCKED)
@pytest.mark.parametrize("shape", [(0,), (0, 64), (4, 0)])
def test_empty_tensors_round_trip(dtype, shape):
    codes, absmax = quantize(torch.zeros(shape), dtype, 32)
    assert codes.shape == shape and codes.dtype == dtype and absmax.numel() == 0
    assert dequantize(codes, absmax).shape == shape
