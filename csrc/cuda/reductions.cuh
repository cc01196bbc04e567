// Deterministic reductions for the CUDA launchers: within a block (warp
// shuffles, then one warp over the warps' results), and per tensor of a list
// from per-chunk partial results.
//
// A multi-tensor pass writes one partial result per chunk at the chunk's
// slot (Chunk::slot); the chunks of one tensor occupy consecutive slots,
// numbered dtype group by dtype group (SlotPlan). A cleanup kernel then
// combines each tensor's slots in a fixed order: no float atomics, so the
// result is the same on every run.
#pragma once

#include "cuda/dtype_groups.cuh"
#include "cuda/launch.cuh"
#include "cuda/multi_tensor_apply.cuh"

#include <c10/cuda/CUDAException.h>

#include <cstdint>
#include <vector>

namespace apex_amp {

constexpr int kWarpSize = 32;
// Threads per block of the cleanup kernels (slots are few: one per 64K elements).
constexpr int kCleanupBlockSize = 256;

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};

// The larger of two non-negative values, NaN if either is NaN.
struct NanMaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return (a != a || b != b) ? (a != a ? a : b) : (a > b ? a : b);
  }
};

// `value` combined over the block, valid in thread 0. Fixed order, hence
// deterministic. Every thread of the block must call it; a kernel may call it
// more than once (the barrier at the start protects the shared array of the
// previous call).
template <int BlockSize, typename T, typename Op>
__device__ __forceinline__ T block_reduce(T value, Op op) {
  static_assert(BlockSize % kWarpSize == 0 && BlockSize / kWarpSize <= kWarpSize, "");
  __shared__ T warp_results[BlockSize / kWarpSize];
  __syncthreads();
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = op(value, __shfl_down_sync(0xffffffffu, value, offset));
  }
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  if (lane == 0) {
    warp_results[warp] = value;
  }
  __syncthreads();
  value = threadIdx.x < BlockSize / kWarpSize ? warp_results[threadIdx.x] : T(0);
  if (warp == 0) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      value = op(value, __shfl_down_sync(0xffffffffu, value, offset));
    }
  }
  return value;
}

template <int BlockSize, typename T>
__device__ __forceinline__ T block_sum(T value) {
  return block_reduce<BlockSize>(value, SumOp{});
}

// The slots of a list's chunks: group g's chunks start at group_first_slot[g]
// (pass that offset to the group's multi-tensor pass), tensor i's at
// tensor_first_slot[i] (by list position).
struct SlotPlan {
  std::vector<int64_t> group_first_slot;
  std::vector<int64_t> tensor_first_slot;
  std::vector<int64_t> tensor_num_slots;
  int64_t num_slots = 0;

  template <int Depth>
  SlotPlan(const std::vector<DtypeGroup<Depth>>& groups, size_t num_tensors)
      : tensor_first_slot(num_tensors, 0), tensor_num_slots(num_tensors, 0) {
    for (const auto& group : groups) {
      group_first_slot.push_back(num_slots);
      for (size_t k = 0; k < group.tensors.size(); ++k) {
        const int64_t chunks = num_chunks(group.tensors[k].numel);
        tensor_first_slot[group.positions[k]] = num_slots;
        tensor_num_slots[group.positions[k]] = chunks;
        num_slots += chunks;
      }
    }
  }
};

// One block per tensor, packed into the kernel argument like the
// multi-tensor metadata (16 bytes per tensor; 224 tensors stay under 4 KB).
struct TensorSlotRanges {
  static constexpr int kMaxTensors = 224;
  int64_t first_slot[kMaxTensors];
  int32_t num_slots[kMaxTensors];
  int32_t position[kMaxTensors];  // index of the tensor in the op's list
};
static_assert(sizeof(TensorSlotRanges) + 3 * sizeof(void*) <= kKernelArgLimitBytes, "");

// How a tensor's slots become its value: the square root of their sum (a norm
// from sums of squares), their sum (squared norms, which FSDP2's shards add up
// before the root: LAMB's passes), or their NaN-propagating maximum.
enum class SlotCombine : int { kSqrtOfSum, kSum, kMax };

namespace {  // one copy of the kernel per launcher file

// out[position] = the tensor's slots combined; sums in double.
__global__ void __launch_bounds__(kCleanupBlockSize) per_tensor_slots_kernel(
    TensorSlotRanges ranges,
    const float* partials,
    float* out,
    SlotCombine combine) {
  const float* slots = partials + ranges.first_slot[blockIdx.x];
  const int num_slots = ranges.num_slots[blockIdx.x];
  if (combine == SlotCombine::kMax) {
    float largest = 0.f;
    for (int slot = threadIdx.x; slot < num_slots; slot += blockDim.x) {
      largest = NanMaxOp{}(largest, slots[slot]);
    }
    largest = block_reduce<kCleanupBlockSize>(largest, NanMaxOp{});
    if (threadIdx.x == 0) {
      out[ranges.position[blockIdx.x]] = largest;
    }
    return;
  }
  double sum = 0.0;
  for (int slot = threadIdx.x; slot < num_slots; slot += blockDim.x) {
    sum += slots[slot];
  }
  sum = block_sum<kCleanupBlockSize>(sum);
  if (threadIdx.x == 0) {
    out[ranges.position[blockIdx.x]] = static_cast<float>(combine == SlotCombine::kSum ? sum : ::sqrt(sum));
  }
}

}  // namespace

// out[i] for every tensor of the plan with at least one chunk (the others
// are left as they are: callers zero `out`). Runs on `stream`.
inline void per_tensor_from_slots(
    cudaStream_t stream,
    const SlotPlan& plan,
    const float* partials,
    float* out,
    SlotCombine combine) {
  TensorSlotRanges ranges{};
  int packed = 0;
  const auto launch = [&]() {
    APEX_AMP_LAUNCH(packed, kCleanupBlockSize, 0, stream, per_tensor_slots_kernel)(
        ranges, partials, out, combine);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    packed = 0;
  };
  for (size_t i = 0; i < plan.tensor_num_slots.size(); ++i) {
    if (plan.tensor_num_slots[i] == 0) {
      continue;
    }
    ranges.first_slot[packed] = plan.tensor_first_slot[i];
    ranges.num_slots[packed] = static_cast<int32_t>(plan.tensor_num_slots[i]);
    ranges.position[packed] = static_cast<int32_t>(i);
    if (++packed == TensorSlotRanges::kMaxTensors) {
      launch();
    }
  }
  if (packed > 0) {
    launch();
  }
}

// Per-chunk partials of one list: sum of squares or largest |x|, in fp32.
template <typename T>
struct ChunkPartialFunctor {
  float* partials;  // this dtype group's first slot
  bool take_max;

  __device__ void operator()(const Chunk<1>& chunk) const {
    const T* values = chunk_data<T>(chunk, 0);
    float result = 0.f;
    for_each_element(chunk.size, is_vector_aligned<T>(values), [&](auto width, int i) {
      constexpr int W = decltype(width)::value;
      float x[W];
      load_floats<W>(values + i, x);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        result = take_max ? NanMaxOp{}(result, ::fabsf(x[k])) : result + x[k] * x[k];
      }
    });
    result = take_max ? block_reduce<kBlockSize>(result, NanMaxOp{}) : block_sum<kBlockSize>(result);
    if (threadIdx.x == 0) {
      partials[chunk.slot] = result;
    }
  }
};

// The per-chunk partials of `tensors` into `partials` (plan.num_slots floats).
inline void chunk_partials(
    cudaStream_t stream,
    const std::vector<DtypeGroup<1>>& groups,
    const SlotPlan& plan,
    float* partials,
    bool take_max) {
  for (size_t g = 0; g < groups.size(); ++g) {
    dispatch_floating(groups[g].dtypes[0], [&](auto tag) {
      using T = typename decltype(tag)::type;
      multi_tensor_apply<1>(
          stream, groups[g].tensors, ChunkPartialFunctor<T>{partials + plan.group_first_slot[g], take_max});
    });
  }
}

}  // namespace apex_amp
