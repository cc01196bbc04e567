// CPU launcher of fused_adam_: one Adam/AdamW step over whole lists, one pass
// per element (kernels.inc: adam_unit), math in fp32.
//
// Supported dtypes, per index i:
//   params[i] fp32 (master weights): grads[i] fp32, fp16 or bf16; model_params
//     empty, or model_params[i] fp16, bf16 or fp32 (written from the updated
//     params in the same pass);
//   params[i] fp16 or bf16: grads[i] of the same dtype, no model_params;
//   exp_avgs[i], exp_avg_sqs[i]: the dtype of params[i]
// (checked by validate.h: validate_fused_adam, shared with CUDA).
// With found_inf given and non-zero the op does nothing at all (not even the
// step increment). Otherwise step is incremented first, and the bias
// correction uses the incremented value; this holds for empty lists too, so
// an optimizer whose parameter groups are all empty still counts its steps.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "amp_math.h"
#include "validate.h"
#include "cpu/kernel_table.h"
#include "cpu/list_parallel.h"

namespace apex_amp::cpu {
namespace {

const at::Device kCpu(at::kCPU);

void fused_adam_cpu(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList model_params,
    const at::Tensor& step,
    double lr,
    double beta1,
    double beta2,
    double eps,
    double weight_decay,
    bool adamw_mode,
    bool bias_correction,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf) {
  validate_fused_adam(
      params, grads, exp_avgs, exp_avg_sqs, model_params, step, lr, beta1, beta2, eps,
      weight_decay, inv_scale, found_inf, kCpu);
  const bool has_model_params = !model_params.empty();

  // Any non-zero value (NaN included) means "skip this step".
  if (found_inf.has_value() && *found_inf->data_ptr<float>() != 0.f) {
    return;
  }
  float& step_count = *step.data_ptr<float>();
  step_count += 1.f;
  const AdamStepParams hyper = make_adam_step_params(
      static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
      static_cast<float>(eps), static_cast<float>(weight_decay), step_count, adamw_mode,
      bias_correction);
  const float inv_scale_value = inv_scale.has_value() ? *inv_scale->data_ptr<float>() : 1.f;

  const ListPlan plan(params);
  const ListOperand param_operand(params);
  const ListOperand grad_operand(grads);
  const ListOperand exp_avg_operand(exp_avgs);
  const ListOperand exp_avg_sq_operand(exp_avg_sqs);
  const ListOperand model_operand(model_params);
  AdamOperands operands{
      param_operand.view(), grad_operand.view(), exp_avg_operand.view(),
      exp_avg_sq_operand.view(), model_operand.view()};
  if (!has_model_params) {
    operands.model_params = OperandView{nullptr, nullptr};
  }
  active_kernels().adam(plan.view(), operands, hyper, inv_scale_value);
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_amp, CPU, m) {
  m.impl("fused_adam_", &fused_adam_cpu);
}

}  // namespace apex_amp::cpu
