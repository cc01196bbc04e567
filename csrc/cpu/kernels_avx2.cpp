// The kernels of kernels.inc for CPUs with AVX2, FMA and F16C (x86-64 since
// 2013), chosen at run time by isa_dispatch.cpp.
//
// How this file gets its instruction set: no build flags are needed, so
// setup.py just lists it among the sources (after the other csrc/cpu files;
// see below). After the shared headers (kernels_prelude.h) are included with
// the ordinary flags, `#pragma GCC target` turns on AVX2/FMA/F16C for every
// function defined below it, and CPU_CAPABILITY_AVX2 makes ATen's
// Vectorized<float> the AVX2 one, in a namespace of our own
// (CPU_CAPABILITY=apex_amp_avx2) so that it never merges with ATen's or with
// another variant at link time; amp_math.h is internal to each file for the
// same reason. Listing the kernels_*.cpp files last is a second guard: GNU ld
// keeps the first copy of an inline function that several objects define.
// Other compilers (clang, MSVC) and other architectures build an empty
// variant, and the default kernels run instead.
#include "cpu/kernels_prelude.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define APEX_AMP_HAVE_AVX2_KERNELS 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
// No fused multiply-add contraction (GCC contracts a * b + c by default once
// FMA is on): every variant then rounds exactly like the default one, so
// results do not depend on the CPU a job runs or resumes on.
#pragma GCC optimize("fp-contract=off")

// ATen's AVX2 vectors call SLEEF functions that sleef.h declares only when
// __AVX__ is defined; in C++ the pragma does not define it, so define it for
// that one header (declarations only; we call none of them).
#ifndef __AVX__
#define __AVX__ 1
#include <sleef.h>
#undef __AVX__
#endif

#define CPU_CAPABILITY apex_amp_avx2
#define CPU_CAPABILITY_AVX2
#define APEX_AMP_ISA_NAME "avx2"
#include "cpu/kernels.inc"
#pragma GCC pop_options
#endif

namespace apex_amp::cpu {

const KernelTable* kernel_table_avx2() {
#ifdef APEX_AMP_HAVE_AVX2_KERNELS
  return &apex_amp_avx2::kKernelTable;
#else
  return nullptr;
#endif
}

}  // namespace apex_amp::cpu
