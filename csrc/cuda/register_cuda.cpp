// Every CUDA kernel of torch.ops.apex_amp, registered for the CUDA dispatch key
// (the schemas are apex_amp/_op_registry.py's); the launchers are in
// csrc/cuda/*.cu, declared in cuda/launchers.h.
#include "cuda/launchers.h"

#include <torch/library.h>

namespace apex_amp {

TORCH_LIBRARY_IMPL(apex_amp, CUDA, m) {
  m.impl("check_finite", &check_finite_cuda);
  m.impl("unscale_", &unscale_cuda);
  m.impl("scale_", &scale_cuda);
  m.impl("axpby_", &axpby_cuda);
  m.impl("l2norm", &l2norm_cuda);
  m.impl("update_scale_", &update_scale_cuda);
  m.impl("fused_adam_", &fused_adam_cuda);
  m.impl("fused_sgd_", &fused_sgd_cuda);
  m.impl("fused_adagrad_", &fused_adagrad_cuda);
  m.impl("fused_novograd_", &fused_novograd_cuda);
  m.impl("fused_lamb_", &fused_lamb_cuda);
  m.impl("fused_lamb_moments_", &fused_lamb_moments_cuda);
  m.impl("fused_lamb_update_", &fused_lamb_update_cuda);
}

}  // namespace apex_amp
