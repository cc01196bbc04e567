"""Inputs for comparing the emulated CUDA launchers with the CPU kernels: twin
tensor lists (the same values in the same memory layout, one list for each
backend), the list shapes that stress the multi-tensor apply, and an exact
comparison.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import torch
from torch import Tensor

EMULATED = torch.ops.apex_amp_emulated
CPU = torch.ops.apex_amp
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KILP = 4  # elements per vector access (csrc/cuda/chunk_packing.h)

def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Limits:
    """The packing constants of the emulation build (csrc/cuda/chunk_packing.h)."""

    chunk_size: int
    max_blocks: int                   # chunks per launch
    kernel_arg_limit: int             # bytes
    functor_budget: int               # bytes of the arguments left to an op's functor
    max_tensors: tuple[int, ...]      # tensors per launch, for 1..5 lists
    metadata_bytes: tuple[int, ...]   # sizeof(TensorListMetadata<1..5>)

    @classmethod
    def of_build(cls) -> "Limits":
        v = EMULATED.launch_limits()
        return cls(v[0], v[1], v[2], v[3], tuple(v[4:9]), tuple(v[9:14]))

    def tensors_per_launch(self, depth: int) -> int:
        return self.max_tensors[depth - 1]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One list position of an op: its element count, per list the dtype and
    the offset (in elements) of the tensor in its allocation, and the layout
    its tensors share: None for a flat tensor, else (shape, memory format)."""

    numel: int
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    layout: tuple | None = None  # (shape, torch.memory_format or "transposed")


# Dense layouts other than contiguous, which the ops accept and the kernels
# walk as flat memory: (shape, memory format), or (shape, "transposed").
DENSE_LAYOUTS = (
    ((2, 3, 5, 7), torch.channels_last),
    ((2, 16, 16, 17), torch.channels_last),          # more than two 4096-element chunks
    ((2, 3, 4, 5, 6), torch.channels_last_3d),
    ((130, 33), "transposed"),                       # a .t() of a (33, 130) matrix
)


def dense_strides(shape: tuple[int, ...], memory_format) -> tuple[int, ...]:
    if memory_format == "transposed":
        return tuple(reversed(torch.empty(tuple(reversed(shape))).stride()))
    return torch.empty(shape, memory_format=memory_format).stride()


def placed(values: Tensor, offset: int, layout=None) -> Tensor:
    """A copy of `values` placed `offset` elements into an allocation that ends
    where it ends, flat or in `layout` (shape, memory format); AddressSanitizer
    then rejects any access outside it (the allocation's end is a redzone, the
    bytes in front are poisoned)."""
    buffer = torch.empty(offset + values.numel(), dtype=values.dtype)
    view = buffer[offset:]
    if layout is not None:
        shape, memory_format = layout
        view = view.as_strided(shape, dense_strides(shape, memory_format))
        values = values.reshape(shape)
    view.copy_(values)
    if view.numel() > 0:
        EMULATED.poison_around(view)
    return view


def random_values(numel: int, dtype: torch.dtype, generator: torch.Generator,
                  scale: float = 1.0, positive: bool = False) -> Tensor:
    values = torch.randn(numel, generator=generator) * scale
    return (values.abs() if positive else values).to(dtype)


def twin_lists(entries: Sequence[Entry], list_index: int, seed: int, scale: float = 1.0,
               positive: bool = False) -> tuple[list[Tensor], list[Tensor]]:
    """List `list_index` of an op, twice: equal values, equal offsets."""
    generator = torch.Generator().manual_seed(seed)
    first, second = [], []
    for entry in entries:
        values = random_values(entry.numel, entry.dtypes[list_index], generator, scale, positive)
        first.append(placed(values, entry.offsets[list_index], entry.layout))
        second.append(placed(values, entry.offsets[list_index], entry.layout))
    return first, second


def flag(value: float = 0.0) -> Tensor:
    return torch.full((1,), value, dtype=torch.float32)


def offset_patterns(depth: int) -> list[tuple[int, ...]]:
    """Offsets of a position's tensors, one per list: every list aligned (the
    vector path), every list misaligned, and one list misaligned while the
    others are not (which must also take the scalar path)."""
    patterns = [(0,) * depth, (1,) * depth, (3,) * depth]
    patterns += [tuple(1 if j == k else 0 for j in range(depth)) for k in range(depth)]
    return list(dict.fromkeys(patterns))


def entries_for(limits: Limits, dtype_combos: Sequence[tuple[torch.dtype, ...]], *,
                sizes: Sequence[int] | None = None, beyond_one_launch: bool = True,
                many: bool = True) -> list[Entry]:
    """Positions that take the multi-tensor apply through its cases: empty,
    one-element and odd sizes (scalar tails), sizes around the chunk size, each
    offset pattern, dtype combinations cycling through `dtype_combos`, the
    dense layouts other than contiguous; with `beyond_one_launch` an aligned
    tensor of more chunks than one launch takes (its chunks carry over to the
    next launch), with `many` more tensors than one launch takes."""
    chunk = limits.chunk_size
    if sizes is None:
        sizes = (0, 1, 3, 5, 33, chunk - 1, chunk, chunk + 1, 2 * chunk + 5)
    depth = len(dtype_combos[0])
    patterns = offset_patterns(depth)
    # Shifted by the size, so that every offset pattern meets every dtype combination.
    entries = [Entry(numel, dtype_combos[(i + j) % len(dtype_combos)], offsets)
               for i, numel in enumerate(sizes) for j, offsets in enumerate(patterns)]
    combos = itertools.cycle(dtype_combos)
    for k, (shape, memory_format) in enumerate(DENSE_LAYOUTS):
        entries.append(Entry(math.prod(shape), next(combos), patterns[k % len(patterns)],
                             (shape, memory_format)))
    if beyond_one_launch:
        entries.append(Entry(limits.max_blocks * chunk + 3, next(combos), (0,) * depth))
    if many:
        for k in range(limits.tensors_per_launch(depth) + 20):
            entries.append(Entry(7 + k % 5, next(combos), patterns[k % len(patterns)]))
    return entries


def assert_bitwise_equal(actual: Tensor, expected: Tensor, what: str) -> None:
    """Same dtype, shape and bits, except that any NaN matches any NaN (the CPU's
    vector conversions and c10's scalar ones write different NaN payloads)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    actual, expected = actual.reshape(-1), expected.reshape(-1)
    nan = actual.isnan()
    mismatch = nan != expected.isnan()
    bits = {2: torch.int16, 4: torch.int32}[actual.element_size()]
    mismatch |= ~nan & (actual.view(bits) != expected.view(bits))
    if mismatch.any():
        i = int(mismatch.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(mismatch.sum())} of {actual.numel()} elements differ; first at [{i}]: "
            f"emulated CUDA {actual[i].item()!r}, CPU {expected[i].item()!r}")


def assert_lists_equal(actual: Sequence[Tensor], expected: Sequence[Tensor], what: str,
                       entries: Sequence[Entry] | None = None) -> None:
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        layout = ""
        if entries is not None:
            layout = f" (numel {entries[i].numel}, offsets {entries[i].offsets})"
        assert_bitwise_equal(a, e, f"{what}[{i}]{layout}")
