// CUDA launcher of fused_sgd_: SGD with momentum (amp_math.h: sgd_update) over
// whole tensor lists, one pass per element; without momentum buffers the
// stateless rule. found_inf set: nothing changes. SGD counts no steps.
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
void fused_sgd_cuda(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList momentum_buffers,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    double lr,
    double momentum,
    double dampening,
    double weight_decay,
    bool nesterov,
    bool first_run,
    bool wd_after_momentum,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding) {
  if (params.empty()) {
    return;  // nothing to run, and no tensor to take the device from
  }
  const at::Device device = params[0].device();
  validate_fused_sgd(
      params, grads, momentum_buffers, model_params, master_remainders, state_absmaxes, lr,
      momentum, dampening, weight_decay, nesterov, inv_scale, found_inf, state_rounding, device);
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const FusedStepArgs args{nullptr, optional_data(inv_scale), optional_data(found_inf),
                           rounding_data(state_rounding)};
  if (momentum_buffers.empty()) {
    const PlainSgdHyper hyper{static_cast<float>(lr), static_cast<float>(weight_decay)};
    run_rule_with_formats(stream, params, grads, {}, model_params, master_remainders, state_absmaxes, hyper, args);
    return;
  }
  const SgdHyper hyper{
      static_cast<float>(lr), static_cast<float>(momentum), static_cast<float>(dampening),
      static_cast<float>(weight_decay), nesterov, first_run, wd_after_momentum};
  run_rule_with_formats(
      stream, params, grads, {momentum_buffers}, model_params, master_remainders, state_absmaxes, hyper, args);
}

}  // namespace apex_amp
