// CPU launcher of fused_lamb_: apex's LAMB. Two passes over the lists:
//   1. the moments (amp_math.h: lamb_moments), with the gradients unscaled and
//      divided by the global-norm clip (lamb_grad_scale of grad_norm, the norm
//      of the grads as given, times inv_scale); per tensor, the norms of the
//      param and of the update direction;
//   2. the update (the LambHyper rule), lr times each tensor's trust ratio
//      (lamb_trust_step) as its value.
// found_inf set: nothing changes, step count included.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

#include "amp_math.h"
#include "validate.h"
#include "cpu/fused_step_cpu.h"

namespace apex_amp::cpu {
namespace {

void fused_lamb_cpu(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    const at::Tensor& step,
    const at::Tensor& grad_norm,
    double lr,
    double beta1,
    double beta2,
    double eps,
    double weight_decay,
    bool bias_correction,
    bool grad_averaging,
    bool adam_w_mode,
    double max_grad_norm,
    bool use_nvlamb,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding) {
  validate_fused_lamb(
      params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
      grad_norm, lr, beta1, beta2, eps, weight_decay, max_grad_norm, inv_scale, found_inf, state_rounding, at::kCPU);
  const std::optional<float> step_after = take_step(step, found_inf);
  if (!step_after) {
    return;
  }
  const float inv = value_or_one(inv_scale);
  LambHyper hyper =
      lamb_hyper(beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, adam_w_mode);
  hyper.grad_scale =
      lamb_grad_scale(*grad_norm.data_ptr<float>() * inv, static_cast<float>(max_grad_norm));
  prepare_step(hyper, *step_after);

  const FusedLists lists(
      params, grads, {exp_avgs, exp_avg_sqs}, model_params, master_remainders, state_absmaxes, state_rounding);
  const ListPlan& plan = lists.list_plan();
  std::vector<float> param_squares(plan.num_units());
  std::vector<float> direction_squares(plan.num_units());
  active_kernels().lamb_moments(
      plan.view(), lists.operands(), hyper, inv, param_squares.data(), direction_squares.data());
  const std::vector<double> param_sums = per_tensor_sums(plan, param_squares, params.size());
  const std::vector<double> direction_sums = per_tensor_sums(plan, direction_squares, params.size());
  std::vector<float> trust_steps(params.size());
  for (size_t t = 0; t < params.size(); ++t) {
    trust_steps[t] = lamb_trust_step(
        static_cast<float>(std::sqrt(param_sums[t])), static_cast<float>(std::sqrt(direction_sums[t])),
        static_cast<float>(lr), hyper.weight_decay, use_nvlamb);
  }
  active_kernels().lamb(plan.view(), lists.operands(trust_steps.data()), hyper, inv);
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_amp, CPU, m) {
  m.impl("fused_lamb_", &fused_lamb_cpu);
}

}  // namespace apex_amp::cpu
