// CUDA kernels of fused_adam_: one Adam/AdamW step over whole tensor lists,
// one pass per element (semantics in csrc/ops.cpp, math in amp_math.h).
//
// No host sync anywhere: the step counter, inv_scale and found_inf stay on
// the device. Every block reads found_inf and returns at once when it is
// set; otherwise it reads `step`, computes the bias corrections for step + 1
// and updates its chunk. After all multi-tensor launches one single-thread
// kernel on the same stream increments `step`, again only when found_inf is
// clear, so every block of the op sees the same step.
#include "amp_math.h"
#include "cuda/dtype_groups.cuh"
#include "cuda/launch.cuh"
#include "cuda/multi_tensor_apply.cuh"
#include "validate.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>

namespace apex_amp {
namespace {

// The lists a fused Adam chunk walks, in TensorEntry order.
enum AdamList : int { kParam = 0, kGrad = 1, kExpAvg = 2, kExpAvgSq = 3, kModelParam = 4 };

// Device-resident inputs shared by every block, and the host hyper-parameters.
struct AdamArgs {
  const float* step;       // the step count before this op
  const float* inv_scale;  // nullptr: grads are used as they are
  const float* found_inf;  // nullptr: never skip
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  bool adamw_mode;
  bool bias_correction;
};

__device__ __forceinline__ bool step_is_skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.f;  // NaN counts as set
}

// Param is the dtype of params and both moments; ModelParam is void when no
// model copy is written (then the chunk has 4 lists, else 5).
template <typename Param, typename Grad, typename ModelParam>
struct FusedAdamFunctor {
  static constexpr bool kWritesModelParam = !std::is_void<ModelParam>::value;
  static constexpr int kDepth = kWritesModelParam ? 5 : 4;

  AdamArgs args;

  __device__ void operator()(const Chunk<kDepth>& chunk) const {
    // The same value for every thread of the block, so the early return is
    // uniform and the __syncthreads below is reached by all or none.
    if (step_is_skipped(args.found_inf)) {
      return;
    }
    __shared__ AdamStepParams shared_hyper;
    if (threadIdx.x == 0) {
      // Two double-precision pow() per block rather than per thread.
      shared_hyper = make_adam_step_params(
          args.lr, args.beta1, args.beta2, args.eps, args.weight_decay, *args.step + 1.f,
          args.adamw_mode, args.bias_correction);
    }
    __syncthreads();
    const AdamStepParams hyper = shared_hyper;
    const float inv_scale = args.inv_scale != nullptr ? *args.inv_scale : 1.f;

    Param* params = chunk_data<Param>(chunk, kParam);
    const Grad* grads = chunk_data<Grad>(chunk, kGrad);
    Param* exp_avgs = chunk_data<Param>(chunk, kExpAvg);
    Param* exp_avg_sqs = chunk_data<Param>(chunk, kExpAvgSq);
    bool vectorizable = is_vector_aligned<Param>(params) && is_vector_aligned<Grad>(grads) &&
        is_vector_aligned<Param>(exp_avgs) && is_vector_aligned<Param>(exp_avg_sqs);
    if constexpr (kWritesModelParam) {
      vectorizable = vectorizable &&
          is_vector_aligned<ModelParam>(chunk_data<ModelParam>(chunk, kModelParam));
    }

    for_each_element(chunk.size, vectorizable, [&](auto width, int i) {
      constexpr int W = decltype(width)::value;
      float p[W];
      float g[W];
      float m[W];
      float v[W];
      load_floats<W>(params + i, p);
      load_floats<W>(grads + i, g);
      load_floats<W>(exp_avgs + i, m);
      load_floats<W>(exp_avg_sqs + i, v);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        adam_update<float>(p[k], m[k], v[k], g[k] * inv_scale, hyper);
      }
      store_floats<W>(params + i, p);
      store_floats<W>(exp_avgs + i, m);
      store_floats<W>(exp_avg_sqs + i, v);
      if constexpr (kWritesModelParam) {
        store_floats<W>(chunk_data<ModelParam>(chunk, kModelParam) + i, p);
      }
    });
  }
};

__global__ void increment_step_kernel(float* step, const float* found_inf) {
  if (!step_is_skipped(found_inf)) {
    *step += 1.f;
  }
}

template <typename Param, typename Grad, typename ModelParam, int Depth>
void launch_adam(cudaStream_t stream, const DtypeGroup<Depth>& group, const AdamArgs& args) {
  using Functor = FusedAdamFunctor<Param, Grad, ModelParam>;
  static_assert(Functor::kDepth == Depth, "model-param list and functor disagree");
  multi_tensor_apply<Depth>(stream, group.tensors, Functor{args});
}

// The supported combinations (validate.h: check_adam_dtypes) and no others,
// to keep the number of kernel instantiations small: fp32 params with any
// grad dtype (x any model copy dtype), or low-precision params with grads of
// their own dtype and no model copy.
void run_adam_group(cudaStream_t stream, const DtypeGroup<4>& group, const AdamArgs& args) {
  const at::ScalarType param = group.dtypes[kParam];
  if (param == at::kFloat) {
    dispatch_floating(group.dtypes[kGrad], [&](auto grad_tag) {
      using Grad = typename decltype(grad_tag)::type;
      launch_adam<float, Grad, void>(stream, group, args);
    });
  } else {
    dispatch_floating(param, [&](auto param_tag) {
      using Param = typename decltype(param_tag)::type;
      if constexpr (!std::is_same<Param, float>::value) {
        launch_adam<Param, Param, void>(stream, group, args);
      }
    });
  }
}

void run_adam_group(cudaStream_t stream, const DtypeGroup<5>& group, const AdamArgs& args) {
  TORCH_CHECK(
      group.dtypes[kParam] == at::kFloat,
      "apex_amp: internal error: model_params with non-fp32 params passed validation");
  dispatch_floating(group.dtypes[kGrad], [&](auto grad_tag) {
    dispatch_floating(group.dtypes[kModelParam], [&](auto model_tag) {
      using Grad = typename decltype(grad_tag)::type;
      using ModelParam = typename decltype(model_tag)::type;
      launch_adam<float, Grad, ModelParam>(stream, group, args);
    });
  });
}

const float* optional_data(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

void fused_adam_cuda(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList model_params,
    const at::Tensor& step,
    double lr,
    double beta1,
    double beta2,
    double eps,
    double weight_decay,
    bool adamw_mode,
    bool bias_correction,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf) {
  const at::Device device = step.device();
  validate_fused_adam(
      params, grads, exp_avgs, exp_avg_sqs, model_params, step, lr, beta1, beta2, eps,
      weight_decay, inv_scale, found_inf, device);
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  float* step_ptr = step.data_ptr<float>();
  const float* found_inf_ptr = optional_data(found_inf);
  const AdamArgs args{
      step_ptr,
      optional_data(inv_scale),
      found_inf_ptr,
      static_cast<float>(lr),
      static_cast<float>(beta1),
      static_cast<float>(beta2),
      static_cast<float>(eps),
      static_cast<float>(weight_decay),
      adamw_mode,
      bias_correction};

  if (model_params.empty()) {
    for (const auto& group : group_by_dtype<4>({params, grads, exp_avgs, exp_avg_sqs})) {
      run_adam_group(stream, group, args);
    }
  } else {
    for (const auto& group :
         group_by_dtype<5>({params, grads, exp_avgs, exp_avg_sqs, model_params})) {
      run_adam_group(stream, group, args);
    }
  }

  APEX_AMP_LAUNCH(1, 1, 0, stream, increment_step_kernel)(step_ptr, found_inf_ptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_amp, CUDA, m) {
  m.impl("fused_adam_", &fused_adam_cuda);
}

}  // namespace apex_amp
