// The CPU kernels of every op, compiled once per instruction set, and the
// choice among them at run time.
//
// kernels.inc holds the kernels; kernels_default.cpp, kernels_avx2.cpp and
// kernels_avx512.cpp each compile it for one instruction set into their own
// namespace and hand back a KernelTable. Nothing is chosen at build time from
// the build machine (never -march=native): the table is chosen on first use
// from the CPU the process runs on (see isa_dispatch.cpp).
#pragma once

#include "fused_rules.h"
#include "state_formats.h"
#include "cpu/list_parallel.h"

namespace apex_amp::cpu {

// The most per-element state tensors a fused rule keeps (Adam's and LAMB's two moments).
constexpr int kMaxRuleStates = 2;

// The state operands of a step, per tensor (fused_step_cpu.h builds them):
// a tensor is `formatted` when its master is a bf16 weight plus remainder or
// one of its states is stored in a format other than its params' dtype
// (state_formats.h); the kernels then read its master and states in fp32
// segment by segment, run the rule, and store them back in their formats.
// absmax[k][t]: the absmaxes of state k of tensor t (null: not blocked), one
// per block of block[k][t] elements; remainder[t]: int16 data (null array: none).
// rounding: null when bf16 states round to nearest even; else the op's
// state_rounding, two int64 per tensor: (stream key, global index of its
// first element), and bf16 states round stochastically (state_formats.h).
struct FormatView {
  const uint8_t* formatted;
  const StateFormat* format[kMaxRuleStates];
  float* const* absmax[kMaxRuleStates];
  const int64_t* block[kMaxRuleStates];
  char* const* remainder;
  const int64_t* rounding;
};

// The tensors of one fused optimizer step: params, grads, the rule's state
// lists (the first kStates used), the O2 model copy (data null: none) and,
// for rules that take one, a value per tensor of the lists.
// stream_model_copy: write fp16/bf16 model copies with non-temporal stores
// (the launcher decides: fused_step_cpu.h, kStreamingModelCopyMinElements).
// formats: null when no tensor is formatted (every step before state formats).
struct RuleOperands {
  OperandView params;
  OperandView grads;
  OperandView states[kMaxRuleStates];
  OperandView model_params;
  const float* tensor_values;
  bool stream_model_copy;
  const FormatView* formats;
};

// One member per fused rule (fused_rules.h): runs the rule over every unit,
// grads multiplied by inv_scale, the hyper-parameters already prepared for the step.
#define APEX_AMP_RULE_MEMBER(name, Hyper) \
  void (*name)(const PlanView& plan, const RuleOperands& tensors, const Hyper& hyper, float inv_scale);

// Kernels that check values return true when they met an inf or NaN.
struct KernelTable {
  const char* isa;  // "default", "avx2" or "avx512"
  bool (*check_finite)(const PlanView& plan, const OperandView& tensors);
  bool (*unscale)(const PlanView& plan, const OperandView& grads, float inv_scale);
  bool (*scale)(const PlanView& plan, const OperandView& src, const OperandView& dst, float scale);
  bool (*axpby)(
      const PlanView& plan,
      const OperandView& x,
      const OperandView& y,
      float a,
      float b);
  // Writes the fp32 sum of squares of each work unit to unit_sums[unit].
  void (*sum_of_squares)(const PlanView& plan, const OperandView& tensors, float* unit_sums);
  // Writes the largest |x| of each work unit to unit_maxes[unit] (NaN if the unit holds one).
  void (*max_abs)(const PlanView& plan, const OperandView& tensors, float* unit_maxes);
  // LAMB's first pass: updates the moments and writes, per unit, the sums of
  // squares of the params and of the update directions.
  void (*lamb_moments)(
      const PlanView& plan,
      const RuleOperands& tensors,
      const LambHyper& hyper,
      float inv_scale,
      float* unit_param_squares,
      float* unit_direction_squares);
  APEX_AMP_FUSED_RULES(APEX_AMP_RULE_MEMBER)
};

// nullptr when this build or this compiler could not produce the variant.
const KernelTable* kernel_table_default();
const KernelTable* kernel_table_avx2();
const KernelTable* kernel_table_avx512();

// The best table for the CPU we run on, capped by ATen's own choice (so
// ATEN_CPU_CAPABILITY=default|avx2|avx512 also selects ours, e.g. in tests).
const KernelTable& active_kernels();

// The instruction sets compiled into this build, e.g. "default avx2 avx512",
// and the one in use, for build reports.
const char* compiled_isas();
const char* active_isa();

}  // namespace apex_amp::cpu
