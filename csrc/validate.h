// Host-side argument validation of every apex_amp op, one function per op,
// for the CPU and the CUDA launchers alike: each launcher passes the device
// it runs on, and both backends then accept and reject the same inputs with
// the same messages. Call before any work starts.
//
// This file is the authority on what an op accepts. The fake kernels in
// apex_amp/_fallback.py check the metadata part of these rules (lengths,
// dtypes, devices, sizes, layouts) in their own words, as fake kernels must
// for torch.compile; the tests check that both reject the same calls and
// name the same argument, not that they use the same words.
#pragma once

#include "checks.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <optional>

namespace apex_amp {

inline void validate_check_finite(
    at::TensorList tensors,
    const at::Tensor& found_inf,
    const at::Device& device) {
  constexpr const char* op = "check_finite";
  check_tensor_list(op, "tensors", tensors, device);
  check_scalar_tensor(op, "found_inf", found_inf, device);
}

inline void validate_unscale(
    at::TensorList grads,
    const at::Tensor& found_inf,
    const at::Tensor& inv_scale,
    const at::Device& device) {
  constexpr const char* op = "unscale_";
  check_tensor_list(op, "grads", grads, device);
  check_disjoint_within(op, "grads", grads);
  check_scalar_tensor(op, "found_inf", found_inf, device);
  check_scalar_tensor(op, "inv_scale", inv_scale, device);
}

inline void validate_scale(
    at::TensorList src,
    at::TensorList dst,
    const at::Tensor& scale,
    const at::Tensor& found_inf,
    const at::Device& device) {
  constexpr const char* op = "scale_";
  check_same_length(op, "src", src, "dst", dst);
  check_tensor_list(op, "src", src, device);
  check_tensor_list(op, "dst", dst, device);
  check_disjoint_within(op, "dst", dst);
  check_corresponding(op, "src", src, "dst", dst);
  check_no_partial_overlap(op, "src", src, "dst", dst);
  check_scalar_tensor(op, "scale", scale, device);
  check_scalar_tensor(op, "found_inf", found_inf, device);
}

inline void validate_axpby(
    at::TensorList x,
    at::TensorList y,
    const at::Tensor& a,
    const at::Tensor& found_inf,
    const at::Device& device) {
  constexpr const char* op = "axpby_";
  check_same_length(op, "x", x, "y", y);
  check_tensor_list(op, "x", x, device);
  check_tensor_list(op, "y", y, device);
  check_disjoint_within(op, "y", y);
  check_corresponding(op, "x", x, "y", y);
  check_no_partial_overlap(op, "x", x, "y", y);
  check_scalar_tensor(op, "a", a, device);
  check_scalar_tensor(op, "found_inf", found_inf, device);
}

inline void validate_l2norm(at::TensorList tensors, const at::Device& device) {
  check_tensor_list("l2norm", "tensors", tensors, device);
}

// Tensors that fused_adam_ writes element by element must not share memory.
inline void check_adam_disjoint(
    const char* name_a,
    at::TensorList a,
    const char* name_b,
    at::TensorList b) {
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK(
        at::get_overlap_status(a[i], b[i]) == at::MemOverlapStatus::No, "apex_amp.fused_adam_: ",
        name_a, "[", i, "] and ", name_b, "[", i,
        "] share memory; each parameter needs its own moment buffers");
  }
}

// The dtype combinations fused_adam_ supports, per index i:
//   params[i] fp32 (master weights): grads[i] fp32, fp16 or bf16; model_params
//     empty, or model_params[i] fp16, bf16 or fp32;
//   params[i] fp16 or bf16: grads[i] of the same dtype, no model_params;
//   exp_avgs[i], exp_avg_sqs[i]: the dtype of params[i].
inline void check_adam_dtypes(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList model_params) {
  constexpr const char* op = "fused_adam_";
  const bool has_model_params = !model_params.empty();
  for (size_t i = 0; i < params.size(); ++i) {
    const at::ScalarType param_dtype = params[i].scalar_type();
    if (param_dtype != at::kFloat) {
      TORCH_CHECK(
          grads[i].scalar_type() == param_dtype, "apex_amp.", op, ": grads[", i, "] has dtype ",
          grads[i].scalar_type(), " but params[", i, "] is ", param_dtype,
          "; fp16/bf16 params need grads of the same dtype (or keep fp32 master params)");
      TORCH_CHECK(
          !has_model_params, "apex_amp.", op, ": model_params[", i, "] was given but params[", i,
          "] is ", param_dtype,
          "; a model copy is written only from fp32 master params, pass model_params=[] "
          "or fp32 params");
    }
    TORCH_CHECK(
        exp_avgs[i].scalar_type() == param_dtype, "apex_amp.", op, ": exp_avgs[", i,
        "] has dtype ", exp_avgs[i].scalar_type(), "; expected ", param_dtype,
        ", the dtype of params[", i, "]");
    TORCH_CHECK(
        exp_avg_sqs[i].scalar_type() == param_dtype, "apex_amp.", op, ": exp_avg_sqs[", i,
        "] has dtype ", exp_avg_sqs[i].scalar_type(), "; expected ", param_dtype,
        ", the dtype of params[", i, "]");
  }
}

inline void validate_fused_adam(
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
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const at::Device& device) {
  constexpr const char* op = "fused_adam_";
  check_same_length(op, "params", params, "grads", grads);
  check_same_length(op, "params", params, "exp_avgs", exp_avgs);
  check_same_length(op, "params", params, "exp_avg_sqs", exp_avg_sqs);
  const bool has_model_params = !model_params.empty();
  if (has_model_params) {
    check_same_length(op, "params", params, "model_params", model_params);
  }
  check_tensor_list(op, "params", params, device);
  check_tensor_list(op, "grads", grads, device);
  check_tensor_list(op, "exp_avgs", exp_avgs, device);
  check_tensor_list(op, "exp_avg_sqs", exp_avg_sqs, device);
  check_tensor_list(op, "model_params", model_params, device);
  check_disjoint_within(op, "params", params);
  check_disjoint_within(op, "exp_avgs", exp_avgs);
  check_disjoint_within(op, "exp_avg_sqs", exp_avg_sqs);
  check_disjoint_within(op, "model_params", model_params);
  check_adam_dtypes(params, grads, exp_avgs, exp_avg_sqs, model_params);
  check_corresponding(op, "params", params, "grads", grads);
  check_corresponding(op, "params", params, "exp_avgs", exp_avgs);
  check_corresponding(op, "params", params, "exp_avg_sqs", exp_avg_sqs);
  check_adam_disjoint("params", params, "exp_avgs", exp_avgs);
  check_adam_disjoint("params", params, "exp_avg_sqs", exp_avg_sqs);
  check_adam_disjoint("exp_avgs", exp_avgs, "exp_avg_sqs", exp_avg_sqs);
  if (has_model_params) {
    check_corresponding(op, "params", params, "model_params", model_params);
    // An fp32 model_params[i] may be params[i] itself (a redundant write).
    check_no_partial_overlap(op, "params", params, "model_params", model_params);
  }
  check_scalar_tensor(op, "step", step, device);
  if (inv_scale.has_value()) {
    check_scalar_tensor(op, "inv_scale", *inv_scale, device);
  }
  if (found_inf.has_value()) {
    check_scalar_tensor(op, "found_inf", *found_inf, device);
  }
  // Written so that NaN fails every check.
  TORCH_CHECK(lr >= 0.0, "apex_amp.", op, ": lr must be >= 0, got ", lr);
  TORCH_CHECK(
      beta1 >= 0.0 && beta1 < 1.0, "apex_amp.", op, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(
      beta2 >= 0.0 && beta2 < 1.0, "apex_amp.", op, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, "apex_amp.", op, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(
      weight_decay >= 0.0, "apex_amp.", op, ": weight_decay must be >= 0, got ", weight_decay);
}

inline void validate_update_scale(
    const at::Tensor& scale,
    const at::Tensor& growth_tracker,
    const at::Tensor& hysteresis_tracker,
    const at::Tensor& found_inf,
    double growth_factor,
    double backoff_factor,
    int64_t growth_interval,
    int64_t hysteresis,
    double min_scale,
    double max_scale,
    const at::Device& device) {
  constexpr const char* op = "update_scale_";
  check_scalar_tensor(op, "scale", scale, device);
  check_scalar_tensor(op, "growth_tracker", growth_tracker, device, at::kInt);
  check_scalar_tensor(op, "hysteresis_tracker", hysteresis_tracker, device, at::kInt);
  check_scalar_tensor(op, "found_inf", found_inf, device);
  constexpr int64_t int32_max = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(
      growth_interval >= 1 && growth_interval <= int32_max, "apex_amp.", op,
      ": growth_interval must be an integer in [1, 2^31 - 1], got ", growth_interval);
  TORCH_CHECK(
      hysteresis >= 1 && hysteresis <= int32_max, "apex_amp.", op,
      ": hysteresis must be an integer in [1, 2^31 - 1], got ", hysteresis);
  // Written so that NaN fails every check.
  TORCH_CHECK(
      growth_factor >= 1.0, "apex_amp.", op, ": growth_factor must be >= 1, got ", growth_factor);
  TORCH_CHECK(
      backoff_factor > 0.0 && backoff_factor < 1.0, "apex_amp.", op,
      ": backoff_factor must be in (0, 1), got ", backoff_factor);
  // min_scale 0 and max_scale inf turn the floor and the cap off (apex's rule).
  TORCH_CHECK(
      min_scale >= 0.0 && min_scale <= max_scale, "apex_amp.", op,
      ": need 0 <= min_scale <= max_scale, got min_scale=", min_scale, " and max_scale=",
      max_scale);
}

}  // namespace apex_amp
