// The schemas of every apex_amp op, in one place.
//
// Kernels register against these names with TORCH_LIBRARY_IMPL(apex_amp, CPU|CUDA, m)
// (csrc/cpu/*.cpp, csrc/cuda/*.cu); fake (meta) kernels for torch.compile are
// registered from Python in apex_amp/ops.py. The pure-PyTorch fallback in
// apex_amp/_fallback.py defines the same signatures under the namespace
// apex_amp_fallback, and a test keeps the two in agreement.
//
// Conventions shared by all ops:
//   * found_inf is a one-element float32 tensor; an op that checks values
//     writes 1.0 into it when it meets an inf or NaN and never clears it.
//   * inv_scale, scale and a are one-element float32 tensors on the tensors'
//     device, so the loss scale never has to come back to the host.
//   * every list op takes the whole list in one call; fp32, fp16 and bf16
//     tensors may be mixed in one list, and the math runs in fp32.
#include <torch/library.h>

TORCH_LIBRARY(apex_amp, m) {
  // found_inf := 1 if any element of any tensor is inf or NaN. Read-only.
  m.def("check_finite(Tensor[] tensors, Tensor(a!) found_inf) -> ()");

  // grads[i] *= inv_scale in place; found_inf := 1 if any element of grads
  // (before scaling) is inf or NaN.
  m.def("unscale_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()");

  // dst[i] = src[i] * scale, converted to dst[i]'s dtype; found_inf := 1 if
  // any element of src or of the result is inf or NaN (fp32 -> fp16 overflow
  // counts). dst[i] may be src[i] itself.
  m.def("scale_(Tensor[] src, Tensor(a!)[] dst, Tensor scale, Tensor(b!) found_inf) -> ()");

  // y[i] = a * x[i] + b * y[i]; found_inf := 1 if any element of x or of the
  // result is inf or NaN. `a` is a device scalar because it is usually an
  // inverse loss scale; `b` is a host number.
  m.def("axpby_(Tensor[] x, Tensor(a!)[] y, Tensor a, float b, Tensor(b!) found_inf) -> ()");

  // (total, per_tensor): the L2 norm of all elements of all tensors as a
  // 0-dim float32 tensor, and, when per_tensor is true, a float32 tensor of
  // one norm per input tensor (else an empty one). Accumulates in fp32.
  m.def("l2norm(Tensor[] tensors, bool per_tensor) -> (Tensor, Tensor)");

  // One Adam/AdamW step over whole lists, one pass per element, math in fp32.
  //   params:       fp32 master weights, or tensors of the same dtype as grads;
  //   grads:        fp32, fp16 or bf16 (multiplied by inv_scale when given);
  //   exp_avgs, exp_avg_sqs: the moments, same dtype as params;
  //   model_params: empty, or fp16/bf16 model weights written from the updated
  //                 params in the same pass (O2's low-precision model copy);
  //   step:         one-element float32 tensor, incremented by the op, so the
  //                 bias correction uses the step count after increment;
  //   found_inf:    when given and non-zero the whole op is a no-op (params,
  //                 moments, model_params and step stay untouched), decided on
  //                 the device with no host sync.
  m.def(
      "fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] model_params, Tensor(e!) step, float lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool adamw_mode, "
      "bool bias_correction, Tensor? inv_scale=None, Tensor? found_inf=None) -> ()");

  // The dynamic loss-scale rule (amp_math.h: update_scale_math) applied once,
  // on the device that holds the scale. scale: one-element float32;
  // growth_tracker, hysteresis_tracker: one-element int32; found_inf as above.
  // consecutive_hysteresis: the hysteresis refills after every clean step
  // (apex), else only when the scale grows (Megatron, DeepSpeed's default).
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, "
      "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
      "float backoff_factor, int growth_interval, int hysteresis, float min_scale, "
      "float max_scale, bool consecutive_hysteresis) -> ()");
}
