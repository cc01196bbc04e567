// Test-only stand-in for c10's header of this name (see CUDAException.h):
// the current stream of the emulated device, which every emulated launch
// must use.
#pragma once

#include "cuda_emulation.h"

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

namespace c10::cuda {

class CUDAStream {
 public:
  explicit CUDAStream(cudaStream_t stream) : stream_(stream) {}
  cudaStream_t stream() const {
    return stream_;
  }
  operator cudaStream_t() const {
    return stream_;
  }

 private:
  cudaStream_t stream_;
};

inline CUDAStream getCurrentCUDAStream(c10::DeviceIndex device_index = -1) {
  TORCH_CHECK(
      device_index == -1, "apex_amp CUDA emulation: one emulated device; got device_index ",
      device_index);
  return CUDAStream(apex_amp::emulation::current_stream());
}

}  // namespace c10::cuda
