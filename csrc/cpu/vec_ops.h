// The vector side of amp_math.h: ValueOps for at::vec::Vectorized<float>,
// and loads/stores that turn fp32, fp16 and bf16 storage into fp32 vectors.
//
// Included only from kernels.inc, after the instruction set has been chosen
// (CPU_CAPABILITY and the matching CPU_CAPABILITY_* macro), so
// Vectorized<float> here is the type of that instruction set. The helpers live
// in a namespace named after it, like ATen's own, so that the copies compiled
// for different instruction sets never merge at link time.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "amp_math.h"

namespace apex_amp {
namespace {  // where amp_math.h declares ValueOps

template <>
struct ValueOps<at::vec::Vectorized<float>> {
  static inline at::vec::Vectorized<float> sqrt(const at::vec::Vectorized<float>& x) {
    return x.sqrt();
  }
};

}  // namespace

namespace cpu::CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;

// The loops step in blocks of two fp32 vectors: exactly one fp16/bf16 vector,
// so reduced-precision storage is read and written with full-width accesses.
constexpr int64_t kBlock = 2 * Vec::size();

inline void load_block(const float* p, Vec& lo, Vec& hi) {
  lo = Vec::loadu(p);
  hi = Vec::loadu(p + Vec::size());
}

template <typename T>
inline void load_block(const T* p, Vec& lo, Vec& hi) {
  at::vec::load_to_float<T>(p, lo, hi);
}

inline void store_block(float* p, const Vec& lo, const Vec& hi) {
  lo.store(p);
  hi.store(p + Vec::size());
}

// Rounds to nearest even, like the scalar conversion of the tail.
template <typename T>
inline void store_block(T* p, const Vec& lo, const Vec& hi) {
  at::vec::convert_from_float<T>(lo, hi).store(p);
}

// Whether this instruction set stores a reduced-precision block with one
// non-temporal store (stream_block): the vector ISAs, where a block is exactly
// one fp16/bf16 vector (64 bytes, a cache line, with AVX-512; 32 with AVX2).
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kHasStreamingStores = true;
#else
constexpr bool kHasStreamingStores = false;
#endif

// The bytes a reduced-precision block spans; stream_block needs its address
// aligned to this.
constexpr int64_t kHalfBlockBytes = kBlock * 2;

// store_block for a stream that is written and not read again soon (the O2
// model copy): a non-temporal store writes the line without reading it first
// (no write-allocate) and without evicting the streams still being read.
// Same values as store_block; p must be kHalfBlockBytes-aligned, and the
// stores must be fenced (streaming_fence) before other threads read them.
template <typename T>
inline void stream_block(T* p, const Vec& lo, const Vec& hi) {
  static_assert(!std::is_same_v<T, float>, "only reduced-precision blocks are streamed");
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_stream_si512(reinterpret_cast<__m512i*>(p), __m512i(at::vec::convert_from_float<T>(lo, hi)));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), __m256i(at::vec::convert_from_float<T>(lo, hi)));
#else
  store_block(p, lo, hi);
#endif
}

// Orders this thread's non-temporal stores before its later stores (the end
// of a parallel region, where other threads may start reading).
inline void streaming_fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

template <typename T>
inline float load_scalar(const T* p) {
  return static_cast<float>(*p);
}

template <typename T>
inline void store_scalar(T* p, float value) {
  *p = static_cast<T>(value);
}

// The sum of the lanes of a vector (of probes, or of squares).
inline float sum_lanes(const Vec& v) {
  __at_align__ float lanes[Vec::size()];
  v.store(lanes);
  float sum = 0.f;
  for (int64_t i = 0; i < Vec::size(); ++i) {
    sum += lanes[i];
  }
  return sum;
}

}  // namespace cpu::CPU_CAPABILITY
}  // namespace apex_amp
