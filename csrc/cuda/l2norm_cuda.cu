// CUDA kernels of l2norm: the L2 norm of a whole tensor list and of each tensor.
//
// Two stages, no float atomics, so the result is the same on every run:
//   1. a multi-tensor pass writes one fp32 sum of squares per chunk into a
//      workspace (`partials`), at the chunk's slot; the chunks of one tensor
//      occupy consecutive slots;
//   2. cleanup kernels add the slots in double, in a fixed order: one block
//      sums all of them into the total, and (when asked) one block per
//      tensor sums that tensor's slot range into its norm (reductions.cuh).
//      (Like the CPU kernel: fp32 within a chunk, double across chunks and tensors.)
#include "cuda/dtype_groups.cuh"
#include "cuda/launch.cuh"
#include "cuda/launchers.h"
#include "cuda/multi_tensor_apply.cuh"
#include "cuda/reductions.cuh"
#include "validate.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <tuple>
#include <vector>

namespace apex_amp {
namespace {

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

}  // namespace

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
  const SlotPlan plan(groups, tensors.size());
  const int64_t num_slots = plan.num_slots;
  if (num_slots == 0) {
    return {total, norms};
  }

  at::Tensor partials = at::empty({num_slots}, float_options);
  float* partials_ptr = partials.data_ptr<float>();
  chunk_partials(stream, groups, plan, partials_ptr, /*take_max=*/false);

  APEX_AMP_LAUNCH(1, kCleanupBlockSize, 0, stream, total_norm_kernel)(
      partials_ptr, num_slots, total.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  if (per_tensor) {
    per_tensor_from_slots(stream, plan, partials_ptr, norms.data_ptr<float>(), SlotCombine::kSqrtOfSum);
  }
  return {total, norms};
}

}  // namespace apex_amp
