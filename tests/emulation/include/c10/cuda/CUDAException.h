// Test-only stand-in for c10's header of this name, used by the host
// emulation build of csrc/cuda (tests/emulation), whose include path puts it
// first: an emulated launch's error comes back as c10 reports a real one.
#pragma once

#include "cuda_emulation.h"

#include <c10/util/Exception.h>

#define C10_CUDA_CHECK(EXPR)                                                   \
  do {                                                                         \
    const cudaError_t apex_amp_emulated_error = (EXPR);                        \
    TORCH_CHECK(                                                               \
        apex_amp_emulated_error == cudaSuccess,                                \
        "CUDA error: ", cudaGetErrorString(apex_amp_emulated_error));          \
  } while (0)

#define C10_CUDA_KERNEL_LAUNCH_CHECK() C10_CUDA_CHECK(cudaGetLastError())
