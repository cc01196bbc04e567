// CPU launcher of fused_novograd_: apex's NovoGrad. Two passes:
//   1. each tensor's gradient norm (L2, or L-infinity with norm_type 0; or
//      grad_norms[i] when given: FSDP2's norms of the whole gradients),
//      unscaled, blended into its one-element second moment exp_avg_sqs[i]
//      (amp_math.h: novograd_blend);
//   2. the elementwise rule (NovoGradHyper) with that moment as the tensor's value.
// found_inf set: nothing changes, step count included.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "amp_math.h"
#include "validate.h"
#include "cpu/fused_step_cpu.h"

namespace apex_amp::cpu {
namespace {

// Each gradient's norm: L2 (sums of squares per unit, in double per tensor),
// or the largest |g| (NaN if any is); 0 for an empty tensor.
void compute_norms(at::TensorList grads, bool l2, std::vector<double>& norms) {
  const ListPlan grad_plan(grads);
  const ListOperand grad_operand(grads);
  std::vector<float> unit_values(grad_plan.num_units());
  if (l2) {
    active_kernels().sum_of_squares(grad_plan.view(), grad_operand.view(), unit_values.data());
    norms = per_tensor_sums(grad_plan, unit_values, grads.size());
    for (double& norm : norms) {
      norm = std::sqrt(norm);
    }
    return;
  }
  active_kernels().max_abs(grad_plan.view(), grad_operand.view(), unit_values.data());
  for (int64_t u = 0; u < grad_plan.num_units(); ++u) {
    double& norm = norms[grad_plan.units()[u].tensor];
    const double value = unit_values[u];
    norm = (value != value || value > norm) ? value : norm;
  }
}

void fused_novograd_cpu(
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
    bool bias_correction,
    bool grad_averaging,
    bool reg_inside_moment,
    int64_t norm_type,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding,
    const std::optional<at::Tensor>& grad_norms) {
  validate_fused_novograd(
      params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
      lr, beta1, beta2, eps, weight_decay, norm_type, inv_scale, found_inf, state_rounding, grad_norms, at::kCPU);
  const std::optional<float> step_after = take_step(step, found_inf);
  if (!step_after) {
    return;
  }
  const float inv = value_or_one(inv_scale);
  const bool l2 = norm_type == 2;

  // 1. Per-tensor gradient norms, blended into the second moments.
  std::vector<double> norms(grads.size(), 0.0);
  if (grad_norms.has_value()) {
    const float* given = grad_norms->data_ptr<float>();
    std::copy(given, given + grads.size(), norms.begin());
  } else {
    compute_norms(grads, l2, norms);
  }
  std::vector<float> moments(grads.size());
  for (size_t t = 0; t < grads.size(); ++t) {
    float& moment = *exp_avg_sqs[t].data_ptr<float>();
    moment = novograd_blend(moment, static_cast<float>(norms[t]) * inv, static_cast<float>(beta2), l2);
    moments[t] = moment;
  }

  // 2. The elementwise rule.
  NovoGradHyper hyper = novograd_hyper(
      lr, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, reg_inside_moment);
  prepare_step(hyper, *step_after);
  const FusedLists lists(
      params, grads, {exp_avgs}, model_params, master_remainders, state_absmaxes, state_rounding);
  active_kernels().novograd(lists.plan(), lists.operands(moments.data()), hyper, inv);
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_amp, CPU, m) {
  m.impl("fused_novograd_", &fused_novograd_cpu);
}

}  // namespace apex_amp::cpu
