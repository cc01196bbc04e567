// CPU launchers of the list ops check_finite, unscale_, scale_, axpby_ and
// l2norm: validate the arguments (validate.h, shared with CUDA), read the device scalars (on the CPU they
// are plain memory, so this is no sync), and run the kernels of the active
// instruction set over the whole list in one parallel pass.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "validate.h"
#include "cpu/kernel_table.h"
#include "cpu/list_parallel.h"

namespace apex_amp::cpu {
namespace {

const at::Device kCpu(at::kCPU);

float read_scalar(const at::Tensor& one_element) {
  return *one_element.data_ptr<float>();
}

// A blind write: found_inf is only ever set, never cleared.
void mark_found(const at::Tensor& found_inf) {
  *found_inf.data_ptr<float>() = 1.f;
}

void check_finite_cpu(at::TensorList tensors, const at::Tensor& found_inf) {
  validate_check_finite(tensors, found_inf, kCpu);

  const ListPlan plan(tensors);
  const ListOperand operand(tensors);
  if (active_kernels().check_finite(plan.view(), operand.view())) {
    mark_found(found_inf);
  }
}

void unscale_cpu(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  validate_unscale(grads, found_inf, inv_scale, kCpu);

  const ListPlan plan(grads);
  const ListOperand operand(grads);
  if (active_kernels().unscale(plan.view(), operand.view(), read_scalar(inv_scale))) {
    mark_found(found_inf);
  }
}

void scale_cpu(
    at::TensorList src,
    at::TensorList dst,
    const at::Tensor& scale,
    const at::Tensor& found_inf) {
  validate_scale(src, dst, scale, found_inf, kCpu);

  const ListPlan plan(src);
  const ListOperand src_operand(src);
  const ListOperand dst_operand(dst);
  if (active_kernels().scale(
          plan.view(), src_operand.view(), dst_operand.view(), read_scalar(scale))) {
    mark_found(found_inf);
  }
}

void axpby_cpu(
    at::TensorList x,
    at::TensorList y,
    const at::Tensor& a,
    double b,
    const at::Tensor& found_inf) {
  validate_axpby(x, y, a, found_inf, kCpu);

  const ListPlan plan(x);
  const ListOperand x_operand(x);
  const ListOperand y_operand(y);
  if (active_kernels().axpby(
          plan.view(), x_operand.view(), y_operand.view(), read_scalar(a),
          static_cast<float>(b))) {
    mark_found(found_inf);
  }
}

// Each work unit is summed in fp32 (a 16K-element unit spread over 16-32
// vector lanes keeps fp32 accurate), and the units of a tensor and the
// tensors of the list are added in double, in a fixed order: the result does
// not depend on the number of threads, and a huge tensor or a long list loses
// no precision across units.
std::tuple<at::Tensor, at::Tensor> l2norm_cpu(at::TensorList tensors, bool per_tensor) {
  validate_l2norm(tensors, kCpu);

  const auto options = at::TensorOptions().dtype(at::kFloat).device(kCpu);
  const int64_t num_tensors = static_cast<int64_t>(tensors.size());
  at::Tensor per_tensor_norms = at::empty({per_tensor ? num_tensors : 0}, options);

  const ListPlan plan(tensors);
  const ListOperand operand(tensors);
  std::vector<float> unit_sums(plan.num_units());
  active_kernels().sum_of_squares(plan.view(), operand.view(), unit_sums.data());

  std::vector<double> tensor_sums(num_tensors, 0.0);
  for (int64_t u = 0; u < plan.num_units(); ++u) {
    tensor_sums[plan.units()[u].tensor] += unit_sums[u];
  }
  double total_sum = 0.0;
  for (int64_t t = 0; t < num_tensors; ++t) {
    total_sum += tensor_sums[t];
    if (per_tensor) {
      per_tensor_norms.data_ptr<float>()[t] = static_cast<float>(std::sqrt(tensor_sums[t]));
    }
  }
  at::Tensor total = at::empty({}, options);
  *total.data_ptr<float>() = static_cast<float>(std::sqrt(total_sum));
  return {total, per_tensor_norms};
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_amp, CPU, m) {
  m.impl("check_finite", &check_finite_cpu);
  m.impl("unscale_", &unscale_cpu);
  m.impl("scale_", &scale_cpu);
  m.impl("axpby_", &axpby_cpu);
  m.impl("l2norm", &l2norm_cpu);
}

}  // namespace apex_amp::cpu
