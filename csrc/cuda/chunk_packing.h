// Host side of the multi-tensor apply: packing chunks of a tensor list into
// kernel-argument metadata.
//
// The tensors of a list op are cut into chunks of kChunkSize elements; one
// thread block processes one chunk. Everything a block needs to find its
// chunk (the tensors' addresses and sizes, and which tensor and which chunk
// each block takes) is packed into a TensorListMetadata struct that travels
// in the kernel's arguments, so a launch needs no device-side setup and no
// host-to-device copy. When the metadata is full (too many tensors or too
// many blocks for one launch) it is handed to the launcher and packing
// starts again, carrying a half-processed tensor over to the next launch.
//
// Plain C++ (no CUDA), so that the packing can be checked on any machine
// (tests/emulation/test_chunk_packing.py); multi_tensor_apply.cuh adds the
// kernel and the launch.
#pragma once

#include <c10/util/Exception.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace apex_amp {

// Elements per chunk, i.e. per thread block: large enough that a block's
// fixed cost (reading its metadata, one flag write) is negligible, small
// enough that a 100k-element tensor still spreads over a couple of blocks.
// The test-only host emulation of these kernels (tests/emulation) builds them
// with smaller chunks, so that small tensors already span several launches.
#ifdef APEX_AMP_EMULATION_CHUNK_SIZE
constexpr int kChunkSize = APEX_AMP_EMULATION_CHUNK_SIZE;
#else
constexpr int kChunkSize = 65536;
#endif
// Elements per vector load/store (16 bytes of fp32, 8 of fp16/bf16).
constexpr int kILP = 4;
static_assert(kChunkSize % kILP == 0, "chunks must start on a vector boundary");

// The size limit of a kernel's arguments. Classic CUDA allows 4 KB; CUDA 12.1+
// allows 32 KB on Volta and newer, but only with a 12.1+ toolkit *and*
// driver, and the larger argument block is copied at every launch. We stay
// under 4 KB: the extension then runs with any toolkit and driver torch
// supports, and a launch still covers up to 320 chunks (~20M elements) or a
// few dozen tensors, which amortises the launch cost for typical models.
constexpr size_t kKernelArgLimitBytes = 4096;
// Of those, what each op's functor (its scalars and flag pointers) may use.
constexpr size_t kFunctorArgBudgetBytes = 256;
// Chunks (blocks) per launch, for every arity.
constexpr int kMaxBlocksPerLaunch = 320;

// Tensors per launch for an op that walks `depth` lists at once: as many as
// fit in the argument budget next to the block maps (an address per list
// plus a 64-bit size per tensor).
constexpr int max_tensors_per_launch(int depth) {
  constexpr size_t block_map_bytes = kMaxBlocksPerLaunch * (sizeof(int32_t) + sizeof(uint8_t));
  constexpr size_t header_bytes = sizeof(int64_t);
  constexpr size_t available =
      kKernelArgLimitBytes - kFunctorArgBudgetBytes - block_map_bytes - header_bytes;
  const size_t per_tensor = sizeof(void*) * depth + sizeof(int64_t);
  const size_t fit = available / per_tensor;
  // block_to_tensor holds uint8 indices.
  return static_cast<int>(fit < 256 ? fit : 256);
}

template <int Depth>
struct TensorListMetadata {
  static constexpr int kMaxTensors = max_tensors_per_launch(Depth);
  static constexpr int kMaxBlocks = kMaxBlocksPerLaunch;

  // Chunks handed to earlier launches of the same multi_tensor_apply call, so
  // that (first_chunk_slot + blockIdx.x) numbers every chunk of the call once
  // (the l2norm kernel writes one partial sum per chunk at that index).
  int64_t first_chunk_slot;
  int64_t numel[kMaxTensors];
  void* addresses[Depth][kMaxTensors];
  int32_t block_to_chunk[kMaxBlocks];
  uint8_t block_to_tensor[kMaxBlocks];
};

static_assert(sizeof(TensorListMetadata<1>) <= kKernelArgLimitBytes - kFunctorArgBudgetBytes, "");
static_assert(sizeof(TensorListMetadata<5>) <= kKernelArgLimitBytes - kFunctorArgBudgetBytes, "");
static_assert(TensorListMetadata<5>::kMaxTensors >= 16, "too few tensors per launch");

// One tensor of each of the op's lists, at the same list position.
template <int Depth>
struct TensorEntry {
  std::array<void*, Depth> data;
  int64_t numel;
};

constexpr int64_t num_chunks(int64_t numel) {
  return (numel + kChunkSize - 1) / kChunkSize;
}

// Packs every chunk of `tensors` into metadata and calls launch(meta,
// num_blocks) each time a metadata block is full, and once at the end.
// Chunks are numbered (first_chunk_slot + block) in list order, empty
// tensors contributing none.
template <int Depth, typename Launch>
void pack_chunks(const std::vector<TensorEntry<Depth>>& tensors, const Launch& launch) {
  using Metadata = TensorListMetadata<Depth>;
  Metadata meta{};
  int num_tensors = 0;  // tensors packed into `meta`
  int num_blocks = 0;   // chunks packed into `meta`
  int64_t chunks_launched = 0;

  const auto flush = [&]() {
    meta.first_chunk_slot = chunks_launched;
    launch(meta, num_blocks);
    chunks_launched += num_blocks;
    num_blocks = 0;
  };

  for (const TensorEntry<Depth>& entry : tensors) {
    if (entry.numel == 0) {
      continue;
    }
    const int64_t chunks = num_chunks(entry.numel);
    TORCH_CHECK(
        chunks <= INT32_MAX, "apex_amp: a tensor of ", entry.numel,
        " elements is too large for the multi-tensor kernels");
    for (int list = 0; list < Depth; ++list) {
      meta.addresses[list][num_tensors] = entry.data[list];
    }
    meta.numel[num_tensors] = entry.numel;
    ++num_tensors;

    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      meta.block_to_tensor[num_blocks] = static_cast<uint8_t>(num_tensors - 1);
      meta.block_to_chunk[num_blocks] = static_cast<int32_t>(chunk);
      ++num_blocks;

      const bool last_chunk = chunk == chunks - 1;
      const bool blocks_full = num_blocks == Metadata::kMaxBlocks;
      const bool tensors_full = num_tensors == Metadata::kMaxTensors;
      if (blocks_full || (tensors_full && last_chunk)) {
        flush();
        if (last_chunk) {
          num_tensors = 0;
        } else {
          // The current tensor has chunks left: it opens the next launch.
          for (int list = 0; list < Depth; ++list) {
            meta.addresses[list][0] = meta.addresses[list][num_tensors - 1];
          }
          meta.numel[0] = meta.numel[num_tensors - 1];
          num_tensors = 1;
        }
      }
    }
  }
  if (num_blocks > 0) {
    flush();
  }
}

}  // namespace apex_amp
