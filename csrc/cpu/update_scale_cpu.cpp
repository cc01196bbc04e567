// CPU launcher of update_scale_: validate (validate.h), then apply amp_math.h's
// update_scale_math once to the one-element state tensors.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

#include "amp_math.h"
#include "validate.h"

namespace apex_amp::cpu {
namespace {

const at::Device kCpu(at::kCPU);

void update_scale_cpu(
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
  validate_update_scale(
      scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
      growth_interval, hysteresis, min_scale, max_scale, kCpu);

  float& scale_value = *scale.data_ptr<float>();
  int32_t& growth_count = *growth_tracker.data_ptr<int32_t>();
  int32_t& hysteresis_left = *hysteresis_tracker.data_ptr<int32_t>();
  // Any non-zero value, NaN included, is an overflow.
  const bool overflow = *found_inf.data_ptr<float>() != 0.f;
  const ScaleRule rule{
      growth_factor,
      backoff_factor,
      static_cast<int32_t>(growth_interval),
      static_cast<int32_t>(hysteresis),
      static_cast<float>(min_scale),
      static_cast<float>(max_scale),
      consecutive_hysteresis};
  update_scale_math(scale_value, growth_count, hysteresis_left, overflow, rule);
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_amp, CPU, m) {
  m.impl("update_scale_", &update_scale_cpu);
}

}  // namespace apex_amp::cpu
