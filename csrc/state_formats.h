// The optimizer-state formats, element by element and block by block: what
// the fused kernels use to read a state in fp32 and to store it back.
//
// apex_amp/optimizers/state_formats.py is the definition (its docstring says
// why each rule is what it is); everything here restates it operation by
// operation in fp32, so a kernel's codes and absmaxes equal the reference's
// bit for bit (tests/test_ops_state_formats.py). The dynamic maps are built
// by the reference's formula, in double, at compile time (no pow(), no
// contraction), and tests/test_state_format_maps.py compares them with
// state_formats.dynamic_map through apex_amp._C.
//
// A blocked state (fp8, int8, uint8) keeps one fp32 absmax per block of B
// consecutive elements in memory order; block k of a tensor starts at element
// k * B. Its values are code * (absmax / 448) (fp8) or map[code] * absmax
// (int8: the signed map, code + 127 its index; uint8: the unsigned map).
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>

namespace apex_amp {

// How one state tensor is stored (the op's dtype of it, relative to its params).
enum class StateFormat : uint8_t {
  kFloat32,   // fp32
  kBFloat16,  // bf16, rounded to nearest even
  kFp8,       // float8_e4m3fn codes, an fp32 absmax per block
  kInt8,      // int8 codes into the signed dynamic map, an fp32 absmax per block
  kUInt8,     // uint8 codes into the unsigned dynamic map, an fp32 absmax per block
};

constexpr bool is_blocked(StateFormat format) {
  return format == StateFormat::kFp8 || format == StateFormat::kInt8 || format == StateFormat::kUInt8;
}

namespace state_formats {

constexpr float kFp8Max = 448.f;                      // the largest finite float8_e4m3fn
constexpr float kSmallestNormal = 1.17549435082228750797e-38f;  // 2^-126
constexpr int kSignedMapSize = 255;
constexpr int kUnsignedMapSize = 256;
constexpr int kSignedZeroIndex = 127;  // the signed map's 0 (code 0)

// The maps' decades and entries per decade, as the reference writes them out.
constexpr double kDecades[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
constexpr int kUnsignedCounts[7] = {2, 4, 8, 16, 32, 64, 128};
constexpr int kSignedCounts[7] = {1, 2, 4, 8, 16, 32, 63};

// The map's values in (1e-7, 1], ascending: the midpoints of `count` equal steps
// from 0.1 to 1 in each decade (in double, in the reference's order), then 1.
template <int kPositive>
constexpr std::array<double, kPositive> positive_map_values(const int (&counts)[7]) {
  std::array<double, kPositive> values{};
  int n = 0;
  for (int d = 0; d < 7; ++d) {
    for (int j = 0; j < counts[d]; ++j) {
      values[n++] = kDecades[d] * (0.1 + 0.9 * ((j + 0.5) / counts[d]));
    }
  }
  values[n] = 1.0;
  return values;
}

constexpr std::array<float, kSignedMapSize> build_signed_map() {
  constexpr int kPositive = (kSignedMapSize - 1) / 2;
  const std::array<double, kPositive> positive = positive_map_values<kPositive>(kSignedCounts);
  std::array<float, kSignedMapSize> map{};
  for (int i = 0; i < kPositive; ++i) {
    map[kPositive - 1 - i] = static_cast<float>(-positive[i]);
    map[kPositive + 1 + i] = static_cast<float>(positive[i]);
  }
  map[kPositive] = 0.f;
  return map;
}

constexpr std::array<float, kUnsignedMapSize> build_unsigned_map() {
  constexpr int kPositive = kUnsignedMapSize - 1;
  const std::array<double, kPositive> positive = positive_map_values<kPositive>(kUnsignedCounts);
  std::array<float, kUnsignedMapSize> map{};
  map[0] = 0.f;
  for (int i = 0; i < kPositive; ++i) {
    map[1 + i] = static_cast<float>(positive[i]);
  }
  return map;
}

// The fp32 midpoints between neighbouring entries, (m[i] + m[i + 1]) * 0.5 in fp32.
template <size_t kSize>
constexpr std::array<float, kSize - 1> build_midpoints(const std::array<float, kSize>& map) {
  std::array<float, kSize - 1> midpoints{};
  for (size_t i = 0; i + 1 < kSize; ++i) {
    midpoints[i] = (map[i] + map[i + 1]) * 0.5f;
  }
  return midpoints;
}

constexpr std::array<float, kSignedMapSize> kSignedMap = build_signed_map();
constexpr std::array<float, kUnsignedMapSize> kUnsignedMap = build_unsigned_map();
constexpr std::array<float, kSignedMapSize - 1> kSignedMidpoints = build_midpoints(kSignedMap);
constexpr std::array<float, kUnsignedMapSize - 1> kUnsignedMidpoints = build_midpoints(kUnsignedMap);

// Internal linkage, as amp_math.h: the CPU kernels compile this once per instruction set.
namespace {

inline bool is_finite_value(float x) {
  return x - x == 0.f;  // inf - inf and NaN - NaN are NaN
}

// How a block with largest magnitude `absmax` (NaN if the block holds one) is quantized.
struct BlockScale {
  float inv;            // 1 / absmax, or 0 (tiny, zero or non-finite blocks)
  bool zero_codes;      // int8/uint8: every code the zero code (fp8 writes x * 448 regardless)
  float stored_absmax;  // what the block's absmax entry holds: absmax, or 0 for a flushed block
};

inline BlockScale block_scale(float absmax) {
  const bool usable = absmax >= kSmallestNormal;  // false for NaN
  const bool finite = is_finite_value(absmax);
  BlockScale scale;
  scale.inv = (usable && finite) ? 1.f / absmax : 0.f;
  scale.zero_codes = !(usable && finite);
  scale.stored_absmax = (usable || !finite) ? absmax : 0.f;
  return scale;
}

// The largest |v| of a block, NaN if any element is NaN.
inline float block_absmax(const float* values, int64_t n) {
  float largest = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float magnitude = values[i] < 0.f ? -values[i] : values[i];
    nan |= magnitude != magnitude;
    largest = magnitude > largest ? magnitude : largest;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : largest;
}

// clamp(x, low, 1) as torch.clamp: NaN stays NaN, -0 stays -0.
inline float clamp_to_unit(float x, float low) {
  return x < low ? low : (x > 1.f ? 1.f : x);
}

// The index of the nearest map entry: the number of midpoints below x (ties to the lower entry).
template <size_t kSize>
inline int nearest_entry(const std::array<float, kSize>& midpoints, float x) {
  int low = 0;
  int high = static_cast<int>(kSize);
  while (low < high) {
    const int middle = (low + high) / 2;
    if (midpoints[middle] < x) {
      low = middle + 1;
    } else {
      high = middle;
    }
  }
  return low;
}

// The fp8 code of `scaled` (x * 448) from c10's nearest-even code: a nonzero
// value keeps the smallest subnormal of its sign (state_formats.py says why:
// fp8 has one format for every state, so the rule covers the signed ones too).
// The CUDA encoder calls it too.
C10_HOST_DEVICE inline uint8_t fp8_code_keeping_nonzero(uint8_t nearest, float scaled) {
  return static_cast<uint8_t>((nearest & 0x7F) == 0 && scaled != 0.f ? nearest | 1 : nearest);
}

inline c10::Float8_e4m3fn quantize_fp8(float value, const BlockScale& scale) {
  const float scaled = clamp_to_unit(value * scale.inv, -1.f) * kFp8Max;
  return c10::Float8_e4m3fn(fp8_code_keeping_nonzero(c10::Float8_e4m3fn(scaled).x, scaled),
                            c10::Float8_e4m3fn::from_bits());
}

inline int8_t quantize_int8(float value, const BlockScale& scale) {
  if (scale.zero_codes) {
    return 0;
  }
  const float x = clamp_to_unit(value * scale.inv, -1.f);
  return static_cast<int8_t>(nearest_entry(kSignedMidpoints, x) - kSignedZeroIndex);
}

// The unsigned map's code of x from its nearest entry: a positive x keeps the
// smallest positive entry (state_formats.py says why). The CUDA encoder calls it too.
C10_HOST_DEVICE inline uint8_t unsigned_code(int nearest, float x) {
  return static_cast<uint8_t>(nearest == 0 && x > 0.f ? 1 : nearest);
}

inline uint8_t quantize_uint8(float value, const BlockScale& scale) {
  if (scale.zero_codes) {
    return 0;
  }
  const float x = clamp_to_unit(value * scale.inv, 0.f);
  return unsigned_code(nearest_entry(kUnsignedMidpoints, x), x);
}

inline float dequantize_fp8(c10::Float8_e4m3fn code, float absmax) {
  return static_cast<float>(code) * (absmax / kFp8Max);
}

inline float dequantize_int8(int8_t code, float absmax) {
  return kSignedMap[code + kSignedZeroIndex] * absmax;
}

inline float dequantize_uint8(uint8_t code, float absmax) {
  return kUnsignedMap[code] * absmax;
}

// One block of a blocked state: n fp32 values from / to its codes and absmax.
inline void dequantize_block(StateFormat format, const void* codes, float absmax, int64_t n, float* values) {
  switch (format) {
    case StateFormat::kFp8: {
      const auto* c = static_cast<const c10::Float8_e4m3fn*>(codes);
      for (int64_t i = 0; i < n; ++i) {
        values[i] = dequantize_fp8(c[i], absmax);
      }
      return;
    }
    case StateFormat::kInt8: {
      const auto* c = static_cast<const int8_t*>(codes);
      for (int64_t i = 0; i < n; ++i) {
        values[i] = dequantize_int8(c[i], absmax);
      }
      return;
    }
    default: {  // kUInt8, the only other blocked format
      const auto* c = static_cast<const uint8_t*>(codes);
      for (int64_t i = 0; i < n; ++i) {
        values[i] = dequantize_uint8(c[i], absmax);
      }
      return;
    }
  }
}

// Writes the block's codes and returns the absmax it stores.
inline float quantize_block(StateFormat format, const float* values, int64_t n, void* codes) {
  const BlockScale scale = block_scale(block_absmax(values, n));
  switch (format) {
    case StateFormat::kFp8: {
      auto* c = static_cast<c10::Float8_e4m3fn*>(codes);
      for (int64_t i = 0; i < n; ++i) {
        c[i] = quantize_fp8(values[i], scale);
      }
      break;
    }
    case StateFormat::kInt8: {
      auto* c = static_cast<int8_t*>(codes);
      for (int64_t i = 0; i < n; ++i) {
        c[i] = quantize_int8(values[i], scale);
      }
      break;
    }
    default: {  // kUInt8
      auto* c = static_cast<uint8_t*>(codes);
      for (int64_t i = 0; i < n; ++i) {
        c[i] = quantize_uint8(values[i], scale);
      }
      break;
    }
  }
  return scale.stored_absmax;
}

// Remainder masters: the fp32 master of a bf16 weight and its int16 remainder,
// and back (state_formats.join_master / split_master): bit arithmetic mod 2^32.
inline float join_master(c10::BFloat16 weight, int16_t remainder) {
  const uint32_t bits = (static_cast<uint32_t>(weight.x) << 16) +
      static_cast<uint32_t>(static_cast<int32_t>(remainder));
  float master;
  std::memcpy(&master, &bits, sizeof(master));
  return master;
}

// The weight is the master rounded to the nearest bf16, ties away from zero.
inline void split_master(float master, c10::BFloat16& weight, int16_t& remainder) {
  uint32_t bits;
  std::memcpy(&bits, &master, sizeof(bits));
  weight = c10::BFloat16(static_cast<uint16_t>((bits + 0x8000u) >> 16), c10::BFloat16::from_bits());
  remainder = static_cast<int16_t>(static_cast<uint16_t>(bits & 0xFFFFu));
}

// ---- stochastic rounding of bf16 states ------------------------------------
// state_formats.py: rounding_bits and round_bf16_stochastic, in uint32
// arithmetic (the reference's int64 steps never overflow, so they are these
// modulo 2^32). Host-device: the CUDA kernels call these very functions.
constexpr uint32_t kGolden32 = 0x9E3779B9u;

C10_HOST_DEVICE inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  return x ^ (x >> 15);
}

// The stream of state list `state_index` of the tensor whose key is `key`
// (the op's state_rounding[i][0]).
C10_HOST_DEVICE inline uint32_t rounding_stream(int64_t key, int state_index) {
  const uint64_t bits = static_cast<uint64_t>(key);
  const uint32_t salt = kGolden32 * static_cast<uint32_t>(state_index + 1);
  return mix32(mix32(mix32(static_cast<uint32_t>(bits) ^ kGolden32) ^ static_cast<uint32_t>(bits >> 32)) ^ salt);
}

// The 16 random bits of element `index` (of the whole parameter) of a stream.
C10_HOST_DEVICE inline uint32_t rounding_bits(uint32_t stream, int64_t index) {
  const uint64_t bits = static_cast<uint64_t>(index);
  return mix32(mix32(static_cast<uint32_t>(bits) ^ stream) ^ static_cast<uint32_t>(bits >> 32)) >> 16;
}

// `value` rounded to bf16 with the random bits `random16`: added to the low
// half of its pattern, then truncated; NaN, and a finite value that would
// become inf, round to nearest even instead (so inf only where RNE gives it).
C10_HOST_DEVICE inline c10::BFloat16 round_bf16_stochastic(float value, uint32_t random16) {
  uint32_t pattern;
  memcpy(&pattern, &value, sizeof(pattern));
  const uint16_t high = static_cast<uint16_t>((pattern + random16) >> 16);
  const bool nan = value != value;
  const bool overflowed = (high & 0x7FFFu) == 0x7F80u && (pattern & 0x7F800000u) != 0x7F800000u;
  if (nan || overflowed) {
    return c10::BFloat16(value);
  }
  return c10::BFloat16(high, c10::BFloat16::from_bits());
}

}  // namespace
}  // namespace state_formats
}  // namespace apex_amp
