// The CPU kernels of every op, compiled once per instruction set, and the
// choice among them at run time.
//
// kernels.inc holds the kernels; kernels_default.cpp, kernels_avx2.cpp and
// kernels_avx512.cpp each compile it for one instruction set into their own
// namespace and hand back a KernelTable. Nothing is chosen at build time from
// the build machine (never -march=native): the table is chosen on first use
// from the CPU the process runs on (see isa_dispatch.cpp).
#pragma once

#include "cpu/list_parallel.h"

namespace apex_amp {
// Defined in amp_math.h, which the kernel files must include only after their
// instruction-set pragma (kernels.inc), so it is not included here.
struct AdamStepParams;
}  // namespace apex_amp

namespace apex_amp::cpu {

// The tensors of one fused_adam_ call; model_params.data is null when the
// call has no model copy.
struct AdamOperands {
  OperandView params;
  OperandView grads;
  OperandView exp_avgs;
  OperandView exp_avg_sqs;
  OperandView model_params;
};

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
  void (*adam)(
      const PlanView& plan,
      const AdamOperands& tensors,
      const AdamStepParams& hyper,
      float inv_scale);
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
