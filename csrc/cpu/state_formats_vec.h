// The state formats' conversions in vector registers, for the formatted path
// of kernels.inc: the same results as state_formats.h's scalar functions, bit
// for bit, 16 (AVX-512) or 8 (AVX2) elements at a time. The default variant
// (and any tail shorter than a vector) runs the scalar functions themselves.
//
// How each conversion stays exact:
// - Dequantizing int8/uint8 is a lookup in a 256-entry table of the map entry
//   the scalar function multiplies by the scale, then the same one fp32
//   multiply. AVX-512 looks up with permutes of the table held in registers
//   (gathers are slow on CPUs with the GDS mitigation); AVX2 gathers it, but
//   holds the encoder's small tables (up to 32 entries) in registers too. fp8
//   codes are decoded from their bits (dequantize_fp8_lanes), to the same
//   values as c10's conversion.
// - Quantizing to int8/uint8 is the scalar's count of the midpoints below x.
//   The maps' decade structure gives it in a few steps (ZoneCount); the lanes
//   where that estimate could be off by one take the exact branch-free search:
//   eight steps of a binary search whose candidates at each step are looked up
//   by the step's prefix (a table per step, built from the midpoints padded
//   with +inf to 255 entries, so the search counts exactly the midpoints < x;
//   NaN compares false and gives 0, as the scalar loop does). uint8 then
//   raises a positive x's code 0 to 1, as the scalar does.
// - Quantizing to fp8 restates c10's fp32 -> float8_e4m3fn conversion
//   (round to nearest even, subnormals through the same fp32 add) lane by lane
//   in 32-bit integer arithmetic, then raises a nonzero value's code 0 to 1,
//   as the scalar does.
// - A block's absmax is the lanes' largest magnitude; a NaN anywhere makes it
//   the scalar's quiet NaN.
// - Remainder masters are the scalar bit arithmetic, lane by lane.
//
// Included from kernels.inc only, after the instruction set has been chosen.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "state_formats.h"

namespace apex_amp::cpu::CPU_CAPABILITY {
namespace {

namespace sf = ::apex_amp::state_formats;

// ---- tables (the same for every instruction set) -----------------------------

// What dequantizing int8/uint8 multiplies by the scale, indexed by the code's byte.
struct DecodeTables {
  alignas(64) float signed_[256]; // the signed map's entry of the int8 code of this byte
  alignas(64) float unsigned_[256];
};

inline const DecodeTables& decode_tables() {
  static const DecodeTables tables = [] {
    DecodeTables t{};
    for (int byte = 0; byte < 256; ++byte) {
      // int8 code -128 is never written; it reads the map's last entry, as the
      // reference's index -1 does (state_formats.dequantize).
      const int code = static_cast<int8_t>(static_cast<uint8_t>(byte));
      const int index = code + sf::kSignedZeroIndex;
      t.signed_[byte] = sf::kSignedMap[index < 0 ? sf::kSignedMapSize - 1 : index];
      t.unsigned_[byte] = sf::kUnsignedMap[byte];
    }
    return t;
  }();
  return tables;
}

// The binary search's candidates, step by step: at step l (l = 0..7, stride
// s = 128 >> l) the search has settled the top l bits of the index, idx, and
// compares x with padded[idx + s - 1]; levels[l][idx >> (8 - l)] holds it.
// padded: the midpoints, then +inf up to 255 entries.
struct SearchTables {
  alignas(64) float levels[8][128];
};

template <size_t kMidpoints>
constexpr SearchTables build_search_tables(const std::array<float, kMidpoints>& midpoints) {
  static_assert(kMidpoints <= 255, "the search covers at most 255 midpoints");
  SearchTables t{};
  for (int l = 0; l < 8; ++l) {
    const int stride = 128 >> l;
    for (int j = 0; j < 128; ++j) {
      const int position = j * 2 * stride + stride - 1;
      t.levels[l][j] = (j < (1 << l) && position < static_cast<int>(kMidpoints))
          ? midpoints[position]
          : std::numeric_limits<float>::infinity();
    }
  }
  return t;
}

constexpr SearchTables kSignedSearch = build_search_tables(sf::kSignedMidpoints);
constexpr SearchTables kUnsignedSearch = build_search_tables(sf::kUnsignedMidpoints);

// The maps' zones (see ZoneCount below): per zone z, its upper edge, the
// estimate's slope and offset, the count of positive midpoints below its
// start and the most it adds; per binade b of [2^(b - 24), 2^(b - 23)), the
// zones wholly below it. Small integers are stored as floats (exact), so
// that every table is read the same way.
constexpr int kZones = 16;        // zones 0..8 used; the rest repeat zone 8
constexpr int kBinades = 32;      // binades 2^-24 .. 2^7 (an |x| <= 1 needs up to 2^0)
constexpr int kFirstBinadeExponent = 127 - 24;
constexpr float kZoneDoubt = 1.f / 4096;  // t this close to an integer takes the exact search

struct ZoneTables {
  alignas(64) float zones_below[kBinades];
  alignas(64) float upper[kZones];
  alignas(64) float slope[kZones];
  alignas(64) float offset[kZones];
  alignas(64) float base[kZones];
  alignas(64) float inner_max[kZones];
  bool one_edge_per_binade;
};

// first_positive: the index of the first midpoint above 0 (the signed map's
// 127 negative midpoints come first).
template <size_t kMidpoints>
constexpr ZoneTables build_zone_tables(const std::array<float, kMidpoints>& midpoints, const int (&counts)[7],
                                       int first_positive) {
  ZoneTables t{};
  int start[8] = {};
  for (int k = 0; k < 7; ++k) {
    start[k + 1] = start[k] + counts[k];
  }
  const int positive = start[7] + 1;  // the midpoints above 0
  float edge[8] = {};
  for (int k = 0; k < 7; ++k) {
    edge[k] = midpoints[first_positive + start[k]];
  }
  edge[7] = midpoints[first_positive + positive - 1];
  for (int z = 0; z < kZones; ++z) {
    const bool in_decade = z >= 1 && z <= 7;
    const int k = z - 1;
    t.upper[z] = z < 8 ? edge[z] : std::numeric_limits<float>::infinity();
    t.slope[z] = in_decade ? static_cast<float>(counts[k] / (0.9 * sf::kDecades[k])) : 0.f;
    t.offset[z] = in_decade ? static_cast<float>(-counts[k] / 9.0) : 0.5f;  // 0.5: never doubtful
    t.base[z] = static_cast<float>(z == 0 ? 0 : in_decade ? start[k] + 1 : positive);
    t.inner_max[z] = static_cast<float>(in_decade ? counts[k] - 1 : 0);
  }
  t.one_edge_per_binade = true;
  double lower = 1.0 / 16777216.0;  // 2^-24
  for (int b = 0; b < kBinades; ++b, lower *= 2) {
    int below = 0, inside = 0;
    for (int z = 0; z < 8; ++z) {
      below += edge[z] < lower;
      inside += edge[z] >= lower && edge[z] < 2 * lower;
    }
    t.zones_below[b] = static_cast<float>(below);
    t.one_edge_per_binade = t.one_edge_per_binade && inside <= 1;
  }
  return t;
}

constexpr ZoneTables kSignedZones = build_zone_tables(sf::kSignedMidpoints, sf::kSignedCounts, sf::kSignedZeroIndex);
constexpr ZoneTables kUnsignedZones = build_zone_tables(sf::kUnsignedMidpoints, sf::kUnsignedCounts, 0);
static_assert(kSignedZones.one_edge_per_binade && kUnsignedZones.one_edge_per_binade,
              "ZoneCount finds a zone with one compare per binade");

// The scalar absmax of the reference's NaN blocks (block_absmax's).
inline float nan_absmax() {
  return std::numeric_limits<float>::quiet_NaN();
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define APEX_AMP_STATE_FORMATS_VECTORIZED 1

// ---- the few vector primitives the conversions need, per instruction set ----
#if defined(CPU_CAPABILITY_AVX512)

constexpr int64_t kLanes = 16;
using FVec = __m512;
using IVec = __m512i;
using Mask = __mmask16;

inline FVec load_f(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f(float* p, FVec v) { _mm512_storeu_ps(p, v); }
inline FVec set_f(float x) { return _mm512_set1_ps(x); }
inline FVec mul_f(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline FVec add_f(FVec a, FVec b) { return _mm512_add_ps(a, b); }
inline FVec max_f(FVec a, FVec b) { return _mm512_max_ps(a, b); }
inline IVec set_i(int32_t x) { return _mm512_set1_epi32(x); }
inline IVec add_i(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec sub_i(IVec a, IVec b) { return _mm512_sub_epi32(a, b); }
inline IVec and_i(IVec a, IVec b) { return _mm512_and_si512(a, b); }
inline IVec or_i(IVec a, IVec b) { return _mm512_or_si512(a, b); }
inline IVec xor_i(IVec a, IVec b) { return _mm512_xor_si512(a, b); }
template <int kBits> inline IVec shr_i(IVec a) { return _mm512_srli_epi32(a, kBits); }
template <int kBits> inline IVec shl_i(IVec a) { return _mm512_slli_epi32(a, kBits); }
inline IVec as_int(FVec v) { return _mm512_castps_si512(v); }
inline FVec as_float(IVec v) { return _mm512_castsi512_ps(v); }
inline Mask lt_f(FVec a, FVec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline Mask gt_f(FVec a, FVec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline Mask nan_f(FVec a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline Mask lt_i(IVec a, IVec b) { return _mm512_cmplt_epi32_mask(a, b); }
inline Mask gt_i(IVec a, IVec b) { return _mm512_cmpgt_epi32_mask(a, b); }
inline Mask eq_i(IVec a, IVec b) { return _mm512_cmpeq_epi32_mask(a, b); }
inline Mask or_m(Mask a, Mask b) { return static_cast<Mask>(a | b); }
inline Mask no_lanes() { return 0; }
inline bool any(Mask m) { return m != 0; }
inline FVec select_f(Mask m, FVec if_false, FVec if_true) { return _mm512_mask_blend_ps(m, if_false, if_true); }
inline IVec select_i(Mask m, IVec if_false, IVec if_true) { return _mm512_mask_blend_epi32(m, if_false, if_true); }
inline FVec sub_f(FVec a, FVec b) { return _mm512_sub_ps(a, b); }
inline FVec min_f(FVec a, FVec b) { return _mm512_min_ps(a, b); }
inline FVec to_float(IVec v) { return _mm512_cvtepi32_ps(v); }
inline IVec truncate_i(FVec v) { return _mm512_cvttps_epi32(v); }
inline FVec nearest_integer_f(FVec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline IVec min_i(IVec a, IVec b) { return _mm512_min_epi32(a, b); }
inline IVec max_i(IVec a, IVec b) { return _mm512_max_epi32(a, b); }

// table[index] for index in [0, kEntries), kEntries a power of two <= 256,
// from the table held in registers: a permute over each 32-entry slice, then
// blends on the index's higher bits.
template <int kEntries>
inline FVec pick(const FVec* regs, IVec index) {
  if constexpr (kEntries <= 16) {
    return _mm512_permutexvar_ps(index, regs[0]);
  } else if constexpr (kEntries == 32) {
    return _mm512_permutex2var_ps(regs[0], index, regs[1]);
  } else {
    constexpr int kHalf = kEntries / 2;
    const FVec low = pick<kHalf>(regs, index);
    const FVec high = pick<kHalf>(regs + kHalf / 16, index);
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(index, _mm512_set1_epi32(kHalf)), low, high);
  }
}

// A table of kEntries floats, loaded into registers once per block (a loop
// that stores through a float or byte pointer could not keep it there itself).
template <int kEntries>
struct Table {
  static constexpr int kRegs = kEntries <= 16 ? 1 : kEntries / 16;
  FVec regs[kRegs];
  explicit Table(const float* table) {
    for (int r = 0; r < kRegs; ++r) {
      regs[r] = _mm512_loadu_ps(table + 16 * r);
    }
  }
  FVec operator()(IVec index) const {
    return pick<kEntries>(regs, index);
  }
};

inline IVec load_bytes(const void* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}

inline void store_bytes(void* p, IVec v) {  // the low byte of each lane
  _mm_storeu_si128(static_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
}

inline IVec load_halves_unsigned(const void* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

inline IVec load_halves_signed(const void* p) {
  return _mm512_cvtepi16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

inline void store_halves(void* p, IVec v) {  // the low 16 bits of each lane
  _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v));
}

#else  // AVX2

constexpr int64_t kLanes = 8;
using FVec = __m256;
using IVec = __m256i;
using Mask = __m256i;  // all-ones lanes

inline FVec load_f(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f(float* p, FVec v) { _mm256_storeu_ps(p, v); }
inline FVec set_f(float x) { return _mm256_set1_ps(x); }
inline FVec mul_f(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline FVec add_f(FVec a, FVec b) { return _mm256_add_ps(a, b); }
inline FVec max_f(FVec a, FVec b) { return _mm256_max_ps(a, b); }
inline IVec set_i(int32_t x) { return _mm256_set1_epi32(x); }
inline IVec add_i(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec sub_i(IVec a, IVec b) { return _mm256_sub_epi32(a, b); }
inline IVec and_i(IVec a, IVec b) { return _mm256_and_si256(a, b); }
inline IVec or_i(IVec a, IVec b) { return _mm256_or_si256(a, b); }
inline IVec xor_i(IVec a, IVec b) { return _mm256_xor_si256(a, b); }
template <int kBits> inline IVec shr_i(IVec a) { return _mm256_srli_epi32(a, kBits); }
template <int kBits> inline IVec shl_i(IVec a) { return _mm256_slli_epi32(a, kBits); }
inline IVec as_int(FVec v) { return _mm256_castps_si256(v); }
inline FVec as_float(IVec v) { return _mm256_castsi256_ps(v); }
inline Mask lt_f(FVec a, FVec b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
inline Mask gt_f(FVec a, FVec b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
inline Mask nan_f(FVec a) { return _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
inline Mask lt_i(IVec a, IVec b) { return _mm256_cmpgt_epi32(b, a); }
inline Mask gt_i(IVec a, IVec b) { return _mm256_cmpgt_epi32(a, b); }
inline Mask eq_i(IVec a, IVec b) { return _mm256_cmpeq_epi32(a, b); }
inline Mask or_m(Mask a, Mask b) { return _mm256_or_si256(a, b); }
inline Mask no_lanes() { return _mm256_setzero_si256(); }
inline bool any(Mask m) { return !_mm256_testz_si256(m, m); }
inline FVec select_f(Mask m, FVec if_false, FVec if_true) {
  return _mm256_blendv_ps(if_false, if_true, _mm256_castsi256_ps(m));
}
inline IVec select_i(Mask m, IVec if_false, IVec if_true) { return _mm256_blendv_epi8(if_false, if_true, m); }
inline FVec sub_f(FVec a, FVec b) { return _mm256_sub_ps(a, b); }
inline FVec min_f(FVec a, FVec b) { return _mm256_min_ps(a, b); }
inline FVec to_float(IVec v) { return _mm256_cvtepi32_ps(v); }
inline IVec truncate_i(FVec v) { return _mm256_cvttps_epi32(v); }
inline FVec nearest_integer_f(FVec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline IVec min_i(IVec a, IVec b) { return _mm256_min_epi32(a, b); }
inline IVec max_i(IVec a, IVec b) { return _mm256_max_epi32(a, b); }

// table[index] for index in [0, kEntries), kEntries a power of two <= 32, from
// the table held in registers: a permute over each 8-entry slice, then blends
// on the index's higher bits (as AVX-512's pick, a quarter of the width).
template <int kEntries>
inline FVec pick(const FVec* regs, IVec index) {
  if constexpr (kEntries <= 8) {
    return _mm256_permutevar8x32_ps(regs[0], index);  // (the index's low 3 bits)
  } else {
    constexpr int kHalf = kEntries / 2;
    constexpr int kBit = kHalf == 8 ? 3 : kHalf == 16 ? 4 : -1;
    static_assert(kBit > 0, "pick: at most 32 entries in registers");
    const FVec low = pick<kHalf>(regs, index);
    const FVec high = pick<kHalf>(regs + kHalf / 8, index);
    // blendv reads each lane's sign bit: the index's bit kBit moved there.
    return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(index, 31 - kBit)));
  }
}

// A table of kEntries floats. Up to 32 entries are held in registers and read
// by permutes (a few micro-ops per 8 lanes: the int8 encoder's zone tables and
// the search's first levels); larger ones (the 256-entry decode maps, the
// search's last two levels) by gathers, which cost tens of micro-ops per 8 lanes
// on some CPUs (AMD Zen 1/2: benchmarks/README.md) and a few on others.
template <int kEntries>
struct Table {
  static constexpr bool kInRegisters = kEntries <= 32;
  static constexpr int kRegs = kEntries <= 8 ? 1 : kEntries / 8;
  FVec regs[kInRegisters ? kRegs : 1];
  const float* table;
  // table: at least max(kEntries, 8) floats (a smaller table's slice is read whole; its
  // entries past kEntries are never picked).
  explicit Table(const float* t) : table(t) {
    if constexpr (kInRegisters) {
      for (int r = 0; r < kRegs; ++r) {
        regs[r] = _mm256_loadu_ps(t + 8 * r);
      }
    }
  }
  FVec operator()(IVec index) const {
    if constexpr (kInRegisters) {
      return pick<kEntries>(regs, index);
    } else {
      return _mm256_i32gather_ps(table, index, 4);
    }
  }
};

inline IVec load_bytes(const void* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
}

// The low byte of each lane (every lane holds 0..255 here).
inline void store_bytes(void* p, IVec v) {
  const IVec words = _mm256_packus_epi32(v, v);          // v0-3 v0-3 | v4-7 v4-7
  const IVec bytes = _mm256_packus_epi16(words, words);  // v0-3 x4 | v4-7 x4
  const __m128i both = _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
  _mm_storel_epi64(static_cast<__m128i*>(p), both);
}

inline IVec load_halves_unsigned(const void* p) {
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}

inline IVec load_halves_signed(const void* p) {
  return _mm256_cvtepi16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}

// The low 16 bits of each lane (every lane holds 0..0xFFFF here).
inline void store_halves(void* p, IVec v) {
  const IVec words = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0b1000);  // v0-3 v4-7 low
  _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_castsi256_si128(words));
}

#endif

// ---- the conversions -----------------------------------------------------------

// dequantize_block, n a multiple of kLanes.
// One vector of dequantize_lanes: factor is the block's absmax.
inline void dequantize_vector(const Table<256>& lookup, const uint8_t* bytes, FVec factor, float* values) {
  store_f(values, mul_f(lookup(load_bytes(bytes)), factor));
}

inline void dequantize_lanes(const float* table, const void* codes, float scale, int64_t n, float* values) {
  const auto* bytes = static_cast<const uint8_t*>(codes);
  const FVec factor = set_f(scale);
  const Table<256> lookup(table);
  for (int64_t i = 0; i < n; i += kLanes) {
    dequantize_vector(lookup, bytes + i, factor, values + i);
  }
}

// dequantize_fp8's values, n a multiple of kLanes, from the codes' bits instead
// of a table: a normal code s eeee mmm is the fp32 of sign s, exponent
// eeee + 120 and mantissa mmm << 20; a subnormal one (eeee = 0) is mmm * 2^-9,
// exact in fp32 and a normal number there (no flushing of denormals can change
// it). A vector holding a NaN code (0x7f, 0xff) takes the scalar function.
// One vector of dequantize_fp8_lanes: factor is set_f(absmax / kFp8Max).
inline void dequantize_fp8_vector(const uint8_t* bytes, float absmax, FVec factor, float* values) {
  const IVec low_bits = set_i(0x7F);
  const IVec code = load_bytes(bytes);
  const IVec magnitude = and_i(code, low_bits);
  if (any(eq_i(magnitude, low_bits))) {
    sf::dequantize_block(StateFormat::kFp8, bytes, absmax, kLanes, values);
    return;
  }
  const IVec normal = add_i(shl_i<20>(magnitude), set_i(120 << 23));
  const FVec subnormal = mul_f(to_float(magnitude), set_f(1.f / 512));
  const FVec value = select_f(lt_i(magnitude, set_i(8)), as_float(normal), subnormal);
  const IVec sign = shl_i<24>(and_i(code, set_i(0x80)));
  store_f(values, mul_f(as_float(or_i(as_int(value), sign)), factor));
}

inline void dequantize_fp8_lanes(const void* codes, float absmax, int64_t n, float* values) {
  const auto* bytes = static_cast<const uint8_t*>(codes);
  const FVec factor = set_f(absmax / sf::kFp8Max);
  for (int64_t i = 0; i < n; i += kLanes) {
    dequantize_fp8_vector(bytes + i, absmax, factor, values + i);
  }
}

// A block's absmax, gathered vector by vector: observe each, then finish.
struct AbsmaxLanes {
  FVec largest = set_f(0.f);
  Mask nan = no_lanes();

  void observe(FVec v) {
    nan = or_m(nan, nan_f(v));
    largest = max_f(largest, as_float(and_i(as_int(v), set_i(0x7FFFFFFF))));
  }

  float finish() const {
    if (any(nan)) {
      return nan_absmax();
    }
    alignas(64) float lanes[kLanes];
    store_f(lanes, largest);
    float result = 0.f;
    for (int64_t k = 0; k < kLanes; ++k) {
      result = lanes[k] > result ? lanes[k] : result;
    }
    return result;
  }
};

// block_absmax, n a multiple of kLanes.
inline float absmax_lanes(const float* values, int64_t n) {
  AbsmaxLanes absmax;
  for (int64_t i = 0; i < n; i += kLanes) {
    absmax.observe(load_f(values + i));
  }
  return absmax.finish();
}

// clamp_to_unit(value * inv, low). max/min return their second operand when
// either is NaN (and of two zeros), so a NaN (or -0) x passes as the scalar's.
inline FVec scaled_unit(FVec value, FVec inv, FVec low) {
  return min_f(set_f(1.f), max_f(low, mul_f(value, inv)));
}

// sf::quantize_fp8's codes, lane by lane, for what quantizing meets: values
// in [-448, 448] (scaled_unit's clamp times 448) or NaN. c10's
// fp8e4m3fn_from_fp32_value restated for them: such a value never reaches 480
// (the saturation), its normal code is at most 0x7e (448) and fits in 7 bits,
// and its subnormal code is at most 8, so c10's range checks and masks drop
// out and NaN alone takes 0x7f. A nonzero magnitude keeps code 1 at least
// (sf::fp8_code_keeping_nonzero).
inline IVec fp8_codes_in_range(FVec value) {
  constexpr int32_t kDenormMagic = 141 << 23;    // 2^14
  constexpr int32_t kSmallestNormal = 121 << 23; // 2^-6
  const IVec bits = as_int(value);
  const IVec magnitude = and_i(bits, set_i(0x7FFFFFFF));
  const IVec subnormal = sub_i(as_int(add_f(as_float(magnitude), as_float(set_i(kDenormMagic)))), set_i(kDenormMagic));
  const IVec odd = and_i(shr_i<20>(magnitude), set_i(1));
  const IVec normal = shr_i<20>(add_i(add_i(magnitude, set_i(static_cast<int32_t>((uint32_t)(7 - 127) << 23) + 0x7FFFF)), odd));
  IVec code = select_i(lt_i(magnitude, set_i(kSmallestNormal)), normal, subnormal);
  code = max_i(code, min_i(magnitude, set_i(1)));
  code = select_i(nan_f(value), code, set_i(0x7f));
  return or_i(code, and_i(shr_i<24>(bits), set_i(0x80)));
}

// The branch-free count of midpoints below x (nearest_entry): step kLevel
// settles bit 7 - kLevel of the index.
template <int kLevel, typename TableT>
inline IVec search_step(const TableT& candidates, FVec x, IVec index) {
  const FVec candidate = candidates(shr_i<8 - kLevel>(index));
  return select_i(lt_f(candidate, x), index, add_i(index, set_i(128 >> kLevel)));
}

struct NearestEntry {
  Table<1> l0;
  Table<2> l1;
  Table<4> l2;
  Table<8> l3;
  Table<16> l4;
  Table<32> l5;
  Table<64> l6;
  Table<128> l7;

  explicit NearestEntry(const SearchTables& t)
      : l0(t.levels[0]), l1(t.levels[1]), l2(t.levels[2]), l3(t.levels[3]), l4(t.levels[4]),
        l5(t.levels[5]), l6(t.levels[6]), l7(t.levels[7]) {}

  IVec operator()(FVec x) const {
    IVec index = set_i(0);
    index = search_step<0>(l0, x, index);
    index = search_step<1>(l1, x, index);
    index = search_step<2>(l2, x, index);
    index = search_step<3>(l3, x, index);
    index = search_step<4>(l4, x, index);
    index = search_step<5>(l5, x, index);
    index = search_step<6>(l6, x, index);
    return search_step<7>(l7, x, index);
  }
};

// The count of a map's midpoints below x (nearest_entry's index) by its zones,
// in a few arithmetic steps instead of eight search steps. For y = |x| the
// positive midpoints split into zones at the midpoints between the map's
// decades (zone 0 ends at the midpoint after 0, zone k + 1 spans decade k, zone
// 8 starts at the midpoint before 1). The binade of y (its fp32 exponent) holds
// at most one zone edge (static_assert above), so one lookup and one compare
// give y's zone exactly. Within decade k the map's midpoints are at
// d_k (0.1 + 0.9 j / c_k), so t = y c_k / (0.9 d_k) - c_k / 9 crosses the
// integer j where y crosses the decade's j-th midpoint, up to the fp32
// roundings of the midpoints and of t: below 2e-5 in t over every midpoint and
// 300 ulps either side (checked against the search when this was written), 12x
// under kZoneDoubt. A vector with a lane whose t is within kZoneDoubt of an
// integer, or a NaN, takes the exact search (about 2 lanes in 1000 of spread
// values).
struct ZoneCount {
  Table<kBinades> zones_below;
  Table<kZones> upper;
  Table<kZones> slope;
  Table<kZones> offset;
  Table<kZones> base;
  Table<kZones> inner_max;

  explicit ZoneCount(const ZoneTables& t)
      : zones_below(t.zones_below), upper(t.upper), slope(t.slope), offset(t.offset), base(t.base),
        inner_max(t.inner_max) {}

  // The positive midpoints below y >= 0; `doubtful` is set where it may be off.
  IVec operator()(FVec y, Mask& doubtful) const {
    const IVec binade = min_i(max_i(sub_i(shr_i<23>(as_int(y)), set_i(kFirstBinadeExponent)), set_i(0)),
                              set_i(kBinades - 1));
    IVec zone = truncate_i(zones_below(binade));
    zone = select_i(gt_f(y, upper(zone)), zone, add_i(zone, set_i(1)));
    const FVec t = add_f(mul_f(y, slope(zone)), offset(zone));
    const FVec distance = as_float(and_i(as_int(sub_f(t, nearest_integer_f(t))), set_i(0x7FFFFFFF)));
    doubtful = or_m(lt_f(distance, set_f(kZoneDoubt)), nan_f(y));
    const IVec inner = min_i(max_i(truncate_i(t), set_i(0)), truncate_i(inner_max(zone)));
    return add_i(truncate_i(base(zone)), inner);
  }
};

// One vector of fp8 codes; inv is the block's BlockScale::inv.
inline void quantize_fp8_vector(const float* values, FVec inv, uint8_t* bytes) {
  store_bytes(bytes, fp8_codes_in_range(mul_f(scaled_unit(load_f(values), inv, set_f(-1.f)), set_f(sf::kFp8Max))));
}

// One vector of int8 (is_signed) or uint8 codes of a block whose scale does
// not zero its codes; zone_count is the map's (kSignedZones or kUnsignedZones).
inline void quantize_int8_vector(const float* values, FVec inv, bool is_signed, const ZoneCount& zone_count,
                                 uint8_t* bytes) {
  const IVec zero = set_i(0);
  const FVec x = scaled_unit(load_f(values), inv, set_f(is_signed ? -1.f : 0.f));
  Mask doubtful;
  const IVec count = zone_count(as_float(and_i(as_int(x), set_i(0x7FFFFFFF))), doubtful);
  // The code is index - zero_index: +count above 0; the signed map is
  // symmetric, so -count below (a tie with a midpoint is doubtful).
  IVec code = is_signed ? select_i(lt_i(as_int(x), zero), count, sub_i(zero, count)) : count;
  if (any(doubtful)) {
    const NearestEntry nearest_entry(is_signed ? kSignedSearch : kUnsignedSearch);
    code = sub_i(nearest_entry(x), set_i(is_signed ? sf::kSignedZeroIndex : 0));
  }
  if (!is_signed) {
    code = select_i(gt_f(x, set_f(0.f)), code, max_i(code, set_i(1)));  // as sf::quantize_uint8
  }
  store_bytes(bytes, and_i(code, set_i(0xFF)));
}

// quantize_block's codes, n a multiple of kLanes, with the block's scale.
inline void quantize_lanes(StateFormat format, const float* values, int64_t n, const sf::BlockScale& scale,
                           void* codes) {
  auto* bytes = static_cast<uint8_t*>(codes);
  const FVec inv = set_f(scale.inv);
  if (format == StateFormat::kFp8) {
    for (int64_t i = 0; i < n; i += kLanes) {
      quantize_fp8_vector(values + i, inv, bytes + i);
    }
    return;
  }
  if (scale.zero_codes) {
    std::memset(bytes, 0, static_cast<size_t>(n));
    return;
  }
  const bool is_signed = format == StateFormat::kInt8;
  const ZoneCount zone_count(is_signed ? kSignedZones : kUnsignedZones);
  for (int64_t i = 0; i < n; i += kLanes) {
    quantize_int8_vector(values + i, inv, is_signed, zone_count, bytes + i);
  }
}

#endif  // AVX512 || AVX2

// ---- what kernels.inc calls: the vector conversions where the ISA has them ----

inline void dequantize_block_fast(StateFormat format, const void* codes, float absmax, int64_t n, float* values) {
#ifdef APEX_AMP_STATE_FORMATS_VECTORIZED
  if (n % kLanes == 0) {
    const DecodeTables& t = decode_tables();
    if (format == StateFormat::kFp8) {
      dequantize_fp8_lanes(codes, absmax, n, values);
    } else {
      dequantize_lanes(format == StateFormat::kInt8 ? t.signed_ : t.unsigned_, codes, absmax, n, values);
    }
    return;
  }
#endif
  sf::dequantize_block(format, codes, absmax, n, values);
}

// Writes the block's codes and returns the absmax it stores (quantize_block).
inline float quantize_block_fast(StateFormat format, const float* values, int64_t n, void* codes) {
#ifdef APEX_AMP_STATE_FORMATS_VECTORIZED
  if (n % kLanes == 0) {
    const sf::BlockScale scale = sf::block_scale(absmax_lanes(values, n));
    quantize_lanes(format, values, n, scale, codes);
    return scale.stored_absmax;
  }
#endif
  return sf::quantize_block(format, values, n, codes);
}

inline void join_masters_fast(const c10::BFloat16* weight, const int16_t* remainder, int64_t n, float* master) {
  int64_t i = 0;
#ifdef APEX_AMP_STATE_FORMATS_VECTORIZED
  for (; i + kLanes <= n; i += kLanes) {  // (weight << 16) + remainder, mod 2^32
    const IVec bits = add_i(shl_i<16>(load_halves_unsigned(weight + i)), load_halves_signed(remainder + i));
    store_f(master + i, as_float(bits));
  }
#endif
  for (; i < n; ++i) {
    master[i] = sf::join_master(weight[i], remainder[i]);
  }
}

inline void split_masters_fast(const float* master, int64_t n, c10::BFloat16* weight, int16_t* remainder) {
  int64_t i = 0;
#ifdef APEX_AMP_STATE_FORMATS_VECTORIZED
  for (; i + kLanes <= n; i += kLanes) {
    const IVec bits = as_int(load_f(master + i));
    store_halves(weight + i, shr_i<16>(add_i(bits, set_i(0x8000))));
    store_halves(remainder + i, and_i(bits, set_i(0xFFFF)));
  }
#endif
  for (; i < n; ++i) {
    sf::split_master(master[i], weight[i], remainder[i]);
  }
}

}  // namespace
}  // namespace apex_amp::cpu::CPU_CAPABILITY
