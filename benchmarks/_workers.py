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

A process's own layout (where its allocator put the tensors, which cache sets its buffers share)
moves a small model's step by several percent from one process to the next, as much as the
differences being measured. ``replicas`` starts that many workers per configuration and pools
their steps, so that a ratio compares configurations rather than two processes' luck; the median
of each replica is kept so a report can show the spread between processes.
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
                       rounds: int, measure: bool = False, replicas: int = 1) -> dict[str, dict[str, Any]]:
    """Time every configuration in its own worker(s), in interleaved rounds.

    Each configuration runs ``reps`` steps in each of its ``replicas`` workers. Returns, per
    configuration, ``timing`` and ``cpu_timing`` (:class:`Timing` of all its workers' steps),
    ``replica_cpu_medians`` (each worker's median CPU time) and, with ``measure``, whatever the
    module's ``measure`` returned in its first worker (merged in).
    """
    context = multiprocessing.get_context("spawn")
    workers = {}
    slots = [(config, replica) for replica in range(replicas) for config in configs]
    for slot in slots:
        parent, child = context.Pipe()
        process = context.Process(target=_worker, args=(child, module_name, slot[0], model_name, args), daemon=True)
        process.start()
        workers[slot] = (process, parent)

    def ask(slot: tuple[str, int], message: tuple) -> Any:
        conn = workers[slot][1]
        conn.send(message)
        kind, value = conn.recv()
        if kind == "error":
            raise RuntimeError(f"{model_name} / {slot[0]} failed in its worker: {value}")
        return value

    try:
        for slot in slots:
            kind, value = workers[slot][1].recv()
            if kind == "error":
                raise RuntimeError(f"{model_name} / {slot[0]} failed to start: {value}")
        samples: dict[tuple[str, int], list] = {slot: [] for slot in slots}
        per_round = max(1, reps // rounds)
        for r in range(rounds):
            order = slots[r % len(slots):] + slots[:r % len(slots)]  # rotate: none always goes first
            for slot in order:
                samples[slot] += ask(slot, ("time", per_round))
        results: dict[str, dict[str, Any]] = {}
        for config in configs:
            mine = [samples[(config, replica)] for replica in range(replicas)]
            wall, cpu = zip(*(sample for steps in mine for sample in steps))
            results[config] = {"timing": Timing(wall), "cpu_timing": Timing(cpu),
                               "replica_cpu_medians": [Timing(tuple(c for _, c in steps)).median for steps in mine]}
            if measure:
                results[config].update(ask((config, 0), ("measure", None)))
        return results
    finally:
        for process, conn in workers.values():
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            process.join(timeout=30)
