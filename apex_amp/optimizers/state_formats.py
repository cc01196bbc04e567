"""The storage formats of the fused optimizers' state, and of "remainder" masters: the reference.

A fused optimizer keeps each per-element state tensor (Adam's ``exp_avg`` and
``exp_avg_sq``, SGD's momentum, ...) in one of four precisions
(:class:`StatePrecision`). The kernels (csrc/state_formats.h) dequantize, update
in fp32 and requantize in the same pass; this module is the definition they are
tested against, and what the pure-PyTorch ops and the checkpoint conversions use.

* ``fp32``: the state as today, bitwise.
* ``bf16``: the fp32 value rounded to nearest even (``Tensor.to(torch.bfloat16)``).
* ``fp8``: ``float8_e4m3fn`` codes, one fp32 ``absmax`` per block of ``block``
  consecutive elements (in memory order); a value is ``code * (absmax / 448)``.
* ``int8``: 8-bit codes into a 256-entry *dynamic map* (:func:`dynamic_map`), one
  fp32 ``absmax`` per block; a value is ``map[code] * absmax``. States that are
  never negative (``exp_avg_sq``, Adagrad's ``sum``) use the unsigned map (uint8
  codes), the others the signed map (int8 codes, ``code + 127`` indexes the map).

Quantizing one block of fp32 values ``v`` with ``a = max |v|`` (NaN if any is NaN):

* ``a`` inf or NaN: ``absmax = a`` and every code is the zero code, so the whole
  block reads back NaN (``0 * inf``): a poisoned state stays poisoned, on every backend alike;
* ``a`` below the smallest normal fp32 (2**-126, zero included): ``absmax = 0`` and
  zero codes (the block is flushed to zero: such moments are far below any ``eps``);
* else ``x = clamp(v * (1 / a), -1, 1)`` in fp32 (``[0, 1]`` for the unsigned map);
  int8: the code of the nearest map entry, ties to the lower entry (compared
  with the fp32 midpoints ``(m[i] + m[i+1]) * 0.5``), except that the unsigned
  map gives an ``x > 0`` at least its smallest positive entry: a second moment
  stored as 0 would make Adam divide by the current gradient alone, and the
  step of an element whose gradients are small for its block grows with the
  step count (docs/low_precision_state.md); fp8: ``x * 448`` rounded to
  nearest even e4m3fn, except that a nonzero value keeps the smallest
  subnormal of its sign (``2**-9``): fp8 has one format for every state, so
  the rule that keeps a second moment off 0 covers the signed states as well,
  where it moves a value under ``2**-10`` by at most ``2**-9`` (of ``absmax / 448``).

Which format a parameter's state gets is decided from its *global* shape
(:func:`state_layout`), so that it is the same on every FSDP2 mesh: tensors under
``min_quantized_numel`` elements keep fp32; fp8 and int8 blocks never cross a
row (dim 0 index), because FSDP2 shards cut only between rows: the block size
is the largest power of two <= ``state_block_size`` dividing the row's element
count, and a tensor without one (1-D tensors, odd row sizes) keeps fp32.

Stochastic rounding of bf16 state (``state_rounding="stochastic"``): instead of rounding to
nearest even, an fp32 value is rounded to one of its two bf16 neighbours with probabilities
proportional to its distance from the other (:func:`round_bf16_stochastic`): a 16-bit random
integer ``r`` is added to the low 16 bits of the fp32 pattern and the low 16 bits are dropped,
so the expected value is the fp32 value itself. NaN and inf stay what round-to-nearest-even
makes of them, and a finite value becomes inf only where round-to-nearest-even's does (values
between bf16's largest finite number and the rounding boundary above it round down). ``r`` is a
pure function of (stream key, state index, element index) (:func:`rounding_bits`: a counter-based
hash of 32-bit integer mixes, the same in the kernels, csrc/state_formats.h); the key of a
parameter at a step is :func:`rounding_key` (seed, step counter, the parameter's index in the
optimizer), and the element index counts in the *whole* parameter, so an FSDP2 shard draws the
bits that one rank draws for the same elements.

Remainder masters (``master_weights="remainder"``): the fp32 master of a bf16
weight is kept as the weight plus a 16-bit remainder (:func:`split_master`,
:func:`join_master`); the weight is the master rounded to the nearest bf16,
ties away from zero, and weight and remainder give back the master bit for bit.
"""

from __future__ import annotations

import enum
import functools
import math
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "StatePrecision", "StateLayout", "DEFAULT_BLOCK_SIZE", "MIN_BLOCK_SIZE", "MAX_BLOCK_SIZE",
    "DEFAULT_MIN_QUANTIZED_NUMEL", "FP8_MAX", "dynamic_map", "state_layout", "storage_dtype",
    "quantize", "dequantize", "split_master", "join_master", "StateRounding", "rounding_key", "rounding_bits",
    "round_bf16_stochastic",
]

DEFAULT_BLOCK_SIZE = 256
MIN_BLOCK_SIZE = 32
MAX_BLOCK_SIZE = 4096
DEFAULT_MIN_QUANTIZED_NUMEL = 4096
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_SMALLEST_NORMAL = 2.0 ** -126
# The dynamic maps' decades, written out (a pow() could differ between C++ and Python).
_DECADES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
_UNSIGNED_COUNTS = (2, 4, 8, 16, 32, 64, 128)  # 254 entries in (1e-7, 1), plus 0 and 1
_SIGNED_COUNTS = (1, 2, 4, 8, 16, 32, 63)  # 126 per sign, plus +-1 and 0: 255 entries


class StatePrecision(str, enum.Enum):
    """How a fused optimizer stores a per-element state tensor (``state_precision=``)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"

    @property
    def blocked(self) -> bool:
        """Whether the format keeps one fp32 absmax per block of elements."""
        return self in (StatePrecision.FP8, StatePrecision.INT8)

    @classmethod
    def parse(cls, value: object) -> "StatePrecision":
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"state_precision must be one of {choices}, got {value!r}") from None


class StateRounding(str, enum.Enum):
    """How a bf16 state is rounded when it is stored (``state_rounding=``)."""

    NEAREST = "nearest"  # to nearest even, as Tensor.to(torch.bfloat16)
    STOCHASTIC = "stochastic"  # up or down at random, unbiased (round_bf16_stochastic)

    @classmethod
    def parse(cls, value: object) -> "StateRounding":
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(r.value) for r in cls)
            raise ValueError(f"state_rounding must be one of {choices}, got {value!r}") from None


class StateLayout(NamedTuple):
    """A parameter's state format: its precision and, for fp8/int8, the block size (else None)."""

    precision: StatePrecision
    block: Optional[int]


@functools.lru_cache(maxsize=None)
def _map_values(signed: bool) -> tuple[float, ...]:
    counts = _SIGNED_COUNTS if signed else _UNSIGNED_COUNTS
    positive = []
    for decade, count in zip(_DECADES, counts):
        # The midpoints of `count` equal steps from 0.1 to 1, times the decade (float64, this order).
        positive += [decade * (0.1 + 0.9 * ((j + 0.5) / count)) for j in range(count)]
    positive.append(1.0)
    if signed:
        return tuple([-v for v in reversed(positive)] + [0.0] + positive)
    return tuple([0.0] + positive)


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> Tensor:
    """The int8 format's map: 255 (signed) or 256 (unsigned) fp32 values in [-1, 1] / [0, 1], ascending.

    Example::

        >>> dynamic_map(signed=False)[[0, -1]]
        tensor([0., 1.])
    """
    return torch.tensor(_map_values(signed), dtype=torch.float64).to(torch.float32).to(device)


def _midpoints(table: Tensor) -> Tensor:
    return (table[:-1] + table[1:]) * 0.5


def storage_dtype(precision: StatePrecision, nonnegative: bool) -> torch.dtype:
    """The dtype of a state's data in ``precision`` (``nonnegative``: the state is never negative)."""
    return {
        StatePrecision.FP32: torch.float32,
        StatePrecision.BF16: torch.bfloat16,
        StatePrecision.FP8: torch.float8_e4m3fn,
        StatePrecision.INT8: torch.uint8 if nonnegative else torch.int8,
    }[precision]


def state_layout(global_shape: Sequence[int], precision: StatePrecision | str, block_size: int = DEFAULT_BLOCK_SIZE,
                 min_quantized_numel: int = DEFAULT_MIN_QUANTIZED_NUMEL) -> StateLayout:
    """The state format of a parameter of ``global_shape`` (a DTensor's global shape, not its shard's).

    Args:
        global_shape: the whole parameter's shape.
        precision: the requested precision.
        block_size: the largest block (a power of two in [32, 4096]).
        min_quantized_numel: smaller tensors keep fp32 state.

    Example::

        >>> state_layout((1024, 768), "int8")
        StateLayout(precision=<StatePrecision.INT8: 'int8'>, block=256)
        >>> state_layout((8192,), "int8").precision.value   # a 1-D tensor's shards may cut any block
        'fp32'
    """
    precision = StatePrecision.parse(precision)
    check_block_size(block_size)
    if int(min_quantized_numel) < 0:
        raise ValueError(f"min_quantized_numel must be >= 0, got {min_quantized_numel}")
    numel = math.prod(global_shape)
    if precision is StatePrecision.FP32 or numel < min_quantized_numel or numel == 0:
        return StateLayout(StatePrecision.FP32, None)
    if not precision.blocked:
        return StateLayout(precision, None)
    row = numel // global_shape[0] if len(global_shape) > 1 else 1
    block = block_size
    while block >= MIN_BLOCK_SIZE and row % block:
        block //= 2
    if block < MIN_BLOCK_SIZE:
        return StateLayout(StatePrecision.FP32, None)
    return StateLayout(precision, block)


def check_block_size(block_size: int) -> None:
    if (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < MIN_BLOCK_SIZE
            or block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1)):
        raise ValueError(f"state_block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
                         f"got {block_size!r}")


def _block_absmax(blocks: Tensor) -> Tensor:
    absmax = blocks.abs().amax(dim=1)
    # amax ignores no NaN on CPU, but say it: a block holding a NaN has a NaN absmax.
    return torch.where(blocks.isnan().any(dim=1), torch.nan, absmax)


def quantize(values: Tensor, dtype: torch.dtype, block: Optional[int] = None) -> tuple[Tensor, Optional[Tensor]]:
    """fp32 ``values`` in the format whose data has ``dtype``: (codes, absmax per block or None).

    ``dtype`` float32/bfloat16 need no block; float8_e4m3fn, int8 and uint8 need ``block``
    dividing ``values.numel()``. Blocks run over the elements in memory order (``values``
    must be dense); the codes have ``values``' shape and strides.
    """
    if dtype in (torch.float32, torch.bfloat16):
        return values.to(dtype), None
    if block is None or values.numel() % block:
        raise ValueError(f"quantizing to {dtype} needs a block size dividing numel {values.numel()}, got {block}")
    if values.numel() == 0:
        empty_absmax = values.new_empty((values.shape[0], 0) if values.dim() > 1 else (0,), dtype=torch.float32)
        return torch.empty_like(values, dtype=dtype), empty_absmax
    flat = _memory_order(values).float().reshape(-1, block)
    absmax = _block_absmax(flat)
    usable = absmax >= _SMALLEST_NORMAL  # False for NaN, inf below
    finite = torch.isfinite(absmax)
    inv = torch.where(usable & finite, 1.0 / torch.where(usable, absmax, 1.0), 0.0)
    low = 0.0 if dtype == torch.uint8 else -1.0
    x = torch.clamp(flat * inv[:, None], low, 1.0)
    if dtype == torch.float8_e4m3fn:
        scaled = x * FP8_MAX
        bits = scaled.to(dtype).view(torch.uint8)
        # A nonzero value keeps the smallest subnormal of its sign (see the docstring).
        codes = torch.where(((bits & 0x7F) == 0) & (scaled != 0), bits | 1, bits).view(dtype)
    elif dtype in (torch.int8, torch.uint8):
        signed = dtype == torch.int8
        table = dynamic_map(signed, values.device)
        index = torch.searchsorted(_midpoints(table), x.contiguous())
        if not signed:
            # A never-negative state's positive values keep the smallest positive entry (see the docstring).
            index = torch.where((index == 0) & (x > 0), 1, index)
        zero = 127 if signed else 0
        index = torch.where((usable & finite)[:, None], index, zero)
        codes = (index - 127).to(torch.int8) if signed else index.to(torch.uint8)
    else:
        raise ValueError(f"no state format stores {dtype}; use float32, bfloat16, float8_e4m3fn, int8 or uint8")
    stored_absmax = torch.where(usable | ~finite, absmax, 0.0)
    # (rows, blocks per row): an FSDP2 shard of the param is a shard of this along dim 0.
    rows_hold_blocks = values.dim() > 1 and (values.numel() // max(values.shape[0], 1)) % block == 0
    absmax_shape = (values.shape[0], -1) if rows_hold_blocks else (-1,)
    return _like(codes.reshape(-1), values), stored_absmax.reshape(absmax_shape)


def dequantize(codes: Tensor, absmax: Optional[Tensor] = None) -> Tensor:
    """The fp32 values of a state in any format (the inverse of :func:`quantize`, up to its rounding)."""
    if codes.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return codes.float()
    if codes.numel() == 0:
        return torch.empty_like(codes, dtype=torch.float32)
    if absmax is None or absmax.numel() == 0 or codes.numel() % absmax.numel():
        raise ValueError(f"a {codes.dtype} state needs one absmax per block, got "
                         f"{None if absmax is None else absmax.numel()} for {codes.numel()} elements")
    flat_absmax = absmax.reshape(-1).float()
    block = codes.numel() // flat_absmax.numel()
    flat = _memory_order(codes).reshape(-1, block)
    if codes.dtype == torch.float8_e4m3fn:
        values = flat.float() * (flat_absmax / FP8_MAX)[:, None]
    elif codes.dtype in (torch.int8, torch.uint8):
        signed = codes.dtype == torch.int8
        index = flat.long() + 127 if signed else flat.long()
        values = dynamic_map(signed, codes.device)[index] * flat_absmax[:, None]
    else:
        raise ValueError(f"no state format stores {codes.dtype}")
    return _like(values.reshape(-1), codes)


def _memory_order(tensor: Tensor) -> Tensor:
    # The elements as the kernels walk them: a dense tensor's storage order.
    if tensor.is_contiguous():
        return tensor.reshape(-1)
    order = sorted(range(tensor.dim()), key=lambda d: tensor.stride(d), reverse=True)
    return tensor.permute(order).reshape(-1)


def _like(flat: Tensor, like: Tensor) -> Tensor:
    # `flat` (memory order) as a tensor with `like`'s shape and strides.
    shaped = flat.reshape(like.shape) if like.is_contiguous() else _from_memory_order(flat, like)
    return torch.empty_like(like, dtype=flat.dtype).copy_(shaped)


def _from_memory_order(flat: Tensor, like: Tensor) -> Tensor:
    order = sorted(range(like.dim()), key=lambda d: like.stride(d), reverse=True)
    permuted = flat.reshape([like.shape[d] for d in order])
    inverse = [order.index(d) for d in range(like.dim())]
    return permuted.permute(inverse)


def split_master(master: Tensor) -> tuple[Tensor, Tensor]:
    """An fp32 master as (bf16 weight, int16 remainder): weight + remainder is the master, bit for bit.

    The weight is the master rounded to the nearest bf16, ties away from zero (round-to-nearest-even,
    as ``Tensor.to(torch.bfloat16)`` rounds, cannot be undone from 16 more bits at a tie).

    Example::

        >>> master = torch.randn(5)
        >>> weight, remainder = split_master(master)
        >>> torch.equal(join_master(weight, remainder), master)
        True
    """
    if master.dtype != torch.float32:
        raise TypeError(f"split_master takes an fp32 master, got {master.dtype}")
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = ((bits + 0x8000) & 0xFFFFFFFF) >> 16
    low = bits & 0xFFFF
    weight = _int16_of(high).view(torch.bfloat16)
    return weight, _int16_of(low)


def join_master(weight: Tensor, remainder: Tensor) -> Tensor:
    """The fp32 master of a bf16 ``weight`` and its int16 ``remainder`` (see :func:`split_master`)."""
    if weight.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError(f"join_master takes a bf16 weight and an int16 remainder, got {weight.dtype} and "
                        f"{remainder.dtype}")
    high = weight.view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((high << 16) + remainder.to(torch.int64)) & 0xFFFFFFFF
    return _int32_of(bits).view(torch.float32)


def _int16_of(unsigned: Tensor) -> Tensor:
    return torch.where(unsigned >= 0x8000, unsigned - 0x10000, unsigned).to(torch.int16)


def _int32_of(unsigned: Tensor) -> Tensor:
    return torch.where(unsigned >= 0x80000000, unsigned - 0x100000000, unsigned).to(torch.int32)


# ---- stochastic rounding of bf16 state --------------------------------------------------------------
# Every step below is an operation on 32-bit values held in int64 (Python ints or int64 tensors):
# the multipliers are below 2**31, so a product of a 32-bit value stays below 2**63 and no int64
# ever overflows; the kernels do the same in uint32 arithmetic (csrc/state_formats.h).
_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # 2**32 / golden ratio: separates the inputs of the mixes
# A two-multiply 32-bit mix (xorshift-multiply, constants from C. Wellons' hash-prospector, chosen
# among its best for multipliers below 2**31).
_MIX_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
_COUNTER_SHIFT = 32  # a key holds the step counter in its high 32 bits
MAX_ROUNDING_COUNTER = 2 ** 31 - 1  # keys stay non-negative int64


def _mix32(x):
    # x: a value in [0, 2**32) (an int or an int64 tensor); a bijection of [0, 2**32).
    x = x ^ (x >> 16)
    x = (x * _MIX_MULTIPLIERS[0]) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX_MULTIPLIERS[1]) & _MASK32
    return x ^ (x >> 15)


def _halves(value):
    # The low and high 32 bits of a 64-bit pattern (an int, or an int64 tensor: two's complement).
    return value & _MASK32, (value >> 32) & _MASK32


def rounding_key(seed: int, counter, param_index: int):
    """The stream key of parameter ``param_index`` at step ``counter`` of a run seeded with ``seed``.

    ``counter`` (an int, or an int64 tensor on the device: the optimizer's step counter) lands in
    the key's high 32 bits, a hash of (seed, param_index) in the low ones; the ops take one key
    per tensor (their ``state_rounding`` argument).

    Example::

        >>> rounding_key(0, 1, 0) != rounding_key(0, 2, 0) != rounding_key(1, 1, 0)
        True
    """
    seed_low, seed_high = _halves(int(seed))
    stream = _mix32(_mix32(_mix32(int(param_index) & _MASK32 ^ _GOLDEN32) ^ seed_low) ^ seed_high)
    return (counter << _COUNTER_SHIFT) | stream


def _state_stream(key, state_index: int):
    # One 32-bit stream per (tensor, state list): Adam's two moments draw different bits.
    low, high = _halves(key)
    salt = (_GOLDEN32 * (state_index + 1)) & _MASK32
    return _mix32(_mix32(_mix32(low ^ _GOLDEN32) ^ high) ^ salt)


def rounding_bits(key, state_index: int, index: Tensor) -> Tensor:
    """The 16 random bits (an int64 tensor in [0, 2**16)) that round element ``index`` of state list
    ``state_index`` of the tensor with stream ``key`` (an int or an int64 scalar tensor).

    ``index`` (int64, >= 0) counts the elements of the whole parameter in memory order.

    Example::

        >>> bits = rounding_bits(rounding_key(0, 1, 0), 0, torch.arange(4))
        >>> bits.dtype, bool(((bits >= 0) & (bits < 65536)).all())
        (torch.int64, True)
    """
    stream = _state_stream(key, state_index)
    low, high = _halves(index)
    return _mix32(_mix32(low ^ stream) ^ high) >> 16


def round_bf16_stochastic(values: Tensor, key, state_index: int, offset=0) -> Tensor:
    """fp32 ``values`` stochastically rounded to bf16, with the bits of stream ``key``.

    Element j (in memory order) of ``values`` is element ``offset + j`` of the whole parameter
    (an FSDP2 shard's first element is not the parameter's) and takes
    ``rounding_bits(key, state_index, offset + j)``: ``r`` added to the low half of its fp32
    pattern, then truncated. Exactly representable values are unchanged; NaN, inf and finite
    values that round-to-nearest-even sends to inf round as ``Tensor.to(torch.bfloat16)``; no
    other finite value becomes inf (one that would is rounded to nearest even instead, i.e. down
    to bf16's largest finite number).

    Example::

        >>> x = torch.full((10000,), 1.0 + 2.0 ** -10)           # a quarter of the way to the next bf16
        >>> rounded = round_bf16_stochastic(x, rounding_key(0, 1, 0), 0)
        >>> sorted(set(rounded.float().tolist()))
        [1.0, 1.0078125]
        >>> abs(rounded.float().mean().item() - x[0].item()) < 2e-4    # unbiased
        True
    """
    if values.dtype != torch.float32:
        raise TypeError(f"round_bf16_stochastic rounds fp32 values, got {values.dtype}")
    flat = _memory_order(values)
    index = torch.arange(flat.numel(), dtype=torch.int64, device=values.device) + offset  # an int or a tensor
    bits = rounding_bits(key, state_index, index)
    pattern = flat.view(torch.int32).to(torch.int64) & _MASK32
    high = ((pattern + bits) >> 16) & 0xFFFF
    stochastic = _int16_of(high).view(torch.bfloat16)
    nearest = flat.to(torch.bfloat16)
    keep_nearest = flat.isnan() | (stochastic.isinf() & flat.isfinite())
    return _like(torch.where(keep_nearest, nearest, stochastic), values)
