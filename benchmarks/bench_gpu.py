"""apex_amp on a CUDA GPU against torch's own fused path, measured in the same run.

Sections:
  kernels   on a transformer-like list of tensors (the shapes of bench_kernels.py) at each size:
            the O2 optimizer step in bf16 and fp16 (apex_amp: check_finite + fused_adam_ with the
            unscale folded in, fp32 masters and the half model copy written in the same pass;
            torch: _amp_foreach_non_finite_check_and_unscale_ on the half grads, a copy into fp32
            master grads, _fused_adamw_ told about found_inf, a copy back into the half model),
            fp32 AdamW (fused_adam_ vs _fused_adamw_, and FusedAdam.step() vs
            AdamW(fused=True).step()), FusedSGD / FusedAdagrad vs torch's fused SGD / Adagrad,
            FusedLAMB and FusedNovoGrad (no fused peer in torch: against the bound only), and the
            overflow check (check_finite, unscale_ vs _amp_foreach_non_finite_check_and_unscale_).
            Each row: median time (CUDA events), the bound (bytes moved per element / the
            bandwidth of a device-to-device copy measured in the same run), and the peer's ratio.
  training  one training step of a GPT-2-small-sized model (12 layers, d_model 768, 12 heads,
            vocabulary 50304, context 1024, batch 8: about 163M parameters) for torch.amp
            (autocast, fused AdamW, GradScaler with fp16), apex_amp O1 and O2 (FusedAdam), in bf16
            and fp16, and O2 with fp8 GEMMs where the GPU has fp8 (sm_89+). Each configuration
            runs in its own process (O1's casts are process-wide), one after another: median step
            time over the timed steps and the peak of torch.cuda.max_memory_allocated.

``--device cpu`` runs everything tiny on the CPU (timings meaningless): the dry run of
scripts/gpu_check.sh uses it so the script is exercised on a machine without a GPU.

Run (from the repository root, apex_amp built with its CUDA kernels):
    python benchmarks/bench_gpu.py kernels --sizes 16M,64M
    python benchmarks/bench_gpu.py training --steps 10
    python benchmarks/bench_gpu.py all --json /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "examples")]

from _kernel_workloads import BETAS, EPS, LR, WEIGHT_DECAY, transformer_like_shapes  # noqa: E402

SIZE_SUFFIX = {"K": 10**3, "M": 10**6}
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_size(text: str) -> int:
    return int(float(text[:-1]) * SIZE_SUFFIX[text[-1]]) if text[-1] in SIZE_SUFFIX else int(text)


# ----------------------------------------------------------------------------- timing


class Timer:
    """Median milliseconds of ``fn`` over ``reps`` calls after ``warmup`` (CUDA events on a GPU)."""

    def __init__(self, device: torch.device, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            import time

            samples = []
            for _ in range(self.reps):
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e3)
            return statistics.median(samples)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.reps)]
        torch.cuda.synchronize()
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)


def copy_bandwidth(device: torch.device, timer: Timer, megabytes: int) -> float:
    """Bytes per millisecond of a device-to-device copy (bytes read + bytes written)."""
    source = torch.empty(megabytes * 2**20 // 4, device=device)
    source.uniform_()
    target = torch.empty_like(source)
    milliseconds = timer(lambda: target.copy_(source))
    return 2 * source.numel() * 4 / milliseconds


# ----------------------------------------------------------------------------- kernels


def tensors(shapes, dtype, device, fill: str, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seed)
    if fill == "zeros":
        return [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
    scale = {"param": 0.02, "grad": 1e-3}[fill]
    return [(torch.randn(s, generator=generator, device=device) * scale).to(dtype) for s in shapes]


def with_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    leaves = [torch.nn.Parameter(p) for p in params]
    for leaf, grad in zip(leaves, grads):
        leaf.grad = grad
    return leaves


def kernel_rows(shapes, device: torch.device, timer: Timer) -> list[dict]:
    """Every kernel row at one size: name, bytes per element, apex_amp ms, peer name and ms."""
    from apex_amp import ops as amp_ops
    from apex_amp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

    ops = amp_ops.backend_namespace()  # the op namespace itself: positional arguments, no wrapper's Python
    rows = []
    flag = lambda value=0.0: torch.full((1,), value, device=device)  # noqa: E731

    def row(name, bytes_per_element, apex_fn, peer_name=None, peer_fn=None, peer_bytes=None):
        rows.append({"name": name, "bytes_per_element": bytes_per_element, "apex_ms": timer(apex_fn),
                     "peer": peer_name, "peer_ms": timer(peer_fn) if peer_fn else None,
                     "peer_bytes_per_element": peer_bytes})

    # The O2 step: 2 B half grad read twice (check, step), 4+4 master, 4+4 + 4+4 moments, 2 B copy.
    for half_name, half in HALF.items():
        model = tensors(shapes, half, device, "param", 1)
        masters = [t.float() for t in model]
        grads = tensors(shapes, half, device, "grad", 2)
        m, v = tensors(shapes, torch.float32, device, "zeros", 0), tensors(shapes, torch.float32, device, "zeros", 0)
        step, found_inf, inv_scale = flag(), flag(), flag(1.0)

        def apex_o2():
            found_inf.zero_()
            ops.check_finite(grads, found_inf)
            ops.fused_adam_(masters, grads, m, v, model, [], [], step, LR, *BETAS, EPS, WEIGHT_DECAY, True, True,
                            inv_scale, found_inf)

        t_model = tensors(shapes, half, device, "param", 1)
        t_masters = with_grads([t.float() for t in t_model], tensors(shapes, torch.float32, device, "zeros", 0))
        t_grads = tensors(shapes, half, device, "grad", 2)
        t_m, t_v = tensors(shapes, torch.float32, device, "zeros", 0), tensors(shapes, torch.float32, device, "zeros", 0)
        t_steps = [flag() for _ in shapes]
        t_found, t_inv = flag(), flag(1.0)
        master_grads = [p.grad for p in t_masters]

        def torch_o2():
            # The half grads into the fp32 master grads first: torch's unscale has no bf16 kernel on CUDA.
            t_found.zero_()
            torch._foreach_copy_(master_grads, t_grads)
            torch._amp_foreach_non_finite_check_and_unscale_(master_grads, t_found, t_inv)
            torch._fused_adamw_(t_masters, master_grads, t_m, t_v, [], t_steps, lr=LR, beta1=BETAS[0],
                                beta2=BETAS[1], weight_decay=WEIGHT_DECAY, eps=EPS, amsgrad=False, maximize=False,
                                found_inf=t_found)
            torch._foreach_copy_(t_model, t_masters)

        row(f"O2 step {half_name}", 30, apex_o2, "torch: copy + unscale + _fused_adamw_ + copy", torch_o2, 48)

    params = tensors(shapes, torch.float32, device, "param", 3)
    grads32 = tensors(shapes, torch.float32, device, "grad", 4)
    m32, v32 = tensors(shapes, torch.float32, device, "zeros", 0), tensors(shapes, torch.float32, device, "zeros", 0)
    step32 = flag()
    t_params = with_grads(tensors(shapes, torch.float32, device, "param", 3), tensors(shapes, torch.float32, device,
                                                                                      "grad", 4))
    t_adam = torch.optim.AdamW(t_params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    t_adam.step()
    t_state = [t_adam.state[p] for p in t_params]
    row("fp32 AdamW op", 28,
        lambda: ops.fused_adam_(params, grads32, m32, v32, [], [], [], step32, LR, *BETAS, EPS, WEIGHT_DECAY, True, True,
                                None, None),
        "torch._fused_adamw_",
        lambda: torch._fused_adamw_(t_params, [p.grad for p in t_params], [s["exp_avg"] for s in t_state],
                                    [s["exp_avg_sq"] for s in t_state], [], [s["step"] for s in t_state], lr=LR,
                                    beta1=BETAS[0], beta2=BETAS[1], weight_decay=WEIGHT_DECAY, eps=EPS,
                                    amsgrad=False, maximize=False), 28)

    def optimizer_pair(name, bytes_per_element, make_apex, make_torch=None, peer_name=None):
        apex_opt = make_apex(with_grads(tensors(shapes, torch.float32, device, "param", 5),
                                        tensors(shapes, torch.float32, device, "grad", 6)))
        apex_opt.step()
        peer = None
        if make_torch is not None:
            try:
                peer = make_torch(with_grads(tensors(shapes, torch.float32, device, "param", 5),
                                             tensors(shapes, torch.float32, device, "grad", 6)))
                peer.step()
            except RuntimeError as error:  # e.g. torch 2.11's fused Adagrad: CPU only
                peer, peer_name = None, f"{peer_name}: not available here ({str(error)[:60]}...)"
        row(name, bytes_per_element, apex_opt.step, peer_name, peer.step if peer else None,
            bytes_per_element)

    optimizer_pair("FusedAdam.step() fp32", 28, lambda ps: FusedAdam(ps, lr=LR, weight_decay=WEIGHT_DECAY),
                   lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, fused=True),
                   "AdamW(fused=True).step()")
    optimizer_pair("FusedSGD.step() momentum", 20, lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
                   lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True), "SGD(fused=True).step()")
    optimizer_pair("FusedAdagrad.step()", 20, lambda ps: FusedAdagrad(ps, lr=0.1),
                   lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True), "Adagrad(fused=True).step()")
    optimizer_pair("FusedLAMB.step()", 28, lambda ps: FusedLAMB(ps, lr=1e-3))
    optimizer_pair("FusedNovoGrad.step()", 20, lambda ps: FusedNovoGrad(ps, lr=1e-3))

    for half_name, half in HALF.items():
        check_grads = tensors(shapes, half, device, "grad", 7)
        found = flag()
        peer_grads = tensors(shapes, half, device, "grad", 7)
        inv_cycle = [flag(0.5), flag(2.0)]
        turn = [0]

        def next_inv():
            turn[0] ^= 1
            return inv_cycle[turn[0]]

        row(f"check_finite {half_name}", 2, lambda: ops.check_finite(check_grads, found))
        # torch's fused unscale has no bf16 kernel on CUDA: no peer there.
        has_peer = half == torch.float16 or device.type == "cpu"
        row(f"unscale_ {half_name}", 4, lambda: ops.unscale_(check_grads, found, next_inv()),
            "torch._amp_foreach_non_finite_check_and_unscale_" if has_peer else None,
            (lambda: torch._amp_foreach_non_finite_check_and_unscale_(peer_grads, found, next_inv()))
            if has_peer else None, 4)
    return rows


def run_kernels(args, device: torch.device) -> dict:
    timer = Timer(device, args.reps, args.warmup)
    bandwidth = copy_bandwidth(device, timer, args.bandwidth_mb)  # bytes per ms
    result = {"copy_bandwidth_gb_s": bandwidth / 1e6, "sizes": {}}
    for size_text in args.sizes.split(","):
        shapes, description = transformer_like_shapes(parse_size(size_text))
        elements = sum(torch.Size(s).numel() for s in shapes)
        rows = kernel_rows(shapes, device, timer)
        for r in rows:
            r["bound_ms"] = r["bytes_per_element"] * elements / bandwidth
        result["sizes"][size_text] = {"description": description, "elements": elements, "rows": rows}
    result["bandwidth_after_gb_s"] = copy_bandwidth(device, timer, args.bandwidth_mb) / 1e6
    return result


def kernel_table(result: dict) -> list[str]:
    lines = [f"device-to-device copy: {result['copy_bandwidth_gb_s']:.0f} GB/s before the rows, "
             f"{result['bandwidth_after_gb_s']:.0f} GB/s after (bytes read + written)", "",
             "| size | kernel | B/elem | apex_amp ms | x bound | peer | peer ms | peer / apex_amp |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for size, block in result["sizes"].items():
        for r in block["rows"]:
            peer = r["peer"] or "-"
            peer_ms = f"{r['peer_ms']:.3f}" if r["peer_ms"] is not None else "-"
            ratio = f"{r['peer_ms'] / r['apex_ms']:.2f}" if r["peer_ms"] is not None else "-"
            lines.append(f"| {size} | {r['name']} | {r['bytes_per_element']} | {r['apex_ms']:.3f} "
                         f"| {r['apex_ms'] / r['bound_ms']:.2f} | {peer} | {peer_ms} | {ratio} |")
    return lines


# ----------------------------------------------------------------------------- training

TRAINING_CONFIGS = [("torch.amp", "bf16"), ("apex O1", "bf16"), ("apex O2", "bf16"), ("apex O2 fp8", "bf16"),
                    ("torch.amp", "fp16"), ("apex O1", "fp16"), ("apex O2", "fp16")]


def model_size(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"d_model": 768, "heads": 12, "layers": 12, "context": 1024, "vocab_size": 50304, "batch": 8}
    return {"d_model": 64, "heads": 4, "layers": 1, "context": 32, "vocab_size": 128, "batch": 2}


def train_one(config: str, half_name: str, device_name: str, steps: int, warmup: int) -> dict:
    """One configuration's step time and peak memory, in this process."""
    import transformer

    from apex_amp import amp
    from apex_amp.optimizers import FusedAdam

    device, half = torch.device(device_name), HALF[half_name]
    size = model_size(device)
    torch.manual_seed(0)
    model = transformer.make_model(size["d_model"], size["heads"], size["layers"], size["context"],
                                   size["vocab_size"]).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, size["vocab_size"], (size["batch"], size["context"] + 1), device=device)
    x, y = ids[:, :-1], ids[:, 1:]
    if config.startswith("apex"):
        optimizer = FusedAdam(model.parameters(), lr=1e-4)
        level = config.split()[1]
        model, optimizer = amp.initialize(model, optimizer, opt_level=level, half_dtype=half, verbosity=0,
                                          fp8=True if config.endswith("fp8") else None)

        def step():
            optimizer.zero_grad(set_to_none=True)
            loss = transformer.lm_loss(model, x, y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            return loss
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        scaler = torch.amp.GradScaler(device.type) if half == torch.float16 else None

        def step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=half):
                loss = transformer.lm_loss(model, x, y)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            return loss

    timer = Timer(device, steps, warmup)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses = []
    milliseconds = timer(lambda: losses.append(step().detach()))
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return {"config": config, "half": half_name, "parameters": parameters, "step_ms": milliseconds,
            "peak_mib": peak / 2**20, "first_loss": float(losses[0]), "last_loss": float(losses[-1])}


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9)


def run_training(args, device: torch.device) -> dict:
    results = []
    for config, half_name in TRAINING_CONFIGS:
        if config.endswith("fp8") and not fp8_supported(device):
            results.append({"config": config, "half": half_name, "error": "no fp8 on this GPU (sm_89+ needed)"})
            continue
        command = [sys.executable, __file__, "--one", f"{config},{half_name}", "--device", device.type,
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.config_timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            error = " / ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            results.append({"config": config, "half": half_name, "error": error[-400:]})
        else:
            results.append(json.loads(lines[-1][len("RESULT "):]))
    return {"model": model_size(device), "configs": results}


def training_table(result: dict) -> list[str]:
    size = result["model"]
    lines = [f"model: {size['layers']} layers, d_model {size['d_model']}, {size['heads']} heads, context "
             f"{size['context']}, vocabulary {size['vocab_size']}, batch {size['batch']}", "",
             "| configuration | half | step ms | / torch.amp | peak MiB | loss first -> last |",
             "| --- | --- | --- | --- | --- | --- |"]
    baseline = {r["half"]: r["step_ms"] for r in result["configs"] if r["config"] == "torch.amp" and "step_ms" in r}
    bf16_o2 = next((r["step_ms"] for r in result["configs"] if r["config"] == "apex O2" and r["half"] == "bf16"
                    and "step_ms" in r), None)
    for r in result["configs"]:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['half']} | failed: {r['error']} | | | |")
            continue
        versus = f"{r['step_ms'] / baseline[r['half']]:.2f}" if r["half"] in baseline else "-"
        if r["config"].endswith("fp8") and bf16_o2:
            versus += f" ({r['step_ms'] / bf16_o2:.2f} x bf16 O2)"
        lines.append(f"| {r['config']} | {r['half']} | {r['step_ms']:.2f} | {versus} | {r['peak_mib']:.0f} "
                     f"| {r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
    return lines


# ----------------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", nargs="?", choices=("kernels", "training", "all"), default="all")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: everything tiny, to exercise the script without a GPU")
    parser.add_argument("--sizes", default=None, help="kernel sizes (default 16M,64M on cuda, 64K on cpu)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per kernel (default 20; 3 on cpu)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls or steps first (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="timed training steps (default 10; 2 on cpu)")
    parser.add_argument("--bandwidth-mb", type=int, default=None, help="copy buffer (default 1024 MiB; 16 on cpu)")
    parser.add_argument("--config-timeout", type=float, default=120.0, help="seconds per training configuration")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # "config,half": one training configuration here
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    args.sizes = args.sizes or ("64K" if cpu else "16M,64M")
    args.reps = args.reps or (3 if cpu else 20)
    args.steps = args.steps or (2 if cpu else 10)
    args.bandwidth_mb = args.bandwidth_mb or (16 if cpu else 1024)
    if args.one:
        config, half_name = args.one.split(",")
        print("RESULT " + json.dumps(train_one(config, half_name, args.device, args.steps, args.warmup)))
        return 0
    if not cpu and not torch.cuda.is_available():
        parser.error("--device cuda needs a visible CUDA GPU (use --device cpu to exercise the script)")
    device = torch.device(args.device)
    if not cpu:
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    results, lines, key = {}, [], []
    if args.section in ("kernels", "all"):
        results["kernels"] = run_kernels(args, device)
        lines += kernel_table(results["kernels"]) + [""]
        largest = list(results["kernels"]["sizes"].values())[-1]["rows"]
        o2 = next(r for r in largest if r["name"] == "O2 step bf16")
        key.append(f"O2 bf16 step {o2['apex_ms'] / o2['bound_ms']:.2f}x its bound, torch's "
                   f"{o2['peer_ms'] / o2['apex_ms']:.2f}x apex_amp's time")
    if args.section in ("training", "all"):
        results["training"] = run_training(args, device)
        lines += training_table(results["training"])
        done = [r for r in results["training"]["configs"] if "step_ms" in r]
        failed = len(results["training"]["configs"]) - len(done)
        key.append(f"training {len(done)} configs ok" + (f", {failed} failed" if failed else ""))
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print("KEY: " + "; ".join(key))
    training_failed = any("error" in r and "no fp8" not in r["error"]
                          for r in results.get("training", {}).get("configs", []))
    return 1 if training_failed else 0


if __name__ == "__main__":
    sys.exit(main())
