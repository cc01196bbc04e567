// CUDA launcher of fused_adagrad_: apex's Adagrad (amp_math.h: the
// AdagradHyper rule) over whole tensor lists, one pass per element.
// found_inf set: nothing changes. Adagrad counts no steps.
#include "amp_math.h"
#include "cuda/formatted_rule.cuh"
#include "cuda/fused_rule.cuh"
#include "cuda/launchers.h"
#include "validate.h"

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

namespace apex_amp {
void fused_adagrad_cuda(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList state_sums,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    double lr,
    double eps,
    double weight_decay,
    bool adagrad_w_mode,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding) {
  if (params.empty()) {
    return;  // nothing to run, and no tensor to take the device from
  }
  const at::Device device = params[0].device();
  validate_fused_adagrad(
      params, grads, state_sums, model_params, master_remainders, state_absmaxes, lr, eps,
      weight_decay, inv_scale, found_inf, state_rounding, device);
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const AdagradHyper hyper{
      static_cast<float>(lr), static_cast<float>(eps), static_cast<float>(weight_decay), adagrad_w_mode};
  const FusedStepArgs args{nullptr, optional_data(inv_scale), optional_data(found_inf),
                           rounding_data(state_rounding)};
  run_rule_with_formats(
      stream, params, grads, {state_sums}, model_params, master_remainders, state_absmaxes, hyper, args);
}

}  // namespace apex_amp
