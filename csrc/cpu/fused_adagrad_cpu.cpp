// CPU launcher of fused_adagrad_: apex's Adagrad (amp_math.h: the
// AdagradHyper rule) over whole lists, one pass per element. found_inf set:
// nothing changes. Adagrad counts no steps.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>

#include "amp_math.h"
#include "validate.h"
#include "cpu/fused_step_cpu.h"

namespace apex_amp::cpu {
namespace {

void fused_adagrad_cpu(
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
  validate_fused_adagrad(
      params, grads, state_sums, model_params, master_remainders, state_absmaxes, lr, eps,
      weight_decay, inv_scale, found_inf, state_rounding, at::kCPU);
  if (found_inf.has_value() && *found_inf->data_ptr<float>() != 0.f) {
    return;
  }
  const AdagradHyper hyper{
      static_cast<float>(lr), static_cast<float>(eps), static_cast<float>(weight_decay), adagrad_w_mode};
  const FusedLists lists(
      params, grads, {state_sums}, model_params, master_remainders, state_absmaxes, state_rounding);
  active_kernels().adagrad(lists.plan(), lists.operands(), hyper, value_or_one(inv_scale));
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_amp, CPU, m) {
  m.impl("fused_adagrad_", &fused_adagrad_cpu);
}

}  // namespace apex_amp::cpu
