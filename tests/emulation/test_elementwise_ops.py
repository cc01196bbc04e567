"""check_finite, unscale_, scale_ and axpby_: the emulated CUDA launchers give
the CPU kernels' results bit for bit (the same amp_math.h arithmetic, no
reduction), on lists that cross every packing boundary.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from _twins import (CPU, DTYPES, EMULATED, KILP, Entry, assert_bitwise_equal, assert_lists_equal,
                    dtype_id, entries_for, flag, placed, twin_lists)

NONFINITE = (float("inf"), float("-inf"), float("nan"))
PAIRS = list(itertools.product(DTYPES, DTYPES))


def pair_id(pair):
    return f"{dtype_id(pair[0])}-to-{dtype_id(pair[1])}"


def nonfinite_positions(numel, chunk):
    """First and last element, the scalar tail (past the last whole vector),
    and both sides of the first chunk boundary."""
    candidates = {0, numel - 1, numel - 1 - (numel % KILP) // 2, chunk - 1, chunk}
    return sorted(p for p in candidates if 0 <= p < numel)


def run_check_finite(entries, seed, plant=None):
    emu, cpu = twin_lists(entries, 0, seed)
    if plant is not None:
        plant(emu)
        plant(cpu)
    emu_flag, cpu_flag = flag(), flag()
    EMULATED.check_finite(emu, emu_flag)
    CPU.check_finite(cpu, cpu_flag)
    assert_bitwise_equal(emu_flag, cpu_flag, "found_inf")
    assert_lists_equal(emu, cpu, "tensors (read only)", entries)
    return emu_flag.item()


def run_unscale(entries, seed, inv_scale=2.0**-13, plant=None):
    emu, cpu = twin_lists(entries, 0, seed, scale=2.0**13)
    if plant is not None:
        plant(emu)
        plant(cpu)
    emu_flag, cpu_flag = flag(), flag()
    EMULATED.unscale_(emu, emu_flag, flag(inv_scale))
    CPU.unscale_(cpu, cpu_flag, flag(inv_scale))
    assert_bitwise_equal(emu_flag, cpu_flag, "found_inf")
    assert_lists_equal(emu, cpu, "grads", entries)
    return emu_flag.item()


def run_scale(entries, seed, scale, in_place=False, src_scale=1.0):
    emu_src, cpu_src = twin_lists(entries, 0, seed, scale=src_scale)
    if in_place:
        emu_dst, cpu_dst = emu_src, cpu_src
    else:
        emu_dst, cpu_dst = twin_lists(entries, 1, seed + 1)
    emu_flag, cpu_flag = flag(), flag()
    EMULATED.scale_(emu_src, emu_dst, flag(scale), emu_flag)
    CPU.scale_(cpu_src, cpu_dst, flag(scale), cpu_flag)
    assert_bitwise_equal(emu_flag, cpu_flag, "found_inf")
    assert_lists_equal(emu_dst, cpu_dst, "dst", entries)
    assert_lists_equal(emu_src, cpu_src, "src", entries)
    return emu_flag.item()


def run_axpby(entries, seed, a, b, plant_x=None):
    emu_x, cpu_x = twin_lists(entries, 0, seed)
    emu_y, cpu_y = twin_lists(entries, 1, seed + 1)
    if plant_x is not None:
        plant_x(emu_x)
        plant_x(cpu_x)
    emu_flag, cpu_flag = flag(), flag()
    EMULATED.axpby_(emu_x, emu_y, flag(a), b, emu_flag)
    CPU.axpby_(cpu_x, cpu_y, flag(a), b, cpu_flag)
    assert_bitwise_equal(emu_flag, cpu_flag, "found_inf")
    assert_lists_equal(emu_y, cpu_y, "y", entries)
    return emu_flag.item()


def plant_at(index, position, value):
    def plant(tensors):
        tensors[index][position] = value
    return plant


# ---- smoke: one call per op over a list that crosses every boundary at once

def test_check_finite_on_mixed_list_crossing_launches(limits):
    entries = entries_for(limits, [(d,) for d in DTYPES])
    assert run_check_finite(entries, seed=1) == 0.0
    last = len(entries) - 1  # a small tensor in a launch after the big one
    assert run_check_finite(entries, seed=1, plant=plant_at(last, 6, float("nan"))) == 1.0


def test_unscale_on_mixed_list_crossing_launches(limits):
    assert run_unscale(entries_for(limits, [(d,) for d in DTYPES]), seed=2) == 0.0


def test_scale_on_mixed_list_crossing_launches(limits):
    assert run_scale(entries_for(limits, PAIRS), seed=3, scale=3.0) == 0.0


def test_axpby_on_mixed_list_crossing_launches(limits):
    assert run_axpby(entries_for(limits, PAIRS), seed=4, a=0.5, b=0.25) == 0.0


# ---- the full matrix

@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("value", NONFINITE, ids=str)
def test_check_finite_and_unscale_find_a_nonfinite_value_anywhere(limits, dtype, value):
    chunk = limits.chunk_size
    for numel in (1, 3, KILP + 1, chunk + 3, 2 * chunk + 5):
        for offset in (0, 1):
            entries = [Entry(5, (dtype,), (0,)), Entry(numel, (dtype,), (offset,))]
            for position in nonfinite_positions(numel, chunk):
                plant = plant_at(1, position, value)
                assert run_check_finite(entries, seed=numel, plant=plant) == 1.0
                assert run_unscale(entries, seed=numel, plant=plant) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_check_finite_on_one_dtype_lists(limits, dtype):
    assert run_check_finite(entries_for(limits, [(dtype,)]), seed=5) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("inv_scale", [2.0**-16, 0.3, 4.0], ids=str)
def test_unscale_on_one_dtype_lists(limits, dtype, inv_scale):
    # inv_scale 4 overflows fp16/bf16 results, which unscale_ must not report.
    run_unscale(entries_for(limits, [(dtype,)], many=False), seed=6, inv_scale=inv_scale)


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_scale_converts_every_dtype_pair(limits, pair):
    assert run_scale(entries_for(limits, [pair], many=False), seed=7, scale=0.75) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_scale_in_place(limits, dtype):
    assert run_scale(entries_for(limits, [(dtype, dtype)], many=False), seed=8, scale=2.0**-7,
                     in_place=True) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("pair", [(torch.float32, torch.float16), (torch.float32, torch.bfloat16)],
                         ids=pair_id)
def test_scale_reports_results_that_overflow_the_destination(limits, pair):
    # fp32 values around 1e5 * 1e3 overflow fp16 (and, times 1e35, bf16).
    scale = 1e3 if pair[1] == torch.float16 else 1e35
    entries = [Entry(n, pair, (1, 0)) for n in (3, limits.chunk_size + 1)]
    assert run_scale(entries, seed=9, scale=scale, src_scale=1e5) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_axpby_on_every_dtype_pair(limits, pair):
    assert run_axpby(entries_for(limits, [pair], many=False), seed=10, a=2.0**-10, b=1.0) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("value", NONFINITE, ids=str)
def test_axpby_reports_a_nonfinite_x(limits, value):
    chunk = limits.chunk_size
    for numel in (1, 7, chunk + 3):
        entries = [Entry(numel, (torch.float16, torch.float32), (1, 0))]
        for position in nonfinite_positions(numel, chunk):
            assert run_axpby(entries, seed=11, a=0.5, b=1.0,
                             plant_x=plant_at(0, position, value)) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_axpby_when_x_is_y(limits, dtype):
    entries = entries_for(limits, [(dtype, dtype)], many=False)
    emu, cpu = twin_lists(entries, 0, seed=13)
    emu_flag, cpu_flag = flag(), flag()
    EMULATED.axpby_(emu, emu, flag(0.5), 0.25, emu_flag)
    CPU.axpby_(cpu, cpu, flag(0.5), 0.25, cpu_flag)
    assert_bitwise_equal(emu_flag, cpu_flag, "found_inf")
    assert_lists_equal(emu, cpu, "y (= x)", entries)


@pytest.mark.slow
def test_found_inf_is_never_cleared(limits):
    entries = entries_for(limits, [(torch.float32,)], many=False)
    emu, _ = twin_lists(entries, 0, seed=12)
    found_inf = flag(1.0)
    EMULATED.check_finite(emu, found_inf)
    EMULATED.unscale_(emu, found_inf, flag(0.5))
    assert found_inf.item() == 1.0


def test_placed_views_break_alignment_as_intended():
    # The offsets are what make the launchers take the scalar path.
    for dtype in DTYPES:
        for offset, aligned in ((0, True), (1, False), (3, False)):
            view = placed(torch.zeros(8, dtype=dtype), offset)
            assert (view.data_ptr() % (KILP * view.element_size()) == 0) == aligned
