"""One process per configuration, driven in interleaved rounds: shared by bench_training.py and bench_overhead.py.

amp.initialize changes process-wide state (O1 turns its casts on, and its autocast kernels also
change plain torch.autocast), so every configuration runs in its own worker process. The workers
are started at once and asked for a few timed steps each in turn, round after round, in a rotating
order, so that a change of load on the machine hits every configuration alike. A step is timed in
wall time and in the CPU time of the worker's thread (``time.thread_time``): with one thread every
op of a step runs on that thread (autograd's CPU backward included), so its CPU time is the step's
work without the waits for a core that other processes on a shared machine cause.

A benchmark script names a module with ``build_step(config, model_name, args) -> (step, objects)``;
the worker imports it (spawned workers cannot receive functions) and may also run that module's
``measure(step, objects) -> dict`` when the driver asks for extra measurements.
"""

from __future__ import annotations

import importlib
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from _timing import Timing

__all__ = ["run_configurations"]

HERE = Path(__file__).resolve().parent


def _worker(conn, module_name: str, config: str, model_name: str, args: dict) -> None:
    sys.path[:0] = [str(HERE), str(HERE.parent / "examples"), str(HERE.parent)]
    torch.set_num_threads(args["threads"])
    try:
        module = importlib.import_module(module_name)
        step, objects = module.build_step(config, model_name, args)
        for _ in range(args["warmup"]):
            step()
        conn.send(("ready", None))
        while True:
            command, value = conn.recv()
            if command == "time":
                samples = []
                for _ in range(value):
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    step()
                    samples.append((time.perf_counter() - start, time.thread_time() - start_cpu))
                conn.send(("samples", samples))
            elif command == "measure":
                conn.send(("measured", module.measure(step, objects)))
            else:
                break
    except Exception as error:  # report it to the parent instead of hanging it
        conn.send(("error", f"{type(error).__name__}: {error}"))
    conn.close()


def run_configurations(module_name: str, configs: Sequence[str], model_name: str, args: dict, *, reps: int,
                       rounds: int, measure: bool = False) -> dict[str, dict[str, Any]]:
    """Time every configuration in its own worker, in interleaved rounds.

    Returns, per configuration, ``timing`` and ``cpu_timing`` (:class:`Timing` of the steps) and,
    with ``measure``, whatever the module's ``measure`` returned (merged in).
    """
    context = multiprocessing.get_context("spawn")
    workers = {}
    for config in configs:
        parent, child = context.Pipe()
        process = context.Process(target=_worker, args=(child, module_name, config, model_name, args), daemon=True)
        process.start()
        workers[config] = (process, parent)

    def ask(config: str, message: tuple) -> Any:
        conn = workers[config][1]
        conn.send(message)
        kind, value = conn.recv()
        if kind == "error":
            raise RuntimeError(f"{model_name} / {config} failed in its worker: {value}")
        return value

    try:
        for config in configs:
            kind, value = workers[config][1].recv()
            if kind == "error":
                raise RuntimeError(f"{model_name} / {config} failed to start: {value}")
        samples: dict[str, list] = {config: [] for config in configs}
        per_round = max(1, reps // rounds)
        configs = list(configs)
        for r in range(rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]  # rotate: none always goes first
            for config in order:
                samples[config] += ask(config, ("time", per_round))
        results: dict[str, dict[str, Any]] = {}
        for config in configs:
            wall, cpu = zip(*samples[config])
            results[config] = {"timing": Timing(wall), "cpu_timing": Timing(cpu)}
            if measure:
                results[config].update(ask(config, ("measure", None)))
        return results
    finally:
        for process, conn in workers.values():
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            process.join(timeout=30)
