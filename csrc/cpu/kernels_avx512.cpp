// The kernels of kernels.inc for CPUs with AVX-512 F/BW/VL/DQ (the set ATen's
// AVX512 capability requires), chosen at run time by isa_dispatch.cpp.
// Built like kernels_avx2.cpp (see there): no build flags, a
// `#pragma GCC target` after the shared headers, an empty variant elsewhere.
#include "cpu/kernels_prelude.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define APEX_AMP_HAVE_AVX512_KERNELS 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#pragma GCC optimize("fp-contract=off")  // as in kernels_avx2.cpp

// As in kernels_avx2.cpp: sleef.h declares the AVX and AVX-512 functions
// that ATen's vectors name only under __AVX__ / __AVX512F__.
#ifndef __AVX__
#define __AVX__ 1
#define APEX_AMP_DEFINED_AVX
#endif
#ifndef __AVX512F__
#define __AVX512F__ 1
#define APEX_AMP_DEFINED_AVX512F
#endif
#include <sleef.h>
#ifdef APEX_AMP_DEFINED_AVX
#undef __AVX__
#endif
#ifdef APEX_AMP_DEFINED_AVX512F
#undef __AVX512F__
#endif

#define CPU_CAPABILITY apex_amp_avx512
#define CPU_CAPABILITY_AVX512
#define APEX_AMP_ISA_NAME "avx512"
#include "cpu/kernels.inc"
#pragma GCC pop_options
#endif

namespace apex_amp::cpu {

const KernelTable* kernel_table_avx512() {
#ifdef APEX_AMP_HAVE_AVX512_KERNELS
  return &apex_amp_avx512::kKernelTable;
#else
  return nullptr;
#endif
}

}  // namespace apex_amp::cpu
