// The CUDA launchers of csrc/cuda/*.cu, one per op, registered for the CUDA
// dispatch key by csrc/cuda/register_cuda.cpp. The registration lives in a C++
// file of its own because torch/library.h's templates are the largest part of a
// .cu file's compile: nvcc parses them once per arch (docs/building.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace apex_amp {

// multi_tensor_cuda.cu
void check_finite_cuda(at::TensorList tensors, const at::Tensor& found_inf);
void unscale_cuda(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale);
void scale_cuda(
    at::TensorList src,
    at::TensorList dst,
    const at::Tensor& scale,
    const at::Tensor& found_inf);
void axpby_cuda(
    at::TensorList x,
    at::TensorList y,
    const at::Tensor& a,
    double b,
    const at::Tensor& found_inf);

// l2norm_cuda.cu
std::tuple<at::Tensor, at::Tensor> l2norm_cuda(at::TensorList tensors, bool per_tensor);

// update_scale_cuda.cu
void update_scale_cuda(
    const at::Tensor& scale,
    const at::Tensor& growth_tracker,
    const at::Tensor& hysteresis_tracker,
    const at::Tensor& found_inf,
    double growth_factor,
    double backoff_factor,
    int64_t growth_interval,
    int64_t hysteresis,
    double min_scale,
    double max_scale,
    bool consecutive_hysteresis);

// fused_adam_cuda.cu
void fused_adam_cuda(
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
    bool adamw_mode,
    bool bias_correction,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding);

// fused_sgd_cuda.cu
void fused_sgd_cuda(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList momentum_buffers,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    double lr,
    double momentum,
    double dampening,
    double weight_decay,
    bool nesterov,
    bool first_run,
    bool wd_after_momentum,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding);

// fused_adagrad_cuda.cu
void fused_adagrad_cuda(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList state_sums,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    double lr,
    double eps,
    double weight_decay,
    bool adagrad_w_mode,
    const std::optional<at::Tensor>& inv_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& state_rounding);

// fused_novograd_cuda.cu
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
    const std::optional<at::Tensor>& grad_norms);

// fused_lamb_cuda.cu
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
    const std::optional<at::Tensor>& found_inf);
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
    const std::optional<at::Tensor>& state_rounding);
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
    const std::optional<at::Tensor>& state_rounding);

}  // namespace apex_amp
