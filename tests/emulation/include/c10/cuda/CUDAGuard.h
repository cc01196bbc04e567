// Test-only stand-in for c10's header of this name (see CUDAException.h).
// The emulated GPU is the CPU, so a guard takes the launcher's device, a CPU
// device, and records that a guard is held: every emulated launch needs one,
// as a real launch needs the tensors' device to be current.
#pragma once

#include "cuda_emulation.h"

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

namespace c10::cuda {

class CUDAGuard {
 public:
  explicit CUDAGuard(c10::Device device) {
    TORCH_CHECK(
        device.is_cpu(), "apex_amp CUDA emulation: a launcher guarded ", device,
        "; the emulated kernels run on CPU tensors");
    apex_amp::emulation::enter_device_guard();
  }
  ~CUDAGuard() {
    apex_amp::emulation::leave_device_guard();
  }
  CUDAGuard(const CUDAGuard&) = delete;
  CUDAGuard& operator=(const CUDAGuard&) = delete;
};

}  // namespace c10::cuda
