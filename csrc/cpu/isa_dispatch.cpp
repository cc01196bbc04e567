// Choosing the kernel variant for the CPU the process runs on.
//
// Two conditions, both required: the CPU has the instructions (checked here,
// including F16C, which ATen's AVX2 test does not look at), and ATen would
// use that capability too. The second makes ATEN_CPU_CAPABILITY=default|avx2
// select our variants as well, which is how the tests run all of them on one
// machine.
#include <ATen/Version.h>

#include <string>

#include "cpu/kernel_table.h"

namespace apex_amp::cpu {
namespace {

bool cpu_has_avx2() {
#if defined(__GNUC__) && defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__GNUC__) && defined(__x86_64__)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

const KernelTable& choose_kernels() {
  // "DEFAULT", "AVX2" or "AVX512" on x86 (at::native::get_cpu_capability
  // itself is not exported from libtorch).
  const std::string aten_capability = at::get_cpu_capability();
  if (aten_capability == "AVX512" && cpu_has_avx512() && kernel_table_avx512() != nullptr) {
    return *kernel_table_avx512();
  }
  if ((aten_capability == "AVX512" || aten_capability == "AVX2") && cpu_has_avx2() &&
      kernel_table_avx2() != nullptr) {
    return *kernel_table_avx2();
  }
  return *kernel_table_default();
}

}  // namespace

const KernelTable& active_kernels() {
  // Chosen once; thread-safe static initialisation.
  static const KernelTable& kernels = choose_kernels();
  return kernels;
}

const char* compiled_isas() {
  static const std::string names = [] {
    std::string list = "default";
    if (kernel_table_avx2() != nullptr) {
      list += " avx2";
    }
    if (kernel_table_avx512() != nullptr) {
      list += " avx512";
    }
    return list;
  }();
  return names.c_str();
}

const char* active_isa() {
  return active_kernels().isa;
}

}  // namespace apex_amp::cpu
