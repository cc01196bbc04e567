// The CUDA side of the fused optimizer rules (amp_math.h): one functor that
// runs any rule over a chunk of the lists, and the launcher part every
// fused optimizer shares (dtype groups, the kernel instantiation per dtype
// combination, the step count).
//
// No host sync anywhere: the step count, inv_scale and found_inf stay on the
// device. Every block reads found_inf and returns at once when it is set;
// otherwise thread 0 completes the hyper-parameters for step + 1
// (prepare_step) into shared memory. After all of an op's launches one
// single-thread kernel on the same stream increments `step`, again only when
// found_inf is clear, so every block of the op sees the same step.
#pragma once

#include "amp_math.h"
#include "cuda/dtype_groups.cuh"
#include "cuda/launch.cuh"
#include "cuda/multi_tensor_apply.cuh"

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <vector>

namespace apex_amp {

// The device scalars of one fused step; a null pointer means: no step count
// (prepare_step gets 0), no unscaling, never skip, bf16 states rounded to
// nearest even (state_rounding: the op's (params, 2) int64 rows, read by
// formatted_rule.cuh only).
struct FusedStepArgs {
  const float* step;       // the step count before this op
  const float* inv_scale;
  const float* found_inf;
  const int64_t* state_rounding = nullptr;
};

inline const int64_t* rounding_data(const std::optional<at::Tensor>& state_rounding) {
  return state_rounding.has_value() ? state_rounding->data_ptr<int64_t>() : nullptr;
}

__device__ __forceinline__ bool step_is_skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.f;  // NaN counts as set
}

inline const float* optional_data(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// The lists a rule walks, in TensorEntry order: params, grads, the rule's
// kStates state lists, the model copy when Model is not void, and a pointer
// to the tensor's value when the rule takes one (not offset by the chunk).
template <typename Hyper, typename Param, typename Grad, typename Model>
struct FusedRuleFunctor {
  static constexpr int kStates = Hyper::kStates;
  static constexpr int kSlots = kStates > 0 ? kStates : 1;  // C++ has no empty arrays
  static constexpr bool kWritesModel = !std::is_void<Model>::value;
  static constexpr int kModelList = 2 + kStates;
  static constexpr int kValueList = kModelList + (kWritesModel ? 1 : 0);
  static constexpr int kDepth = kValueList + (Hyper::kTakesTensorValue ? 1 : 0);

  Hyper hyper;
  FusedStepArgs args;

  __device__ void operator()(const Chunk<kDepth>& chunk) const {
    // The same value for every thread of the block, so the early return is
    // uniform and the __syncthreads below is reached by all or none.
    if (step_is_skipped(args.found_inf)) {
      return;
    }
    __shared__ Hyper shared_hyper;
    if (threadIdx.x == 0) {
      // The step's pow() once per block rather than per thread.
      Hyper prepared = hyper;
      prepare_step(prepared, args.step != nullptr ? *args.step + 1.f : 0.f);
      shared_hyper = prepared;
    }
    __syncthreads();
    const Hyper h = shared_hyper;
    const float inv_scale = args.inv_scale != nullptr ? *args.inv_scale : 1.f;
    float value = 0.f;
    if constexpr (Hyper::kTakesTensorValue) {
      value = *static_cast<const float*>(chunk.tensor_data[kValueList]);
    }

    Param* params = chunk_data<Param>(chunk, 0);
    const Grad* grads = chunk_data<Grad>(chunk, 1);
    Param* states[kSlots] = {};
    bool vectorizable = is_vector_aligned<Param>(params) && is_vector_aligned<Grad>(grads);
#pragma unroll
    for (int s = 0; s < kStates; ++s) {
      states[s] = chunk_data<Param>(chunk, 2 + s);
      vectorizable = vectorizable && is_vector_aligned<Param>(states[s]);
    }
    if constexpr (kWritesModel) {
      vectorizable = vectorizable && is_vector_aligned<Model>(chunk_data<Model>(chunk, kModelList));
    }

    for_each_element(chunk.size, vectorizable, [&](auto width, int i) {
      constexpr int W = decltype(width)::value;
      float p[W];
      float g[W] = {};
      float s[kSlots][W] = {};
      load_floats<W>(params + i, p);
      if constexpr (Hyper::kReadsGrad) {
        load_floats<W>(grads + i, g);
      }
#pragma unroll
      for (int k = 0; k < kStates; ++k) {
        load_floats<W>(states[k] + i, s[k]);
      }
#pragma unroll
      for (int e = 0; e < W; ++e) {
        float element_states[kSlots];
#pragma unroll
        for (int k = 0; k < kSlots; ++k) {
          element_states[k] = s[k][e];
        }
        fused_rule<float>(p[e], element_states, g[e] * inv_scale, h, value);
#pragma unroll
        for (int k = 0; k < kSlots; ++k) {
          s[k][e] = element_states[k];
        }
      }
      store_floats<W>(params + i, p);
      if constexpr (Hyper::kWritesStates) {
#pragma unroll
        for (int k = 0; k < kStates; ++k) {
          store_floats<W>(states[k] + i, s[k]);
        }
      }
      if constexpr (kWritesModel) {
        store_floats<W>(chunk_data<Model>(chunk, kModelList) + i, p);
      }
    });
  }
};

namespace {  // one copy of the kernel per launcher file

__global__ void increment_step_kernel(float* step, const float* found_inf) {
  if (!step_is_skipped(found_inf)) {
    *step += 1.f;
  }
}

}  // namespace

// Increments `step` on `stream` unless found_inf is set; the last launch of an op.
inline void increment_step(cudaStream_t stream, float* step, const float* found_inf) {
  APEX_AMP_LAUNCH(1, 1, 0, stream, increment_step_kernel)(step, found_inf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace fused_rule_detail {

template <typename Hyper, typename Param, typename Grad, typename Model, int Lists>
void launch(
    cudaStream_t stream,
    const DtypeGroup<Lists>& group,
    const Hyper& hyper,
    const FusedStepArgs& args,
    const float* tensor_values) {
  using Functor = FusedRuleFunctor<Hyper, Param, Grad, Model>;
  if constexpr (Hyper::kTakesTensorValue) {
    static_assert(Functor::kDepth == Lists + 1, "lists and functor disagree");
    std::vector<TensorEntry<Lists + 1>> entries(group.tensors.size());
    for (size_t k = 0; k < group.tensors.size(); ++k) {
      for (int list = 0; list < Lists; ++list) {
        entries[k].data[list] = group.tensors[k].data[list];
      }
      entries[k].data[Lists] = const_cast<float*>(tensor_values + group.positions[k]);
      entries[k].numel = group.tensors[k].numel;
    }
    multi_tensor_apply<Lists + 1>(stream, entries, Functor{hyper, args});
  } else {
    static_assert(Functor::kDepth == Lists, "lists and functor disagree");
    multi_tensor_apply<Lists>(stream, group.tensors, Functor{hyper, args});
  }
}

// The dtype combinations validate.h (check_fused_dtypes) admits, and no
// others, to keep the number of kernel instantiations small: fp32 params with
// any grad dtype (and any model copy dtype), or fp16/bf16 params with grads
// of their own dtype and no model copy. A rule that reads no grad gets the
// params as its grads list and one instantiation per param dtype.
template <typename Hyper, bool kWithModel, int Lists>
void run_group(
    cudaStream_t stream,
    const DtypeGroup<Lists>& group,
    const Hyper& hyper,
    const FusedStepArgs& args,
    const float* tensor_values) {
  const at::ScalarType param = group.dtypes[0];
  if (param != at::kFloat) {
    dispatch_floating(param, [&](auto param_tag) {
      using Param = typename decltype(param_tag)::type;
      if constexpr (!std::is_same<Param, float>::value && !kWithModel) {
        launch<Hyper, Param, Param, void>(stream, group, hyper, args, tensor_values);
      }
    });
    return;
  }
  const auto with_grad = [&](auto grad_tag) {
    using Grad = typename decltype(grad_tag)::type;
    if constexpr (kWithModel) {
      dispatch_floating(group.dtypes[Lists - 1], [&](auto model_tag) {
        using Model = typename decltype(model_tag)::type;
        launch<Hyper, float, Grad, Model>(stream, group, hyper, args, tensor_values);
      });
    } else {
      launch<Hyper, float, Grad, void>(stream, group, hyper, args, tensor_values);
    }
  };
  if constexpr (Hyper::kReadsGrad) {
    dispatch_floating(group.dtypes[1], with_grad);
  } else {
    with_grad(TypeTag<float>{});
  }
}

template <typename Hyper, bool kWithModel>
void run_lists(
    cudaStream_t stream,
    at::TensorList params,
    at::TensorList grads,
    std::initializer_list<at::TensorList> states,
    at::TensorList model_params,
    const Hyper& hyper,
    const FusedStepArgs& args,
    const float* tensor_values,
    const std::vector<uint8_t>* skipped) {
  constexpr int kLists = 2 + Hyper::kStates + (kWithModel ? 1 : 0);
  std::array<at::TensorList, kLists> lists;
  lists[0] = params;
  lists[1] = Hyper::kReadsGrad ? grads : params;
  int next = 2;
  for (at::TensorList state : states) {
    lists[next++] = state;
  }
  if constexpr (kWithModel) {
    lists[next] = model_params;
  }
  for (auto& group : group_by_dtype<kLists>(lists)) {
    if (skipped != nullptr) {  // formatted tensors: another kernel's (formatted_rule.cuh)
      DtypeGroup<kLists> kept{group.dtypes, {}, {}};
      for (size_t k = 0; k < group.tensors.size(); ++k) {
        if (!(*skipped)[group.positions[k]]) {
          kept.tensors.push_back(group.tensors[k]);
          kept.positions.push_back(group.positions[k]);
        }
      }
      if (kept.tensors.empty()) {
        continue;
      }
      group = std::move(kept);
    }
    run_group<Hyper, kWithModel>(stream, group, hyper, args, tensor_values);
  }
}

}  // namespace fused_rule_detail

// Runs the rule of `hyper` over the lists on `stream` (the caller holds a
// CUDAGuard for their device). `states`: the rule's kStates lists in its
// order; model_params empty for no model copy; tensor_values a device array
// of one value per list position, for rules that take one. Does not count
// the step: call increment_step after the op's last launch. `skipped`, when
// given, marks the list positions to leave alone (formatted tensors).
template <typename Hyper>
void run_fused_rule(
    cudaStream_t stream,
    at::TensorList params,
    at::TensorList grads,
    std::initializer_list<at::TensorList> states,
    at::TensorList model_params,
    const Hyper& hyper,
    const FusedStepArgs& args,
    const float* tensor_values = nullptr,
    const std::vector<uint8_t>* skipped = nullptr) {
  TORCH_CHECK(
      static_cast<int>(states.size()) == Hyper::kStates,
      "apex_amp: internal error: a fused rule got the wrong number of state lists");
  if (model_params.empty()) {
    fused_rule_detail::run_lists<Hyper, false>(
        stream, params, grads, states, model_params, hyper, args, tensor_values, skipped);
  } else {
    fused_rule_detail::run_lists<Hyper, true>(
        stream, params, grads, states, model_params, hyper, args, tensor_values, skipped);
  }
}

}  // namespace apex_amp
