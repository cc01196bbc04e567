// The optimizer-state formats on the device: csrc/state_formats.h restated,
// operation by operation, as host-device functions for the CUDA kernels
// (cuda/formatted_rule.cuh).
//
// state_formats.h is the CPU kernels' definition and compiles once per
// instruction set with internal linkage; its functions are host-only, and its
// maps are host constexpr arrays. Here the maps are copied, at compile time,
// from those very arrays into constant memory, and each function below does
// exactly what its namesake there does, in the same fp32 operations, so that
// a code or an absmax written on the device equals the CPU kernels' bit for
// bit (tests/emulation/test_state_formats.py checks it through the host
// emulation).
#pragma once

#include "state_formats.h"

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace apex_amp {
namespace device_formats {

namespace sf = ::apex_amp::state_formats;

// The dynamic maps and their midpoints, as state_formats.h builds them.
struct MapTables {
  float signed_map[sf::kSignedMapSize];
  float signed_midpoints[sf::kSignedMapSize - 1];
  float unsigned_map[sf::kUnsignedMapSize];
  float unsigned_midpoints[sf::kUnsignedMapSize - 1];
};

constexpr MapTables make_map_tables() {
  MapTables tables{};
  for (int i = 0; i < sf::kSignedMapSize; ++i) {
    tables.signed_map[i] = sf::kSignedMap[i];
  }
  for (int i = 0; i + 1 < sf::kSignedMapSize; ++i) {
    tables.signed_midpoints[i] = sf::kSignedMidpoints[i];
  }
  for (int i = 0; i < sf::kUnsignedMapSize; ++i) {
    tables.unsigned_map[i] = sf::kUnsignedMap[i];
  }
  for (int i = 0; i + 1 < sf::kUnsignedMapSize; ++i) {
    tables.unsigned_midpoints[i] = sf::kUnsignedMidpoints[i];
  }
  return tables;
}

namespace {  // one copy per launcher file, as the kernels

__constant__ MapTables kMaps = make_map_tables();

C10_HOST_DEVICE inline bool is_finite_value(float x) {
  return x - x == 0.f;  // inf - inf and NaN - NaN are NaN
}

C10_HOST_DEVICE inline float quiet_nan() {
  return std::numeric_limits<float>::quiet_NaN();
}

// state_formats::BlockScale: how a block with largest magnitude `absmax` is quantized.
struct BlockScale {
  float inv;
  bool zero_codes;
  float stored_absmax;
};

C10_HOST_DEVICE inline BlockScale block_scale(float absmax) {
  const bool usable = absmax >= sf::kSmallestNormal;  // false for NaN
  const bool finite = is_finite_value(absmax);
  BlockScale scale;
  scale.inv = (usable && finite) ? 1.f / absmax : 0.f;
  scale.zero_codes = !(usable && finite);
  scale.stored_absmax = (usable || !finite) ? absmax : 0.f;
  return scale;
}

// |v| as state_formats::block_absmax takes it (-0 stays -0, never above +0).
C10_HOST_DEVICE inline float magnitude(float v) {
  return v < 0.f ? -v : v;
}

// Two partial absmaxes of one block, either NaN if the block holds one: the
// larger, NaN if either is. Partials start at +0, so the order of the
// combination does not change the result (state_formats::block_absmax's).
C10_HOST_DEVICE inline float combine_absmax(float a, float b) {
  if (a != a || b != b) {
    return quiet_nan();
  }
  return b > a ? b : a;
}

C10_HOST_DEVICE inline float clamp_to_unit(float x, float low) {
  return x < low ? low : (x > 1.f ? 1.f : x);
}

// The number of the `size` midpoints below x (ties to the lower entry).
C10_HOST_DEVICE inline int nearest_entry(const float* midpoints, int size, float x) {
  int low = 0;
  int high = size;
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

C10_HOST_DEVICE inline c10::Float8_e4m3fn quantize_fp8(float value, const BlockScale& scale) {
  const float scaled = clamp_to_unit(value * scale.inv, -1.f) * sf::kFp8Max;
  return c10::Float8_e4m3fn(sf::fp8_code_keeping_nonzero(c10::Float8_e4m3fn(scaled).x, scaled),
                            c10::Float8_e4m3fn::from_bits());
}

__device__ inline int8_t quantize_int8(float value, const BlockScale& scale) {
  if (scale.zero_codes) {
    return 0;
  }
  const float x = clamp_to_unit(value * scale.inv, -1.f);
  return static_cast<int8_t>(
      nearest_entry(kMaps.signed_midpoints, sf::kSignedMapSize - 1, x) - sf::kSignedZeroIndex);
}

__device__ inline uint8_t quantize_uint8(float value, const BlockScale& scale) {
  if (scale.zero_codes) {
    return 0;
  }
  const float x = clamp_to_unit(value * scale.inv, 0.f);
  return sf::unsigned_code(nearest_entry(kMaps.unsigned_midpoints, sf::kUnsignedMapSize - 1, x), x);
}

C10_HOST_DEVICE inline float dequantize_fp8(c10::Float8_e4m3fn code, float absmax) {
  return static_cast<float>(code) * (absmax / sf::kFp8Max);
}

__device__ inline float dequantize_int8(int8_t code, float absmax) {
  return kMaps.signed_map[code + sf::kSignedZeroIndex] * absmax;
}

__device__ inline float dequantize_uint8(uint8_t code, float absmax) {
  return kMaps.unsigned_map[code] * absmax;
}

// Element `index` of a blocked state in fp32, its block's absmax given.
__device__ inline float dequantize(StateFormat format, const void* codes, int64_t index, float absmax) {
  switch (format) {
    case StateFormat::kFp8:
      return dequantize_fp8(static_cast<const c10::Float8_e4m3fn*>(codes)[index], absmax);
    case StateFormat::kInt8:
      return dequantize_int8(static_cast<const int8_t*>(codes)[index], absmax);
    default:  // kUInt8, the only other blocked format
      return dequantize_uint8(static_cast<const uint8_t*>(codes)[index], absmax);
  }
}

// Stores the code of `value` at element `index` of a blocked state.
__device__ inline void quantize(StateFormat format, float value, const BlockScale& scale, void* codes,
                                     int64_t index) {
  switch (format) {
    case StateFormat::kFp8:
      static_cast<c10::Float8_e4m3fn*>(codes)[index] = quantize_fp8(value, scale);
      return;
    case StateFormat::kInt8:
      static_cast<int8_t*>(codes)[index] = quantize_int8(value, scale);
      return;
    default:  // kUInt8
      static_cast<uint8_t*>(codes)[index] = quantize_uint8(value, scale);
      return;
  }
}

// state_formats::join_master / split_master.
C10_HOST_DEVICE inline float join_master(c10::BFloat16 weight, int16_t remainder) {
  const uint32_t bits = (static_cast<uint32_t>(weight.x) << 16) +
      static_cast<uint32_t>(static_cast<int32_t>(remainder));
  float master;
  memcpy(&master, &bits, sizeof(master));
  return master;
}

C10_HOST_DEVICE inline void split_master(float master, c10::BFloat16& weight, int16_t& remainder) {
  uint32_t bits;
  memcpy(&bits, &master, sizeof(bits));
  weight = c10::BFloat16(static_cast<uint16_t>((bits + 0x8000u) >> 16), c10::BFloat16::from_bits());
  remainder = static_cast<int16_t>(static_cast<uint16_t>(bits & 0xFFFFu));
}

}  // namespace
}  // namespace device_formats
}  // namespace apex_amp
