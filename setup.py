"""Build apex_amp and its one compiled extension, ``apex_amp._C``.

    pip install --no-build-isolation .      # or -e . while developing

torch must already be installed (the kernels are compiled against it), hence
--no-build-isolation. Environment variables:

    APEX_AMP_PYTHON_ONLY=1  no extension: apex_amp runs its pure-PyTorch fallback
    APEX_AMP_CUDA=0|1       CUDA kernels off / on (default: on when torch is a
                            CUDA build and a CUDA toolkit is found)
    CUDA_HOME, CUDA_PATH    the CUDA toolkit (default: the one nvcc on PATH
                            reports, else /usr/local/cuda)
    TORCH_CUDA_ARCH_LIST    GPU archs (default: the visible GPUs', or
                            DEFAULT_CUDA_ARCH_LIST when none is visible)
    MAX_JOBS                parallel compile jobs (default: usable cores)
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# sm_80 (A100) and sm_90 (H100) machine code, plus PTX that newer GPUs JIT-compile.
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0+PTX"
BUILD_TEMP = os.path.join(ROOT, "build", f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")


def log(message):
    print(f"apex_amp setup: {message}", flush=True)


def env_switch(name):
    """True/False for NAME=1/0, None when unset."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        sys.exit(f"apex_amp setup: {name} must be 0 or 1, got {value!r}")
    return None if value == "" else value == "1"


def nvcc_reported_toolkit(nvcc):
    # nvcc may be a wrapper script outside its toolkit (here /usr/local/bin/nvcc
    # execs /usr/local/cuda-13.0/bin/nvcc), so ask nvcc where its own binaries
    # live instead of taking the folder above the one on PATH, as torch does.
    with tempfile.TemporaryDirectory() as scratch:
        result = subprocess.run([nvcc, "--dryrun", "-c", "probe.cu"], cwd=scratch,
                                capture_output=True, text=True, timeout=120)
    found = re.search(r"^#\$ _HERE_=(.+)$", result.stdout + result.stderr, re.MULTILINE)
    return os.path.dirname(found.group(1).strip()) if found else None


def find_cuda_toolkit():
    """(folder, how it was chosen) of the CUDA toolkit to build with."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            return os.environ[variable], f"from ${variable}"
    nvcc = shutil.which("nvcc")
    if nvcc:
        toolkit = nvcc_reported_toolkit(nvcc)
        if toolkit:
            return toolkit, f"reported by `{nvcc} --dryrun`"
    return "/usr/local/cuda", "the standard location (no nvcc on PATH)"


def toolkit_problem(toolkit):
    for needed in ("bin/nvcc", "include/cuda_runtime.h"):
        if not os.path.isfile(os.path.join(toolkit, needed)):
            return f"{toolkit} has no {needed}"
    return None


def choose_cuda_toolkit(torch):
    """The CUDA toolkit folder to build the CUDA kernels with, or None for CPU only."""
    forced = env_switch("APEX_AMP_CUDA")
    if forced is False:
        log("CUDA kernels off (APEX_AMP_CUDA=0)")
        return None
    if torch.version.cuda is None:
        if forced:
            sys.exit(f"apex_amp setup: APEX_AMP_CUDA=1 but torch {torch.__version__} is not a "
                     "CUDA build; install a CUDA build of torch or unset APEX_AMP_CUDA")
        log(f"CUDA kernels off (torch {torch.__version__} is not a CUDA build)")
        return None
    toolkit, why = find_cuda_toolkit()
    problem = toolkit_problem(toolkit)
    if problem:
        if forced:
            sys.exit(f"apex_amp setup: APEX_AMP_CUDA=1 but no usable CUDA toolkit: {problem}. "
                     "Set CUDA_HOME to the toolkit folder (the one holding bin/nvcc and "
                     "include/cuda_runtime.h), or set APEX_AMP_CUDA=0 for a CPU-only build.")
        log(f"CUDA kernels off: no usable CUDA toolkit ({problem}); set CUDA_HOME to build them")
        return None
    log(f"CUDA toolkit {toolkit} ({why})")
    return toolkit


def nvcc_version(toolkit, torch):
    output = subprocess.run([os.path.join(toolkit, "bin", "nvcc"), "--version"],
                            capture_output=True, text=True, check=True).stdout
    version = re.search(r"release (\d+\.\d+)", output).group(1)
    if version.split(".")[0] != torch.version.cuda.split(".")[0]:
        sys.exit(f"apex_amp setup: nvcc is CUDA {version} but torch was built with CUDA "
                 f"{torch.version.cuda}; point CUDA_HOME at a CUDA {torch.version.cuda} toolkit")
    if version != torch.version.cuda:
        log(f"warning: nvcc is CUDA {version}, torch was built with {torch.version.cuda} "
            "(a minor-version difference is expected to work)")
    return version


def cuda_arch_flags(toolkit, torch, cpp_extension):
    """nvcc's -gencode flags and their targets ("sm_80;sm_90;compute_90")."""
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCH_LIST
    # torch's own parser, so named archs ("Hopper") and visible GPUs work as in
    # any torch extension; passing its flags ourselves makes torch add no more.
    flags = cpp_extension._get_cuda_arch_flags()
    targets = [re.search(r",code=(\w+)", flag).group(1) for flag in flags]
    targets.sort(key=lambda target: (target.startswith("compute_"), target))
    supported = subprocess.run([os.path.join(toolkit, "bin", "nvcc"), "--list-gpu-arch"],
                               capture_output=True, text=True, check=True).stdout.split()
    for target in targets:
        if "compute_" + target.split("_")[1].rstrip("af") not in supported:
            sys.exit(f"apex_amp setup: this nvcc cannot build for {target}; choose archs among "
                     f"{' '.join(supported)} with TORCH_CUDA_ARCH_LIST")
    return flags, ";".join(targets)


def nvidia_pip_include_dirs():
    # torch's CUDA headers include cuBLAS, cuSPARSE, cuSOLVER... headers that a
    # bare toolkit may lack; the pip packages torch depends on carry them.
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec else []
    return sorted(path for root in roots for path in glob.glob(os.path.join(root, "*", "include")))


def sources(pattern):
    return sorted(glob.glob(pattern, root_dir=ROOT))


def extension_modules():
    if env_switch("APEX_AMP_PYTHON_ONLY"):
        log("Python-only install (APEX_AMP_PYTHON_ONLY=1): no compiled kernels")
        return [], {}
    import torch

    toolkit = choose_cuda_toolkit(torch)
    if toolkit:
        # torch.utils.cpp_extension reads CUDA_HOME once, when it is imported.
        os.environ["CUDA_HOME"] = toolkit
    from torch.utils import cpp_extension

    if toolkit and cpp_extension.CUDA_HOME != toolkit:
        sys.exit("apex_amp setup: torch.utils.cpp_extension was imported before setup.py chose "
                 f"the CUDA toolkit; run with CUDA_HOME={toolkit}")
    if not cpp_extension.is_ninja_available():
        sys.exit("apex_amp setup: ninja is needed to build the kernels; `pip install ninja`")
    os.environ.setdefault("MAX_JOBS", str(len(os.sched_getaffinity(0))))

    cxx_flags = ["-O3", "-std=c++20"]
    link_flags = []
    if torch._C.has_openmp:
        # at::parallel_for runs serially unless the caller is compiled with OpenMP.
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    extra_compile_args = {"cxx": cxx_flags}
    macros = []
    include_dirs = [os.path.join(ROOT, "csrc")]
    files = sources("csrc/*.cpp") + sources("csrc/cpu/*.cpp")
    if toolkit:
        version = nvcc_version(toolkit, torch)
        arch_flags, archs = cuda_arch_flags(toolkit, torch, cpp_extension)
        log(f"CUDA {version} kernels for {archs} (MAX_JOBS={os.environ['MAX_JOBS']})")
        # String literals for csrc/module.cpp's build_info().
        macros = [("APEX_AMP_WITH_CUDA", None),
                  ("APEX_AMP_CUDA_ARCHS", f'"{archs}"'),
                  ("APEX_AMP_CUDA_VERSION", f'"{version}"')]
        # The toolkit's own headers first; the pip packages' only fill the gaps.
        include_dirs += [os.path.join(toolkit, "include")] + nvidia_pip_include_dirs()
        # No --use_fast_math: amp_math.h needs IEEE inf/NaN.
        extra_compile_args["nvcc"] = ["-O3", "-std=c++20", "-lineinfo"] + arch_flags
        files += sources("csrc/cuda/*.cu") + sources("csrc/cuda/*.cpp")
        make_extension = cpp_extension.CUDAExtension
    else:
        log(f"CPU kernels only (MAX_JOBS={os.environ['MAX_JOBS']})")
        make_extension = cpp_extension.CppExtension
    extension = make_extension(
        name="apex_amp._C",
        sources=files,
        include_dirs=include_dirs,
        define_macros=macros,
        extra_compile_args=extra_compile_args,
        extra_link_args=link_flags,
    )
    return [extension], {"build_ext": build_ext_command(cpp_extension.BuildExtension)}


def build_ext_command(build_extension_class):
    class BuildExt(build_extension_class):
        """torch's BuildExtension (ninja) in one fixed build folder, ISA kernels linked last."""

        def finalize_options(self):
            super().finalize_options()
            # `pip install -e .` would compile in a fresh temporary folder each
            # time; a fixed one lets ninja recompile only what changed.
            self.build_temp = BUILD_TEMP

        def build_extension(self, ext):
            # csrc/cpu/kernels_<isa>.cpp compile code for one ISA each with
            # `#pragma GCC target`. The linker keeps the first copy of an inline
            # function that several objects define, so those objects go last
            # (setuptools sorts the sources by name, which would not).
            link = self.compiler.link_shared_object

            def link_isa_objects_last(objects, *args, **kwargs):
                def is_isa(path):
                    return os.path.basename(path).startswith("kernels_")
                return link(sorted(objects, key=is_isa), *args, **kwargs)

            self.compiler.link_shared_object = link_isa_objects_last
            try:
                super().build_extension(ext)
            finally:
                self.compiler.link_shared_object = link

    return BuildExt


ext_modules, cmdclass = extension_modules()
setup(
    packages=find_packages(include=["apex_amp", "apex_amp.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
