"""csrc/cuda/chunk_packing.h on its own: which chunks each launch gets.

torch.ops.apex_amp_emulated.pack_chunks(numels, depth) runs pack_chunks over
made-up addresses and returns one row per block of every launch, as the
kernel would decode its metadata (columns below, as in inspection_ops.cpp).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _twins import EMULATED

LAUNCH, LAUNCH_BLOCKS, BLOCK, POSITION, LISTS_AGREE, NUMEL, CHUNK, SLOT = range(8)


def pack(numels, depth):
    return EMULATED.pack_chunks(list(numels), depth).tolist()


def expected_chunks(numels, chunk_size):
    """(position, chunk) of every chunk of the call, in list order."""
    return [(p, c) for p, n in enumerate(numels) for c in range(-(-n // chunk_size))]


def check_packing(numels, depth, limits):
    """Every property a kernel relies on, for one call."""
    rows = pack(numels, depth)
    chunk = limits.chunk_size
    # Each chunk of each non-empty tensor exactly once, numbered in list order.
    assert [(r[POSITION], r[CHUNK]) for r in rows] == expected_chunks(numels, chunk)
    assert [r[SLOT] for r in rows] == list(range(len(rows)))
    for r in rows:
        assert r[LISTS_AGREE] == 1, f"block {r[BLOCK]} of launch {r[LAUNCH]}: lists disagree"
        assert r[NUMEL] == numels[r[POSITION]]
        assert r[CHUNK] * chunk < r[NUMEL]  # the chunk starts inside its tensor
    launches = {}
    for r in rows:
        launches.setdefault(r[LAUNCH], []).append(r)
    assert sorted(launches) == list(range(len(launches)))
    for index, blocks in launches.items():
        assert [r[BLOCK] for r in blocks] == list(range(len(blocks)))
        assert all(r[LAUNCH_BLOCKS] == len(blocks) for r in blocks)
        tensors = {r[POSITION] for r in blocks}
        assert len(blocks) <= limits.max_blocks
        assert len(tensors) <= limits.tensors_per_launch(depth)
        # A launch ends early only when it is full: no launch is wasted.
        if index != len(launches) - 1:
            assert len(blocks) == limits.max_blocks or len(tensors) == limits.tensors_per_launch(depth)
    return launches


def test_limits_fit_the_kernel_argument_limit(limits):
    for depth in range(1, 6):
        assert limits.metadata_bytes[depth - 1] + limits.functor_budget <= limits.kernel_arg_limit
        assert 16 <= limits.tensors_per_launch(depth) <= 256  # block_to_tensor is uint8
    assert limits.kernel_arg_limit == 4096


@pytest.mark.parametrize("depth", [1, 2, 4, 5])
def test_tensor_longer_than_one_launch_continues_in_the_next(limits, depth):
    chunks = 2 * limits.max_blocks + 3
    numels = [5, chunks * limits.chunk_size - 1, 7]
    launches = check_packing(numels, depth, limits)
    assert len(launches) == 3
    # The long tensor opens launches 1 and 2, at the chunk where the previous one stopped.
    assert launches[1][0][POSITION] == 1 and launches[1][0][CHUNK] == limits.max_blocks - 1
    assert launches[2][0][POSITION] == 1 and launches[2][0][CHUNK] == 2 * limits.max_blocks - 1


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
def test_list_longer_than_one_launch_starts_a_new_launch_at_a_tensor_boundary(limits, depth):
    per_launch = limits.tensors_per_launch(depth)
    numels = [1 + k % 3 for k in range(2 * per_launch + 1)]
    launches = check_packing(numels, depth, limits)
    assert [len(blocks) for blocks in launches.values()] == [per_launch, per_launch, 1]


def test_tensor_filling_the_last_tensor_slot_takes_the_rest_of_the_launch(limits):
    per_launch = limits.tensors_per_launch(1)
    # The last tensor that fits has more chunks than the launch has blocks left.
    numels = [1] * (per_launch - 1) + [limits.max_blocks * limits.chunk_size]
    launches = check_packing(numels, 1, limits)
    carried = range(limits.max_blocks - per_launch + 1, limits.max_blocks)
    assert len(launches[0]) == limits.max_blocks
    assert [(r[POSITION], r[CHUNK]) for r in launches[1]] == [(per_launch - 1, c) for c in carried]


def test_empty_tensors_get_no_block_and_no_launch(limits):
    assert pack([0, 0, 0], 2) == []
    rows = pack([0, 3, 0, limits.chunk_size + 1, 0], 2)
    assert [(r[POSITION], r[CHUNK]) for r in rows] == [(1, 0), (3, 0), (3, 1)]


def test_exactly_full_launches_leave_no_empty_launch_behind(limits):
    numels = [limits.max_blocks * limits.chunk_size]
    launches = check_packing(numels, 1, limits)
    assert len(launches) == 1


def test_a_tensor_of_more_than_2_to_the_31_chunks_is_refused(limits):
    with pytest.raises(RuntimeError, match="too large for the multi-tensor kernels"):
        pack([(2**31) * limits.chunk_size + 1], 1)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), depth=st.integers(1, 5))
def test_any_list_packs_every_chunk_once_within_the_limits(limits, data, depth):
    chunk, blocks = limits.chunk_size, limits.max_blocks
    size = st.one_of(st.integers(0, 9), st.integers(0, 3 * chunk + 7),
                     st.integers((blocks - 20) * chunk, (2 * blocks + 20) * chunk))
    check_packing(data.draw(st.lists(size, max_size=300), label="numels"), depth, limits)
