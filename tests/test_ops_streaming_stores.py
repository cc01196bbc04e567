"""The O2 model copy of a large step is written with non-temporal stores, and
that changes no bit.

From STREAMING_MIN_ELEMENTS model-copy elements per call on, the CPU kernels of
the vector instruction sets write fp16/bf16 model copies with non-temporal
stores (csrc/cpu/fused_step_cpu.h: kStreamingModelCopyMinElements), for every
unit whose model copy is aligned to a vector block. The same step taken in
calls too small to stream must give the same bits: params, moments and the
model copy, odd sizes, scalar tails, a misaligned model copy and non-finite
masters included. A slow test repeats it under each instruction set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _reference as ref
from _backends import skip_unless_the_cpu_has
from apex_amp._extension import STATUS

# Mirrors kStreamingModelCopyMinElements in csrc/cpu/fused_step_cpu.h.
STREAMING_MIN_ELEMENTS = 1 << 22
# The big tensor alone reaches the threshold; it is split for the small calls at
# a multiple of the work unit, so that both runs cut it into the same units
# (hence the same vector loops and scalar tails).
BIG = STREAMING_MIN_ELEMENTS + 1031
SPLIT = 128 * ref.CPU_UNIT
SMALL_SIZES = (0, 1, 33, 1031, 3 * ref.CPU_UNIT + 5)
REPO = Path(__file__).resolve().parents[1]


def _extension_ops():
    if not STATUS.loaded:
        pytest.skip(f"compiled extension not in use: {STATUS.reason}")
    return torch.ops.apex_amp


def _case(half_dtype, *, seed, misaligned_copy, poison_masters):
    """(masters, half grads, model copies) of one O2 step; fresh tensors each call."""
    sizes = (BIG, *SMALL_SIZES)
    masters = ref.random_tensors(sizes, [torch.float32], seed=seed, scale=0.02)
    grads = ref.random_tensors(sizes, [half_dtype], seed=seed + 1, scale=1e-3)
    if poison_masters:
        # A non-finite master (an earlier overflow in fp32) reaches the copy in the
        # vector loop and in the scalar tail of the big tensor and of an odd one.
        for position, value in ((5, float("nan")), (SPLIT + 77, float("inf")), (BIG - 3, float("-inf")),
                                (BIG - 1, float("nan"))):
            masters[0][position] = value
        masters[4][1030] = float("nan")
    models = [m.to(half_dtype) for m in masters]
    if misaligned_copy:
        # One element into its storage: no block of this copy is vector-aligned.
        storage = torch.empty(BIG + 1, dtype=half_dtype)
        storage[1:] = models[0]
        models[0] = storage[1:]
    return masters, grads, models


def _step(ops, masters, grads, models, *, pieces):
    """One AdamW step: in one call, or with the big tensor in pieces of < the threshold."""
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    lists = [masters, grads, exp_avgs, exp_avg_sqs, models]
    calls = [lists]
    if pieces:
        calls = [[[t[0][:SPLIT]] for t in lists], [[t[0][SPLIT:]] for t in lists], [t[1:] for t in lists]]
    for call in calls:
        step = torch.zeros(1)
        ops.fused_adam_(*call, [], [], step, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True, ref.flag(0.5), ref.flag())
    return [t.view(torch.uint8) if t.dtype != torch.float32 else t.view(torch.int32)
            for t in (*masters, *exp_avgs, *exp_avg_sqs, *models)]


def _bits_of_both_runs(half_dtype, *, misaligned_copy=False, poison_masters=False):
    ops = _extension_ops()
    streamed = _step(ops, *_case(half_dtype, seed=7, misaligned_copy=misaligned_copy,
                                 poison_masters=poison_masters), pieces=False)
    in_pieces = _step(ops, *_case(half_dtype, seed=7, misaligned_copy=misaligned_copy,
                                  poison_masters=poison_masters), pieces=True)
    return streamed, in_pieces


def _assert_same_bits(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"tensor {i} ({g.numel()} words) differs at {(g != w).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("half_dtype", (torch.float16, torch.bfloat16), ids=ref.dtype_id)
def test_streamed_model_copy_is_bitwise_the_step_taken_in_small_calls(half_dtype):
    _assert_same_bits(*_bits_of_both_runs(half_dtype))


@pytest.mark.parametrize("half_dtype", (torch.float16, torch.bfloat16), ids=ref.dtype_id)
def test_streamed_model_copy_keeps_the_bits_of_non_finite_masters(half_dtype):
    _assert_same_bits(*_bits_of_both_runs(half_dtype, poison_masters=True))


@pytest.mark.parametrize("half_dtype", (torch.float16, torch.bfloat16), ids=ref.dtype_id)
def test_misaligned_model_copy_in_a_large_step_is_bitwise_the_same(half_dtype):
    _assert_same_bits(*_bits_of_both_runs(half_dtype, misaligned_copy=True))


def test_streamed_model_copy_is_the_cast_of_the_updated_masters():
    ops = _extension_ops()
    masters, grads, models = _case(torch.float16, seed=11, misaligned_copy=False, poison_masters=False)
    _step(ops, masters, grads, models, pieces=False)
    for master, model in zip(masters, models):
        assert torch.equal(model, master.to(torch.float16))


_CHILD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import test_ops_streaming_stores as t
problems = []
for dtype in (torch.float16, torch.bfloat16):
    for kwargs in ({{}}, {{"poison_masters": True}}, {{"misaligned_copy": True}}):
        got, want = t._bits_of_both_runs(dtype, **kwargs)
        problems += [f"{{dtype}} {{kwargs}} tensor {{i}}" for i, (g, w) in enumerate(zip(got, want))
                     if not torch.equal(g, w)]
print(json.dumps({{"capability": torch.backends.cpu.get_cpu_capability(), "problems": problems}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("capability", ("default", "avx2", "avx512"))
def test_streamed_model_copy_is_bitwise_under_every_instruction_set(capability):
    skip_unless_the_cpu_has(capability)
    _extension_ops()
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": str(REPO)}
    env.pop("APEX_AMP_FORCE_FALLBACK", None)
    child = subprocess.run([sys.executable, "-c", _CHILD.format(tests=str(REPO / "tests"))], env=env,
                           capture_output=True, text=True, timeout=600, cwd=REPO)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    if report["capability"].lower() != capability:
        pytest.skip(f"this CPU runs {report['capability']}, not {capability}")
    assert report["problems"] == []
