// Multi-tensor apply: one kernel launch works on many tensors.
//
// chunk_packing.h packs chunks of a tensor list into kernel-argument
// metadata; this header adds the kernel that turns a block's metadata entry
// into a Chunk and hands it to an op's functor, the launch on the caller's
// stream, and the device-side element loop (vector loads where a chunk's
// pointers allow them, scalar accesses otherwise) that the functors share.
//
// This is the idea of apex's multi_tensor_apply.cuh, written afresh with
// named limits, 64-bit element offsets and a shared element loop.
#pragma once

#include "chunk_packing.h"
#include "launch.cuh"

#include <c10/cuda/CUDAException.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace apex_amp {

// Threads per block of the multi-tensor kernels.
constexpr int kBlockSize = 512;

// What one block works on: elements [offset, offset + size) of one tensor of
// each list. Functors take it by const reference and read their typed
// pointers with chunk_data<T>(chunk, list).
template <int Depth>
struct Chunk {
  void* tensor_data[Depth];
  int64_t offset;  // 64-bit: tensors may hold more than 2^31 elements
  int size;        // <= kChunkSize
  int64_t slot;    // index of this chunk among all chunks of the call
};

template <typename T, int Depth>
__device__ __forceinline__ T* chunk_data(const Chunk<Depth>& chunk, int list) {
  return static_cast<T*>(chunk.tensor_data[list]) + chunk.offset;
}

template <int Depth, typename Functor>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_kernel(TensorListMetadata<Depth> meta, Functor functor) {
  const int tensor = meta.block_to_tensor[blockIdx.x];
  Chunk<Depth> chunk;
#pragma unroll
  for (int list = 0; list < Depth; ++list) {
    chunk.tensor_data[list] = meta.addresses[list][tensor];
  }
  chunk.offset = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t remaining = meta.numel[tensor] - chunk.offset;
  chunk.size = remaining < kChunkSize ? static_cast<int>(remaining) : kChunkSize;
  chunk.slot = meta.first_chunk_slot + blockIdx.x;
  functor(chunk);
}

// Runs `functor` over every chunk of `tensors` on `stream`, in as few launches
// as the metadata allows (chunk_packing.h). The caller holds a CUDAGuard for
// the tensors' device and passes the current stream,
// c10::cuda::getCurrentCUDAStream() (the function at::cuda re-exports; the
// c10 header spares nvcc the cuBLAS/cuSPARSE headers of ATen/cuda/CUDAContext.h).
template <int Depth, typename Functor>
void multi_tensor_apply(
    cudaStream_t stream,
    const std::vector<TensorEntry<Depth>>& tensors,
    const Functor& functor) {
  using Metadata = TensorListMetadata<Depth>;
  static_assert(sizeof(Functor) <= kFunctorArgBudgetBytes, "functor exceeds its argument budget");
  static_assert(
      sizeof(Metadata) + sizeof(Functor) <= kKernelArgLimitBytes, "kernel arguments exceed 4 KB");
  pack_chunks<Depth>(tensors, [&](const Metadata& meta, int num_blocks) {
    APEX_AMP_LAUNCH(num_blocks, kBlockSize, 0, stream, multi_tensor_kernel<Depth, Functor>)(
        meta, functor);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// ---------------------------------------------------------------------------
// Device-side element access shared by the functors.

// N elements of T moved as one aligned load/store (N = kILP on the vector path).
template <typename T, int N>
struct alignas(sizeof(T) * N) VectorOf {
  T value[N];
};

template <typename T>
__device__ __forceinline__ bool is_vector_aligned(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % (sizeof(T) * kILP) == 0;
}

// Loads N elements of T from p (aligned to N elements when N > 1) as floats.
template <int N, typename T>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[N]) {
  const VectorOf<T, N> loaded = *reinterpret_cast<const VectorOf<T, N>*>(p);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    out[k] = static_cast<float>(loaded.value[k]);
  }
}

// Stores N floats to p as T (rounded to nearest even for fp16/bf16).
template <int N, typename T>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[N]) {
  VectorOf<T, N> stored;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    stored.value[k] = static_cast<T>(in[k]);
  }
  *reinterpret_cast<VectorOf<T, N>*>(p) = stored;
}

// x as it will read back after being stored as T.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// Calls body(width, i) so that the block covers elements [0, size) of a
// chunk: with width = kILP (elements i .. i+kILP-1, vector loads) over the
// bulk when `vectorizable`, and with width = 1 over the rest. `width` is a
// std::integral_constant, so the body is one generic lambda compiled twice.
// Every thread returns from here; callers may synchronise the block after it.
template <typename Body>
__device__ __forceinline__ void for_each_element(int size, bool vectorizable, const Body& body) {
  const int vector_end = vectorizable ? size - size % kILP : 0;
  for (int i = threadIdx.x * kILP; i < vector_end; i += blockDim.x * kILP) {
    body(std::integral_constant<int, kILP>(), i);
  }
  for (int i = vector_end + threadIdx.x; i < size; i += blockDim.x) {
    body(std::integral_constant<int, 1>(), i);
  }
}

}  // namespace apex_amp
