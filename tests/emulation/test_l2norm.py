"""l2norm: the emulated CUDA launcher against the CPU kernel and an exact sum.

Not bit for bit: both sum squares in fp32 within a piece of a tensor and add
the pieces in double, but the pieces and the order differ. The emulated
kernel sums a chunk as 512 threads, each over its share of the chunk, then
two shuffle trees; the CPU kernel sums a 16384-element work unit in two
vector accumulators of 8 or 16 lanes with fused multiply-adds, then the
lanes, then the scalar tail. For a sum of non-negative terms, a chain of k
fp32 additions is off by at most k units of roundoff (u = 2^-24) relative to
the sum; the square root halves that, and storing the norm as fp32 adds one
more u. Those chains bound the difference, and a lost or doubled chunk (off
by a whole chunk's share) is far outside them.
"""

from __future__ import annotations

import math

import pytest
import torch

from _twins import (CPU, DTYPES, EMULATED, Entry, assert_bitwise_equal, dtype_id, entries_for,
                    twin_lists)

U = 2.0**-24
BLOCK_THREADS = 512       # csrc/cuda/multi_tensor_apply.cuh: kBlockSize
CPU_UNIT = 16384          # csrc/cpu/list_parallel.h: kChunkElements
CPU_MIN_LANES = 8         # fp32 lanes of the narrowest Vectorized<float>
CPU_MAX_LANES = 16


def emulated_chain(chunk_size):
    """Longest chain of fp32 additions in a chunk's sum: a thread's share (the
    vector loop plus at most one tail element), then 5 + 5 shuffle steps."""
    per_thread = -(-chunk_size // (BLOCK_THREADS * 4)) * 4 + 1
    return per_thread + 10


def cpu_chain():
    """Longest chain in a CPU work unit: one lane's fused multiply-adds, the
    two accumulators and the lanes added up, and the scalar tail."""
    return CPU_UNIT // (2 * CPU_MIN_LANES) + 1 + CPU_MAX_LANES + 2 * CPU_MAX_LANES


def norm_bound(*chains):
    """Relative error bound of a norm whose sum of squares has these chains (+1 for the rounded square)."""
    return sum(0.5 * (k + 1) + 1 for k in chains) * U


def exact_norms(tensors):
    sums = [float((t.double() ** 2).sum()) for t in tensors]
    return math.sqrt(sum(sums)), [math.sqrt(s) for s in sums]


def assert_within(actual, expected, relative, what):
    assert abs(actual - expected) <= relative * abs(expected) + 1e-30, (
        f"{what}: {actual!r} vs {expected!r}, relative difference "
        f"{abs(actual - expected) / max(abs(expected), 1e-30):.3g} > {relative:.3g}")


def compare(limits, entries, seed, per_tensor=True, scale=1.0):
    emu_tensors, cpu_tensors = twin_lists(entries, 0, seed, scale=scale)
    emu_total, emu_each = EMULATED.l2norm(emu_tensors, per_tensor)
    cpu_total, cpu_each = CPU.l2norm(cpu_tensors, per_tensor)
    assert emu_each.shape == cpu_each.shape == (len(entries) if per_tensor else 0,)
    exact_total, exact_each = exact_norms(cpu_tensors)
    emulated_only = norm_bound(emulated_chain(limits.chunk_size))
    both = norm_bound(emulated_chain(limits.chunk_size), cpu_chain())
    assert_within(emu_total.item(), exact_total, emulated_only, "total vs exact")
    assert_within(emu_total.item(), cpu_total.item(), both, "total vs CPU kernel")
    for i in range(emu_each.numel()):
        assert_within(emu_each[i].item(), exact_each[i], emulated_only, f"norm of tensor {i} vs exact")
        assert_within(emu_each[i].item(), cpu_each[i].item(), both, f"norm of tensor {i} vs CPU kernel")
    return emu_total, emu_each


def test_bounds_are_tight_enough_to_see_a_lost_element():
    # One unit element among chunk_size of them changes the norm by ~1 / (2 * chunk_size).
    assert norm_bound(emulated_chain(4096)) < 1 / (2 * 4096) / 10
    assert norm_bound(emulated_chain(4096), cpu_chain()) < 1 / (2 * 4096)


def test_per_tensor_norms_on_mixed_list_crossing_launches(limits):
    compare(limits, entries_for(limits, [(d,) for d in DTYPES]), seed=1)


def test_per_tensor_norms_of_more_tensors_than_one_cleanup_launch_takes(limits):
    # per_tensor_norm_kernel packs 224 tensors per launch; empty ones get no block.
    sizes = [0 if k % 7 == 0 else 1 + k % 9 for k in range(500)]
    sizes[250] = 3 * limits.chunk_size + 1
    entries = [Entry(n, (DTYPES[k % 3],), (k % 4,)) for k, n in enumerate(sizes)]
    _, each = compare(limits, entries, seed=2)
    assert all(each[k].item() == 0.0 for k, n in enumerate(sizes) if n == 0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("per_tensor", [False, True], ids=["total", "per-tensor"])
def test_one_dtype_lists(limits, dtype, per_tensor):
    compare(limits, entries_for(limits, [(dtype,)]), seed=3, per_tensor=per_tensor)


@pytest.mark.slow
def test_large_values_in_fp16_do_not_overflow_the_fp32_sum(limits):
    entries = [Entry(limits.chunk_size + 5, (torch.float16,), (1,))]
    compare(limits, entries, seed=4, scale=1e4)  # up to ~5e4, near fp16's 65504


@pytest.mark.slow
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=str)
def test_nonfinite_values_give_the_same_norms(limits, value):
    entries = [Entry(n, (torch.bfloat16,), (1,)) for n in (5, 2 * limits.chunk_size + 3, 4)]
    emu, cpu = twin_lists(entries, 0, seed=5)
    for tensors in (emu, cpu):
        tensors[1][-1] = value
    emu_total, emu_each = EMULATED.l2norm(emu, True)
    cpu_total, cpu_each = CPU.l2norm(cpu, True)
    assert not math.isfinite(emu_total.item())
    assert_bitwise_equal(emu_total, cpu_total, "total")
    assert_bitwise_equal(emu_each[1:2], cpu_each[1:2], "norm of the tensor with the bad value")


def test_a_list_of_empty_tensors_has_norm_zero_without_any_launch(limits):
    entries = [Entry(0, (dtype,), (0,)) for dtype in DTYPES]
    emu, cpu = twin_lists(entries, 0, seed=6)
    total, each = EMULATED.l2norm(emu, True)
    cpu_total, cpu_each = CPU.l2norm(cpu, True)
    assert total.item() == cpu_total.item() == 0.0
    assert each.tolist() == cpu_each.tolist() == [0.0, 0.0, 0.0]
