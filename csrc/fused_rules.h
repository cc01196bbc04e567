// The fused optimizer rules, listed once.
//
// Each rule is a hyper-parameter struct and a fused_rule() overload in
// amp_math.h. This list is what the per-instruction-set CPU kernel tables
// (cpu/kernel_table.h, cpu/kernels.inc) are generated from; it names the
// structs without defining them, because amp_math.h may be included only after
// a kernel file has chosen its instruction set.
//
//   X(name, HyperType): the table member `name` runs HyperType's rule.
#pragma once

namespace apex_amp {
struct AdamStepParams;
struct SgdHyper;
struct PlainSgdHyper;
struct AdagradHyper;
struct NovoGradHyper;
struct LambHyper;
}  // namespace apex_amp

#define APEX_AMP_FUSED_RULES(X)     \
  X(adam, ::apex_amp::AdamStepParams) \
  X(sgd, ::apex_amp::SgdHyper)        \
  X(plain_sgd, ::apex_amp::PlainSgdHyper) \
  X(adagrad, ::apex_amp::AdagradHyper) \
  X(novograd, ::apex_amp::NovoGradHyper) \
  X(lamb, ::apex_amp::LambHyper)
