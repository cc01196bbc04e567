// Per-element math shared by the CPU and the CUDA launchers.
//
// Every function here is written once, as a template over the value type T,
// and instantiated with T = float by the CUDA kernels and the CPU tail loops,
// and with T = at::vec::Vectorized<float> by the CPU vector loops. The CPU
// tests therefore check the very arithmetic that the GPU runs.
//
// Rules that keep one body valid for both value types:
//   * only +, -, *, / between values of type T; scalars are broadcast with T(x);
//   * square roots go through ValueOps<T>::sqrt, specialised per value type
//     (the float one here, the vector one in cpu/vec_ops.h);
//   * non-finite detection uses nonfinite_probe(): x * 0 is NaN exactly when x
//     is inf or NaN, and +-0 otherwise, so adding probes into an accumulator
//     turns it into NaN on the first bad element, with no branch in the loop.
//     (This is why the extension must never be built with -ffast-math.)
#pragma once
// Lets the CPU kernels check that they include this header first after their
// instruction-set pragma (csrc/cpu/kernels.inc).
#define APEX_AMP_AMP_MATH_H

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

namespace apex_amp {

// Hyper-parameters of one Adam step, with the bias corrections already folded
// into two scalars so that the per-element body does no pow().
struct AdamStepParams {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  float step_size;              // lr / (1 - beta1^step), or lr without bias correction
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step), or 1 without bias correction
  bool adamw_mode;              // decoupled weight decay (AdamW) instead of L2 (Adam)
};

// The constants of the dynamic loss-scale rule (update_scale_math). The
// factors stay double: apex and torch multiply the fp32 scale by a double
// factor and round the product once.
struct ScaleRule {
  double growth_factor;
  double backoff_factor;
  int32_t growth_interval;
  int32_t hysteresis;
  float min_scale;
  float max_scale;
  bool consecutive_hysteresis;
};

// Everything below has internal linkage (an unnamed namespace). The CPU
// kernels compile this header once per instruction set (csrc/cpu/kernels_*.cpp);
// with external linkage, the linker would keep one copy of, say,
// adam_update<float> for all of them, possibly the AVX-512 one, which the
// AVX2 kernels would then run on a CPU without AVX-512.
namespace {

template <typename T>
struct ValueOps;

template <>
struct ValueOps<float> {
  C10_HOST_DEVICE static inline float sqrt(float x) {
    return ::sqrtf(x);
  }
};

// NaN exactly when x is inf or NaN; +-0 otherwise.
template <typename T>
C10_HOST_DEVICE inline T nonfinite_probe(T x) {
  return x * T(0.f);
}

// True when a probe accumulator saw a non-finite value.
C10_HOST_DEVICE inline bool probe_says_nonfinite(float probe_sum) {
  return probe_sum != probe_sum;
}

// `step` is the step number after increment (1 on the first step).
C10_HOST_DEVICE inline AdamStepParams make_adam_step_params(
    float lr,
    float beta1,
    float beta2,
    float eps,
    float weight_decay,
    float step,
    bool adamw_mode,
    bool bias_correction) {
  AdamStepParams p;
  p.lr = lr;
  p.beta1 = beta1;
  p.beta2 = beta2;
  p.eps = eps;
  p.weight_decay = weight_decay;
  p.adamw_mode = adamw_mode;
  if (bias_correction) {
    // pow in double: beta^step for large step loses all precision in float.
    const double bc1 = 1.0 - ::pow(static_cast<double>(beta1), static_cast<double>(step));
    const double bc2 = 1.0 - ::pow(static_cast<double>(beta2), static_cast<double>(step));
    p.step_size = static_cast<float>(lr / bc1);
    p.bias_correction2_sqrt = static_cast<float>(::sqrt(bc2));
  } else {
    p.step_size = lr;
    p.bias_correction2_sqrt = 1.f;
  }
  return p;
}

// One Adam/AdamW update of one element (or one vector of elements), in the
// order torch.optim.Adam/AdamW use, so results agree to rounding.
// `grad` must already be unscaled.
template <typename T>
C10_HOST_DEVICE inline void adam_update(
    T& param,
    T& exp_avg,
    T& exp_avg_sq,
    T grad,
    const AdamStepParams& h) {
  if (h.weight_decay != 0.f) {
    if (h.adamw_mode) {
      param = param * T(1.f - h.lr * h.weight_decay);
    } else {
      grad = grad + T(h.weight_decay) * param;
    }
  }
  exp_avg = T(h.beta1) * exp_avg + T(1.f - h.beta1) * grad;
  exp_avg_sq = T(h.beta2) * exp_avg_sq + T(1.f - h.beta2) * grad * grad;
  const T denom = ValueOps<T>::sqrt(exp_avg_sq) / T(h.bias_correction2_sqrt) + T(h.eps);
  param = param - T(h.step_size) * exp_avg / denom;
}

// y := a * x + b * y (gradient accumulation across backward passes).
template <typename T>
C10_HOST_DEVICE inline T axpby(T x, T y, T a, T b) {
  return a * x + b * y;
}

// True when x is neither inf nor NaN.
C10_HOST_DEVICE inline bool is_finite(float x) {
  return !probe_says_nonfinite(nonfinite_probe(x));
}

// Dynamic loss-scale update for one step: the one statement of the scaler's
// rule, run on the device that holds the scale so that no host sync is
// needed (CPU and CUDA launchers; apex_amp/_fallback.py restates it in torch
// ops for installs without a compiler).
//   overflow: reset the growth counter and spend one unit of hysteresis
//             (never below 0); once it is spent, multiply the scale by
//             backoff_factor, never going below min_scale;
//   clean:    count the step; after growth_interval clean steps in a row,
//             multiply the scale by growth_factor, capped at max_scale; a
//             product that is inf in fp32 is no scale, and the old one stays.
//             The hysteresis refills after every clean step when
//             consecutive_hysteresis (so only overflows in a row back off:
//             apex's update_scale_hysteresis), else only when the scale grows
//             (Megatron's and DeepSpeed's default).
// The products are taken in double and rounded once to fp32, as apex and
// torch._amp_update_scale_ do; with hysteresis 1, min_scale 0 and max_scale
// inf this is exactly torch._amp_update_scale_'s rule.
C10_HOST_DEVICE inline void update_scale_math(
    float& scale,
    int32_t& growth_tracker,
    int32_t& hysteresis_tracker,
    bool found_inf,
    const ScaleRule& rule) {
  if (found_inf) {
    growth_tracker = 0;
    hysteresis_tracker = hysteresis_tracker > 0 ? hysteresis_tracker - 1 : 0;
    if (hysteresis_tracker == 0) {
      const float reduced = static_cast<float>(scale * rule.backoff_factor);
      scale = reduced > rule.min_scale ? reduced : rule.min_scale;
    }
    return;
  }
  growth_tracker += 1;
  const bool grows = growth_tracker >= rule.growth_interval;
  if (grows) {
    growth_tracker = 0;
    const float grown = static_cast<float>(scale * rule.growth_factor);
    if (is_finite(grown)) {
      scale = grown <= rule.max_scale ? grown : (scale > rule.max_scale ? scale : rule.max_scale);
    }
  }
  if (grows || rule.consecutive_hysteresis) {
    hysteresis_tracker = rule.hysteresis;
  }
}

}  // namespace
}  // namespace apex_amp
