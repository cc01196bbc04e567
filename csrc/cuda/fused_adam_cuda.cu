// CUDA launcher of fused_adam_: one Adam/AdamW step over whole tensor lists,
// one pass per element (amp_math.h: adam_update, run by fused_rule.cuh's
// functor), with no host sync: step, inv_scale and found_inf stay on the device.
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
void fused_adam_cuda(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    const at::Tensor& step,
    double lr,
    double beta1,
    double beta2,
    double eps,
    double weight_decay,
    bool adamw_mode,
    bool bias_correction,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding) {
  const at::Device device = step.device();
  validate_fused_adam(
      params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
      lr, beta1, beta2, eps, weight_decay, inv_scale, found_inf, state_rounding, device);
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const AdamStepParams hyper =
      adam_hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction);
  const FusedStepArgs args{step.data_ptr<float>(), optional_data(inv_scale), optional_data(found_inf),
                           rounding_data(state_rounding)};
  run_rule_with_formats(
      stream, params, grads, {exp_avgs, exp_avg_sqs}, model_params, master_remainders, state_absmaxes, hyper, args);
  increment_step(stream, step.data_ptr<float>(), args.found_inf);
}

}  // namespace apex_amp
