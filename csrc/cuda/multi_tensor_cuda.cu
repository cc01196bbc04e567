// CUDA kernels of the element-wise list ops: check_finite, unscale_, scale_,
// axpby_ (semantics in csrc/ops.cpp, per-element math in csrc/amp_math.h).
//
// Non-finite values are found with amp_math.h's probes: each thread adds
// nonfinite_probe(x) of every value it checks into one register, and at the
// end a thread whose probe sum is NaN writes 1.0f to found_inf. Many threads
// may write at once; they all write the same value, so no atomic is needed
// and the flag is never cleared (apex's "blind write").
#include "amp_math.h"
#include "cuda/dtype_groups.cuh"
#include "cuda/launchers.h"
#include "cuda/multi_tensor_apply.cuh"
#include "validate.h"

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace apex_amp {
namespace {

__device__ __forceinline__ void report_nonfinite(float probe, float* found_inf) {
  if (probe_says_nonfinite(probe)) {
    *found_inf = 1.f;
  }
}

// Reads only.
template <typename T>
struct CheckFiniteFunctor {
  float* found_inf;

  __device__ void operator()(const Chunk<1>& chunk) const {
    const T* values = chunk_data<T>(chunk, 0);
    float probe = 0.f;
    for_each_element(chunk.size, is_vector_aligned<T>(values), [&](auto width, int i) {
      constexpr int W = decltype(width)::value;
      float x[W];
      load_floats<W>(values + i, x);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        probe += nonfinite_probe(x[k]);
      }
    });
    report_nonfinite(probe, found_inf);
  }
};

// grads *= inv_scale in place; checks the grads as read.
template <typename T>
struct UnscaleFunctor {
  float* found_inf;
  const float* inv_scale;

  __device__ void operator()(const Chunk<1>& chunk) const {
    T* grads = chunk_data<T>(chunk, 0);
    const float inv = *inv_scale;
    float probe = 0.f;
    for_each_element(chunk.size, is_vector_aligned<T>(grads), [&](auto width, int i) {
      constexpr int W = decltype(width)::value;
      float g[W];
      load_floats<W>(grads + i, g);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        probe += nonfinite_probe(g[k]);
        g[k] = g[k] * inv;
      }
      store_floats<W>(grads + i, g);
    });
    report_nonfinite(probe, found_inf);
  }
};

// dst = src * scale converted to Out. Only the stored result is probed: a
// non-finite src always gives a non-finite result (inf * 0 is NaN), so this
// covers src too, and an fp32 -> fp16 overflow shows as inf after rounding.
// dst may be src itself: each element is read before the same thread writes it.
template <typename In, typename Out>
struct ScaleFunctor {
  float* found_inf;
  const float* scale;

  __device__ void operator()(const Chunk<2>& chunk) const {
    const In* src = chunk_data<In>(chunk, 0);
    Out* dst = chunk_data<Out>(chunk, 1);
    const float factor = *scale;
    const bool vectorizable = is_vector_aligned<In>(src) && is_vector_aligned<Out>(dst);
    float probe = 0.f;
    for_each_element(chunk.size, vectorizable, [&](auto width, int i) {
      constexpr int W = decltype(width)::value;
      float v[W];
      load_floats<W>(src + i, v);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        v[k] = round_to<Out>(v[k] * factor);
        probe += nonfinite_probe(v[k]);
      }
      store_floats<W>(dst + i, v);
    });
    report_nonfinite(probe, found_inf);
  }
};

// y = a * x + b * y, probing the stored result, which covers x as in
// ScaleFunctor (inf or NaN in x makes a * x + b * y inf or NaN).
template <typename X, typename Y>
struct AxpbyFunctor {
  float* found_inf;
  const float* a;
  float b;

  __device__ void operator()(const Chunk<2>& chunk) const {
    const X* xs = chunk_data<X>(chunk, 0);
    Y* ys = chunk_data<Y>(chunk, 1);
    const float a_value = *a;
    const bool vectorizable = is_vector_aligned<X>(xs) && is_vector_aligned<Y>(ys);
    float probe = 0.f;
    for_each_element(chunk.size, vectorizable, [&](auto width, int i) {
      constexpr int W = decltype(width)::value;
      float x[W];
      float y[W];
      load_floats<W>(xs + i, x);
      load_floats<W>(ys + i, y);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        y[k] = round_to<Y>(axpby<float>(x[k], y[k], a_value, b));
        probe += nonfinite_probe(y[k]);
      }
      store_floats<W>(ys + i, y);
    });
    report_nonfinite(probe, found_inf);
  }
};

}  // namespace

void check_finite_cuda(at::TensorList tensors, const at::Tensor& found_inf) {
  const at::Device device = found_inf.device();
  validate_check_finite(tensors, found_inf, device);
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* found_inf_ptr = found_inf.data_ptr<float>();
  for (const auto& group : group_by_dtype<1>({tensors})) {
    dispatch_floating(group.dtypes[0], [&](auto tag) {
      using T = typename decltype(tag)::type;
      multi_tensor_apply<1>(stream, group.tensors, CheckFiniteFunctor<T>{found_inf_ptr});
    });
  }
}

void unscale_cuda(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  const at::Device device = found_inf.device();
  validate_unscale(grads, found_inf, inv_scale, device);
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* found_inf_ptr = found_inf.data_ptr<float>();
  const float* inv_scale_ptr = inv_scale.data_ptr<float>();
  for (const auto& group : group_by_dtype<1>({grads})) {
    dispatch_floating(group.dtypes[0], [&](auto tag) {
      using T = typename decltype(tag)::type;
      multi_tensor_apply<1>(stream, group.tensors, UnscaleFunctor<T>{found_inf_ptr, inv_scale_ptr});
    });
  }
}

void scale_cuda(
    at::TensorList src,
    at::TensorList dst,
    const at::Tensor& scale,
    const at::Tensor& found_inf) {
  const at::Device device = found_inf.device();
  validate_scale(src, dst, scale, found_inf, device);
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* found_inf_ptr = found_inf.data_ptr<float>();
  const float* scale_ptr = scale.data_ptr<float>();
  for (const auto& group : group_by_dtype<2>({src, dst})) {
    dispatch_floating(group.dtypes[0], [&](auto in_tag) {
      dispatch_floating(group.dtypes[1], [&](auto out_tag) {
        using In = typename decltype(in_tag)::type;
        using Out = typename decltype(out_tag)::type;
        multi_tensor_apply<2>(stream, group.tensors, ScaleFunctor<In, Out>{found_inf_ptr, scale_ptr});
      });
    });
  }
}

void axpby_cuda(
    at::TensorList x,
    at::TensorList y,
    const at::Tensor& a,
    double b,
    const at::Tensor& found_inf) {
  const at::Device device = found_inf.device();
  validate_axpby(x, y, a, found_inf, device);
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* found_inf_ptr = found_inf.data_ptr<float>();
  const float* a_ptr = a.data_ptr<float>();
  const float b_value = static_cast<float>(b);
  for (const auto& group : group_by_dtype<2>({x, y})) {
    dispatch_floating(group.dtypes[0], [&](auto x_tag) {
      dispatch_floating(group.dtypes[1], [&](auto y_tag) {
        using X = typename decltype(x_tag)::type;
        using Y = typename decltype(y_tag)::type;
        multi_tensor_apply<2>(stream, group.tensors, AxpbyFunctor<X, Y>{found_inf_ptr, a_ptr, b_value});
      });
    });
  }
}

}  // namespace apex_amp
