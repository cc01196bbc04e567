"""Per-step cost of apex_amp O1 against torch.autocast and plain fp32, on small models.

Two models, one full training step each (zero_grad, forward, loss, backward, SGD step):
  * a 50-layer MLP (Linear + ReLU, width 64, batch 64): many tiny ops, so any per-op
    overhead of the casting machinery shows;
  * a small transformer encoder (2 layers, d_model 64, 4 heads, sequence 32, batch 8):
    linear, layer_norm, softmax/attention, gelu, the ops where O1's rules differ from torch's
    CPU policy.

Variants, timed in interleaved rounds (each round runs every variant ``reps / rounds`` times)
so a change of machine load hits all of them:
  * ``fp32``: no autocast;
  * ``torch.autocast``: forward and loss inside ``torch.autocast(device, half_dtype)``;
  * ``apex_amp O1``: ``casting.activate(half_dtype)`` is in effect for the whole round (as after
    ``amp.initialize``); forward and loss run with the O1 rules, backward and
    ``optimizer.step()`` under ``disable_casts()`` (what the frontend's ``scale_loss`` block
    does), then ``clear_cache()``;
  * ``O1, backward with casts on``: the same, but ``backward()`` runs with O1 casting on, as
    when a user calls it outside ``scale_loss``. Autograd runs backward with the caller's
    autocast state, so the O1 Python kernels are entered from the backward pass, where each
    call costs far more than in forward (the GIL is re-taken from the autograd engine).

O1 is activated only for its own variant's turn in each round, because activation is
process-wide and would otherwise change the other two variants.

Usage: ``python benchmarks/bench_o1_overhead.py [--threads 1] [--reps 60] [--rounds 20]
[--dtype bf16|fp16] [--json out.json]`` (defaults: 60 steps in 20 rounds). bf16 on CPU by default (CPU fp16 matmuls are very slow).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _timing import Timing, format_table, machine_info  # noqa: E402

from apex_amp.amp import casting  # noqa: E402

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mlp_problem(device):
    torch.manual_seed(0)
    layers = []
    for _ in range(50):
        layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 10)).to(device)
    x = torch.randn(64, 64, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    return model, x, y


class TinyTransformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 64)
        layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, activation="gelu",
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(dim=1))


def transformer_problem(device):
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    x = torch.randn(8, 32, 16, device=device)
    y = torch.randint(0, 10, (8,), device=device)
    return model, x, y


def make_steps(model, x, y, device, half_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def fp32_step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    def autocast_step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, half_dtype):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    def o1_step():
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        with casting.disable_casts():  # the frontend's scale_loss block: backward, then step
            loss.backward()
            optimizer.step()
        casting.clear_cache()

    def o1_step_backward_cast():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        with casting.disable_casts():
            optimizer.step()
        casting.clear_cache()

    @contextlib.contextmanager
    def o1_active():
        casting.activate(half_dtype)
        try:
            yield
        finally:
            casting.deactivate()

    return {"fp32": (fp32_step, contextlib.nullcontext),
            "torch.autocast": (autocast_step, contextlib.nullcontext),
            "apex_amp O1": (o1_step, o1_active),
            "O1, backward with casts on": (o1_step_backward_cast, o1_active)}


def time_rounds(variants, *, warmup, reps, rounds, sync):
    """Per-step wall times and this thread's CPU times, per variant, interleaved in rounds.

    CPU time (``time.thread_time``) leaves out the time the thread waits for a core, so on a
    shared, loaded machine it is the steadier of the two; both are reported.
    """
    wall = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    for round_index in range(rounds):
        calls = reps // rounds + (1 if round_index < reps % rounds else 0)
        for name, (step, context) in variants.items():
            with context():
                for _ in range(warmup if round_index == 0 else 1):
                    step()
                for _ in range(calls):
                    sync()
                    wall_start, cpu_start = time.perf_counter(), time.thread_time()
                    step()
                    sync()
                    wall[name].append(time.perf_counter() - wall_start)
                    cpu[name].append(time.thread_time() - cpu_start)
    return ({name: Timing(tuple(v)) for name, v in wall.items()},
            {name: Timing(tuple(v)) for name, v in cpu.items()})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise)")
    parser.add_argument("--reps", type=int, default=60, help="timed steps per variant")
    parser.add_argument("--rounds", type=int, default=20, help="interleaving rounds")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    half_dtype = _DTYPES[args.dtype]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    results = {"machine": machine_info(), "dtype": args.dtype, "device": args.device, "models": {}}
    rows = []
    for model_name, problem in (("MLP-50", mlp_problem), ("transformer-2", transformer_problem)):
        model, x, y = problem(args.device)
        wall, cpu = time_rounds(make_steps(model, x, y, args.device, half_dtype), warmup=5, reps=args.reps,
                                rounds=args.rounds, sync=sync)
        for name in wall:
            rows.append([model_name, name,
                         f"{wall[name].median * 1e3:.3f}", f"{wall[name].iqr * 1e3:.3f}",
                         f"{wall[name].median / wall['torch.autocast'].median:.3f}x",
                         f"{cpu[name].median * 1e3:.3f}",
                         f"{cpu[name].median / cpu['torch.autocast'].median:.3f}x",
                         f"{cpu[name].median / cpu['fp32'].median:.3f}x"])
        results["models"][model_name] = {name: {"wall": wall[name].to_json(), "cpu": cpu[name].to_json()}
                                         for name in wall}
    print(f"apex_amp O1 overhead, {args.dtype} on {args.device}, {args.threads} thread(s), "
          f"{args.reps} steps per variant in {args.rounds} interleaved rounds")
    print(f"load average (1/5/15 min): {results['machine']['load_average_1_5_15min']}")
    print(format_table(["model", "variant", "wall ms", "wall IQR", "wall vs autocast", "CPU ms",
                        "CPU vs autocast", "CPU vs fp32"], rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
