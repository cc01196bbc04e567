// The Python module apex_amp._C. The ops themselves are registered with the
// dispatcher (csrc/ops.cpp); this module only reports how it was built.
#include <torch/extension.h>

#include "cpu/kernel_table.h"

// setup.py defines these for a CUDA build.
#ifndef APEX_AMP_CUDA_ARCHS
#define APEX_AMP_CUDA_ARCHS ""
#endif
#ifndef APEX_AMP_CUDA_VERSION
#define APEX_AMP_CUDA_VERSION ""
#endif

namespace {

py::dict build_info() {
  py::dict info;
#ifdef APEX_AMP_WITH_CUDA
  info["cuda"] = true;
  info["cuda_archs"] = std::string(APEX_AMP_CUDA_ARCHS);
  info["cuda_version"] = std::string(APEX_AMP_CUDA_VERSION);
#else
  info["cuda"] = false;
  info["cuda_archs"] = std::string();
  info["cuda_version"] = py::none();
#endif
  // The CPU kernel variants compiled in, and the one chosen for this CPU.
  info["cpu_isas"] = std::string(apex_amp::cpu::compiled_isas());
  info["cpu_isa"] = std::string(apex_amp::cpu::active_isa());
  info["compiler"] = std::string(__VERSION__);
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "apex_amp's compiled kernels (ops live in torch.ops.apex_amp)";
  m.def("build_info", &build_info, "How this extension was built: CPU ISAs, CUDA, archs, compiler.");
}
