// CPU launchers of fused_lamb_ (apex's LAMB) and of its two passes as ops of
// their own (fused_lamb_moments_, fused_lamb_update_: FSDP2 sums the per-tensor
// squared norms of its shards between them; apex_amp/optimizers/_lamb_ops.py):
//   1. the moments (amp_math.h: lamb_moments), with the gradients unscaled and
//      divided by the global-norm clip (lamb_grad_scale of grad_norm, the norm
//      of the grads as given, times inv_scale); per tensor, the squared norms
//      of the param and of the update direction;
//   2. the update (the LambHyper rule), lr times each tensor's trust ratio
//      (lamb_trust_step of the square roots) as its value.
// found_inf set: nothing changes, step count included (the first pass returns zeros).
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

#include "amp_math.h"
#include "validate.h"
#include "cpu/fused_step_cpu.h"

namespace apex_amp::cpu {
namespace {

bool step_skipped(const std::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && *found_inf->data_ptr<float>() != 0.f;
}

// The op's lists, as validated.
struct LambLists {
  at::TensorList params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes;
};

// `hyper` (lamb_hyper's) for the step numbered step_after, with the global-norm clip.
LambHyper prepared(LambHyper hyper, float step_after, const at::Tensor& grad_norm, double max_grad_norm, float inv) {
  hyper.grad_scale = lamb_grad_scale(*grad_norm.data_ptr<float>() * inv, static_cast<float>(max_grad_norm));
  prepare_step(hyper, step_after);
  return hyper;
}

// Pass 1: the moments of the next step (`step` unchanged), and the
// (2, num_tensors) squared norms (zeros when skipped).
at::Tensor moments_pass(
    const LambLists& l,
    const at::Tensor& step,
    const at::Tensor& grad_norm,
    const LambHyper& hyper,
    double max_grad_norm,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf) {
  const int64_t num_tensors = static_cast<int64_t>(l.params.size());
  at::Tensor norm_squares = at::zeros({2, num_tensors}, at::TensorOptions().dtype(at::kFloat));
  if (step_skipped(found_inf) || num_tensors == 0) {
    return norm_squares;
  }
  const float inv = value_or_one(inv_scale);
  const FusedLists lists(
      l.params, l.grads, {l.exp_avgs, l.exp_avg_sqs}, l.model_params, l.master_remainders, l.state_absmaxes);
  const ListPlan& plan = lists.list_plan();
  std::vector<float> param_squares(plan.num_units());
  std::vector<float> direction_squares(plan.num_units());
  active_kernels().lamb_moments(
      plan.view(), lists.operands(), prepared(hyper, *step.data_ptr<float>() + 1.f, grad_norm, max_grad_norm, inv),
      inv, param_squares.data(), direction_squares.data());
  const std::vector<double> param_sums = per_tensor_sums(plan, param_squares, l.params.size());
  const std::vector<double> direction_sums = per_tensor_sums(plan, direction_squares, l.params.size());
  float* out = norm_squares.data_ptr<float>();
  for (int64_t t = 0; t < num_tensors; ++t) {
    out[t] = static_cast<float>(param_sums[t]);
    out[num_tensors + t] = static_cast<float>(direction_sums[t]);
  }
  return norm_squares;
}

// Pass 2, after pass 1: counts the step and applies it with the trust ratios of norm_squares.
void update_pass(
    const LambLists& l,
    const at::Tensor& step,
    const at::Tensor& grad_norm,
    const at::Tensor& norm_squares,
    const LambHyper& hyper,
    double lr,
    double max_grad_norm,
    bool use_nvlamb,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding) {
  const std::optional<float> step_after = take_step(step, found_inf);
  if (!step_after || l.params.empty()) {
    return;
  }
  const float inv = value_or_one(inv_scale);
  const size_t num_tensors = l.params.size();
  const float* squares = norm_squares.data_ptr<float>();
  std::vector<float> trust_steps(num_tensors);
  for (size_t t = 0; t < num_tensors; ++t) {
    trust_steps[t] = lamb_trust_step(
        std::sqrt(squares[t]), std::sqrt(squares[num_tensors + t]), static_cast<float>(lr), hyper.weight_decay,
        use_nvlamb);
  }
  const FusedLists lists(l.params, l.grads, {l.exp_avgs, l.exp_avg_sqs}, l.model_params, l.master_remainders,
                         l.state_absmaxes, state_rounding);
  active_kernels().lamb(lists.plan(), lists.operands(trust_steps.data()),
                        prepared(hyper, *step_after, grad_norm, max_grad_norm, inv), inv);
}

at::Tensor fused_lamb_moments_cpu(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    const at::Tensor& step,
    const at::Tensor& grad_norm,
    double beta1,
    double beta2,
    double eps,
    double weight_decay,
    bool bias_correction,
    bool grad_averaging,
    bool adam_w_mode,
    double max_grad_norm,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf) {
  validate_fused_lamb(
      "fused_lamb_moments_", params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes,
      step, grad_norm, 0.0, beta1, beta2, eps, weight_decay, max_grad_norm, inv_scale, found_inf, std::nullopt,
      at::kCPU);
  return moments_pass(
      {params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes}, step, grad_norm,
      lamb_hyper(beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, adam_w_mode), max_grad_norm,
      inv_scale, found_inf);
}

void fused_lamb_update_cpu(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    const at::Tensor& step,
    const at::Tensor& grad_norm,
    const at::Tensor& norm_squares,
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
  constexpr const char* op = "fused_lamb_update_";
  validate_fused_lamb(
      op, params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step, grad_norm,
      lr, beta1, beta2, eps, weight_decay, max_grad_norm, inv_scale, found_inf, state_rounding, at::kCPU);
  check_per_tensor_values(op, "norm_squares", norm_squares, 2, static_cast<int64_t>(params.size()), at::kCPU);
  update_pass(
      {params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes}, step, grad_norm,
      norm_squares, lamb_hyper(beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, adam_w_mode), lr,
      max_grad_norm, use_nvlamb, inv_scale, found_inf, state_rounding);
}

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
      "fused_lamb_", params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
      grad_norm, lr, beta1, beta2, eps, weight_decay, max_grad_norm, inv_scale, found_inf, state_rounding, at::kCPU);
  if (step_skipped(found_inf)) {
    return;
  }
  const LambLists lists{params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes};
  const LambHyper hyper =
      lamb_hyper(beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, adam_w_mode);
  const at::Tensor norm_squares = moments_pass(lists, step, grad_norm, hyper, max_grad_norm, inv_scale, found_inf);
  update_pass(lists, step, grad_norm, norm_squares, hyper, lr, max_grad_norm, use_nvlamb, inv_scale, found_inf,
              state_rounding);
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_amp, CPU, m) {
  m.impl("fused_lamb_", &fused_lamb_cpu);
  m.impl("fused_lamb_moments_", &fused_lamb_moments_cpu);
  m.impl("fused_lamb_update_", &fused_lamb_update_cpu);
}

}  // namespace apex_amp::cpu
