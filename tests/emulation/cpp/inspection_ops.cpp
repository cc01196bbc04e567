// Test-only ops of the emulation library, beside the emulated apex_amp ops:
//   pack_chunks(numels, depth): what csrc/cuda/chunk_packing.h puts into each
//     launch for tensors of these sizes, one row per block;
//   launch_limits(): the packing's constants as this build compiled them;
//   poison_around(view): makes the rest of a dense view's storage inaccessible
//     to AddressSanitizer, so that a kernel reading past the view (not only past
//     the allocation) fails.
#include "cuda/chunk_packing.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <sanitizer/asan_interface.h>

#include <cstdint>
#include <vector>

namespace apex_amp::emulation {
namespace {

// pack_chunks never reads tensor memory, so the addresses are made up:
// kFakeBase + position * kFakeStride + list * 8, decoded below.
constexpr uintptr_t kFakeBase = uintptr_t{1} << 40;
constexpr uintptr_t kFakeStride = 64;

// Columns of pack_chunks' rows.
enum PackColumn : int {
  kLaunch,        // index of the launch
  kLaunchBlocks,  // number of blocks of that launch
  kBlock,         // blockIdx.x
  kPosition,      // list position of the block's tensor, from its list-0 address
  kListsAgree,    // 1 when the addresses of every list name the same position
  kNumel,         // numel the block reads from the metadata
  kChunk,         // block_to_chunk
  kSlot,          // first_chunk_slot + blockIdx.x
  kColumns,
};

template <int Depth>
std::vector<int64_t> pack_rows(c10::IntArrayRef numels) {
  std::vector<TensorEntry<Depth>> entries;
  for (size_t position = 0; position < numels.size(); ++position) {
    TORCH_CHECK(numels[position] >= 0, "pack_chunks: numels[", position, "] is negative");
    TensorEntry<Depth> entry;
    for (int list = 0; list < Depth; ++list) {
      entry.data[list] = reinterpret_cast<void*>(kFakeBase + position * kFakeStride + list * 8);
    }
    entry.numel = numels[position];
    entries.push_back(entry);
  }
  std::vector<int64_t> rows;
  int64_t launch = 0;
  pack_chunks<Depth>(entries, [&](const TensorListMetadata<Depth>& meta, int num_blocks) {
    for (int block = 0; block < num_blocks; ++block) {
      const int tensor = meta.block_to_tensor[block];
      const auto address = [&](int list) {
        return reinterpret_cast<uintptr_t>(meta.addresses[list][tensor]) - kFakeBase;
      };
      const int64_t position = static_cast<int64_t>(address(0) / kFakeStride);
      bool lists_agree = true;
      for (int list = 0; list < Depth; ++list) {
        lists_agree = lists_agree &&
            address(list) == static_cast<uintptr_t>(position) * kFakeStride + list * 8;
      }
      const int64_t row[kColumns] = {
          launch, num_blocks, block, position, lists_agree ? 1 : 0, meta.numel[tensor],
          meta.block_to_chunk[block], meta.first_chunk_slot + block};
      rows.insert(rows.end(), row, row + kColumns);
    }
    ++launch;
  });
  return rows;
}

at::Tensor pack_chunks_rows(c10::IntArrayRef numels, int64_t depth) {
  std::vector<int64_t> rows;
  switch (depth) {
    case 1: rows = pack_rows<1>(numels); break;
    case 2: rows = pack_rows<2>(numels); break;
    case 3: rows = pack_rows<3>(numels); break;
    case 4: rows = pack_rows<4>(numels); break;
    case 5: rows = pack_rows<5>(numels); break;
    default: TORCH_CHECK(false, "pack_chunks: depth must be 1 to 5 (lists per op), got ", depth);
  }
  const int64_t num_rows = static_cast<int64_t>(rows.size()) / kColumns;
  return at::tensor(rows, at::kLong).reshape({num_rows, kColumns});
}

// [chunk size, blocks per launch, kernel argument limit, functor budget,
//  then tensors per launch and sizeof(TensorListMetadata) for depths 1..5]
std::vector<int64_t> launch_limits() {
  return {
      kChunkSize, kMaxBlocksPerLaunch, static_cast<int64_t>(kKernelArgLimitBytes),
      static_cast<int64_t>(kFunctorArgBudgetBytes),
      TensorListMetadata<1>::kMaxTensors, TensorListMetadata<2>::kMaxTensors,
      TensorListMetadata<3>::kMaxTensors, TensorListMetadata<4>::kMaxTensors,
      TensorListMetadata<5>::kMaxTensors,
      sizeof(TensorListMetadata<1>), sizeof(TensorListMetadata<2>), sizeof(TensorListMetadata<3>),
      sizeof(TensorListMetadata<4>), sizeof(TensorListMetadata<5>)};
}

void poison_around(const at::Tensor& view) {
  TORCH_CHECK(view.is_non_overlapping_and_dense(), "poison_around: view must be dense");
  const c10::Storage& storage = view.storage();
  auto* begin = static_cast<char*>(storage.mutable_data());
  char* const end = begin + storage.nbytes();
  auto* view_begin = static_cast<char*>(view.data_ptr());
  char* const view_end = view_begin + view.numel() * view.element_size();
  TORCH_CHECK(begin <= view_begin && view_end <= end, "poison_around: view outside its storage");
  // AddressSanitizer tracks 8-byte granules and can only mark a granule's
  // tail inaccessible: bytes before a view that starts inside a granule stay
  // accessible, which is why the tests also place views at a storage's end.
  ASAN_POISON_MEMORY_REGION(begin, view_begin - begin);
  ASAN_POISON_MEMORY_REGION(view_end, end - view_end);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(apex_amp_emulated, m) {
  m.def("pack_chunks(int[] numels, int depth) -> Tensor", &pack_chunks_rows);
  m.def("launch_limits() -> int[]", &launch_limits);
  m.def("poison_around(Tensor view) -> ()", &poison_around);
}

}  // namespace apex_amp::emulation
