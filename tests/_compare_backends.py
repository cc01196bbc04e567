"""Compare every op of the compiled extension with the fallback, in this process.

Run by tests/test_ops_isa.py once per CPU instruction set (the extension picks
its kernels once per process from ATEN_CPU_CAPABILITY). Prints one JSON object:
the capability torch reports and the list of disagreements found. The lengths
exercise the unrolled vector loop, the single-vector loop and the scalar tail.
"""

import json

import torch

from apex_amp import ops

SIZES = (1, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1031, 2 * 65536 + 7)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One fp32 rounding apart can become one ulp of a half-precision result.
HALF_TOLERANCE = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}

extension, fallback = ops.backend_namespace("extension"), ops.backend_namespace("fallback")
generator = torch.Generator()
problems: list[str] = []


def tensors(dtype, scale=1.0):
    return [(torch.randn(n, generator=generator) * scale).to(dtype) for n in SIZES]


def clone(ts):
    return [t.clone() for t in ts]


def flag(value=0.0):
    return torch.full((1,), value)


def compare(name, got, want, rtol=0.0, atol=0.0):
    for i, (g, w) in enumerate(zip(got, want)):
        tol = (rtol, atol)
        if rtol and g.dtype in HALF_TOLERANCE:
            tol = tuple(max(a, b) for a, b in zip(tol, HALF_TOLERANCE[g.dtype]))
        if not torch.allclose(g.float(), w.float(), rtol=tol[0], atol=tol[1], equal_nan=True):
            diff = (g.float() - w.float()).abs().nan_to_num(float("inf")).max().item()
            problems.append(f"{name}: tensor {i} ({g.dtype}, {g.numel()} elements) max diff {diff:g}")


def compare_list_ops(dtype):
    base = tensors(dtype, 100.0)
    for position in (0, 1030, 1028):
        poisoned = clone(base)
        poisoned[12][position] = float("nan")
        for name, namespace in (("extension", extension), ("fallback", fallback)):
            found_inf = flag()
            namespace.check_finite(poisoned, found_inf)
            if found_inf.item() != 1.0:
                problems.append(f"check_finite ({name}, {dtype}) missed a NaN at {position}")
    got, want = clone(base), clone(base)
    extension.unscale_(got, flag(), flag(1 / 3))
    fallback.unscale_(want, flag(), flag(1 / 3))
    compare(f"unscale_ {dtype}", got, want)
    for dst_dtype in DTYPES:
        got = [torch.empty_like(t, dtype=dst_dtype) for t in base]
        want = clone(got)
        extension.scale_(base, got, flag(0.75), flag())
        fallback.scale_(base, want, flag(0.75), flag())
        compare(f"scale_ {dtype}->{dst_dtype}", got, want)
        got = tensors(dst_dtype)
        want = clone(got)
        extension.axpby_(base, got, flag(0.01), 0.5, flag())
        fallback.axpby_(base, want, flag(0.01), 0.5, flag())
        compare(f"axpby_ {dtype}->{dst_dtype}", got, want, rtol=1e-6, atol=1e-6)
    compare(f"l2norm {dtype}", extension.l2norm(base, True), fallback.l2norm(base, True), rtol=1e-5)


def adam_run(namespace, param_dtype, grad_dtype, model_dtype, adamw_mode):
    generator.manual_seed(1)  # the same params and grads for both backends
    params = tensors(param_dtype)
    exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    model_params = [p.to(model_dtype) for p in params] if model_dtype is not None else []
    step = torch.zeros(1)
    for _ in range(3):
        grads = tensors(grad_dtype, 64.0)
        hyper = (1e-2, 0.9, 0.999, 1e-8, 0.01, adamw_mode, True)
        namespace.fused_adam_(
            params, grads, exp_avgs, exp_avg_sqs, model_params, [], [], step, *hyper, flag(1 / 64), flag()
        )
    return params + exp_avgs + exp_avg_sqs + model_params


def compare_fused_adam():
    for param_dtype, grad_dtype, model_dtype in (
        (torch.float32, torch.float32, None),
        (torch.float32, torch.float16, torch.float16),
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16, None),
    ):
        for adamw_mode in (False, True):
            got = adam_run(extension, param_dtype, grad_dtype, model_dtype, adamw_mode)
            want = adam_run(fallback, param_dtype, grad_dtype, model_dtype, adamw_mode)
            name = f"fused_adam_ params={param_dtype} grads={grad_dtype} adamw={adamw_mode}"
            compare(name, got, want, rtol=1e-5, atol=1e-6)


def main():
    generator.manual_seed(0)
    for dtype in DTYPES:
        compare_list_ops(dtype)
    compare_fused_adam()
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "problems": problems}))


if __name__ == "__main__":
    main()
