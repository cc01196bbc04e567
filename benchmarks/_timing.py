"""Timing, memory-bandwidth and reporting helpers shared by the scripts in benchmarks/.

Every benchmark script in this folder is run as ``python benchmarks/<name>.py``,
which puts this folder on ``sys.path``, so a script imports these helpers with
``from _timing import ...``. Nothing here imports apex_amp: the helpers time any
callable.

Methodology they implement:
  * each call is timed on its own with ``time.perf_counter`` after a device
    synchronisation (``sync``), so a sample is one call and the spread is real;
  * the report is the median and the inter-quartile range (IQR) of the samples;
  * competing implementations are timed interleaved, in rounds, so that a
    change of machine load during the run hits all of them alike;
  * a kernel's bound is ``bytes moved per element / measured bandwidth``: the
    time it would take if it did nothing but stream its data once, at the best
    bandwidth any of several access patterns reached (``Bandwidth``), timed
    in the same rounds as the kernels where the machine's bandwidth drifts
    (``BandwidthProbes``).

Example::

    from _timing import Bandwidth, time_interleaved, format_table

    bandwidth = Bandwidth.measure(buffer_mb=512)
    timings = time_interleaved({"mine": run_mine, "theirs": run_theirs}, warmup=3, reps=15)
    mine = timings["mine"]
    print(mine.median * 1e3, "ms;", mine.ns_per(elements), "ns/element;",
          bandwidth.bound_multiple(mine.median, elements, bytes_per_element=28))
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch

from _stream_probe import PATTERNS, StreamProbe

__all__ = [
    "Timing",
    "Bandwidth",
    "BandwidthProbes",
    "time_call",
    "time_interleaved",
    "cache_rotation_count",
    "last_level_cache_bytes",
    "parallel_region_latency",
    "machine_info",
    "format_table",
    "print_targets",
    "finish_run",
]


def _no_sync() -> None:
    pass


@dataclasses.dataclass(frozen=True)
class Timing:
    """The per-call wall times (seconds) of one implementation, with their summary."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def q1(self) -> float:
        return _quantile(self.samples, 0.25)

    @property
    def q3(self) -> float:
        return _quantile(self.samples, 0.75)

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    def ns_per(self, elements: int) -> float:
        """Median nanoseconds per element of a call that touches ``elements`` elements."""
        return self.median * 1e9 / max(elements, 1)

    def to_json(self) -> dict:
        return {"median_s": self.median, "q1_s": self.q1, "q3_s": self.q3, "samples_s": list(self.samples)}


def _quantile(samples: Sequence[float], q: float) -> float:
    # Linear interpolation between order statistics (numpy's default), without numpy.
    ordered = sorted(samples)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def time_call(fn: Callable[[], object], *, warmup: int, reps: int, sync: Callable[[], None] = _no_sync) -> Timing:
    """Time ``reps`` calls of ``fn`` one by one after ``warmup`` untimed calls.

    Args:
        fn: the call to time, with its inputs already bound.
        warmup: untimed calls first (first-touch page faults, lazy state, caches of the allocator).
        reps: timed calls; each is one sample.
        sync: waits for queued device work (e.g. ``torch.cuda.synchronize``); a no-op on CPU.
    """
    return time_interleaved({"fn": fn}, warmup=warmup, reps=reps, rounds=1, sync=sync)["fn"]


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    warmup: int,
    reps: int,
    rounds: int = 3,
    sync: Callable[[], None] = _no_sync,
) -> dict[str, Timing]:
    """Time several implementations of the same work, interleaved in rounds.

    Each implementation gets ``warmup`` untimed calls, then ``rounds`` rounds in
    which every implementation makes ``reps / rounds`` timed calls in turn, so a
    change of load on a shared machine spreads over all of them.

    Args:
        fns: name -> call with its inputs bound.
        warmup: untimed calls per implementation before the first round.
        reps: timed calls per implementation in total (at least ``rounds``).
        rounds: how many times to cycle through the implementations.
        sync: waits for queued device work before and after each timed call.

    Returns:
        name -> :class:`Timing`, in the order of ``fns``.
    """
    if reps < 1 or rounds < 1:
        raise ValueError(f"reps and rounds must be at least 1, got reps={reps}, rounds={rounds}")
    rounds = min(rounds, reps)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    per_round = [reps // rounds + (1 if r < reps % rounds else 0) for r in range(rounds)]
    for calls in per_round:
        for name, fn in fns.items():
            for _ in range(calls):
                sync()
                start = time.perf_counter()
                fn()
                sync()
                samples[name].append(time.perf_counter() - start)
    return {name: Timing(tuple(values)) for name, values in samples.items()}


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """The machine's streaming memory bandwidth (GB/s = 1e9 bytes/s) over several access patterns.

    A bound must be an upper bound for every kernel it judges, so it is the best
    bandwidth of any pattern measured, with the kernels' thread count: torch's own
    streaming ops and, where a C++ compiler is available, probes that stream
    exactly the kernels' patterns (``_stream_probe.py``: Adam's four reads and
    three writes, the O2 step's, ...).

    Attributes:
        patterns: GB/s of each pattern measured, by name (bytes counted once per
            element and stream; a store's write-allocate read is not counted).
        read_only: the names of the read-only patterns among them.
        buffer_mb: size of each buffer (MiB, several times the last-level cache).
        note: why the C++ probes did not run, if they did not.
    """

    patterns: dict
    read_only: tuple
    buffer_mb: int
    note: str = ""

    @property
    def rw_gbs(self) -> float:
        """The bound of kernels that write: the best of the read-write patterns."""
        return max(gbs for name, gbs in self.patterns.items() if name not in self.read_only)

    @property
    def read_gbs(self) -> float:
        """The bound of read-only kernels (a finite check): the best of the read-only patterns."""
        return max(gbs for name, gbs in self.patterns.items() if name in self.read_only)

    @classmethod
    def measure(cls, *, buffer_mb: int = 512, reps: int = 15, sync: Callable[[], None] = _no_sync,
                build_dir: Optional[Path] = None) -> "Bandwidth":
        """Measure every pattern on ``buffer_mb`` MiB fp32 buffers with torch's current threads."""
        return BandwidthProbes(buffer_mb=buffer_mb, build_dir=build_dir).measure(reps=reps, sync=sync)

    def best_with(self, other: "Bandwidth") -> "Bandwidth":
        """Each pattern's better figure of two measurements (of the same buffers; either may lack patterns)."""
        patterns = dict(other.patterns)
        for name, gbs in self.patterns.items():
            patterns[name] = max(gbs, patterns.get(name, 0.0))
        read_only = tuple(dict.fromkeys(self.read_only + other.read_only))
        return dataclasses.replace(self, patterns=patterns, read_only=read_only)

    def bound_seconds(self, elements: int, bytes_per_element: float, *, read_only: bool = False) -> float:
        """The time a kernel moving ``bytes_per_element`` per element would take at the best bandwidth."""
        gbs = self.read_gbs if read_only else self.rw_gbs
        return elements * bytes_per_element / (gbs * 1e9)

    def bound_multiple(self, seconds: float, elements: int, bytes_per_element: float, *, read_only: bool = False) -> float:
        """``seconds`` as a multiple of the bound (1.0 = streaming speed; lower is impossible from DRAM)."""
        return seconds / self.bound_seconds(elements, bytes_per_element, read_only=read_only)

    def describe(self) -> str:
        """One line per pattern, the bounds marked."""
        lines = []
        for name, gbs in sorted(self.patterns.items(), key=lambda item: -item[1]):
            mark = ""
            if gbs == self.rw_gbs and name not in self.read_only:
                mark = "  <- bound of read-write kernels"
            elif gbs == self.read_gbs and name in self.read_only:
                mark = "  <- bound of read-only kernels (r)"
            lines.append(f"    {name:<44} {gbs:7.1f} GB/s{mark}")
        if self.note:
            lines.append(f"    ({self.note})")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"patterns_gbs": self.patterns, "read_only": list(self.read_only), "rw_bound_gbs": self.rw_gbs,
                "read_bound_gbs": self.read_gbs, "buffer_mb": self.buffer_mb, "note": self.note}


class BandwidthProbes:
    """The access patterns ``Bandwidth`` measures, on buffers allocated once and kept.

    Keeping them lets a benchmark time the patterns again and again during a run,
    alone (:meth:`measure`) or interleaved with the kernels they bound (:meth:`calls`
    into ``time_interleaved``, then :meth:`bandwidth_from`), so that the bound and the
    kernels see the same moments of a shared machine.
    """

    def __init__(self, *, buffer_mb: int = 512, build_dir: Optional[Path] = None) -> None:
        self.buffer_mb = buffer_mb
        self.elements = elements = buffer_mb * 2**20 // 4
        buf = torch.rand(elements, dtype=torch.float32) + 1.0
        other = torch.empty_like(buf)
        third = torch.rand_like(buf)
        # name -> (call, bytes per element, read only?). A factor this close to 1 keeps the values normal.
        self._patterns = {
            "in place, torch mul_": (lambda: buf.mul_(1.0000001), 8, False),
            "2 reads + 1 write, torch add": (lambda: torch.add(buf, third, out=other), 12, False),
            "3 reads + 1 write in place, torch addcmul_": (lambda: buf.addcmul_(third, other, value=1e-7), 16, False),
            "copy, torch copy_": (lambda: other.copy_(buf), 8, False),
            "read only, torch sum": (lambda: buf.sum(), 4, True),
            "read only, torch amax": (lambda: buf.amax(), 4, True),
        }
        probe, self.note = StreamProbe.build(elements, torch.get_num_threads(),
                                             build_dir or Path(__file__).resolve().parents[1] / "build" / "stream_probe")
        self._stream_probe = probe  # owns the buffers its calls stream through
        if probe is not None:
            for name, call in probe.calls.items():
                self._patterns[name] = (call, *PATTERNS[name])

    def calls(self, names: Optional[Sequence[str]] = None) -> dict[str, Callable[[], object]]:
        """name -> call of the patterns ``names`` (every pattern when None; names not measured here are left out)."""
        chosen = self._patterns if names is None else [name for name in names if name in self._patterns]
        return {name: self._patterns[name][0] for name in chosen}

    def bandwidth_from(self, timings: Mapping[str, "Timing"]) -> "Bandwidth":
        """The ``Bandwidth`` of the patterns timed in ``timings`` (other entries are ignored)."""
        timed = {name: spec for name, spec in self._patterns.items() if name in timings}
        patterns = {name: nbytes * self.elements / timings[name].median / 1e9 for name, (_, nbytes, _) in timed.items()}
        read_only = tuple(name for name, (_, _, is_read) in timed.items() if is_read)
        return Bandwidth(patterns=patterns, read_only=read_only, buffer_mb=self.buffer_mb, note=self.note)

    def measure(self, *, reps: int = 15, sync: Callable[[], None] = _no_sync) -> "Bandwidth":
        """Every pattern, timed interleaved with the others."""
        return self.bandwidth_from(time_interleaved(self.calls(), warmup=2, reps=reps, sync=sync))


def parallel_region_latency(*, reps: int = 50) -> float:
    """Median seconds of a tiny multi-threaded op: a probe for other processes on the cores.

    On an idle machine an op over 64K floats with torch's threads takes a few tens of
    microseconds. When another process keeps a core busy, every parallel region waits for
    the scheduler to hand its worker thread a core, and this grows to milliseconds (a
    scheduler time slice); every timing taken then is inflated by that much per region.
    """
    buf = torch.ones(1 << 16)
    return time_call(lambda: buf.add_(0.0), warmup=5, reps=reps).median


def last_level_cache_bytes(default: int = 32 * 2**20) -> int:
    """Size of the CPU's last-level cache from sysfs, or ``default`` when it cannot be read."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    sizes = []
    try:
        for index in os.listdir(base):
            if not index.startswith("index"):
                continue
            with open(os.path.join(base, index, "size")) as f:
                text = f.read().strip()
            units = {"K": 2**10, "M": 2**20, "G": 2**30}
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    except (OSError, ValueError):
        return default
    return max(sizes) if sizes else default


def cache_rotation_count(bytes_per_set: int, *, cache_bytes: Optional[int] = None, factor: int = 4,
                         at_least_bytes: int = 0, limit: int = 256) -> int:
    """How many independent copies of a working set to cycle through so none is still cached.

    A training step runs forward and backward between two optimizer steps,
    which evicts the optimizer's data from the caches; a benchmark that calls
    the same kernel on the same small buffers back to back would instead find
    them in cache. Cycling through copies whose total is ``factor`` times the
    last-level cache gives each call cold data, as in training. A virtual
    machine may report less cache than its host's cores share, so a benchmark
    that judges kernels against a bandwidth measured on buffers of some size
    should cycle through at least that much (``at_least_bytes``).

    Args:
        bytes_per_set: bytes one call touches.
        cache_bytes: last-level cache size; read from sysfs when None.
        factor: how many caches' worth of data to cycle through.
        at_least_bytes: the least total to cycle through, whatever the cache.
        limit: most copies to make (small sets would otherwise need thousands).
    """
    cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    needed = -(-max(factor * cache_bytes, at_least_bytes) // max(bytes_per_set, 1))
    return int(max(1, min(limit, needed)))


def machine_info() -> dict:
    """CPU model, cores, cache, torch version and threads, ATen's CPU ISA, and the load average."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "cpu_model": model,
        "logical_cpus": os.cpu_count(),
        "last_level_cache_mib": last_level_cache_bytes() / 2**20,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_1_5_15min": [round(x, 2) for x in load],
        "python": platform.python_version(),
    }


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Plain-text table: columns padded to their widest cell, numbers right-aligned."""
    cells = [[str(h) for h in header]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def is_number(text: str) -> bool:
        # "1.23", "-0.5", "2.10x", "4r": a number with at most a one-letter unit after it.
        core = text[:-1] if text[-1:].isalpha() else text
        return core.replace(".", "", 1).lstrip("-").isdigit()

    lines = []
    for n, row in enumerate(cells):
        padded = [c.rjust(w) if n and is_number(c) else c.ljust(w) for c, w in zip(row, widths)]
        lines.append("  ".join(padded).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_targets(title: str, verdicts: Sequence[tuple[str, str, bool]]) -> None:
    """Print each target as MET or MISSED with what was measured."""
    print(f"\ntargets ({title}):")
    for text, measured, met in verdicts:
        print(f"  {'MET   ' if met else 'MISSED'} {text}: {measured}")


def finish_run(started: float, json_path: Optional[str], payload: dict) -> None:
    """Print the load average at the end and the run's duration; write ``payload`` (with the
    load average) to ``json_path`` when one was given."""
    load_end = [round(x, 2) for x in os.getloadavg()]
    print(f"\nload average at end: {load_end}; run took {time.perf_counter() - started:.0f} s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({**payload, "load_average_end": load_end}, f, indent=1)
        print(f"wrote {json_path}")
