// CPU launcher of fused_sgd_: SGD with momentum (amp_math.h: sgd_update) over
// whole lists, one pass per element. Without momentum buffers (momentum 0)
// the rule keeps no state. found_inf set: nothing changes. SGD counts no steps.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>

#include "amp_math.h"
#include "validate.h"
#include "cpu/fused_step_cpu.h"

namespace apex_amp::cpu {
namespace {

void fused_sgd_cpu(
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
  validate_fused_sgd(
      params, grads, momentum_buffers, model_params, master_remainders, state_absmaxes, lr,
      momentum, dampening, weight_decay, nesterov, inv_scale, found_inf, state_rounding, at::kCPU);
  if (found_inf.has_value() && *found_inf->data_ptr<float>() != 0.f) {
    return;
  }
  const float inv = value_or_one(inv_scale);
  if (momentum_buffers.empty()) {
    const PlainSgdHyper hyper{static_cast<float>(lr), static_cast<float>(weight_decay)};
    const FusedLists lists(
        params, grads, {}, model_params, master_remainders, state_absmaxes, state_rounding);
    active_kernels().plain_sgd(lists.plan(), lists.operands(), hyper, inv);
    return;
  }
  const SgdHyper hyper{
      static_cast<float>(lr), static_cast<float>(momentum), static_cast<float>(dampening),
      static_cast<float>(weight_decay), nesterov, first_run, wd_after_momentum};
  const FusedLists lists(
      params, grads, {momentum_buffers}, model_params, master_remainders, state_absmaxes, state_rounding);
  active_kernels().sgd(lists.plan(), lists.operands(), hyper, inv);
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_amp, CPU, m) {
  m.impl("fused_sgd_", &fused_sgd_cpu);
}

}  // namespace apex_amp::cpu
