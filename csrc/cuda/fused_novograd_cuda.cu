// CUDA launcher of fused_novograd_: apex's NovoGrad in three launches, no host sync:
//   1. per-chunk partial norms of the grads (sums of squares, or largest |g|
//      with norm_type 0) and, per tensor, its norm (reductions.cuh); skipped
//      when grad_norms gives them (FSDP2: the norms of the whole gradients);
//   2. per tensor, the norm (times inv_scale) blended into its one-element
//      second moment (amp_math.h: novograd_blend), also kept as the tensor's value;
//   3. the elementwise rule (NovoGradHyper) with that value.
// Each launch does nothing when found_inf is set; the step count goes last.
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

#include <optional>

namespace apex_amp {
namespace {

// Each second moment is a one-element tensor, so a chunk is one tensor and
// its slot is the tensor's list position.
struct NovoGradBlendFunctor {
  const float* norms;   // by list position, not yet unscaled
  float* moments_out;   // by list position: the blended moments, the rule's values
  FusedStepArgs args;
  float beta2;
  bool l2;

  __device__ void operator()(const Chunk<1>& chunk) const {
    if (step_is_skipped(args.found_inf) || threadIdx.x != 0) {
      return;
    }
    float* moment = chunk_data<float>(chunk, 0);
    const float inv_scale = args.inv_scale != nullptr ? *args.inv_scale : 1.f;
    *moment = novograd_blend(*moment, norms[chunk.slot] * inv_scale, beta2, l2);
    moments_out[chunk.slot] = *moment;
  }
};

}  // namespace

void fused_novograd_cuda(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    const at::Tensor& step,
    double lr,
    double beta1,
    double beta2,
    double eps,
    double weight_decay,
    bool bias_correction,
    bool grad_averaging,
    bool reg_inside_moment,
    int64_t norm_type,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding,
    const std::optional<at::Tensor>& grad_norms) {
  const at::Device device = step.device();
  validate_fused_novograd(
      params, grads, exp_avgs, exp_avg_sqs, model_params, master_remainders, state_absmaxes, step,
      lr, beta1, beta2, eps, weight_decay, norm_type, inv_scale, found_inf, state_rounding, grad_norms, device);
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const FusedStepArgs args{step.data_ptr<float>(), optional_data(inv_scale), optional_data(found_inf),
                           rounding_data(state_rounding)};
  const bool take_max = norm_type == 0;
  const auto float_options = at::TensorOptions().dtype(at::kFloat).device(device);
  const int64_t num_tensors = static_cast<int64_t>(params.size());

  if (num_tensors > 0) {
    // 1. Per-tensor gradient norms (an empty tensor's stays 0), unless given.
    at::Tensor norms = grad_norms.has_value() ? *grad_norms : at::zeros({num_tensors}, float_options);
    const auto groups = group_by_dtype<1>({grads});
    const SlotPlan plan(groups, grads.size());
    if (!grad_norms.has_value() && plan.num_slots > 0) {
      at::Tensor partials = at::empty({plan.num_slots}, float_options);
      chunk_partials(stream, groups, plan, partials.data_ptr<float>(), take_max);
      per_tensor_from_slots(stream, plan, partials.data_ptr<float>(), norms.data_ptr<float>(),
                            take_max ? SlotCombine::kMax : SlotCombine::kSqrtOfSum);
    }
    // 2. Blended into the second moments.
    at::Tensor moments = at::empty({num_tensors}, float_options);
    std::vector<TensorEntry<1>> entries(exp_avg_sqs.size());
    for (size_t i = 0; i < exp_avg_sqs.size(); ++i) {
      entries[i].data[0] = exp_avg_sqs[i].data_ptr();
      entries[i].numel = 1;
    }
    multi_tensor_apply<1>(
        stream, entries,
        NovoGradBlendFunctor{norms.data_ptr<float>(), moments.data_ptr<float>(), args,
                             static_cast<float>(beta2), !take_max});
    // 3. The elementwise rule.
    const NovoGradHyper hyper = novograd_hyper(
        lr, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, reg_inside_moment);
    run_rule_with_formats(stream, params, grads, {exp_avgs}, model_params, master_remainders, state_absmaxes, hyper,
                          args, moments.data_ptr<float>());
  }
  increment_step(stream, step.data_ptr<float>(), args.found_inf);
}

}  // namespace apex_amp
