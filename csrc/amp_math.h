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

// ---- Fused optimizer rules --------------------------------------------------
// Each fused optimizer is a hyper-parameter struct and one overload of
//   fused_rule(param, states, grad, hyper, tensor_value)
// below; the generic kernels (cpu/kernels.inc: rule_kernel, cuda/fused_rule.cuh)
// run it over whole lists, with grads multiplied by inv_scale first and the
// O2 model copy written from the updated param. A hyper struct says how many
// per-element state tensors its rule keeps (kStates), whether the kernels must
// store them back (kWritesStates) and read the grads (kReadsGrad), and is
// completed for the step being taken by prepare_step(hyper, step) (the step
// count after increment; read on the device on CUDA). tensor_value is the
// rule's one per-tensor input (NovoGrad's gradient norm, LAMB's trust ratio),
// 0 for rules without one. The list of rules is csrc/fused_rules.h.

// Hyper-parameters of one Adam step, with the bias corrections already folded
// into two scalars (prepare_step) so that the per-element body does no pow().
struct AdamStepParams {
  static constexpr int kStates = 2;  // exp_avg, exp_avg_sq
  static constexpr bool kWritesStates = true;
  static constexpr bool kReadsGrad = true;
  static constexpr bool kTakesTensorValue = false;
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  float step_size;              // lr / (1 - beta1^step), or lr without bias correction
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step), or 1 without bias correction
  bool adamw_mode;              // decoupled weight decay (AdamW) instead of L2 (Adam)
  bool bias_correction;
};

// SGD with momentum (torch.optim.SGD's update; apex's FusedSGD adds
// wd_after_momentum). first_run: the momentum buffers were just created, so
// they take the gradient itself, as torch does.
struct SgdHyper {
  static constexpr int kStates = 1;  // momentum_buffer
  static constexpr bool kWritesStates = true;
  static constexpr bool kReadsGrad = true;
  static constexpr bool kTakesTensorValue = false;
  float lr;
  float momentum;
  float dampening;
  float weight_decay;
  bool nesterov;
  bool first_run;
  bool wd_after_momentum;
};

// SGD without momentum: no state at all.
struct PlainSgdHyper {
  static constexpr int kStates = 0;
  static constexpr bool kWritesStates = false;
  static constexpr bool kReadsGrad = true;
  static constexpr bool kTakesTensorValue = false;
  float lr;
  float weight_decay;
};

// Adagrad as apex's FusedAdagrad: L2 weight decay into the gradient, or
// decoupled (adagrad_w_mode).
struct AdagradHyper {
  static constexpr int kStates = 1;  // sum
  static constexpr bool kWritesStates = true;
  static constexpr bool kReadsGrad = true;
  static constexpr bool kTakesTensorValue = false;
  float lr;
  float eps;
  float weight_decay;
  bool decoupled;
};

// NovoGrad (apex's FusedNovoGrad): the second moment is one number per tensor
// (a blend of gradient norms, computed before the elementwise pass and given
// as tensor_value), the first moment is per element.
struct NovoGradHyper {
  static constexpr int kStates = 1;  // exp_avg
  static constexpr bool kWritesStates = true;
  static constexpr bool kReadsGrad = true;
  static constexpr bool kTakesTensorValue = true;
  float lr;
  float beta1;
  float beta2;
  float beta3;  // 1 - beta1 with grad_averaging, else 1
  float eps;
  float weight_decay;
  bool reg_inside_moment;  // apex's moment_mode 0: decay added to the normalised gradient
  bool bias_correction;
  float bias_correction1;       // 1 - beta1^step (prepare_step), or 1
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step), or 1
};

// LAMB (apex's FusedLAMB), in two passes. The first updates the moments
// (lamb_moments) and, per tensor, the squared norms of the param and of the
// update direction; the second (this rule) recomputes the direction from the
// moments and applies it with the per-tensor trust ratio as tensor_value
// (lr * ||param|| / ||direction||, or lr). The moments are only read here.
struct LambHyper {
  static constexpr int kStates = 2;  // exp_avg, exp_avg_sq
  static constexpr bool kWritesStates = false;
  static constexpr bool kReadsGrad = false;
  static constexpr bool kTakesTensorValue = true;
  float beta1;
  float beta2;
  float beta3;  // 1 - beta1 with grad_averaging, else 1
  float eps;
  float weight_decay;
  bool adam_w_mode;      // decay added to the direction (else to the gradient, L2)
  bool bias_correction;
  float grad_scale;      // the gradients are divided by it: the global-norm clip (>= 1), set per step
  float bias_correction1;  // 1 - beta1^step, or 1
  float bias_correction2;  // 1 - beta2^step, or 1
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

// 1 - beta^step, with the power in double: beta^step for a large step loses
// all precision in float.
C10_HOST_DEVICE inline double one_minus_power(float beta, float step) {
  return 1.0 - ::pow(static_cast<double>(beta), static_cast<double>(step));
}

// The hyper-parameters of a rule from its op's arguments, for both launchers
// (the step-dependent fields are prepare_step's; LAMB's grad_scale is set per
// step by each launcher). SGD's and Adagrad's are one aggregate each.
inline AdamStepParams adam_hyper(
    double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
    bool bias_correction) {
  AdamStepParams h{};
  h.lr = static_cast<float>(lr);
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.adamw_mode = adamw_mode;
  h.bias_correction = bias_correction;
  return h;
}

inline NovoGradHyper novograd_hyper(
    double lr, double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
    bool grad_averaging, bool reg_inside_moment) {
  NovoGradHyper h{};
  h.lr = static_cast<float>(lr);
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.beta3 = grad_averaging ? 1.f - static_cast<float>(beta1) : 1.f;
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.reg_inside_moment = reg_inside_moment;
  h.bias_correction = bias_correction;
  return h;
}

inline LambHyper lamb_hyper(
    double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
    bool grad_averaging, bool adam_w_mode) {
  LambHyper h{};
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.beta3 = grad_averaging ? 1.f - static_cast<float>(beta1) : 1.f;
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.adam_w_mode = adam_w_mode;
  h.bias_correction = bias_correction;
  h.grad_scale = 1.f;
  return h;
}

// prepare_step: complete a rule's hyper-parameters for the step being taken;
// `step` is the step number after increment (1 on the first step).
C10_HOST_DEVICE inline void prepare_step(AdamStepParams& p, float step) {
  if (p.bias_correction) {
    p.step_size = static_cast<float>(p.lr / one_minus_power(p.beta1, step));
    p.bias_correction2_sqrt = static_cast<float>(::sqrt(one_minus_power(p.beta2, step)));
  } else {
    p.step_size = p.lr;
    p.bias_correction2_sqrt = 1.f;
  }
}

C10_HOST_DEVICE inline void prepare_step(SgdHyper&, float) {}
C10_HOST_DEVICE inline void prepare_step(PlainSgdHyper&, float) {}
C10_HOST_DEVICE inline void prepare_step(AdagradHyper&, float) {}

C10_HOST_DEVICE inline void prepare_step(NovoGradHyper& h, float step) {
  h.bias_correction1 = h.bias_correction ? static_cast<float>(one_minus_power(h.beta1, step)) : 1.f;
  h.bias_correction2_sqrt =
      h.bias_correction ? static_cast<float>(::sqrt(one_minus_power(h.beta2, step))) : 1.f;
}

C10_HOST_DEVICE inline void prepare_step(LambHyper& h, float step) {
  h.bias_correction1 = h.bias_correction ? static_cast<float>(one_minus_power(h.beta1, step)) : 1.f;
  h.bias_correction2 = h.bias_correction ? static_cast<float>(one_minus_power(h.beta2, step)) : 1.f;
}

// LAMB's clip of the gradients by their global norm (apex's LAMB stage 1):
// divide by norm / max_grad_norm when the norm exceeds max_grad_norm.
C10_HOST_DEVICE inline float lamb_grad_scale(float global_grad_norm, float max_grad_norm) {
  return global_grad_norm > max_grad_norm ? global_grad_norm / max_grad_norm : 1.f;
}

// LAMB's per-tensor step: lr scaled by the trust ratio ||param|| / ||direction||
// when decay is on or NVLAMB asks for it, and both norms are non-zero.
C10_HOST_DEVICE inline float lamb_trust_step(
    float param_norm,
    float direction_norm,
    float lr,
    float weight_decay,
    bool use_nvlamb) {
  if ((use_nvlamb || weight_decay != 0.f) && param_norm != 0.f && direction_norm != 0.f) {
    return lr * (param_norm / direction_norm);
  }
  return lr;
}

// NovoGrad's per-tensor second moment: a blend of the previous one and this
// step's gradient norm (L2: in squares; L-inf: linear). A negative previous
// value means "not yet seen a gradient" (apex starts from the first norm
// unless init_zero): the norm itself.
C10_HOST_DEVICE inline float novograd_blend(float previous, float norm, float beta2, bool l2) {
  if (previous < 0.f) {
    return norm;
  }
  if (l2) {
    return ::sqrtf(beta2 * previous * previous + (1.f - beta2) * norm * norm);
  }
  return beta2 * previous + (1.f - beta2) * norm;
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

template <typename T>
C10_HOST_DEVICE inline void sgd_update(T& param, T& momentum_buffer, bool has_momentum, T grad,
                                       float lr, float momentum, float dampening, float weight_decay,
                                       bool nesterov, bool first_run, bool wd_after_momentum) {
  if (weight_decay != 0.f && !wd_after_momentum) {
    grad = grad + T(weight_decay) * param;
  }
  if (has_momentum) {
    momentum_buffer = first_run ? grad : T(momentum) * momentum_buffer + T(1.f - dampening) * grad;
    grad = nesterov ? grad + T(momentum) * momentum_buffer : momentum_buffer;
  }
  if (weight_decay != 0.f && wd_after_momentum) {
    grad = grad + T(weight_decay) * param;
  }
  param = param - T(lr) * grad;
}

// The rules, one overload per hyper type; `grad` is already unscaled.
template <typename T>
C10_HOST_DEVICE inline void fused_rule(T& param, T (&s)[2], T grad, const AdamStepParams& h, float) {
  adam_update(param, s[0], s[1], grad, h);
}

template <typename T>
C10_HOST_DEVICE inline void fused_rule(T& param, T (&s)[1], T grad, const SgdHyper& h, float) {
  sgd_update(param, s[0], h.momentum != 0.f, grad, h.lr, h.momentum, h.dampening, h.weight_decay,
             h.nesterov, h.first_run, h.wd_after_momentum);
}

// (A rule without state gets a one-element array, which it leaves alone: C++ has no empty arrays.)
template <typename T>
C10_HOST_DEVICE inline void fused_rule(T& param, T (&)[1], T grad, const PlainSgdHyper& h, float) {
  T unused(0.f);
  sgd_update(param, unused, false, grad, h.lr, 0.f, 0.f, h.weight_decay, false, false, false);
}

template <typename T>
C10_HOST_DEVICE inline void fused_rule(T& param, T (&s)[1], T grad, const AdagradHyper& h, float) {
  if (!h.decoupled) {
    grad = grad + T(h.weight_decay) * param;
  }
  s[0] = s[0] + grad * grad;
  T step = grad / (ValueOps<T>::sqrt(s[0]) + T(h.eps));
  if (h.decoupled) {
    step = step + T(h.weight_decay) * param;
  }
  param = param - T(h.lr) * step;
}

// tensor_value: the tensor's blended gradient norm (novograd_blend).
template <typename T>
C10_HOST_DEVICE inline void fused_rule(T& param, T (&s)[1], T grad, const NovoGradHyper& h,
                                       float grad_norm) {
  const T denom = T(grad_norm / h.bias_correction2_sqrt + h.eps);
  if (h.reg_inside_moment) {
    grad = grad / denom + T(h.weight_decay) * param;
    s[0] = T(h.beta1) * s[0] + T(h.beta3) * grad;
    param = param - T(h.lr) * (s[0] / T(h.bias_correction1));
  } else {
    s[0] = T(h.beta1) * s[0] + T(h.beta3) * grad;
    const T update = (s[0] / T(h.bias_correction1)) / denom + T(h.weight_decay) * param;
    param = param - T(h.lr) * update;
  }
}

// LAMB's direction from the updated moments (and the param, for decoupled decay).
template <typename T>
C10_HOST_DEVICE inline T lamb_direction(T param, T exp_avg, T exp_avg_sq, const LambHyper& h) {
  const T denom = ValueOps<T>::sqrt(exp_avg_sq / T(h.bias_correction2)) + T(h.eps);
  T direction = (exp_avg / T(h.bias_correction1)) / denom;
  if (h.adam_w_mode) {
    direction = direction + T(h.weight_decay) * param;
  }
  return direction;
}

// LAMB's first pass over one element: the moments. The pass then takes the
// direction (for the norms) from the moments as stored, rounded to their
// dtype, so that the second pass, which recomputes it from the stored moments,
// applies exactly the direction whose norm it was given. (With fp16/bf16
// state this differs from apex, whose first pass kept the unrounded moments
// for the current step; fp32 state, as under O2 masters, is not rounded.)
template <typename T>
C10_HOST_DEVICE inline void lamb_moments(T param, T& exp_avg, T& exp_avg_sq, T grad, const LambHyper& h) {
  grad = grad / T(h.grad_scale);
  if (!h.adam_w_mode) {
    grad = grad + T(h.weight_decay) * param;
  }
  exp_avg = exp_avg * T(h.beta1) + T(h.beta3) * grad;
  exp_avg_sq = exp_avg_sq * T(h.beta2) + T(1.f - h.beta2) * grad * grad;
}

// LAMB's second pass: tensor_value is lr times the tensor's trust ratio.
template <typename T>
C10_HOST_DEVICE inline void fused_rule(T& param, T (&s)[2], T, const LambHyper& h, float trust_step) {
  param = param - T(trust_step) * lamb_direction(param, s[0], s[1], h);
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
