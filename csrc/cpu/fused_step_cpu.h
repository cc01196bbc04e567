// What every fused optimizer's CPU launcher does around its rule: skip on
// found_inf, count the step, read inv_scale, and hand the lists to the
// kernels (kernel_table.h: RuleOperands).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <vector>

#include "cpu/kernel_table.h"
#include "cpu/list_parallel.h"

namespace apex_amp::cpu {

// None when found_inf is given and non-zero (NaN included): the whole op is
// then a no-op, step count included. Otherwise increments `step` (a
// one-element fp32 CPU tensor: plain memory, no sync) and returns the new count.
inline std::optional<float> take_step(const at::Tensor& step, const std::optional<at::Tensor>& found_inf) {
  if (found_inf.has_value() && *found_inf->data_ptr<float>() != 0.f) {
    return std::nullopt;
  }
  float& count = *step.data_ptr<float>();
  count += 1.f;
  return count;
}

inline float value_or_one(const std::optional<at::Tensor>& one_element) {
  return one_element.has_value() ? *one_element->data_ptr<float>() : 1.f;
}

// From this many elements on, a step writes its fp16/bf16 model copy with
// non-temporal stores. An ordinary store first reads the line it writes
// (write-allocate), so the copy's 2 B/el cost 4 B/el of traffic, and it pushes
// the streams being read out of the cache; a non-temporal store writes the
// line straight to memory. That pays when the step's data (16 B/el under O2:
// master 4, moments 8, half grad 2, half copy 2) is far beyond the last-level
// cache anyway; for a smaller model it would evict a copy that the next
// forward pass could have found in cache. 4M elements: 64 MB of step data,
// 2x the 32 MiB L3 of the reference machine (benchmarks/README.md, "What
// limits the O2 step").
constexpr int64_t kStreamingModelCopyMinElements = int64_t{1} << 22;

// The format of state `state` of params[i] (validate.h has checked the pair):
// formats need fp32 or remainder masters; else the state has its params' dtype.
inline StateFormat state_format_of(const at::Tensor& param, const at::Tensor& state, bool has_remainder) {
  const bool master = has_remainder || param.scalar_type() == at::kFloat;
  switch (state.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return StateFormat::kFp8;
    case at::kChar:
      return StateFormat::kInt8;
    case at::kByte:
      return StateFormat::kUInt8;
    case at::kBFloat16:
      return master ? StateFormat::kBFloat16 : StateFormat::kFloat32;  // (the latter unused: not formatted)
    default:
      return StateFormat::kFloat32;
  }
}

// The state operands of one step (kernel_table.h: FormatView), built only when
// some tensor is formatted: a remainder master, or a state whose dtype is not
// its params' (bf16 states of fp32 masters, fp8, int8, uint8).
class StepFormats {
 public:
  StepFormats(
      at::TensorList params,
      std::initializer_list<at::TensorList> states,
      at::TensorList master_remainders,
      at::TensorList state_absmaxes,
      const std::optional<at::Tensor>& state_rounding) {
    const size_t count = params.size();
    const bool has_remainders = !master_remainders.empty();
    formatted_.assign(count, has_remainders ? 1 : 0);
    size_t k = 0;
    for (at::TensorList state : states) {
      formats_[k].resize(count);
      absmax_[k].assign(count, nullptr);
      block_[k].assign(count, 0);
      for (size_t i = 0; i < count; ++i) {
        formats_[k][i] = state_format_of(params[i], state[i], has_remainders);
        if (state[i].scalar_type() != params[i].scalar_type()) {
          formatted_[i] = 1;
        }
        if (is_blocked(formats_[k][i]) && state[i].numel() > 0) {
          const at::Tensor& absmax = state_absmaxes[k * count + i];
          absmax_[k][i] = absmax.data_ptr<float>();
          block_[k][i] = state[i].numel() / absmax.numel();
        }
      }
      ++k;
    }
    for (const at::Tensor& remainder : master_remainders) {
      remainders_.push_back(static_cast<char*>(remainder.data_ptr()));
    }
    any_ = std::find(formatted_.begin(), formatted_.end(), 1) != formatted_.end();
    view_.formatted = formatted_.data();
    for (size_t j = 0; j < k; ++j) {
      view_.format[j] = formats_[j].data();
      view_.absmax[j] = absmax_[j].data();
      view_.block[j] = block_[j].data();
    }
    view_.remainder = has_remainders ? remainders_.data() : nullptr;
    view_.rounding = state_rounding.has_value() ? state_rounding->data_ptr<int64_t>() : nullptr;
  }

  // Null when no tensor is formatted: the kernels then run exactly as before formats existed.
  const FormatView* view() const {
    return any_ ? &view_ : nullptr;
  }

 private:
  std::vector<uint8_t> formatted_;
  std::vector<StateFormat> formats_[kMaxRuleStates];
  std::vector<float*> absmax_[kMaxRuleStates];
  std::vector<int64_t> block_[kMaxRuleStates];
  std::vector<char*> remainders_;
  FormatView view_{};
  bool any_ = false;
};

// The lists of one fused step, as the kernels see them; `states` in the
// rule's order (Adam: exp_avgs, exp_avg_sqs), model_params empty for no copy,
// master_remainders, state_absmaxes and state_rounding as the op takes them (validate.h).
class FusedLists {
 public:
  FusedLists(
      at::TensorList params,
      at::TensorList grads,
      std::initializer_list<at::TensorList> states,
      at::TensorList model_params,
      at::TensorList master_remainders,
      at::TensorList state_absmaxes,
      const std::optional<at::Tensor>& state_rounding = std::nullopt)
      : plan_(params),
        params_(params),
        grads_(grads),
        model_(model_params),
        has_model_(!model_params.empty()),
        formats_(params, states, master_remainders, state_absmaxes, state_rounding) {
    for (at::TensorList state : states) {
      states_.emplace_back(state);
    }
    int64_t elements = 0;
    for (const at::Tensor& model : model_params) {
      elements += model.numel();
    }
    stream_model_ = elements >= kStreamingModelCopyMinElements;
  }

  PlanView plan() const {
    return plan_.view();
  }
  const ListPlan& list_plan() const {
    return plan_;
  }

  RuleOperands operands(const float* tensor_values = nullptr) const {
    RuleOperands operands{};
    operands.params = params_.view();
    operands.grads = grads_.view();
    for (size_t k = 0; k < states_.size() && k < kMaxRuleStates; ++k) {
      operands.states[k] = states_[k].view();
    }
    operands.model_params = has_model_ ? model_.view() : OperandView{nullptr, nullptr};
    operands.tensor_values = tensor_values;
    operands.stream_model_copy = stream_model_;
    operands.formats = formats_.view();
    return operands;
  }

 private:
  ListPlan plan_;
  ListOperand params_;
  ListOperand grads_;
  std::vector<ListOperand> states_;
  ListOperand model_;
  bool has_model_;
  StepFormats formats_;
  bool stream_model_ = false;
};

// Per-unit partial results (fp32 sums or maxima) gathered per tensor: sums in
// double, in unit order, so the result does not depend on the thread count.
inline std::vector<double> per_tensor_sums(const ListPlan& plan, const std::vector<float>& unit_values,
                                           size_t num_tensors) {
  std::vector<double> sums(num_tensors, 0.0);
  for (int64_t u = 0; u < plan.num_units(); ++u) {
    sums[plan.units()[u].tensor] += unit_values[u];
  }
  return sums;
}

}  // namespace apex_amp::cpu
