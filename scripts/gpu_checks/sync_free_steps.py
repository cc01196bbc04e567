"""O1 and O2 training steps on the GPU under ``torch.cuda.set_sync_debug_mode("error")``.

A step of apex_amp (zero_grad, forward, loss, ``amp.scale_loss`` with its backward, the optimizer
step: overflow check, loss-scale update, FusedAdam's unscale and skip) must not wait for the GPU:
every decision stays on the device. After a few warm-up steps (the optimizer creates its state,
the loss scaler its buffers), the checked steps run with the sync debug mode at "error", under
which any operation that synchronises with the host raises. Each configuration (model, opt level,
half dtype) runs in its own process, because O1's casts are process-wide.

``--device cpu`` runs the same steps on the CPU (no sync check: what ``scripts/gpu_check.sh
--dry-run`` runs on a machine without a GPU, so this script is exercised there too).

Run: ``python scripts/gpu_checks/sync_free_steps.py [--device cuda|cpu] [--json PATH]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("digits", "transformer")
LEVELS = ("O1", "O2")
HALVES = ("float16", "bfloat16")
WARMUP_STEPS, CHECKED_STEPS = 3, 10


def run_one(model_name: str, level: str, half_name: str, device_name: str) -> dict:
    """One configuration, in this process: warm-up steps, then the checked ones."""
    sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
    import torch
    import torch.nn.functional as F

    from apex_amp import amp
    from apex_amp.optimizers import FusedAdam

    device = torch.device(device_name)
    torch.manual_seed(0)
    if model_name == "digits":
        import train_digits

        (x, y), _ = train_digits.load_data(0, device)
        x, y = (x[:256], y[:256]) if device.type == "cuda" else (x[:32], y[:32])
        model = train_digits.make_model(train_digits.HIDDEN_DEFAULT).to(device)

        def loss_of(m):
            return F.cross_entropy(m(x), y)
    else:
        import transformer

        # Tiny on the CPU (a dry run: the step's code, not its speed).
        d_model, context, batch = (256, 128, 16) if device.type == "cuda" else (32, 16, 2)
        model = transformer.make_model(d_model=d_model, heads=4, layers=2, context=context).to(device)
        ids = torch.randint(0, transformer.VOCAB_SIZE, (batch, context + 1), device=device)
        x, y = ids[:, :-1], ids[:, 1:]

        def loss_of(m):
            return transformer.lm_loss(m, x, y)

    optimizer = FusedAdam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, half_dtype=getattr(torch, half_name),
                                      verbosity=0)
    losses = []

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.detach())

    for _ in range(WARMUP_STEPS):
        step()
    checked = device.type == "cuda"
    if checked:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(CHECKED_STEPS):
            step()
    finally:
        if checked:
            torch.cuda.set_sync_debug_mode("default")
    values = [float(v) for v in losses]  # the host reads happen here, after the checked steps
    return {"model": model_name, "level": level, "half": half_name, "device": device_name,
            "sync_checked": checked, "first_loss": values[0], "last_loss": values[-1],
            "all_finite": all(v == v and abs(v) != float("inf") for v in values),
            "loss_scale": float(amp.state_dict()["loss_scaler0"]["loss_scale"])}


def run_in_subprocess(config: tuple[str, str, str], device: str) -> dict:
    command = [sys.executable, __file__, "--one", ",".join(config), "--device", device]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    result_lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not result_lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
        return {"model": config[0], "level": config[1], "half": config[2], "device": device, "error": "\n".join(tail)}
    return json.loads(result_lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", type=Path, help="write every configuration's result here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # model,level,half: run one configuration here
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(*args.one.split(","), args.device)))
        return 0
    configs = list(itertools.product(MODELS, LEVELS, HALVES))
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda c: run_in_subprocess(c, args.device), configs))
    failed = 0
    print("| model | level | half | steps without a host sync | loss first -> last | loss scale |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            failed += 1
            print(f"| {r['model']} | {r['level']} | {r['half']} | FAILED | | |")
            print("    " + r["error"].replace("\n", "\n    "))
            continue
        failed += not r["all_finite"]
        checked = f"{CHECKED_STEPS} checked" if r["sync_checked"] else "not checked (CPU)"
        print(f"| {r['model']} | {r['level']} | {r['half']} | {checked} | {r['first_loss']:.4f} -> "
              f"{r['last_loss']:.4f} | {r['loss_scale']:g} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    what = "sync-free" if args.device == "cuda" else "ran (no sync check on the CPU)"
    print(f"KEY: {len(results) - failed}/{len(results)} configurations {what}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
