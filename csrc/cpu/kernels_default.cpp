// The kernels of kernels.inc for any CPU: ATen's portable Vectorized<float>,
// compiled with the extension's ordinary flags. Always built; the fallback
// when the CPU (or ATEN_CPU_CAPABILITY) rules out the AVX2 and AVX-512
// variants. See kernels_avx2.cpp for how the variants are built.
#include "cpu/kernels_prelude.h"

#define CPU_CAPABILITY apex_amp_default
#define APEX_AMP_ISA_NAME "default"
#include "cpu/kernels.inc"

namespace apex_amp::cpu {

const KernelTable* kernel_table_default() {
  return &apex_amp_default::kKernelTable;
}

}  // namespace apex_amp::cpu
