// The Python module apex_amp._C. The ops themselves are registered with the
// dispatcher (csrc/cpu/*.cpp, csrc/cuda/register_cuda.cpp; the schemas in
// apex_amp/_op_registry.py); this module only reports how it was built, so it
// needs pybind11 alone, not torch/extension.h (a third of a minute to compile).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cpu/kernel_table.h"
#include "state_formats.h"

#include <vector>

// setup.py defines these for a CUDA build.
#ifndef APEX_AMP_CUDA_ARCHS
#define APEX_AMP_CUDA_ARCHS ""
#endif
#ifndef APEX_AMP_CUDA_VERSION
#define APEX_AMP_CUDA_VERSION ""
#endif

namespace py = pybind11;

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

// The int8 format's dynamic map as the kernels build it (state_formats.h), and
// the fp32 midpoints they search, for the test against state_formats.dynamic_map.
std::vector<float> state_format_map(bool is_signed) {
  namespace sf = apex_amp::state_formats;
  return is_signed ? std::vector<float>(sf::kSignedMap.begin(), sf::kSignedMap.end())
                   : std::vector<float>(sf::kUnsignedMap.begin(), sf::kUnsignedMap.end());
}

std::vector<float> state_format_midpoints(bool is_signed) {
  namespace sf = apex_amp::state_formats;
  return is_signed ? std::vector<float>(sf::kSignedMidpoints.begin(), sf::kSignedMidpoints.end())
                   : std::vector<float>(sf::kUnsignedMidpoints.begin(), sf::kUnsignedMidpoints.end());
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "apex_amp's compiled kernels (ops live in torch.ops.apex_amp)";
  m.def("build_info", &build_info, "How this extension was built: CPU ISAs, CUDA, archs, compiler.");
  m.def("state_format_map", &state_format_map, py::arg("signed"),
        "The int8 state format's dynamic map (255 signed or 256 unsigned fp32 values) the kernels use.");
  m.def("state_format_midpoints", &state_format_midpoints, py::arg("signed"),
        "The fp32 midpoints between the map's neighbouring entries, which the kernels search.");
}
