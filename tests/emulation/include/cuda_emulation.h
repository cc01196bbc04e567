// CUDA's language and runtime in host C++, as much of them as csrc/cuda uses.
// Test-only: tests/emulation/emulation_build.py compiles csrc/cuda/*.cu a second time
// as C++ with this header force-included, so that the real launchers, chunk
// packing and kernels run on CPU tensors.
//
// A launch runs to completion before it returns: its blocks one after another
// in a shuffled order, and each block's threads as fibers on the launching
// thread (runtime.cpp). A thread runs until it reaches __syncthreads() or a
// warp shuffle, or returns; the scheduler lets the block's threads past a
// barrier only once all of them wait at that same barrier, and completes a
// shuffle once every lane of its mask has reached it. Whatever a GPU refuses
// fails here too:
//   * a configuration a GPU rejects (no block, more than 1024 threads per
//     block, more than 48 KB of dynamic shared memory) sets the error that
//     C10_CUDA_KERNEL_LAUNCH_CHECK() throws;
//   * a block whose threads do not all reach the same __syncthreads(), a
//     shuffle whose mask names a lane that does not take part, a launch
//     outside a device guard or on a stream other than the current one, and
//     a launch whose error nobody checked abort, saying which kernel, block
//     and thread;
//   * misaligned vector accesses (UBSan's alignment check), accesses outside
//     a tensor (AddressSanitizer) and indices outside a __shared__ array
//     (UBSan's bounds check) abort, as the build enables both sanitizers;
//   * kernel parameters over 4 KB in all, references, or types that are not
//     trivially copyable do not compile.
// Shared memory is a static variable: one instance per kernel, and as blocks
// run one at a time, one per running block. As on a GPU, a block may find the
// previous block's values in it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __constant__

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};

// The runtime's stream handle; the emulation has one stream, the current one.
struct CUstream_st;
using cudaStream_t = CUstream_st*;

// The errors an emulated launch can end with, numbered as in CUDA.
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
};

cudaError_t cudaGetLastError();  // and reset it, like CUDA's
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);

namespace apex_amp::emulation {

struct ThreadIndices {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

// The indices of the emulated thread that runs now; aborts outside a kernel.
const ThreadIndices& current_indices();

struct SourceSite {
  const char* file;
  int line;
};

void sync_threads(SourceSite site);

// Waits until every lane of `mask` has reached the same exchange, then copies
// the `size` bytes that lane `source_lane` deposited at `value` to `result`.
void exchange_in_warp(
    SourceSite site,
    unsigned int mask,
    const void* value,
    void* result,
    size_t size,
    unsigned int source_lane);

template <typename T>
T shfl_down_sync(SourceSite site, unsigned int mask, T value, unsigned int delta, int width = 32) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move 32 or 64 bits");
  const ThreadIndices& at = current_indices();
  const unsigned int linear =
      at.thread_idx.x + at.block_dim.x * (at.thread_idx.y + at.block_dim.y * at.thread_idx.z);
  const unsigned int lane = linear % 32;
  const unsigned int segment_lane = lane % static_cast<unsigned int>(width);
  const unsigned int source =
      segment_lane + delta < static_cast<unsigned int>(width) ? lane + delta : lane;
  T result;
  exchange_in_warp(site, mask, &value, &result, sizeof(T), source);
  return result;
}

// Launch checks, stream and device guard (the c10/cuda stand-ins call these).
cudaStream_t current_stream();
void enter_device_guard();
void leave_device_guard();

struct LaunchConfig {
  const char* kernel_name;        // as written at the launch
  const char* kernel_signature;   // __PRETTY_FUNCTION__ of KernelLaunch: the parameter types
  dim3 grid;
  dim3 block;
  size_t shared_bytes;
  cudaStream_t stream;
};

// Runs thread_body(payload) once in every thread of every block, unless a
// GPU would refuse `config`: then sets the error cudaGetLastError() returns.
void run_kernel(const LaunchConfig& config, void (*thread_body)(const void*), const void* payload);

// CUDA's classic limit on the bytes of a kernel's parameters.
constexpr size_t kKernelParameterLimitBytes = 4096;

template <typename... Params>
constexpr size_t kernel_parameter_bytes() {
  size_t bytes = 0;
  ((bytes = (bytes + alignof(Params) - 1) / alignof(Params) * alignof(Params) + sizeof(Params)),
   ...);
  return bytes;
}

// What APEX_AMP_LAUNCH(grid, block, shared_bytes, stream, kernel) yields:
// called with the kernel's arguments, it copies them (as the GPU receives a
// copy) and runs the kernel over the grid.
template <typename... Params>
class KernelLaunch {
 public:
  KernelLaunch(
      const char* kernel_name,
      dim3 grid,
      dim3 block,
      size_t shared_bytes,
      cudaStream_t stream,
      void (*kernel)(Params...))
      : config_{kernel_name, __PRETTY_FUNCTION__, grid, block, shared_bytes, stream},
        kernel_(kernel) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "wrong number of kernel arguments");
    static_assert(
        (!std::is_reference_v<Params> && ...),
        "a kernel parameter cannot be a reference: the GPU receives a copy of the arguments");
    static_assert(
        (std::is_trivially_copyable_v<Params> && ...),
        "kernel arguments are copied byte for byte to the GPU: every parameter type must be "
        "trivially copyable");
    static_assert(
        kernel_parameter_bytes<Params...>() <= kKernelParameterLimitBytes,
        "kernel parameters exceed 4 KB, CUDA's classic limit");
    struct Payload {
      void (*kernel)(Params...);
      std::tuple<Params...> arguments;
    };
    const Payload payload{kernel_, std::tuple<Params...>(std::forward<Args>(args)...)};
    run_kernel(
        config_,
        [](const void* erased) {
          const Payload& p = *static_cast<const Payload*>(erased);
          std::apply(p.kernel, p.arguments);  // each thread gets its own copy, as on a GPU
        },
        &payload);
  }

 private:
  LaunchConfig config_;
  void (*kernel_)(Params...);
};

// CUDA's atomics. Emulated threads switch only at barriers and shuffles, so
// a plain read-modify-write is atomic with respect to every other thread.
template <typename T>
constexpr bool kCudaAtomicType = std::is_same_v<T, int> || std::is_same_v<T, unsigned int> ||
    std::is_same_v<T, unsigned long long> || std::is_same_v<T, float> || std::is_same_v<T, double>;

}  // namespace apex_amp::emulation

#define threadIdx (::apex_amp::emulation::current_indices().thread_idx)
#define blockIdx (::apex_amp::emulation::current_indices().block_idx)
#define blockDim (::apex_amp::emulation::current_indices().block_dim)
#define gridDim (::apex_amp::emulation::current_indices().grid_dim)
#define warpSize 32

#define __syncthreads() ::apex_amp::emulation::sync_threads({__FILE__, __LINE__})
#define __shfl_down_sync(...) ::apex_amp::emulation::shfl_down_sync({__FILE__, __LINE__}, __VA_ARGS__)

#define APEX_AMP_LAUNCH(grid, block, shared_bytes, stream, ...) \
  ::apex_amp::emulation::KernelLaunch(#__VA_ARGS__, grid, block, shared_bytes, stream, __VA_ARGS__)

template <typename T>
T atomicAdd(T* address, T value) {
  static_assert(apex_amp::emulation::kCudaAtomicType<T>, "CUDA has no atomicAdd for this type");
  const T old = *address;
  *address = old + value;
  return old;
}

template <typename T>
T atomicExch(T* address, T value) {
  static_assert(apex_amp::emulation::kCudaAtomicType<T>, "CUDA has no atomicExch for this type");
  const T old = *address;
  *address = value;
  return old;
}

template <typename T>
T atomicMax(T* address, T value) {
  static_assert(std::is_integral_v<T>, "CUDA's atomicMax takes integers");
  const T old = *address;
  *address = old < value ? value : old;
  return old;
}

template <typename T>
T atomicCAS(T* address, T compare, T value) {
  static_assert(std::is_integral_v<T>, "CUDA's atomicCAS takes integers");
  const T old = *address;
  if (old == compare) {
    *address = value;
  }
  return old;
}
