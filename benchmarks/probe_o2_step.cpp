// Controlled probes of the O2 optimizer step on CPU (issue 20): what limits
// check_finite + fused_adam_ with fp32 masters, half grads and a half model
// copy, one knob at a time. A standalone program, not part of the library:
// the kernels here restate kernels.inc's vector loop with raw AVX-512
// intrinsics (same operations, same order, no FMA contraction), so that the
// store kind, the bf16 conversion, the prefetch distance, the split between
// threads and the buffer placement can each be changed alone.
//
// Build and run (benchmarks/README.md, "What limits the O2 step"):
//   g++ -O3 -std=c++17 -fopenmp -ffp-contract=off \
//       -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c \
//       benchmarks/probe_o2_step.cpp -o build/probe_o2_step
//   OMP_NUM_THREADS=2 OMP_PROC_BIND=false build/probe_o2_step [elements] [reps] [experiment...]
//
// Every row is the median of `reps` calls, interleaved in rounds with the
// other rows of its experiment, each call on the next of several copies of the
// data (>= 4x the last-level cache in all), so no call finds its data in cache.
// Columns: ns per element, GB/s over the bytes the kernel must move (O2 step:
// 30 B/el with the separate check, 28 without), and the ratio to the first
// row of the experiment.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

// ---- the data -----------------------------------------------------------------

struct Lists {
  // One buffer per stream; `offset_bytes` shifts each stream's start within its
  // pages (the 4 KiB aliasing experiment).
  float* p;
  float* m;
  float* v;
  uint16_t* g;
  uint16_t* model;
  int64_t n;
  std::vector<void*> owned;
};

void* alloc_at(size_t bytes, size_t offset, std::vector<void*>& owned) {
  void* base = nullptr;
  if (posix_memalign(&base, 4096, bytes + offset + 4096) != 0) {
    std::abort();
  }
  owned.push_back(base);
  return static_cast<char*>(base) + offset;
}

Lists make_lists(int64_t n, const size_t offsets[5]) {
  Lists l{};
  l.n = n;
  l.p = static_cast<float*>(alloc_at(n * 4, offsets[0], l.owned));
  l.g = static_cast<uint16_t*>(alloc_at(n * 2, offsets[1], l.owned));
  l.m = static_cast<float*>(alloc_at(n * 4, offsets[2], l.owned));
  l.v = static_cast<float*>(alloc_at(n * 4, offsets[3], l.owned));
  l.model = static_cast<uint16_t*>(alloc_at(n * 2, offsets[4], l.owned));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    // params ~ 0.02, moments 0, grads 0x3a83: 1.0e-3 as bf16, 0.81 as fp16, so that
    // neither dtype's grads drive the moments into denormals or underflow (which
    // costs microcode assists and would time something else).
    l.p[i] = 0.02f * static_cast<float>((i * 7919) % 1000) / 1000.f;
    l.m[i] = 0.f;
    l.v[i] = 0.f;
    l.g[i] = 0x3a83;
    l.model[i] = 0;
  }
  return l;
}

void free_lists(Lists& l) {
  for (void* p : l.owned) {
    free(p);
  }
  l.owned.clear();
}

// ---- the per-element math: amp_math.h's adam_update (AdamW), vectorised -------

struct Hyper {
  __m512 one_minus_lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, step_size, inv_scale;
};

Hyper make_hyper() {
  const float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, wd = 0.01f;
  Hyper h;
  h.one_minus_lr_wd = _mm512_set1_ps(1.f - lr * wd);
  h.beta1 = _mm512_set1_ps(beta1);
  h.one_minus_beta1 = _mm512_set1_ps(1.f - beta1);
  h.beta2 = _mm512_set1_ps(beta2);
  h.one_minus_beta2 = _mm512_set1_ps(1.f - beta2);
  h.bc2_sqrt = _mm512_set1_ps(std::sqrt(1.f - beta2));
  h.eps = _mm512_set1_ps(eps);
  h.step_size = _mm512_set1_ps(lr / (1.f - beta1));
  h.inv_scale = _mm512_set1_ps(1.f);
  return h;
}

inline void adam(__m512& p, __m512& m, __m512& v, __m512 g, const Hyper& h) {
  p = _mm512_mul_ps(p, h.one_minus_lr_wd);
  m = _mm512_add_ps(_mm512_mul_ps(h.beta1, m), _mm512_mul_ps(h.one_minus_beta1, g));
  v = _mm512_add_ps(_mm512_mul_ps(h.beta2, v), _mm512_mul_ps(_mm512_mul_ps(h.one_minus_beta2, g), g));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), h.bc2_sqrt), h.eps);
  p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(h.step_size, m), denom));
}

// The arithmetic of the C++ stream probe of _stream_probe.py: no division, no root.
inline void streams_only(__m512& p, __m512& m, __m512& v, __m512 g, const Hyper& h) {
  m = _mm512_add_ps(_mm512_mul_ps(m, h.beta1), g);
  v = _mm512_add_ps(_mm512_mul_ps(v, h.beta2), g);
  p = _mm512_sub_ps(p, _mm512_mul_ps(h.eps, _mm512_add_ps(m, v)));
}

// ---- half conversions ------------------------------------------------------------

enum class Half { kFp16, kBf16Software, kBf16Hardware, kNone };

// bf16 -> fp32 (exact) and fp16 -> fp32.
inline void load_half(const uint16_t* src, Half kind, __m512& lo, __m512& hi) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16));
  if (kind == Half::kFp16) {
    lo = _mm512_cvtph_ps(a);
    hi = _mm512_cvtph_ps(b);
  } else {
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(a), 16));
    hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  }
}

// ATen's cvtfp32_bf16 (vec512_bfloat16.h): round to nearest even in integer
// arithmetic, NaN -> 0xffff, two vectors packed and permuted back in order.
inline __m512i bf16_software(__m512 a, __m512 b) {
  const __m512i lo = _mm512_castps_si512(a), hi = _mm512_castps_si512(b);
  const __m512i nan = _mm512_set1_epi32(0xffff), ones = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __mmask16 ok_lo = _mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), ok_hi = _mm512_cmp_ps_mask(b, b, _CMP_ORD_Q);
  __m512i t_lo = _mm512_add_epi32(_mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(lo, 16), ones), bias), lo);
  __m512i t_hi = _mm512_add_epi32(_mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(hi, 16), ones), bias), hi);
  t_lo = _mm512_mask_blend_epi32(ok_lo, nan, _mm512_srli_epi32(t_lo, 16));
  t_hi = _mm512_mask_blend_epi32(ok_hi, nan, _mm512_srli_epi32(t_hi, 16));
  return _mm512_permutexvar_epi64(_mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0), _mm512_packus_epi32(t_lo, t_hi));
}

// AVX512-BF16's vcvtne2ps2bf16 (round to nearest even), then NaN lanes set to
// 0xffff as the software sequence does (the instruction keeps sign and payload).
inline __m512i bf16_hardware(__m512 a, __m512 b) {
  const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  const __mmask32 nan = static_cast<__mmask32>(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q)) |
      (static_cast<__mmask32>(_mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q)) << 16);
  return _mm512_mask_mov_epi16(packed, nan, _mm512_set1_epi16(-1));
}

inline __m512i to_half(__m512 lo, __m512 hi, Half kind) {
  switch (kind) {
    case Half::kFp16:
      return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT)),
                                _mm512_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT), 1);
    case Half::kBf16Software:
      return bf16_software(lo, hi);
    default:
      return bf16_hardware(lo, hi);
  }
}

// ---- one step over [begin, end) ---------------------------------------------------

struct Knobs {
  Half half = Half::kFp16;        // grad and model-copy dtype (kNone: no model copy written)
  bool nt_model = false;          // model copy with non-temporal stores
  bool nt_state = false;          // params and moments with non-temporal stores too
  bool math = true;               // Adam's math, or the stream probe's
  int prefetch_bytes = 0;         // software prefetch this far ahead in every stream (0: none)
  bool copy_after_tile = false;   // model copy in a second loop over the tile just updated
};

constexpr int64_t kBlock = 32;  // elements per iteration: two fp32 vectors, one half vector

inline void store_f32(float* dst, __m512 x, bool nt) {
  if (nt) {
    _mm512_stream_ps(dst, x);
  } else {
    _mm512_storeu_ps(dst, x);
  }
}

void step_range(const Lists& l, int64_t begin, int64_t end, const Knobs& k, const Hyper& h) {
  const Half grad_kind = k.half == Half::kNone ? Half::kFp16 : k.half;
  const int pf_f32 = k.prefetch_bytes / 4, pf_half = k.prefetch_bytes / 2;
  for (int64_t i = begin; i + kBlock <= end; i += kBlock) {
    if (k.prefetch_bytes != 0) {
      // one line of each fp32 stream per 64 B, the half streams every other iteration
      _mm_prefetch(reinterpret_cast<const char*>(l.p + i + pf_f32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(l.p + i + pf_f32 + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(l.m + i + pf_f32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(l.m + i + pf_f32 + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(l.v + i + pf_f32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(l.v + i + pf_f32 + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(l.g + i + pf_half), _MM_HINT_T0);
    }
    __m512 p_lo = _mm512_loadu_ps(l.p + i), p_hi = _mm512_loadu_ps(l.p + i + 16);
    __m512 m_lo = _mm512_loadu_ps(l.m + i), m_hi = _mm512_loadu_ps(l.m + i + 16);
    __m512 v_lo = _mm512_loadu_ps(l.v + i), v_hi = _mm512_loadu_ps(l.v + i + 16);
    __m512 g_lo, g_hi;
    load_half(l.g + i, grad_kind, g_lo, g_hi);
    g_lo = _mm512_mul_ps(g_lo, h.inv_scale);
    g_hi = _mm512_mul_ps(g_hi, h.inv_scale);
    if (k.math) {
      adam(p_lo, m_lo, v_lo, g_lo, h);
      adam(p_hi, m_hi, v_hi, g_hi, h);
    } else {
      streams_only(p_lo, m_lo, v_lo, g_lo, h);
      streams_only(p_hi, m_hi, v_hi, g_hi, h);
    }
    store_f32(l.p + i, p_lo, k.nt_state);
    store_f32(l.p + i + 16, p_hi, k.nt_state);
    store_f32(l.m + i, m_lo, k.nt_state);
    store_f32(l.m + i + 16, m_hi, k.nt_state);
    store_f32(l.v + i, v_lo, k.nt_state);
    store_f32(l.v + i + 16, v_hi, k.nt_state);
    if (k.half != Half::kNone && !k.copy_after_tile) {
      const __m512i half = to_half(p_lo, p_hi, k.half);
      if (k.nt_model) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(l.model + i), half);
      } else {
        _mm512_storeu_si512(l.model + i, half);
      }
    }
  }
  if (k.half != Half::kNone && k.copy_after_tile) {
    for (int64_t i = begin; i + kBlock <= end; i += kBlock) {
      const __m512i half = to_half(_mm512_loadu_ps(l.p + i), _mm512_loadu_ps(l.p + i + 16), k.half);
      if (k.nt_model) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(l.model + i), half);
      } else {
        _mm512_storeu_si512(l.model + i, half);
      }
    }
  }
}

// check_finite over half grads: x * 0 is NaN exactly for inf/NaN.
bool check_range(const uint16_t* g, int64_t begin, int64_t end, Half kind) {
  __m512 acc_lo = _mm512_setzero_ps(), acc_hi = _mm512_setzero_ps();
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t i = begin; i + kBlock <= end; i += kBlock) {
    __m512 lo, hi;
    load_half(g + i, kind == Half::kNone ? Half::kFp16 : kind, lo, hi);
    acc_lo = _mm512_add_ps(acc_lo, _mm512_mul_ps(lo, zero));
    acc_hi = _mm512_add_ps(acc_hi, _mm512_mul_ps(hi, zero));
  }
  const float s = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo, acc_hi));
  return s != s;
}

// check_range over `streams` interleaved sub-ranges of [begin, end): the same
// bytes, but several sequential read streams in flight per thread.
bool check_range_streams(const uint16_t* g, int64_t begin, int64_t end, Half kind, int streams) {
  const int64_t part = ((end - begin) / streams) / kBlock * kBlock;
  __m512 acc = _mm512_setzero_ps();
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t i = 0; i + kBlock <= part; i += kBlock) {
    for (int s = 0; s < streams; ++s) {
      __m512 lo, hi;
      load_half(g + begin + s * part + i, kind == Half::kNone ? Half::kFp16 : kind, lo, hi);
      acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_mul_ps(lo, zero), _mm512_mul_ps(hi, zero)));
    }
  }
  bool bad = check_range(g, begin + streams * part, end, kind);
  const float sum = _mm512_reduce_add_ps(acc);
  return bad || sum != sum;
}

bool run_check(const Lists& l, Half kind, int streams) {
  bool found = false;
#pragma omp parallel reduction(|| : found)
  {
    const int threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t chunk = (l.n / threads + kBlock - 1) / kBlock * kBlock;
    const int64_t b = std::min(l.n, t * chunk), e = t == threads - 1 ? l.n : std::min(l.n, b + chunk);
    found = streams == 1 ? check_range(l.g, b, e, kind) : check_range_streams(l.g, b, e, kind, streams);
  }
  return found;
}

// ---- how the work is split between threads ------------------------------------------

enum class Split {
  kOneRegion,        // one parallel region, each thread one contiguous half (today's plan)
  kRegionPerTensor,  // one parallel region per tensor of a transformer-like list
  kInterleavedTiles, // one region, tiles of `tile` elements dealt round-robin
};

// The transformer-like list of bench_kernels.py (transformer_like_shapes), as sizes.
std::vector<int64_t> transformer_like_sizes(int64_t total) {
  const int planned_layers = total < 4000000 ? 4 : 8;
  int64_t d = std::max<int64_t>(64, 64 * std::llround(std::sqrt(0.85 * total / (12.0 * planned_layers)) / 64));
  const int64_t per_layer = 12 * d * d + 13 * d;
  int64_t layers = std::max<int64_t>(1, std::llround(0.85 * total / per_layer));
  while (layers > 1 && layers * per_layer + 3 * d > total) {
    --layers;
  }
  const int64_t vocab = std::max<int64_t>(1, (total - layers * per_layer - 2 * d) / d);
  std::vector<int64_t> sizes{vocab * d};
  const int64_t layer[] = {d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d};
  for (int64_t k = 0; k < layers; ++k) {
    sizes.insert(sizes.end(), std::begin(layer), std::end(layer));
  }
  sizes.push_back(d);
  sizes.push_back(d);
  return sizes;
}

struct Plan {
  bool check = true;  // the separate check_finite pass first (its own parallel region)
  Split split = Split::kOneRegion;
  int64_t tile = 16384;
  std::vector<int64_t> tensor_bounds;  // for kRegionPerTensor
};

void run_step(const Lists& l, const Knobs& k, const Plan& plan, const Hyper& h) {
  const int threads = omp_get_max_threads();
  const int64_t n = l.n;
  if (plan.check) {
    bool found = false;
#pragma omp parallel num_threads(threads) reduction(|| : found)
    {
      const int t = omp_get_thread_num();
      const int64_t chunk = (n / threads + kBlock - 1) / kBlock * kBlock;
      const int64_t b = std::min(n, t * chunk), e = t == threads - 1 ? n : std::min(n, b + chunk);
      found = check_range(l.g, b, e, k.half);
    }
    if (found) {
      return;
    }
  }
  switch (plan.split) {
    case Split::kOneRegion: {
#pragma omp parallel num_threads(threads)
      {
        const int t = omp_get_thread_num();
        const int64_t chunk = (n / threads + 1023) / 1024 * 1024;
        const int64_t b = std::min(n, t * chunk), e = t == threads - 1 ? n : std::min(n, b + chunk);
        for (int64_t tb = b; tb < e; tb += plan.tile) {
          step_range(l, tb, std::min(e, tb + plan.tile), k, h);
        }
      }
      break;
    }
    case Split::kInterleavedTiles: {
      const int64_t tiles = (n + plan.tile - 1) / plan.tile;
#pragma omp parallel for schedule(static, 1) num_threads(threads)
      for (int64_t tile = 0; tile < tiles; ++tile) {
        step_range(l, tile * plan.tile, std::min(n, (tile + 1) * plan.tile), k, h);
      }
      break;
    }
    case Split::kRegionPerTensor: {
      for (size_t s = 0; s + 1 < plan.tensor_bounds.size(); ++s) {
        const int64_t tb = plan.tensor_bounds[s], te = plan.tensor_bounds[s + 1];
        const int64_t size = te - tb;
        const int use = size < 65536 ? 1 : threads;  // small tensors on one thread, as ATen's grain size does
#pragma omp parallel num_threads(use)
        {
          const int t = omp_get_thread_num();
          const int64_t chunk = (size / use + kBlock - 1) / kBlock * kBlock;
          const int64_t b = tb + std::min(size, t * chunk);
          const int64_t e = t == use - 1 ? te : std::min(te, b + chunk);
          step_range(l, b, e, k, h);
        }
      }
      break;
    }
  }
}

// The arithmetic alone: the step on a few KiB per thread that stay in L1/L2.
void run_in_cache(const Lists& l, const Knobs& k, int64_t per_thread, int repeats, const Hyper& h) {
#pragma omp parallel
  {
    const int64_t b = omp_get_thread_num() * per_thread;
    for (int r = 0; r < repeats; ++r) {
      step_range(l, b, b + per_thread, k, h);
    }
  }
}

// ---- timing -------------------------------------------------------------------------

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Row {
  std::string name;
  std::function<void(const Lists&)> call;
  double bytes_per_element;
  std::vector<double> samples;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : (v[(v.size() - 1) / 2] + v[v.size() / 2]) / 2;
}

void run_rows(const char* title, std::vector<Row>& rows, std::vector<Lists>& copies, int reps, double elements) {
  size_t next = 0;
  for (Row& row : rows) {  // warm-up: every copy once
    for (size_t c = 0; c < copies.size(); ++c) {
      row.call(copies[next++ % copies.size()]);
    }
  }
  for (int r = 0; r < reps; ++r) {
    for (Row& row : rows) {
      const Lists& data = copies[next++ % copies.size()];
      const double t0 = now();
      row.call(data);
      row.samples.push_back(now() - t0);
    }
  }
  std::printf("\n%s\n%-58s %9s %8s %8s\n", title, "variant", "ns/el", "GB/s", "/ first");
  const double first = median(rows.front().samples);
  for (const Row& row : rows) {
    const double med = median(row.samples);
    std::printf("%-58s %9.3f %8.1f %8.2f\n", row.name.c_str(), med / elements * 1e9,
                row.bytes_per_element > 0 ? row.bytes_per_element * elements / med / 1e9 : 0.0, med / first);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 16000000;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 15;
  std::vector<std::string> experiments;
  for (int i = 3; i < argc; ++i) {
    experiments.emplace_back(argv[i]);
  }
  const auto wanted = [&](const char* name) {
    return experiments.empty() || std::find(experiments.begin(), experiments.end(), name) != experiments.end();
  };
  const Hyper h = make_hyper();
  const size_t same_offsets[5] = {0, 0, 0, 0, 0};
  // Staggered: each stream starts 1 KiB + 64 B further into its page than the previous one.
  const size_t staggered_offsets[5] = {0, 1088, 2176, 3264, 320};
  const double bytes_per_set = 16.0 * n;
  const int num_copies = std::max(2, static_cast<int>(std::ceil(4.0 * 32 * 1024 * 1024 / bytes_per_set)));
  std::vector<Lists> copies;
  for (int c = 0; c < num_copies; ++c) {
    copies.push_back(make_lists(n, same_offsets));
  }
  std::printf("probe_o2_step: %lld elements, %d threads, %d copies of %.0f MiB, %d reps\n",
              static_cast<long long>(n), omp_get_max_threads(), num_copies, bytes_per_set / (1 << 20), reps);

  Plan one_region;  // today's split: one region per op, each thread a contiguous half, 16K-element units
  Plan no_check = one_region;
  no_check.check = false;
  const auto step = [&](Knobs k, Plan plan = Plan{}) {
    return [k, plan, &h](const Lists& l) { run_step(l, k, plan, h); };
  };
  const auto with = [](Half half, bool nt_model = false) {
    Knobs k;
    k.half = half;
    k.nt_model = nt_model;
    return k;
  };

  if (wanted("stores")) {
    // The fifth stream: no model copy, the copy with ordinary stores (each line read
    // first: write-allocate), with non-temporal stores, and everything non-temporal.
    Knobs all_nt = with(Half::kFp16, true);
    all_nt.nt_state = true;
    Knobs after = with(Half::kFp16);
    after.copy_after_tile = true;
    Plan after_plan = no_check;
    after_plan.tile = 1024;
    std::vector<Row> rows = {
        {"fp16 grads, no model copy (4 streams)", step(with(Half::kNone), no_check), 26, {}},
        {"fp16 model copy, ordinary stores", step(with(Half::kFp16), no_check), 28, {}},
        {"fp16 model copy, non-temporal stores", step(with(Half::kFp16, true), no_check), 28, {}},
        {"fp16 every store non-temporal", step(all_nt, no_check), 28, {}},
        {"fp16 model copy 1K-element tile behind, ordinary", step(after, after_plan), 28, {}},
    };
    run_rows("[stores] the model copy's stores (fused_adam_ alone, no check)", rows, copies, reps, n);
  }
  if (wanted("bf16")) {
    std::vector<Row> rows = {
        {"fp16 (vcvtps2ph)", step(with(Half::kFp16), no_check), 28, {}},
        {"bf16 software rounding (ATen's sequence)", step(with(Half::kBf16Software), no_check), 28, {}},
        {"bf16 vcvtne2ps2bf16 + NaN fix-up", step(with(Half::kBf16Hardware), no_check), 28, {}},
        {"bf16 software, non-temporal model copy", step(with(Half::kBf16Software, true), no_check), 28, {}},
        {"bf16 hardware, non-temporal model copy", step(with(Half::kBf16Hardware, true), no_check), 28, {}},
    };
    run_rows("[bf16] the bf16 conversion (fused_adam_ alone, no check)", rows, copies, reps, n);
  }
  if (wanted("math")) {
    // Memory with and without Adam's arithmetic; then the arithmetic without memory.
    Knobs streams = with(Half::kFp16);
    streams.math = false;
    Knobs streams_nt = streams;
    streams_nt.nt_model = true;
    std::vector<Row> rows = {
        {"Adam's math, fp16 copy", step(with(Half::kFp16), no_check), 28, {}},
        {"stream probe's math (no div/sqrt), fp16 copy", step(streams, no_check), 28, {}},
        {"stream probe's math, non-temporal copy", step(streams_nt, no_check), 28, {}},
        {"Adam's math, non-temporal copy", step(with(Half::kFp16, true), no_check), 28, {}},
    };
    run_rows("[math] arithmetic against memory (no check)", rows, copies, reps, n);
    // In cache: 4096 elements per thread (80 KiB of streams), repeated.
    const int64_t per_thread = 4096;
    const int repeats = static_cast<int>(std::max<int64_t>(1, n / (per_thread * omp_get_max_threads())));
    const double in_cache_elements = static_cast<double>(per_thread) * omp_get_max_threads() * repeats;
    const auto in_cache = [&](Knobs k) {
      return [k, per_thread, repeats, &h](const Lists& l) { run_in_cache(l, k, per_thread, repeats, h); };
    };
    Knobs bf16_sw = with(Half::kBf16Software), bf16_hw = with(Half::kBf16Hardware);
    std::vector<Row> cached = {
        {"in cache: Adam, fp16 grads and copy", in_cache(with(Half::kFp16)), 0, {}},
        {"in cache: Adam, bf16 software rounding", in_cache(bf16_sw), 0, {}},
        {"in cache: Adam, bf16 hardware rounding", in_cache(bf16_hw), 0, {}},
        {"in cache: Adam, no model copy", in_cache(with(Half::kNone)), 0, {}},
        {"in cache: stream probe's math", in_cache(streams), 0, {}},
    };
    run_rows("[math] in cache: the compute bound (ns per element, all threads)", cached, copies, reps,
             in_cache_elements);
  }
  if (wanted("prefetch")) {
    std::vector<Row> rows;
    for (int distance : {0, 256, 512, 1024, 2048, 4096}) {
      Knobs k = with(Half::kFp16, true);
      k.prefetch_bytes = distance;
      rows.push_back({"fp16, NT copy, prefetch " + std::to_string(distance) + " B ahead", step(k, no_check), 28, {}});
    }
    run_rows("[prefetch] software prefetch distance (no check)", rows, copies, reps, n);
  }
  if (wanted("split")) {
    Plan per_tensor = no_check;
    per_tensor.split = Split::kRegionPerTensor;
    per_tensor.tensor_bounds = {0};
    std::vector<int64_t> sizes = transformer_like_sizes(n);
    int64_t total = 0;
    for (int64_t s : sizes) {
      total = std::min(n, total + s);
      per_tensor.tensor_bounds.push_back(total);
    }
    per_tensor.tensor_bounds.back() = n;
    std::vector<Row> rows = {{"one region, contiguous halves, 16K tiles", step(with(Half::kFp16, true), no_check), 28, {}}};
    for (int64_t tile : {1024, 4096, 65536}) {
      Plan p = no_check;
      p.tile = tile;
      rows.push_back({"one region, contiguous halves, " + std::to_string(tile) + " tiles",
                      step(with(Half::kFp16, true), p), 28, {}});
    }
    for (int64_t tile : {4096, 16384, 262144}) {
      Plan p = no_check;
      p.split = Split::kInterleavedTiles;
      p.tile = tile;
      rows.push_back({"one region, round-robin " + std::to_string(tile) + "-element tiles",
                      step(with(Half::kFp16, true), p), 28, {}});
    }
    rows.push_back({"a region per tensor (" + std::to_string(sizes.size()) + " tensors)",
                    step(with(Half::kFp16, true), per_tensor), 28, {}});
    run_rows("[split] work split between threads (NT copy, no check)", rows, copies, reps, n);
  }
  if (wanted("check")) {
    std::vector<Row> rows = {
        {"check_finite + step (two regions), ordinary copy", step(with(Half::kFp16), one_region), 30, {}},
        {"step alone, ordinary copy", step(with(Half::kFp16), no_check), 28, {}},
        {"check_finite + step, NT copy", step(with(Half::kFp16, true), one_region), 30, {}},
        {"step alone, NT copy", step(with(Half::kFp16, true), no_check), 28, {}},
    };
    run_rows("[check] the separate finite check (2 B/el more read)", rows, copies, reps, n);
    std::vector<Row> alone;
    for (int streams : {1, 2, 4, 8}) {
      alone.push_back({"check_finite alone, " + std::to_string(streams) + " read stream(s) per thread",
                       [streams](const Lists& l) { run_check(l, Half::kFp16, streams); }, 2, {}});
    }
    run_rows("[check] check_finite alone: read streams in flight per thread", alone, copies, reps, n);
  }
  if (wanted("aliasing")) {
    // The same rows on buffers that all start at one page offset (as torch's large
    // tensors do) and on buffers staggered within their pages, interleaved.
    std::vector<Lists> staggered;
    for (int c = 0; c < num_copies; ++c) {
      staggered.push_back(make_lists(n, staggered_offsets));
    }
    const auto on_staggered = [&](Knobs k) {
      return [k, &h, &copies, &staggered](const Lists& l) {
        run_step(staggered[&l - copies.data()], k, Plan{false}, h);
      };
    };
    std::vector<Row> rows;
    for (const auto& [label, knobs] : {std::pair{"fp16, ordinary copy", with(Half::kFp16)},
                                       std::pair{"fp16, NT copy", with(Half::kFp16, true)},
                                       std::pair{"fp16, no copy", with(Half::kNone)}}) {
      rows.push_back({std::string("same page offset: ") + label, step(knobs, no_check), 28, {}});
      rows.push_back({std::string("staggered offsets: ") + label, on_staggered(knobs), 28, {}});
    }
    run_rows("[aliasing] 4 KiB aliasing between the streams (no check)", rows, copies, reps, n);
    for (Lists& l : staggered) {
      free_lists(l);
    }
  }
  for (Lists& l : copies) {
    free_lists(l);
  }
  return 0;
}
