// CUDA kernels of l2norm: the L2 norm of a whole tensor list and of each tensor.
//
// Two stages, no float atomics, so the result is the same on every run:
//   1. a multi-tensor pass writes one fp32 sum of squares per chunk into a
//      workspace (`partials`), at the chunk's slot; the chunks of one tensor
//      occupy consecutive slots;
//   2. cleanup kernels add the slots in double, in a fixed order: one block
//      sums all of them into the total, and (when asked) one block per
//      tensor sums that tensor's slot range into its norm. (Like the CPU
//      kernel: fp32 within a chunk, double across chunks and tensors.)
#include "cuda/dtype_groups.cuh"
#include "cuda/launch.cuh"
#include "cuda/multi_tensor_apply.cuh"
#include "validate.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace apex_amp {
namespace {

constexpr int kWarpSize = 32;
// Threads per block of the cleanup kernels (slots are few: one per 64K elements).
constexpr int kCleanupBlockSize = 256;

// The sum of `value` over the block, valid in thread 0. Fixed reduction
// order, hence deterministic. Call once per kernel from every thread.
template <int BlockSize, typename T>
__device__ __forceinline__ T block_sum(T value) {
  static_assert(BlockSize % kWarpSize == 0 && BlockSize / kWarpSize <= kWarpSize, "");
  __shared__ T warp_sums[BlockSize / kWarpSize];
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  if (lane == 0) {
    warp_sums[warp] = value;
  }
  __syncthreads();
  value = threadIdx.x < BlockSize / kWarpSize ? warp_sums[threadIdx.x] : T(0);
  if (warp == 0) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      value += __shfl_down_sync(0xffffffffu, value, offset);
    }
  }
  return value;
}

// Stage 1: partials[chunk.slot] = sum of squares of the chunk, in fp32.
template <typename T>
struct SumOfSquaresFunctor {
  float* partials;  // this dtype group's first slot

  __device__ void operator()(const Chunk<1>& chunk) const {
    const T* values = chunk_data<T>(chunk, 0);
    float sum = 0.f;
    for_each_element(chunk.size, is_vector_aligned<T>(values), [&](auto width, int i) {
      constexpr int W = decltype(width)::value;
      float x[W];
      load_floats<W>(values + i, x);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        sum += x[k] * x[k];
      }
    });
    sum = block_sum<kBlockSize>(sum);
    if (threadIdx.x == 0) {
      partials[chunk.slot] = sum;
    }
  }
};

// Stage 2a: total = sqrt(sum of all slots). One block.
__global__ void __launch_bounds__(kCleanupBlockSize)
    total_norm_kernel(const float* partials, int64_t num_slots, float* total) {
  double sum = 0.0;
  for (int64_t slot = threadIdx.x; slot < num_slots; slot += blockDim.x) {
    sum += partials[slot];
  }
  sum = block_sum<kCleanupBlockSize>(sum);
  if (threadIdx.x == 0) {
    *total = static_cast<float>(::sqrt(sum));
  }
}

// Stage 2b: one block per tensor, packed into the kernel argument like the
// multi-tensor metadata (16 bytes per tensor; 224 tensors stay under 4 KB).
struct TensorSlotRanges {
  static constexpr int kMaxTensors = 224;
  int64_t first_slot[kMaxTensors];
  int32_t num_slots[kMaxTensors];
  int32_t position[kMaxTensors];  // index of the tensor in the op's list
};
static_assert(sizeof(TensorSlotRanges) + 2 * sizeof(void*) <= kKernelArgLimitBytes, "");

__global__ void __launch_bounds__(kCleanupBlockSize) per_tensor_norm_kernel(
    TensorSlotRanges ranges,
    const float* partials,
    float* norms) {
  const float* slots = partials + ranges.first_slot[blockIdx.x];
  const int num_slots = ranges.num_slots[blockIdx.x];
  double sum = 0.0;
  for (int slot = threadIdx.x; slot < num_slots; slot += blockDim.x) {
    sum += slots[slot];
  }
  sum = block_sum<kCleanupBlockSize>(sum);
  if (threadIdx.x == 0) {
    norms[ranges.position[blockIdx.x]] = static_cast<float>(::sqrt(sum));
  }
}

std::tuple<at::Tensor, at::Tensor> l2norm_cuda(at::TensorList tensors, bool per_tensor) {
  // A list with no tensor never dispatches to CUDA; the first tensor is there.
  TORCH_CHECK(!tensors.empty(), "apex_amp.l2norm: internal error: empty list on CUDA");
  const at::Device device = tensors[0].device();
  validate_l2norm(tensors, device);
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto float_options = at::TensorOptions().dtype(at::kFloat).device(device);
  const int64_t num_tensors = static_cast<int64_t>(tensors.size());
  // Zero-filled: an empty tensor (no chunk, no slot) has norm 0.
  at::Tensor total = at::zeros({}, float_options);
  at::Tensor norms = at::zeros({per_tensor ? num_tensors : 0}, float_options);

  // Slots in the order the multi-tensor passes number their chunks: group by
  // group, then list order within the group.
  const auto groups = group_by_dtype<1>({tensors});
  std::vector<int64_t> group_first_slot;
  std::vector<int64_t> tensor_first_slot(tensors.size());
  int64_t num_slots = 0;
  for (const auto& group : groups) {
    group_first_slot.push_back(num_slots);
    for (size_t k = 0; k < group.tensors.size(); ++k) {
      tensor_first_slot[group.positions[k]] = num_slots;
      num_slots += num_chunks(group.tensors[k].numel);
    }
  }
  if (num_slots == 0) {
    return {total, norms};
  }

  at::Tensor partials = at::empty({num_slots}, float_options);
  float* partials_ptr = partials.data_ptr<float>();
  for (size_t g = 0; g < groups.size(); ++g) {
    dispatch_floating(groups[g].dtypes[0], [&](auto tag) {
      using T = typename decltype(tag)::type;
      multi_tensor_apply<1>(
          stream, groups[g].tensors, SumOfSquaresFunctor<T>{partials_ptr + group_first_slot[g]});
    });
  }

  APEX_AMP_LAUNCH(1, kCleanupBlockSize, 0, stream, total_norm_kernel)(
      partials_ptr, num_slots, total.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  if (per_tensor) {
    float* norms_ptr = norms.data_ptr<float>();
    TensorSlotRanges ranges{};
    int packed = 0;
    const auto launch = [&]() {
      APEX_AMP_LAUNCH(packed, kCleanupBlockSize, 0, stream, per_tensor_norm_kernel)(
          ranges, partials_ptr, norms_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      packed = 0;
    };
    for (size_t i = 0; i < tensors.size(); ++i) {
      const int64_t chunks = num_chunks(tensors[i].numel());
      if (chunks == 0) {
        continue;  // norm stays 0
      }
      ranges.first_slot[packed] = tensor_first_slot[i];
      ranges.num_slots[packed] = static_cast<int32_t>(chunks);
      ranges.position[packed] = static_cast<int32_t>(i);
      if (++packed == TensorSlotRanges::kMaxTensors) {
        launch();
      }
    }
    if (packed > 0) {
      launch();
    }
  }
  return {total, norms};
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_amp, CUDA, m) {
  m.impl("l2norm", &l2norm_cuda);
}

}  // namespace apex_amp
