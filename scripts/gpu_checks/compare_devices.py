"""The CUDA kernels against the CPU kernels on the same inputs: a table of op, dtype and max ulp difference.

Every op of apex_amp runs on identical inputs on the GPU and on the CPU (both through the compiled
extension), and each output is compared in units in the last place of its dtype. Expect:

* 0 ulp for the ops that only scale or copy (``unscale_``, ``scale_``), the overflow flags and the
  loss-scale update (exact arithmetic on powers of two);
* a few ulp where nvcc contracts ``a * b + c`` into one fused multiply-add (``--fmad=true``, its
  default, which setup.py keeps): one rounding instead of two, so the GPU's result is the more
  accurate one by at most an ulp per contracted operation, and the difference grows a little over
  the steps of an optimizer (Adam's moments feed its next step);
* more for reductions (``l2norm`` and the norms inside LAMB and NovoGrad): the GPU sums in another
  order (blocks, then a tree), so their results differ by the rounding of a different summation.

A NaN/inf pattern that differs, or an overflow flag that differs, is a failure (exit code 1);
ulp differences are reported, not judged. ``--device cpu`` compares the compiled CPU kernels with
the pure-PyTorch fallback instead (what ``scripts/gpu_check.sh --dry-run`` runs on a CPU-only
machine, so this script is exercised without a GPU).

Run: ``python scripts/gpu_checks/compare_devices.py [--device cuda|cpu] [--json PATH] [--markdown PATH]``
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # apex_amp from this checkout

from apex_amp import ops  # noqa: E402

# Lengths around the CPU vector widths and the CUDA chunk (65536 elements), and enough small
# tensors after them that the multi-tensor apply needs several launches for one list.
SIZES = (1, 7, 33, 1031, 65536 + 7, 3 * 65536 + 1) + (5,) * 150
# The CPU-only comparison (a dry run) checks the script, not the kernels: a short list.
CPU_SIZES = (1, 7, 33, 1031, 65536 + 7)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
STEPS = 3


class Side:
    """Where one side of the comparison runs: an op namespace and a device."""

    def __init__(self, namespace, device: str, label: str):
        self.ops, self.device, self.label = namespace, torch.device(device), label

    def put(self, tensors):
        return [t.to(self.device) for t in tensors]

    def flag(self, value: float = 0.0):
        return torch.full((1,), value, device=self.device)


def sides(device: str) -> tuple[Side, Side]:
    if device == "cuda":
        return (Side(ops.backend_namespace("extension"), "cuda", "CUDA kernels"),
                Side(ops.backend_namespace("extension"), "cpu", "CPU kernels"))
    return (Side(ops.backend_namespace("fallback"), "cpu", "pure-PyTorch fallback"),
            Side(ops.backend_namespace(ops.BACKEND), "cpu", f"CPU ({ops.BACKEND})"))


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    # Floats as integers in the order of their values: the distance between two of them is the
    # number of representable values between them (their ulp distance).
    int_dtype = {4: torch.int32, 2: torch.int16}[t.element_size()]
    bits = t.contiguous().view(int_dtype).to(torch.int64)
    magnitude = bits & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def differences(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float, int, int]:
    """(max ulp distance over the finite elements, max |a - b| in ulps of the tensor's largest
    value, elements that differ, elements whose inf/NaN pattern differs). Where a result cancels
    to near zero its ulp is tiny, so the first can be large for a difference the second shows is
    one rounding of the tensor's scale."""
    a, b = a.detach().cpu().flatten(), b.detach().cpu().flatten()
    if a.numel() == 0:
        return 0, 0.0, 0, 0
    if not a.is_floating_point():  # counters: any difference is a whole one
        distance = (a.long() - b.long()).abs()
        return int(distance.max()), float(distance.max()), int((distance > 0).sum()), 0
    a_bad, b_bad = ~torch.isfinite(a), ~torch.isfinite(b)
    pattern = int((a_bad != b_bad).sum()) + int((a_bad & b_bad & ((a != b) & ~(a.isnan() & b.isnan()))).sum())
    both_finite = ~a_bad & ~b_bad
    if not both_finite.any():
        return 0, 0.0, 0, pattern
    a, b = a[both_finite], b[both_finite]
    distance = (_ordered_bits(a) - _ordered_bits(b)).abs()
    largest = float(b.double().abs().max())
    scale_ulp = 2.0 ** (math.floor(math.log2(largest)) - MANTISSA_BITS[b.dtype]) if largest else 1.0
    at_scale = float((a.double() - b.double()).abs().max()) / scale_ulp
    return int(distance.max()), at_scale, int((distance > 0).sum()), pattern


def random_list(sizes, dtype, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=generator) * scale).to(dtype) for n in sizes]


class Table:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, op: str, dtype: str, outputs_a, outputs_b, note: str = ""):
        worst, at_scale, differing, pattern, elements = 0, 0.0, 0, 0, 0
        for a, b in zip(outputs_a, outputs_b):
            ulp, scaled, differ, bad = differences(a, b)
            worst, at_scale = max(worst, ulp), max(at_scale, scaled)
            differing, pattern, elements = differing + differ, pattern + bad, elements + a.numel()
        self.rows.append({"op": op, "dtype": dtype, "max_ulp": worst, "max_ulp_of_largest": at_scale,
                          "differing_share": differing / max(elements, 1), "nonfinite_mismatches": pattern,
                          "note": note})

    def failures(self) -> list[dict]:
        return [r for r in self.rows if r["nonfinite_mismatches"]]


# ----------------------------------------------------------------------------- the ops


def list_ops(table: Table, a: Side, b: Side, sizes):
    for name, dtype in DTYPES.items():
        base = random_list(sizes, dtype, 100.0, seed=1)
        poisoned = [t.clone() for t in base]
        poisoned[4][12345] = float("nan")
        poisoned[-1][-1] = float("inf")
        flags = []
        for side in (a, b):
            for tensors in (base, poisoned):
                found_inf = side.flag()
                side.ops.check_finite(side.put(tensors), found_inf)
                flags.append(found_inf)
        table.add("check_finite", name, flags[:2], flags[2:], "flags: clean list, list with a NaN")

        outs = []
        for side in (a, b):
            grads, found_inf = side.put(poisoned), side.flag()
            side.ops.unscale_(grads, found_inf, side.flag(1 / 3))
            outs.append(grads + [found_inf])
        table.add("unscale_", name, *outs, "x 1/3, a NaN and an inf")

        for dst_name, dst_dtype in DTYPES.items():
            outs = []
            for side in (a, b):
                dst = [torch.empty(t.shape, dtype=dst_dtype, device=side.device) for t in base]
                found_inf = side.flag()
                side.ops.scale_(side.put(base), dst, side.flag(0.75), found_inf)
                outs.append(dst + [found_inf])
            table.add("scale_", f"{name}->{dst_name}", *outs, "x 0.75")

            outs = []
            for side in (a, b):
                y, found_inf = side.put(random_list(sizes, dst_dtype, seed=2)), side.flag()
                side.ops.axpby_(side.put(base), y, side.flag(0.01), 0.5, found_inf)
                outs.append(y + [found_inf])
            table.add("axpby_", f"{name}->{dst_name}", *outs, "y = 0.01 x + 0.5 y")

        outs = [list(side.ops.l2norm(side.put(base), True)) for side in (a, b)]
        table.add("l2norm", name, *outs, "total and per tensor (a reduction)")


def update_scale(table: Table, a: Side, b: Side, sizes):
    outs = []
    for side in (a, b):
        scale, growth, hysteresis = side.flag(65536.0), side.flag(0.0), side.flag(2.0)
        growth, hysteresis = growth.to(torch.int32), hysteresis.to(torch.int32)
        trajectory = []
        for found in (0, 0, 1, 0, 1, 1, 0, 0, 0):
            side.ops.update_scale_(scale, growth, hysteresis, side.flag(float(found)), 2.0, 0.5, 2, 2, 1.0,
                                   2.0**24, False)
            trajectory.append(scale.clone())
        outs.append(trajectory + [growth, hysteresis])
    table.add("update_scale_", "fp32", *outs, "a 9-step trajectory")


def fused_adam(table: Table, a: Side, b: Side, sizes):
    combos = (("fp32", torch.float32, torch.float32, None), ("fp32<-fp16 + fp16 copy", torch.float32, torch.float16,
              torch.float16), ("fp32<-bf16 + bf16 copy", torch.float32, torch.bfloat16, torch.bfloat16),
              ("bf16", torch.bfloat16, torch.bfloat16, None))
    for label, param_dtype, grad_dtype, model_dtype in combos:
        outs = []
        for side in (a, b):
            params = side.put(random_list(sizes, param_dtype, seed=3))
            exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
            model = [p.to(model_dtype) for p in params] if model_dtype is not None else []
            step = torch.zeros(1, device=side.device)
            for k in range(STEPS):
                grads = side.put(random_list(sizes, grad_dtype, 64.0, seed=10 + k))
                side.ops.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model, [], [], step, 1e-2, 0.9, 0.999, 1e-8,
                                     0.01, True, True, side.flag(1 / 64), side.flag())
            outs.append(params + exp_avgs + exp_avg_sqs + model)
        table.add("fused_adam_", label, *outs, f"{STEPS} AdamW steps, inv_scale 1/64")


def _optimizer_outputs(make: Callable, side: Side, dtype, sizes) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(t) for t in side.put(random_list(sizes, dtype, seed=4))]
    optimizer = make(params)
    for k in range(STEPS):
        for p, g in zip(params, side.put(random_list(sizes, dtype, 0.1, seed=20 + k))):
            p.grad = g
        optimizer.step()
    states = [v for p in params for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return [p.detach() for p in params] + states


def fused_optimizers(table: Table, a: Side, b: Side, sizes):
    from apex_amp.optimizers import FusedAdagrad, FusedLAMB, FusedNovoGrad, FusedSGD

    makers = {
        "FusedSGD (momentum, nesterov)": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                                             weight_decay=1e-4),
        "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=0.1, weight_decay=1e-4),
        "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=1e-4),
        "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01),
    }
    for name, make in makers.items():
        for dtype_name in ("fp32", "bf16"):
            dtype = DTYPES[dtype_name]
            outs = [_optimizer_outputs(make, side, dtype, sizes) for side in (a, b)]
            reduction = " (per-tensor norms: a reduction)" if name in ("FusedNovoGrad", "FusedLAMB") else ""
            table.add(name, dtype_name, *outs, f"{STEPS} steps through the optimizer{reduction}")


def markdown(table: Table, a: Side, b: Side) -> str:
    lines = [f"{a.label} vs {b.label}, the same inputs; differences in units in the last place of each output's "
             "dtype (nvcc's default --fmad=true contracts a*b+c into one FMA: a few ulp are expected; "
             "reductions sum in another order).", "",
             "| op | dtype | elements that differ | max ulp | max diff in ulps of the largest value "
             "| inf/NaN mismatches | inputs |", "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['op']} | {r['dtype']} | {100 * r['differing_share']:.2f}% | {r['max_ulp']} "
              f"| {r['max_ulp_of_largest']:.2f} | {r['nonfinite_mismatches']} | {r['note']} |" for r in table.rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: CUDA vs CPU kernels; cpu: CPU kernels vs the fallback (no GPU needed)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a visible CUDA GPU")
    a, b = sides(args.device)
    table = Table()
    for section in (list_ops, update_scale, fused_adam, fused_optimizers):
        section(table, a, b, SIZES if args.device == "cuda" else CPU_SIZES)
    text = markdown(table, a, b)
    print(text)
    worst = max(table.rows, key=lambda r: r["max_ulp_of_largest"])
    identical = sum(1 for r in table.rows if r["differing_share"] == 0)
    summary = {"rows": table.rows, "identical_rows": identical, "max_ulp_of_largest": worst["max_ulp_of_largest"],
               "worst": f"{worst['op']} {worst['dtype']}", "failures": len(table.failures())}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if args.markdown:
        args.markdown.write_text(text + "\n")
    print(f"KEY: {identical}/{len(table.rows)} rows bit for bit; max diff {summary['max_ulp_of_largest']:.1f} ulps of "
          f"the largest value ({summary['worst']}); {summary['failures']} inf/NaN mismatches")
    return 1 if table.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
