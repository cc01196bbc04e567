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

#include <ATen/core/Tensor.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

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

// ---- fused optimizer steps -------------------------------------------------
// What every fused optimizer op shares: params (updated), grads, the
// per-element state lists of its rule (updated), an optional model copy, the
// state operands (master_remainders, state_absmaxes), the optional flags; and
// the dtype combinations, per index i:
//   params[i] fp32, or bf16 with master_remainders[i] (fp32 masters): grads[i]
//     fp32, fp16 or bf16; model_params empty, or (fp32 params only)
//     model_params[i] fp16, bf16 or fp32; each state in a state format
//     (kStateFormatDtypes: fp32, bf16, fp8 e4m3, int8 or uint8 codes);
//   params[i] fp16 or bf16 without remainder: grads[i] and each state of the
//     same dtype, no model_params.
// master_remainders: empty, or one int16 tensor per bf16 param, with its sizes
// and strides (the low halves of the fp32 masters; no model_params then).
// state_absmaxes: empty when no state is blocked, else one fp32 contiguous
// tensor per state and param, state-list-major (k * params.size() + i): numel
// 0 for an fp32/bf16 state, numel / B for an fp8/int8/uint8 one, B (the
// tensor's block) a power of two in [kMinStateBlock, kMaxStateBlock].
struct NamedList {
  const char* name;
  at::TensorList list;
};

constexpr std::initializer_list<at::ScalarType> kStateFormatDtypes = {
    at::kFloat, at::kBFloat16, at::kFloat8_e4m3fn, at::kChar, at::kByte};
// Every dtype a state may have: a format, or fp16 (the state of fp16 params).
constexpr std::initializer_list<at::ScalarType> kStateDtypes = {
    at::kFloat, at::kHalf, at::kBFloat16, at::kFloat8_e4m3fn, at::kChar, at::kByte};
constexpr int64_t kMinStateBlock = 32;
constexpr int64_t kMaxStateBlock = 4096;

// fp8 and int8/uint8 states keep one fp32 absmax per block.
inline bool is_blocked_state(at::ScalarType dtype) {
  return dtype == at::kFloat8_e4m3fn || dtype == at::kChar || dtype == at::kByte;
}

// Whether params[i] is an fp32 master (fp32 itself, or bf16 with its remainder).
inline bool has_master(at::TensorList params, at::TensorList master_remainders, size_t i) {
  return params[i].scalar_type() == at::kFloat || !master_remainders.empty();
}

inline void check_fused_dtypes(
    const char* op,
    at::TensorList params,
    at::TensorList grads,
    std::initializer_list<NamedList> states,
    at::TensorList model_params,
    at::TensorList master_remainders) {
  const bool has_model_params = !model_params.empty();
  for (size_t i = 0; i < params.size(); ++i) {
    if (has_master(params, master_remainders, i)) {
      for (const NamedList& state : states) {
        TORCH_CHECK(
            dtype_in(state.list[i].scalar_type(), kStateFormatDtypes), "apex_amp.", op, ": ", state.name, "[",
            i, "] has dtype ", state.list[i].scalar_type(), "; the state of an fp32 master (params[", i,
            "]) is one of ", dtype_names(kStateFormatDtypes));
      }
      continue;  // grads were checked against the floating dtypes
    }
    const at::ScalarType param_dtype = params[i].scalar_type();
    TORCH_CHECK(
        grads[i].scalar_type() == param_dtype, "apex_amp.", op, ": grads[", i, "] has dtype ",
        grads[i].scalar_type(), " but params[", i, "] is ", param_dtype,
        "; fp16/bf16 params need grads of the same dtype (or keep fp32 master params)");
    TORCH_CHECK(
        !has_model_params, "apex_amp.", op, ": model_params[", i, "] was given but params[", i,
        "] is ", param_dtype,
        "; a model copy is written only from fp32 master params, pass model_params=[] "
        "or fp32 params");
    for (const NamedList& state : states) {
      TORCH_CHECK(
          state.list[i].scalar_type() == param_dtype, "apex_amp.", op, ": ", state.name, "[", i,
          "] has dtype ", state.list[i].scalar_type(), "; expected ", param_dtype,
          ", the dtype of params[", i, "] (other state formats need fp32 or remainder masters)");
    }
  }
}

inline void check_master_remainders(
    const char* op,
    at::TensorList params,
    at::TensorList master_remainders,
    at::TensorList model_params,
    const at::Device& device) {
  if (master_remainders.empty()) {
    return;
  }
  check_same_length(op, "params", params, "master_remainders", master_remainders);
  check_tensor_list(op, "master_remainders", master_remainders, device, {at::kShort});
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(
        params[i].scalar_type() == at::kBFloat16, "apex_amp.", op, ": master_remainders[", i,
        "] was given for ", params[i].scalar_type(), " params[", i,
        "]; a remainder completes a bf16 weight to its fp32 master (fp16 is not the high half of fp32)");
    TORCH_CHECK(
        master_remainders[i].sizes() == params[i].sizes() &&
            same_memory_order(params[i], master_remainders[i]),
        "apex_amp.", op, ": master_remainders[", i, "] (sizes ", master_remainders[i].sizes(),
        ", strides ", master_remainders[i].strides(), ") must have the sizes and strides of params[", i,
        "]; make it with torch.empty_like(params[", i, "], dtype=torch.int16)");
  }
  TORCH_CHECK(
      model_params.empty(), "apex_amp.", op,
      ": model_params was given with master_remainders; the bf16 params are the model weights "
      "themselves, pass model_params=[]");
}

inline bool is_block_count(int64_t numel, int64_t blocks) {
  if (blocks == 0 || numel % blocks != 0) {
    return false;
  }
  const int64_t block = numel / blocks;
  return block >= kMinStateBlock && block <= kMaxStateBlock && (block & (block - 1)) == 0;
}

inline void check_state_absmaxes(
    const char* op,
    std::initializer_list<NamedList> states,
    at::TensorList state_absmaxes,
    const at::Device& device) {
  size_t count = 0;
  for (const NamedList& state : states) {
    count += state.list.size();
  }
  if (state_absmaxes.empty()) {
    for (const NamedList& state : states) {
      for (size_t i = 0; i < state.list.size(); ++i) {
        TORCH_CHECK(
            !is_blocked_state(state.list[i].scalar_type()), "apex_amp.", op,
            ": state_absmaxes is empty but ", state.name, "[", i, "] is ", state.list[i].scalar_type(),
            ", a blocked format; pass one fp32 absmax tensor per state and param (", count,
            " in all, state-list-major)");
      }
    }
    return;
  }
  TORCH_CHECK(
      state_absmaxes.size() == count, "apex_amp.", op, ": state_absmaxes holds ", state_absmaxes.size(),
      " tensors; expected one per state and param, ", count, " (", states.size(), " state lists)");
  check_tensor_list(op, "state_absmaxes", state_absmaxes, device, {at::kFloat});
  size_t index = 0;
  for (const NamedList& state : states) {
    for (size_t i = 0; i < state.list.size(); ++i, ++index) {
      const at::Tensor& absmax = state_absmaxes[index];
      const at::Tensor& values = state.list[i];
      TORCH_CHECK(
          absmax.is_contiguous(), "apex_amp.", op, ": state_absmaxes[", index, "] (of ", state.name, "[",
          i, "]) must be contiguous; pass state_absmaxes[", index, "].contiguous()");
      if (!is_blocked_state(values.scalar_type())) {
        TORCH_CHECK(
            absmax.numel() == 0, "apex_amp.", op, ": state_absmaxes[", index, "] (of ", state.name, "[", i,
            "]) holds ", absmax.numel(), " elements but ", state.name, "[", i, "] is ", values.scalar_type(),
            ", which keeps no absmax; pass an empty fp32 tensor");
      } else if (values.numel() == 0) {
        TORCH_CHECK(
            absmax.numel() == 0, "apex_amp.", op, ": state_absmaxes[", index, "] (of ", state.name, "[", i,
            "]) holds ", absmax.numel(), " elements but ", state.name, "[", i, "] is empty");
      } else {
        TORCH_CHECK(
            is_block_count(values.numel(), absmax.numel()), "apex_amp.", op, ": state_absmaxes[", index,
            "] (of ", state.name, "[", i, "]) holds ", absmax.numel(), " elements for the ", values.numel(),
            " of ", state.name, "[", i, "]; a blocked state keeps one absmax per block of B elements, B a "
            "power of two in [", kMinStateBlock, ", ", kMaxStateBlock, "] dividing its numel");
      }
    }
  }
}

// state_rounding: absent (bf16 states round to nearest even), or an int64
// contiguous (params.size(), 2) tensor on the op's device: per param, the
// stream key of its stochastic rounding and the index of its first element in
// the whole parameter (state_formats.h: round_bf16_stochastic).
inline void check_state_rounding(
    const char* op, at::TensorList params, const std::optional<at::Tensor>& state_rounding,
    const at::Device& device) {
  if (!state_rounding.has_value()) {
    return;
  }
  const at::Tensor& rounding = *state_rounding;
  TORCH_CHECK(
      rounding.device() == device && rounding.scalar_type() == at::kLong && rounding.dim() == 2 &&
          rounding.size(0) == static_cast<int64_t>(params.size()) && rounding.size(1) == 2 &&
          rounding.is_contiguous(),
      "apex_amp.", op, ": state_rounding must be a contiguous int64 tensor of shape (", params.size(),
      ", 2) on ", device, " (a stream key and a first-element index per param); got ", rounding.scalar_type(),
      " of shape ", rounding.sizes(), " on ", rounding.device());
}

// Lists, devices, layouts, memory and dtypes of one fused step, its state
// operands and its optional flags. `step` is validated by the ops that count steps.
inline void validate_fused_step(
    const char* op,
    at::TensorList params,
    at::TensorList grads,
    std::initializer_list<NamedList> states,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding,
    const at::Device& device) {
  check_same_length(op, "params", params, "grads", grads);
  for (const NamedList& state : states) {
    check_same_length(op, "params", params, state.name, state.list);
  }
  const bool has_model_params = !model_params.empty();
  if (has_model_params) {
    check_same_length(op, "params", params, "model_params", model_params);
  }
  check_tensor_list(op, "params", params, device);
  check_tensor_list(op, "grads", grads, device);
  for (const NamedList& state : states) {
    check_tensor_list(op, state.name, state.list, device, kStateDtypes);
  }
  check_tensor_list(op, "model_params", model_params, device);
  check_disjoint_within(op, "params", params);
  for (const NamedList& state : states) {
    check_disjoint_within(op, state.name, state.list);
  }
  check_disjoint_within(op, "model_params", model_params);
  check_corresponding(op, "params", params, "grads", grads);
  for (const NamedList& state : states) {
    check_corresponding(op, "params", params, state.name, state.list);
  }
  if (has_model_params) {
    check_corresponding(op, "params", params, "model_params", model_params);
  }
  check_master_remainders(op, params, master_remainders, model_params, device);
  check_fused_dtypes(op, params, grads, states, model_params, master_remainders);
  check_state_absmaxes(op, states, state_absmaxes, device);
  check_disjoint_within(op, "master_remainders", master_remainders);
  check_disjoint_within(op, "state_absmaxes", state_absmaxes);
  // Tensors written element by element must not share memory.
  std::vector<NamedList> written{{"params", params}};
  written.insert(written.end(), states.begin(), states.end());
  if (!master_remainders.empty()) {
    written.push_back({"master_remainders", master_remainders});
  }
  for (size_t a = 0; a < written.size(); ++a) {
    for (size_t b = a + 1; b < written.size(); ++b) {
      for (size_t i = 0; i < params.size(); ++i) {
        TORCH_CHECK(
            at::get_overlap_status(written[a].list[i], written[b].list[i]) == at::MemOverlapStatus::No,
            "apex_amp.", op, ": ", written[a].name, "[", i, "] and ", written[b].name, "[", i,
            "] share memory; each parameter needs its own state buffers");
      }
    }
  }
  // state_absmaxes[k * n + i] belongs to param i: disjoint from what the step writes for it.
  for (size_t k = 0; k < state_absmaxes.size(); ++k) {
    const size_t i = k % params.size();
    for (const NamedList& list : written) {
      TORCH_CHECK(
          at::get_overlap_status(state_absmaxes[k], list.list[i]) == at::MemOverlapStatus::No, "apex_amp.",
          op, ": state_absmaxes[", k, "] and ", list.name, "[", i,
          "] share memory; give each blocked state its own absmax tensor");
    }
  }
  if (has_model_params) {
    // An fp32 model_params[i] may be params[i] itself (a redundant write).
    check_no_partial_overlap(op, "params", params, "model_params", model_params);
  }
  if (inv_scale.has_value()) {
    check_scalar_tensor(op, "inv_scale", *inv_scale, device);
  }
  if (found_inf.has_value()) {
    check_scalar_tensor(op, "found_inf", *found_inf, device);
  }
  check_state_rounding(op, params, state_rounding, device);
}

// A host number of an op; `in_range` is written so that NaN makes it false.
inline void check_number(const char* op, const char* name, double value, bool in_range, const char* expected) {
  TORCH_CHECK(in_range, "apex_amp.", op, ": ", name, " must be ", expected, ", got ", value);
}

inline void check_betas(const char* op, double beta1, double beta2) {
  check_number(op, "beta1", beta1, beta1 >= 0.0 && beta1 < 1.0, "in [0, 1)");
  check_number(op, "beta2", beta2, beta2 >= 0.0 && beta2 < 1.0, "in [0, 1)");
}

// One fp32 value per tensor of the op's lists, contiguous on `device`: shape
// (count) for one row, (rows, count) for several (NovoGrad's grad_norms,
// LAMB's norm_squares).
inline void check_per_tensor_values(
    const char* op, const char* name, const at::Tensor& values, int64_t rows, int64_t count,
    const at::Device& device) {
  const bool shape_ok = rows == 1 ? (values.dim() == 1 && values.size(0) == count)
                                  : (values.dim() == 2 && values.size(0) == rows && values.size(1) == count);
  TORCH_CHECK(
      shape_ok, "apex_amp.", op, ": ", name, " must hold one value per param",
      rows == 1 ? "" : ", per row", ": shape (", rows == 1 ? "" : std::to_string(rows) + ", ", count, "), got ",
      values.sizes());
  TORCH_CHECK(
      values.scalar_type() == at::kFloat, "apex_amp.", op, ": ", name, " must be float32, got ",
      values.scalar_type());
  TORCH_CHECK(
      values.device() == device, "apex_amp.", op, ": ", name, " is on ", values.device(), ", expected ", device);
  TORCH_CHECK(values.is_contiguous(), "apex_amp.", op, ": ", name, " must be contiguous");
}

inline void validate_fused_adam(
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
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding,
    const at::Device& device) {
  constexpr const char* op = "fused_adam_";
  validate_fused_step(
      op, params, grads, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, model_params,
      master_remainders, state_absmaxes, inv_scale, found_inf, state_rounding, device);
  check_scalar_tensor(op, "step", step, device);
  check_number(op, "lr", lr, lr >= 0.0, ">= 0");
  check_betas(op, beta1, beta2);
  check_number(op, "eps", eps, eps >= 0.0, ">= 0");
  check_number(op, "weight_decay", weight_decay, weight_decay >= 0.0, ">= 0");
}

// momentum_buffers: one per param, or none at all (momentum 0: plain SGD).
inline void validate_fused_sgd(
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
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding,
    const at::Device& device) {
  constexpr const char* op = "fused_sgd_";
  if (momentum_buffers.empty()) {
    validate_fused_step(
        op, params, grads, {}, model_params, master_remainders, state_absmaxes, inv_scale, found_inf, state_rounding,
        device);
  } else {
    validate_fused_step(
        op, params, grads, {{"momentum_buffers", momentum_buffers}}, model_params, master_remainders,
        state_absmaxes, inv_scale, found_inf, state_rounding, device);
  }
  check_number(op, "lr", lr, lr >= 0.0, ">= 0");
  check_number(op, "momentum", momentum, momentum >= 0.0, ">= 0");
  check_number(op, "weight_decay", weight_decay, weight_decay >= 0.0, ">= 0");
  check_number(op, "dampening", dampening, dampening >= 0.0 && dampening <= 1.0, "in [0, 1]");
  TORCH_CHECK(
      momentum_buffers.empty() == (momentum == 0.0), "apex_amp.", op,
      ": pass momentum_buffers (one per param) exactly when momentum is not 0 (momentum=",
      momentum, ", ", momentum_buffers.size(), " buffers)");
  TORCH_CHECK(
      !nesterov || (momentum > 0.0 && dampening == 0.0), "apex_amp.", op,
      ": nesterov needs momentum > 0 and dampening 0");
}

inline void validate_fused_adagrad(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList state_sums,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    double lr,
    double eps,
    double weight_decay,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding,
    const at::Device& device) {
  constexpr const char* op = "fused_adagrad_";
  validate_fused_step(
      op, params, grads, {{"state_sums", state_sums}}, model_params, master_remainders, state_absmaxes,
      inv_scale, found_inf, state_rounding, device);
  check_number(op, "lr", lr, lr >= 0.0, ">= 0");
  check_number(op, "eps", eps, eps >= 0.0, ">= 0");
  check_number(op, "weight_decay", weight_decay, weight_decay >= 0.0, ">= 0");
}

// exp_avg_sqs: NovoGrad's per-tensor second moments, one one-element fp32
// tensor per param (negative: no gradient seen yet).
inline void validate_fused_novograd(
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
    int64_t norm_type,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding,
    const std::optional<at::Tensor>& grad_norms,
    const at::Device& device) {
  constexpr const char* op = "fused_novograd_";
  validate_fused_step(
      op, params, grads, {{"exp_avgs", exp_avgs}}, model_params, master_remainders, state_absmaxes,
      inv_scale, found_inf, state_rounding, device);
  check_same_length(op, "params", params, "exp_avg_sqs", exp_avg_sqs);
  for (size_t i = 0; i < exp_avg_sqs.size(); ++i) {
    const std::string name = "exp_avg_sqs[" + std::to_string(i) + "]";
    check_scalar_tensor(op, name.c_str(), exp_avg_sqs[i], device);
  }
  check_disjoint_within(op, "exp_avg_sqs", exp_avg_sqs);
  check_scalar_tensor(op, "step", step, device);
  check_number(op, "lr", lr, lr >= 0.0, ">= 0");
  check_betas(op, beta1, beta2);
  check_number(op, "eps", eps, eps >= 0.0, ">= 0");
  check_number(op, "weight_decay", weight_decay, weight_decay >= 0.0, ">= 0");
  TORCH_CHECK(
      norm_type == 0 || norm_type == 2, "apex_amp.", op,
      ": norm_type must be 2 (L2) or 0 (L-infinity), got ", norm_type);
  if (grad_norms.has_value()) {
    check_per_tensor_values(op, "grad_norms", *grad_norms, 1, static_cast<int64_t>(params.size()), device);
  }
}

// fused_lamb_ and its two passes (fused_lamb_moments_: lr unused, no
// state_rounding; fused_lamb_update_: with the first pass's norm_squares,
// checked by the caller with check_per_tensor_values).
inline void validate_fused_lamb(
    const char* op,
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
    double max_grad_norm,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding,
    const at::Device& device) {
  validate_fused_step(
      op, params, grads, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, model_params,
      master_remainders, state_absmaxes, inv_scale, found_inf, state_rounding, device);
  check_scalar_tensor(op, "step", step, device);
  check_scalar_tensor(op, "grad_norm", grad_norm, device);
  check_number(op, "lr", lr, lr >= 0.0, ">= 0");
  check_betas(op, beta1, beta2);
  check_number(op, "eps", eps, eps >= 0.0, ">= 0");
  check_number(op, "weight_decay", weight_decay, weight_decay >= 0.0, ">= 0");
  check_number(op, "max_grad_norm", max_grad_norm, max_grad_norm > 0.0, "> 0 (inf: no clipping)");
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
