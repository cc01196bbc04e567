// CUDA kernel of update_scale_: the dynamic loss-scale rule of amp_math.h
// (update_scale_math) applied by one thread on the device that holds the
// scale, so the step's found_inf never has to come back to the host.
#include "amp_math.h"
#include "cuda/launch.cuh"
#include "cuda/launchers.h"
#include "validate.h"

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

namespace apex_amp {
namespace {

__global__ void update_scale_kernel(
    float* scale,
    int32_t* growth_tracker,
    int32_t* hysteresis_tracker,
    const float* found_inf,
    ScaleRule rule) {
  update_scale_math(*scale, *growth_tracker, *hysteresis_tracker, *found_inf != 0.f, rule);
}

}  // namespace

void update_scale_cuda(
    const at::Tensor& scale,
    const at::Tensor& growth_tracker,
    const at::Tensor& hysteresis_tracker,
    const at::Tensor& found_inf,
    double growth_factor,
    double backoff_factor,
    int64_t growth_interval,
    int64_t hysteresis,
    double min_scale,
    double max_scale,
    bool consecutive_hysteresis) {
  const at::Device device = scale.device();
  validate_update_scale(
      scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
      growth_interval, hysteresis, min_scale, max_scale, device);
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const ScaleRule rule{
      growth_factor,
      backoff_factor,
      static_cast<int32_t>(growth_interval),
      static_cast<int32_t>(hysteresis),
      static_cast<float>(min_scale),
      static_cast<float>(max_scale),
      consecutive_hysteresis};
  APEX_AMP_LAUNCH(1, 1, 0, stream, update_scale_kernel)(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
      hysteresis_tracker.data_ptr<int32_t>(), found_inf.data_ptr<float>(), rule);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace apex_amp
