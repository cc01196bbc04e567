// Force-included (g++ -include) into csrc/cuda/register_cuda.cpp in the emulated op
// library (tests/emulation/emulation_build.py; the launchers, csrc/cuda/*.cu, get
// cuda_emulation.h alone): the CUDA language as host C++, and the op
// registrations moved from
// torch.ops.apex_amp (CUDA dispatch key) to torch.ops.apex_amp_emulated (CPU
// dispatch key), so that the emulated CUDA launchers take CPU tensors and sit
// next to the real CPU kernels in one process.
#pragma once

#include "cuda_emulation.h"

#include <torch/library.h>

#include <string_view>

#undef TORCH_LIBRARY
#undef TORCH_LIBRARY_IMPL

#define TORCH_LIBRARY(ns, m)                                                             \
  static_assert(std::string_view(#ns) == "apex_amp", "only apex_amp's schemas are moved"); \
  TORCH_LIBRARY_FRAGMENT(apex_amp_emulated, m)

#define TORCH_LIBRARY_IMPL(ns, k, m)                                                \
  static_assert(                                                                    \
      std::string_view(#ns) == "apex_amp" && std::string_view(#k) == "CUDA",        \
      "only apex_amp's CUDA kernels are emulated");                                 \
  _TORCH_LIBRARY_IMPL(apex_amp_emulated, CPU, m, C10_UID)
