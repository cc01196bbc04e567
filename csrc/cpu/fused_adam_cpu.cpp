// CPU launcher of fused_adam_: one Adam/AdamW step over whole lists, one pass
// per element (amp_math.h: adam_update, run by kernels.inc's rule_kernel),
// math in fp32.
//
// Supported dtypes, per index i (validate.h: validate_fused_adam, shared with CUDA):
//   params[i] fp32 (master weights): grads[i] fp32, fp16 or bf16; model_params
//     empty, or model_params[i] fp16, bf16 or fp32 (written from the updated
//     params in the same pass);
//   params[i] fp16 or bf16: grads[i] of the same dtype, no model_params;
//   exp_avgs[i], exp_avg_sqs[i]: the dtype of params[i].
// With found_inf given and non-zero the op does nothing at all (not even the
// step increment). Otherwise step is incremented first, and the bias
// correction uses the incremented value; this holds for empty lists too, so
// an optimizer whose parameter groups are all empty still counts its steps.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>

#include "amp_math.h"
#include "validate.h"
#include "cpu/fused_step_cpu.h"

namespace apex_amp::cpu {
namespace {

void fused_adam_cpu(
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
  validate_fused_adam(
      params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
      lr, beta1, beta2, eps, weight_decay, inv_scale, found_inf, state_rounding, at::kCPU);
  const std::optional<float> step_after = take_step(step, found_inf);
  if (!step_after) {
    return;
  }
  AdamStepParams hyper =
      adam_hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction);
  prepare_step(hyper, *step_after);
  const FusedLists lists(
      params, grads, {exp_avgs, exp_avg_sqs}, model_params, master_remainders, state_absmaxes, state_rounding);
  active_kernels().adam(lists.plan(), lists.operands(), hyper, value_or_one(inv_scale));
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_amp, CPU, m) {
  m.impl("fused_adam_", &fused_adam_cpu);
}

}  // namespace apex_amp::cpu
