// CUDA launchers of fused_lamb_ (apex's LAMB) and of its two passes as ops of
// their own (fused_lamb_moments_, fused_lamb_update_: FSDP2 sums the per-tensor
// squared norms of its shards between them; apex_amp/optimizers/_lamb_ops.py),
// no host sync:
//   1. the moments (amp_math.h: lamb_moments) with the gradients unscaled and
//      divided by the global-norm clip (lamb_grad_scale of grad_norm times
//      inv_scale), per chunk the sums of squares of the params and of the
//      update directions, and per tensor their sums (reductions.cuh): the
//      (2, num_tensors) squared norms;
//   2. from their square roots lr times the trust ratio (lamb_trust_step),
//      then the update (the LambHyper rule) with that as the tensor's value.
// Each launch does nothing when found_inf is set (the squared norms stay 0);
// the step count goes last.
#include "amp_math.h"
#include "cuda/formatted_rule.cuh"
#include "cuda/fused_rule.cuh"
#include "cuda/launchers.h"
#include "cuda/reductions.cuh"
#include "validate.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace apex_amp {
namespace {

struct LambArgs {
  FusedStepArgs step;
  const float* grad_norm;  // of the grads as given (still scaled)
  float max_grad_norm;
  float* param_partials;      // this dtype group's first slot
  float* direction_partials;  // likewise
};

// Lists: params, grads, exp_avgs, exp_avg_sqs.
template <typename Param, typename Grad>
struct LambMomentsFunctor {
  LambHyper hyper;
  LambArgs args;

  __device__ void operator()(const Chunk<4>& chunk) const {
    if (step_is_skipped(args.step.found_inf)) {
      return;
    }
    const float inv_scale = args.step.inv_scale != nullptr ? *args.step.inv_scale : 1.f;
    __shared__ LambHyper shared_hyper;
    if (threadIdx.x == 0) {
      LambHyper prepared = hyper;
      prepare_step(prepared, *args.step.step + 1.f);
      prepared.grad_scale = lamb_grad_scale(*args.grad_norm * inv_scale, args.max_grad_norm);
      shared_hyper = prepared;
    }
    __syncthreads();
    const LambHyper h = shared_hyper;
    const Param* params = chunk_data<Param>(chunk, 0);
    const Grad* grads = chunk_data<Grad>(chunk, 1);
    Param* exp_avgs = chunk_data<Param>(chunk, 2);
    Param* exp_avg_sqs = chunk_data<Param>(chunk, 3);
    const bool vectorizable = is_vector_aligned<Param>(params) && is_vector_aligned<Grad>(grads) &&
        is_vector_aligned<Param>(exp_avgs) && is_vector_aligned<Param>(exp_avg_sqs);
    float param_squares = 0.f;
    float direction_squares = 0.f;
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
      for (int e = 0; e < W; ++e) {
        lamb_moments<float>(p[e], m[e], v[e], g[e] * inv_scale, h);
        m[e] = round_to<Param>(m[e]);  // the moments as stored (amp_math.h: lamb_moments)
        v[e] = round_to<Param>(v[e]);
        const float d = lamb_direction<float>(p[e], m[e], v[e], h);
        param_squares += p[e] * p[e];
        direction_squares += d * d;
      }
      store_floats<W>(exp_avgs + i, m);
      store_floats<W>(exp_avg_sqs + i, v);
    });
    param_squares = block_sum<kBlockSize>(param_squares);
    direction_squares = block_sum<kBlockSize>(direction_squares);
    if (threadIdx.x == 0) {
      args.param_partials[chunk.slot] = param_squares;
      args.direction_partials[chunk.slot] = direction_squares;
    }
  }
};

// LambMomentsFunctor for formatted tensors (formatted_rule.cuh), in the lists
// of FormattedRuleFunctor<LambHyper, ...>: it writes nothing but the sums (the
// moments could not carry their fp32 values to the update through their
// codes: the update recomputes them, as the CPU kernels do). Its elements go
// to threads as LambMomentsFunctor's on the vector path, so the sums are
// those of fp32 states holding the same values, bit for bit.
template <typename Grad, bool kRemainder>
struct FormattedLambMomentsFunctor {
  using Lists = FormattedRuleFunctor<LambHyper, Grad, void, kRemainder>;
  LambHyper hyper;
  LambArgs args;
  StateLayouts layouts;

  __device__ void operator()(const Chunk<Lists::kDepth>& chunk) const {
    if (step_is_skipped(args.step.found_inf)) {
      return;
    }
    const float inv_scale = args.step.inv_scale != nullptr ? *args.step.inv_scale : 1.f;
    __shared__ LambHyper shared_hyper;
    if (threadIdx.x == 0) {
      LambHyper prepared = hyper;
      prepare_step(prepared, *args.step.step + 1.f);
      prepared.grad_scale = lamb_grad_scale(*args.grad_norm * inv_scale, args.max_grad_norm);
      shared_hyper = prepared;
    }
    __syncthreads();
    const LambHyper h = shared_hyper;
    const Grad* grads = static_cast<const Grad*>(chunk.tensor_data[1]);
    float param_squares = 0.f;
    float direction_squares = 0.f;
    for_each_element(chunk.size, true, [&](auto width, int i) {
      constexpr int W = decltype(width)::value;
#pragma unroll
      for (int e = 0; e < W; ++e) {
        const int64_t index = chunk.offset + i + e;
        const float p = read_formatted_master<kRemainder>(chunk, Lists::kExtraList, index);
        float m = read_formatted_state(chunk, layouts, 0, Lists::kAbsmaxList, index);
        float v = read_formatted_state(chunk, layouts, 1, Lists::kAbsmaxList, index);
        lamb_moments<float>(p, m, v, static_cast<float>(grads[index]) * inv_scale, h);
        const float d = lamb_direction<float>(p, m, v, h);
        param_squares += p * p;
        direction_squares += d * d;
      }
    });
    param_squares = block_sum<kBlockSize>(param_squares);
    direction_squares = block_sum<kBlockSize>(direction_squares);
    if (threadIdx.x == 0) {
      args.param_partials[chunk.slot] = param_squares;
      args.direction_partials[chunk.slot] = direction_squares;
    }
  }
};

using FormattedLambGroup =
    formatted_rule_detail::FormattedGroup<FormattedRuleFunctor<LambHyper, float, void, false>::kDepth>;

__global__ void __launch_bounds__(kCleanupBlockSize) lamb_trust_kernel(
    const float* norm_squares,  // (2, num_tensors): params, directions
    float* trust_steps,
    int64_t num_tensors,
    float lr,
    float weight_decay,
    bool use_nvlamb,
    const float* found_inf) {
  if (step_is_skipped(found_inf)) {
    return;
  }
  for (int64_t t = threadIdx.x; t < num_tensors; t += blockDim.x) {
    trust_steps[t] = lamb_trust_step(::sqrtf(norm_squares[t]), ::sqrtf(norm_squares[num_tensors + t]), lr,
                                     weight_decay, use_nvlamb);
  }
}

// The op's lists, as validated.
struct LambLists {
  at::TensorList params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes;
};

// Pass 1: the moments, and the (2, num_tensors) squared norms.
at::Tensor moments_pass(
    const LambLists& l,
    const at::Tensor& grad_norm,
    double max_grad_norm,
    const LambHyper& hyper,
    const FusedStepArgs& step_args,
    cudaStream_t stream) {
  // (ArrayRefs, not a structured binding: lambdas below use them.)
  const at::TensorList params = l.params, grads = l.grads, exp_avgs = l.exp_avgs, exp_avg_sqs = l.exp_avg_sqs,
                       model_params = l.model_params, master_remainders = l.master_remainders,
                       state_absmaxes = l.state_absmaxes;
  const int64_t num_tensors = static_cast<int64_t>(params.size());
  const auto float_options = at::TensorOptions().dtype(at::kFloat).device(grad_norm.device());
  at::Tensor norm_squares = at::zeros({2, num_tensors}, float_options);
  if (num_tensors == 0) {
    return norm_squares;
  }
  // Formatted tensors (formatted_rule.cuh) after the others, in the same slot plan.
  const std::vector<uint8_t> formatted = formatted_positions(params, {exp_avgs, exp_avg_sqs}, master_remainders);
  const bool any_formatted = std::find(formatted.begin(), formatted.end(), 1) != formatted.end();
  std::vector<DtypeGroup<4>> groups;
  for (auto& group : group_by_dtype<4>({params, grads, exp_avgs, exp_avg_sqs})) {
    DtypeGroup<4> kept{group.dtypes, {}, {}};
    for (size_t k = 0; k < group.tensors.size(); ++k) {
      if (!formatted[group.positions[k]]) {
        kept.tensors.push_back(group.tensors[k]);
        kept.positions.push_back(group.positions[k]);
      }
    }
    if (!kept.tensors.empty()) {
      groups.push_back(std::move(kept));
    }
  }
  std::vector<FormattedLambGroup> formatted_groups;
  if (any_formatted) {
    // The moments pass writes no formatted state: no tensor values, no rounding rows.
    formatted_groups = group_formatted<LambHyper>(formatted, params, grads, {exp_avgs, exp_avg_sqs}, model_params,
                                                  master_remainders, state_absmaxes, nullptr, nullptr);
  }
  std::vector<DtypeGroup<4>> slot_groups = groups;
  for (const auto& group : formatted_groups) {  // only their sizes and positions count here
    DtypeGroup<4> sizes{{}, {}, group.positions};
    for (const auto& entry : group.tensors) {
      sizes.tensors.push_back(TensorEntry<4>{{}, entry.numel});
    }
    slot_groups.push_back(std::move(sizes));
  }
  const SlotPlan plan(slot_groups, params.size());
  if (plan.num_slots == 0) {
    return norm_squares;
  }
  // Zeros: a skipped step's functors write no slot, and its squared norms must read 0.
  at::Tensor partials = at::zeros({2, plan.num_slots}, float_options);
  float* param_partials = partials[0].data_ptr<float>();
  float* direction_partials = partials[1].data_ptr<float>();
  const auto args_from = [&](int64_t first_slot) {
    return LambArgs{step_args, grad_norm.data_ptr<float>(), static_cast<float>(max_grad_norm),
                    param_partials + first_slot, direction_partials + first_slot};
  };
  for (size_t g = 0; g < groups.size(); ++g) {
    const LambArgs args = args_from(plan.group_first_slot[g]);
    const auto param_dtype = groups[g].dtypes[0];
    if (param_dtype == at::kFloat) {
      dispatch_floating(groups[g].dtypes[1], [&](auto grad_tag) {
        using Grad = typename decltype(grad_tag)::type;
        multi_tensor_apply<4>(stream, groups[g].tensors, LambMomentsFunctor<float, Grad>{hyper, args});
      });
    } else {
      dispatch_floating(param_dtype, [&](auto param_tag) {
        using Param = typename decltype(param_tag)::type;
        multi_tensor_apply<4>(stream, groups[g].tensors, LambMomentsFunctor<Param, Param>{hyper, args});
      });
    }
  }
  for (size_t j = 0; j < formatted_groups.size(); ++j) {
    const auto& group = formatted_groups[j];
    const LambArgs args = args_from(plan.group_first_slot[groups.size() + j]);
    dispatch_floating(group.grad, [&](auto grad_tag) {
      using Grad = typename decltype(grad_tag)::type;
      constexpr int kDepth = FormattedLambMomentsFunctor<Grad, false>::Lists::kDepth;
      if (master_remainders.empty()) {
        multi_tensor_apply<kDepth>(
            stream, group.tensors, FormattedLambMomentsFunctor<Grad, false>{hyper, args, group.layouts});
      } else {
        multi_tensor_apply<kDepth>(
            stream, group.tensors, FormattedLambMomentsFunctor<Grad, true>{hyper, args, group.layouts});
      }
    });
  }
  per_tensor_from_slots(stream, plan, param_partials, norm_squares[0].data_ptr<float>(), SlotCombine::kSum);
  per_tensor_from_slots(stream, plan, direction_partials, norm_squares[1].data_ptr<float>(), SlotCombine::kSum);
  return norm_squares;
}

// Pass 2, after pass 1: the trust-ratio steps, the update, and the step count.
void update_pass(
    const LambLists& l,
    const at::Tensor& step,
    const at::Tensor& grad_norm,
    const at::Tensor& norm_squares,
    double lr,
    double max_grad_norm,
    bool use_nvlamb,
    const LambHyper& hyper,
    const FusedStepArgs& step_args,
    cudaStream_t stream) {
  const int64_t num_tensors = static_cast<int64_t>(l.params.size());
  if (num_tensors > 0) {
    at::Tensor trust_steps = at::empty({num_tensors}, norm_squares.options());
    APEX_AMP_LAUNCH(1, kCleanupBlockSize, 0, stream, lamb_trust_kernel)(
        norm_squares.data_ptr<float>(), trust_steps.data_ptr<float>(), num_tensors, static_cast<float>(lr),
        hyper.weight_decay, use_nvlamb, step_args.found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    run_rule_with_formats(stream, l.params, l.grads, {l.exp_avgs, l.exp_avg_sqs}, l.model_params,
                          l.master_remainders, l.state_absmaxes, hyper, step_args, trust_steps.data_ptr<float>(),
                          GradClip{grad_norm.data_ptr<float>(), static_cast<float>(max_grad_norm)});
  }
  increment_step(stream, step.data_ptr<float>(), step_args.found_inf);
}

FusedStepArgs step_args_of(
    const at::Tensor& step,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding) {
  return FusedStepArgs{step.data_ptr<float>(), optional_data(inv_scale), optional_data(found_inf),
                       rounding_data(state_rounding)};
}

}  // namespace

at::Tensor fused_lamb_moments_cuda(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    const at::Tensor& step,
    const at::Tensor& grad_norm,
    double beta1,
    double beta2,
    double eps,
    double weight_decay,
    bool bias_correction,
    bool grad_averaging,
    bool adam_w_mode,
    double max_grad_norm,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf) {
  const at::Device device = step.device();
  validate_fused_lamb(
      "fused_lamb_moments_", params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes,
      step, grad_norm, 0.0, beta1, beta2, eps, weight_decay, max_grad_norm, inv_scale, found_inf, std::nullopt,
      device);
  const c10::cuda::CUDAGuard device_guard(device);
  // hyper.grad_scale stays 1: set per block from grad_norm (LambMomentsFunctor).
  const LambHyper hyper =
      lamb_hyper(beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, adam_w_mode);
  return moments_pass({params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes},
                      grad_norm, max_grad_norm, hyper, step_args_of(step, inv_scale, found_inf, std::nullopt),
                      c10::cuda::getCurrentCUDAStream());
}

void fused_lamb_update_cuda(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    const at::Tensor& step,
    const at::Tensor& grad_norm,
    const at::Tensor& norm_squares,
    double lr,
    double beta1,
    double beta2,
    double eps,
    double weight_decay,
    bool bias_correction,
    bool grad_averaging,
    bool adam_w_mode,
    double max_grad_norm,
    bool use_nvlamb,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding) {
  constexpr const char* op = "fused_lamb_update_";
  const at::Device device = step.device();
  validate_fused_lamb(
      op, params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step, grad_norm,
      lr, beta1, beta2, eps, weight_decay, max_grad_norm, inv_scale, found_inf, state_rounding, device);
  check_per_tensor_values(op, "norm_squares", norm_squares, 2, static_cast<int64_t>(params.size()), device);
  const c10::cuda::CUDAGuard device_guard(device);
  const LambHyper hyper =
      lamb_hyper(beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, adam_w_mode);
  update_pass({params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes}, step,
              grad_norm, norm_squares, lr, max_grad_norm, use_nvlamb, hyper,
              step_args_of(step, inv_scale, found_inf, state_rounding), c10::cuda::getCurrentCUDAStream());
}

void fused_lamb_cuda(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    const at::Tensor& step,
    const at::Tensor& grad_norm,
    double lr,
    double beta1,
    double beta2,
    double eps,
    double weight_decay,
    bool bias_correction,
    bool grad_averaging,
    bool adam_w_mode,
    double max_grad_norm,
    bool use_nvlamb,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding) {
  const at::Device device = step.device();
  validate_fused_lamb(
      "fused_lamb_", params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
      grad_norm, lr, beta1, beta2, eps, weight_decay, max_grad_norm, inv_scale, found_inf, state_rounding, device);
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const FusedStepArgs step_args = step_args_of(step, inv_scale, found_inf, state_rounding);
  // hyper.grad_scale stays 1: set per block from grad_norm (LambMomentsFunctor).
  const LambHyper hyper =
      lamb_hyper(beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, adam_w_mode);
  const LambLists lists{params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes};
  const at::Tensor norm_squares = moments_pass(lists, grad_norm, max_grad_norm, hyper, step_args, stream);
  update_pass(lists, step, grad_norm, norm_squares, lr, max_grad_norm, use_nvlamb, hyper, step_args, stream);
}

}  // namespace apex_amp
