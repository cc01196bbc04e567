"""Streaming-bandwidth probes with the access patterns of the kernels being judged.

A kernel's bound is its bytes per element divided by the machine's bandwidth, so
that bandwidth must be the best the machine reaches for *that* kind of access:
a kernel that reads four streams and writes three (Adam) keeps more memory
requests in flight than one in-place stream (``mul_``), and can beat the latter's
bandwidth. A bound taken from one stream then says a kernel runs faster than
memory allows.

These probes stream exactly the kernels' patterns with almost no arithmetic, on
as many threads as the kernels use: one in-place stream, two reads and a write,
Adam's four reads and three writes, the O2 step's (fp32 master, moments, half
gradient in, half model copy out), and a read-only sum. They are plain C++
(std::thread, -O3, no -march: the ISA does not matter for a memory-bound loop),
compiled once with the system's C++ compiler into ``build/stream_probe/`` and
called through ctypes on torch tensors' memory. Without a compiler they are
skipped and the bound falls back to torch's own streaming ops (and says so).
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Optional

import torch

__all__ = ["PATTERNS", "StreamProbe"]

_SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {
template <class Body>
void split(int64_t n, int threads, Body body) {
  // Contiguous chunks, a multiple of 64 elements long, one per thread.
  int64_t chunk = ((n + threads - 1) / threads + 63) / 64 * 64;
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    int64_t begin = t * chunk, end = begin + chunk < n ? begin + chunk : n;
    if (begin < end) pool.emplace_back(body, begin, end);
  }
  body(int64_t(0), chunk < n ? chunk : n);
  for (auto& worker : pool) worker.join();
}

inline uint16_t high_half(float x) {  // bf16 by truncation: a 2-byte store per element
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return uint16_t(bits >> 16);
}

inline float from_half(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}
}  // namespace

extern "C" {
void scale_inplace(float* a, int64_t n, int threads) {  // 1 read + 1 write stream, in place
  split(n, threads, [=](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) a[i] *= 1.0000001f; });
}

void add_out(float* out, const float* x, const float* y, int64_t n, int threads) {  // 2 reads + 1 write
  split(n, threads, [=](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) out[i] = x[i] + y[i]; });
}

void adam_streams(float* p, const float* g, float* m, float* v, int64_t n, int threads) {  // 4 reads + 3 writes
  split(n, threads, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float mi = m[i] * 0.9f + g[i], vi = v[i] * 0.999f + g[i];
      m[i] = mi;
      v[i] = vi;
      p[i] -= 1e-7f * (mi + vi);
    }
  });
}

void o2_streams(float* master, const uint16_t* g, float* m, float* v, uint16_t* model, int64_t n,
                int threads) {  // fp32 master/moments read+write, half gradient read, half model write
  split(n, threads, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float gi = from_half(g[i]);
      float mi = m[i] * 0.9f + gi, vi = v[i] * 0.999f + gi;
      m[i] = mi;
      v[i] = vi;
      float pi = master[i] - 1e-7f * (mi + vi);
      master[i] = pi;
      model[i] = high_half(pi);
    }
  });
}

double read_sum(const float* a, int64_t n, int threads) {  // 1 read stream
  // An OR of the bits: integer, so the compiler may vectorise the reduction (a float sum
  // must keep its order without -ffast-math, and would measure the adder, not the memory).
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(a);
  std::vector<uint32_t> partial(threads > 0 ? threads : 1, 0u);
  int64_t chunk = ((n + threads - 1) / threads + 63) / 64 * 64;
  split(n, threads, [&](int64_t b, int64_t e) {
    uint32_t acc = 0;
    for (int64_t i = b; i < e; ++i) acc |= bits[i];
    partial[b / chunk] = acc;
  });
  uint32_t total = 0;
  for (uint32_t p : partial) total |= p;
  return double(total);
}
}
"""

# name -> (bytes per element, read only?)
PATTERNS: dict[str, tuple[int, bool]] = {
    "1 stream in place (C++)": (8, False),
    "2 reads + 1 write (C++)": (12, False),
    "Adam's 4 reads + 3 writes (C++)": (28, False),
    "O2 step's streams (C++)": (28, False),
    "read only (C++)": (4, True),
}


def _compile(build_dir: Path) -> Optional[Path]:
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]
    library = build_dir / f"libstreamprobe-{digest}.so"
    if library.exists():
        return library
    build_dir.mkdir(parents=True, exist_ok=True)
    source = build_dir / f"streamprobe-{digest}.cpp"
    source.write_text(_SOURCE)
    subprocess.run([compiler, "-O3", "-std=c++17", "-fPIC", "-shared", "-pthread", str(source), "-o", str(library)],
                   check=True, capture_output=True, text=True)
    return library


class StreamProbe:
    """The C++ stream patterns, each as a call on buffers of ``elements`` floats (threads fixed at creation)."""

    def __init__(self, library: Path, elements: int, threads: int) -> None:
        lib = ctypes.CDLL(str(library))
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        for name, args in (("scale_inplace", [p, i64, i32]), ("add_out", [p, p, p, i64, i32]),
                           ("adam_streams", [p, p, p, p, i64, i32]), ("o2_streams", [p, p, p, p, p, i64, i32]),
                           ("read_sum", [p, i64, i32])):
            getattr(lib, name).argtypes = args
        lib.read_sum.restype = ctypes.c_double
        self.elements, self.threads = elements, threads
        f32 = [torch.rand(elements) + 1.0 for _ in range(4)]
        half = [torch.rand(elements).to(torch.bfloat16) for _ in range(2)]
        a, b, c, d = (t.data_ptr() for t in f32)
        g, model = (t.data_ptr() for t in half)
        self._buffers = f32 + half  # kept alive while the calls below hold their addresses
        n, t = elements, threads
        self.calls: dict[str, Callable[[], object]] = {
            "1 stream in place (C++)": lambda: lib.scale_inplace(a, n, t),
            "2 reads + 1 write (C++)": lambda: lib.add_out(a, b, c, n, t),
            "Adam's 4 reads + 3 writes (C++)": lambda: lib.adam_streams(a, b, c, d, n, t),
            "O2 step's streams (C++)": lambda: lib.o2_streams(a, g, c, d, model, n, t),
            "read only (C++)": lambda: lib.read_sum(a, n, t),
        }

    @classmethod
    def build(cls, elements: int, threads: int, build_dir: Path) -> tuple[Optional["StreamProbe"], str]:
        """(probe, "") or (None, why not): a missing compiler is not an error, only a weaker bound."""
        try:
            library = _compile(build_dir)
        except subprocess.CalledProcessError as error:
            return None, f"the C++ stream probes did not compile: {error.stderr.strip()[:300]}"
        if library is None:
            return None, "no C++ compiler (c++/g++) on PATH: the bound uses torch's streaming ops only"
        return cls(library, elements, threads), ""
