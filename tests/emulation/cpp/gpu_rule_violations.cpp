// Kernels that break a rule a GPU enforces, one per case, and one that keeps
// every rule: tests/test_cuda_emulation.py runs `gpu_rule_violations CASE`
// for each and checks that the emulation fails (or, for well_behaved,
// passes) the way a GPU would. The faulty kernels use csrc/cuda's own element
// access (load_floats, store_floats, multi_tensor_apply) where the rule is
// about them.
// First: the CUDA language for the csrc/cuda headers below.
#include "cuda_emulation.h"

#include "cuda/multi_tensor_apply.cuh"

#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace apex_amp {
namespace {

// ---- the well-behaved kernel: shared memory, a barrier, shuffles, atomics

constexpr int kWarps = 3;
constexpr int kThreads = kWarps * 32;

__global__ void rotate_and_reduce_kernel(int* rotated, int* warp_sums, unsigned int* visits) {
  __shared__ int ring[kThreads];
  const int t = static_cast<int>(threadIdx.x);
  // Values unique to the block, so that reading a previous block's (a missing
  // barrier) shows.
  const int first = static_cast<int>(blockIdx.x) * kThreads;
  ring[t] = first + t;
  __syncthreads();
  rotated[first + t] = ring[(t + 1) % kThreads];
  int sum = t;
  for (int offset = 16; offset > 0; offset /= 2) {
    sum += __shfl_down_sync(0xffffffffu, sum, offset);
  }
  if (t % 32 == 0) {
    warp_sums[blockIdx.x * kWarps + t / 32] = sum;
  }
  atomicAdd(visits, 1u);
}

// Adds 1 to every element once, through the shared element loop.
struct CountVisitsFunctor {
  __device__ void operator()(const Chunk<1>& chunk) const {
    float* values = chunk_data<float>(chunk, 0);
    for_each_element(chunk.size, is_vector_aligned<float>(values), [&](auto width, int i) {
      constexpr int W = decltype(width)::value;
      float v[W];
      load_floats<W>(values + i, v);
      for (int k = 0; k < W; ++k) {
        v[k] += 1.f;
      }
      store_floats<W>(values + i, v);
    });
  }
};

void expect(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "well_behaved: %s\n", what);
    std::exit(2);
  }
}

void well_behaved() {
  const c10::cuda::CUDAGuard guard(c10::Device(c10::kCPU));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  constexpr int kBlocks = 4;
  std::vector<int> rotated(kBlocks * kThreads, -1);
  std::vector<int> warp_sums(kBlocks * kWarps, -1);
  unsigned int visits = 0;
  APEX_AMP_LAUNCH(kBlocks, kThreads, 0, stream, rotate_and_reduce_kernel)(
      rotated.data(), warp_sums.data(), &visits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  for (int b = 0; b < kBlocks; ++b) {
    for (int t = 0; t < kThreads; ++t) {
      expect(rotated[b * kThreads + t] == b * kThreads + (t + 1) % kThreads,
             "rotation through shared memory");
    }
    for (int w = 0; w < kWarps; ++w) {
      const int first = 32 * w;
      expect(warp_sums[b * kWarps + w] == 32 * first + 31 * 32 / 2, "warp sum by shuffles");
    }
  }
  expect(visits == kBlocks * kThreads, "atomicAdd count");

  // Aligned and misaligned starts, sizes around the chunk and vector widths,
  // and more chunks than one launch takes.
  const std::vector<int64_t> sizes = {1, 3, kILP, kChunkSize - 1, kChunkSize + 5,
                                      kChunkSize * (kMaxBlocksPerLaunch + 1) + 7};
  std::vector<std::vector<float>> buffers;
  std::vector<TensorEntry<1>> entries;
  for (int64_t size : sizes) {
    for (int64_t offset : {0, 1}) {
      buffers.emplace_back(size + offset, 0.f);
      entries.push_back({{buffers.back().data() + offset}, size});
    }
  }
  multi_tensor_apply<1>(stream, entries, CountVisitsFunctor{});
  for (size_t k = 0; k < entries.size(); ++k) {
    const auto* values = static_cast<const float*>(entries[k].data[0]);
    for (int64_t i = 0; i < entries[k].numel; ++i) {
      expect(values[i] == 1.f, "every element visited exactly once");
    }
  }
  std::puts("well_behaved: ok");
}

// ---- faulty kernels

__global__ void load_vector_kernel(const float* p, float* out) {
  float v[kILP];
  load_floats<kILP>(p, v);
  out[threadIdx.x] = v[0];
}

__global__ void store_vector_kernel(float* p) {
  const float v[kILP] = {1.f, 2.f, 3.f, 4.f};
  store_floats<kILP>(p, v);
}

struct ReadFunctor {
  float* sink;
  __device__ void operator()(const Chunk<1>& chunk) const {
    const float* values = chunk_data<float>(chunk, 0);
    for_each_element(chunk.size, false, [&](auto, int i) {
      float v[1];
      load_floats<1>(values + i, v);
      if (v[0] == 12345.f) {
        *sink = v[0];
      }
    });
  }
};

struct WriteFunctor {
  __device__ void operator()(const Chunk<1>& chunk) const {
    float* values = chunk_data<float>(chunk, 0);
    for_each_element(chunk.size, false, [&](auto, int i) {
      const float v[1] = {0.f};
      store_floats<1>(values + i, v);
    });
  }
};

// Sized for 32 threads, launched with 64.
__global__ void shared_overrun_kernel(float* out) {
  __shared__ float per_thread[32];
  per_thread[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = per_thread[threadIdx.x];
}

__global__ void divergent_barrier_kernel() {
  if (threadIdx.x % 2 == 1) {
    return;
  }
  __syncthreads();
}

__global__ void two_barriers_kernel() {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}

__global__ void shuffle_kernel(int returning_lane, float* out) {
  if (static_cast<int>(threadIdx.x) == returning_lane) {
    return;
  }
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1.f, 1);
}

__global__ void empty_kernel() {}

// Runs `launch` on the current stream under a device guard, as launchers do.
void guarded(const std::function<void(cudaStream_t)>& launch) {
  const c10::cuda::CUDAGuard guard(c10::Device(c10::kCPU));
  launch(c10::cuda::getCurrentCUDAStream());
}

// One exact-size heap allocation, so that AddressSanitizer sees its end.
std::unique_ptr<float[]> floats(size_t n) {
  return std::unique_ptr<float[]>(new float[n]());
}

const std::map<std::string, std::function<void()>>& cases() {
  static const std::map<std::string, std::function<void()>> all = {
      {"well_behaved", well_behaved},
      {"misaligned_vector_load",
       [] {
         alignas(16) float data[2 * kILP] = {};
         float out[1];
         guarded([&](cudaStream_t s) {
           APEX_AMP_LAUNCH(1, 1, 0, s, load_vector_kernel)(data + 1, out);
           C10_CUDA_KERNEL_LAUNCH_CHECK();
         });
       }},
      {"misaligned_vector_store",
       [] {
         alignas(16) float data[2 * kILP] = {};
         guarded([&](cudaStream_t s) {
           APEX_AMP_LAUNCH(1, 1, 0, s, store_vector_kernel)(data + 2);
           C10_CUDA_KERNEL_LAUNCH_CHECK();
         });
       }},
      {"read_past_tensor",
       [] {
         auto data = floats(100);
         float sink = 0.f;
         guarded([&](cudaStream_t s) {  // the entry claims one element more than there is
           multi_tensor_apply<1>(s, {TensorEntry<1>{{data.get()}, 101}}, ReadFunctor{&sink});
         });
       }},
      {"write_past_tensor",
       [] {
         auto data = floats(100);
         guarded([&](cudaStream_t s) {
           multi_tensor_apply<1>(s, {TensorEntry<1>{{data.get()}, 101}}, WriteFunctor{});
         });
       }},
      {"shared_index_out_of_bounds",
       [] {
         float out[64];
         guarded([&](cudaStream_t s) {
           APEX_AMP_LAUNCH(1, 64, 0, s, shared_overrun_kernel)(out);
           C10_CUDA_KERNEL_LAUNCH_CHECK();
         });
       }},
      {"divergent_syncthreads",
       [] {
         guarded([](cudaStream_t s) {
           APEX_AMP_LAUNCH(1, 64, 0, s, divergent_barrier_kernel)();
           C10_CUDA_KERNEL_LAUNCH_CHECK();
         });
       }},
      {"syncthreads_at_two_sites",
       [] {
         guarded([](cudaStream_t s) {
           APEX_AMP_LAUNCH(1, 64, 0, s, two_barriers_kernel)();
           C10_CUDA_KERNEL_LAUNCH_CHECK();
         });
       }},
      {"shuffle_after_lane_returned",
       [] {
         float out[32];
         guarded([&](cudaStream_t s) {
           APEX_AMP_LAUNCH(1, 32, 0, s, shuffle_kernel)(5, out);
           C10_CUDA_KERNEL_LAUNCH_CHECK();
         });
       }},
      {"shuffle_in_partial_warp",
       [] {
         float out[48];
         guarded([&](cudaStream_t s) {  // lanes 16-31 of the second warp do not exist
           APEX_AMP_LAUNCH(1, 48, 0, s, shuffle_kernel)(-1, out);
           C10_CUDA_KERNEL_LAUNCH_CHECK();
         });
       }},
      {"too_many_threads",
       [] {
         guarded([](cudaStream_t s) {
           APEX_AMP_LAUNCH(1, 1025, 0, s, empty_kernel)();
           C10_CUDA_KERNEL_LAUNCH_CHECK();
         });
       }},
      {"no_blocks",
       [] {
         guarded([](cudaStream_t s) {
           APEX_AMP_LAUNCH(0, 32, 0, s, empty_kernel)();
           C10_CUDA_KERNEL_LAUNCH_CHECK();
         });
       }},
      {"too_much_dynamic_shared_memory",
       [] {
         guarded([](cudaStream_t s) {
           APEX_AMP_LAUNCH(1, 32, 48 * 1024 + 1, s, empty_kernel)();
           C10_CUDA_KERNEL_LAUNCH_CHECK();
         });
       }},
      {"launch_on_default_stream",
       [] {
         guarded([](cudaStream_t) {
           APEX_AMP_LAUNCH(1, 32, 0, nullptr, empty_kernel)();
           C10_CUDA_KERNEL_LAUNCH_CHECK();
         });
       }},
      {"launch_without_device_guard",
       [] {
         const cudaStream_t s = c10::cuda::getCurrentCUDAStream();
         APEX_AMP_LAUNCH(1, 32, 0, s, empty_kernel)();
         C10_CUDA_KERNEL_LAUNCH_CHECK();
       }},
      {"unchecked_launch_error",
       [] {
         guarded([](cudaStream_t s) {
           APEX_AMP_LAUNCH(1, 2048, 0, s, empty_kernel)();  // fails, and nobody asks
           APEX_AMP_LAUNCH(1, 32, 0, s, empty_kernel)();
           C10_CUDA_KERNEL_LAUNCH_CHECK();
         });
       }},
      {"thread_index_outside_kernel",
       [] { std::printf("%u\n", threadIdx.x); }},
  };
  return all;
}

}  // namespace
}  // namespace apex_amp

int main(int argc, char** argv) {
  const auto& cases = apex_amp::cases();
  const auto found = argc == 2 ? cases.find(argv[1]) : cases.end();
  if (found == cases.end()) {
    std::fprintf(stderr, "usage: %s CASE, with CASE one of:", argv[0]);
    for (const auto& entry : cases) {
      std::fprintf(stderr, " %s", entry.first.c_str());
    }
    std::fprintf(stderr, "\n");
    return 64;
  }
  try {
    found->second();
  } catch (const c10::Error& error) {
    // A launch a GPU refuses comes back as the error C10_CUDA_KERNEL_LAUNCH_CHECK throws.
    std::fprintf(stderr, "launch failed: %s\n", error.what_without_backtrace());
    return 1;
  }
  return 0;
}
