"""The build and environment report behind ``python -m apex_amp``.

:func:`collect` gathers the facts (which implementation of the ops is in use
and why, how the extension was built, which kernels each op has, which devices
have compiled kernels and which run the pure-PyTorch ops, whether the
host emulation of the CUDA kernels passed in this checkout, the CPU ISA,
torch, GPUs, threads, and where fp8 training runs) into a plain dict; :func:`format_report` turns them into
the text the command prints; :func:`problems` says what is missing when a
caller (CI) requires the compiled CPU or CUDA kernels.
"""

from __future__ import annotations

import importlib
import platform
from typing import Any

import torch

from . import __version__, _emulation_status
from ._device_fallback import DEVICE_KEYS, REBUILD_HINT, compiled_devices
from ._extension import STATUS
from .fp8 import device_support

__all__ = ["collect", "format_report", "problems"]

OP_NAMESPACE = "apex_amp"


def _registered_kernels() -> dict[str, list[str]]:
    # Every op of the TORCH_LIBRARY(apex_amp) block, with the dispatch keys
    # that have a real kernel (fake/meta registrations are not counted).
    prefix = OP_NAMESPACE + "::"
    names = sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix))
    return {
        name[len(prefix):]: [key for key in DEVICE_KEYS
                             if torch._C._dispatch_has_kernel_for_dispatch_key(name, key)]
        for name in names
    }


def _ops_backend() -> str:
    # apex_amp.ops picks the implementation; a broken ops layer must not hide
    # the rest of the report, so say what went wrong instead.
    try:
        ops = importlib.import_module("apex_amp.ops")
    except Exception as error:  # noqa: BLE001 (reported, not swallowed)
        return f"unknown: apex_amp.ops failed to import ({type(error).__name__}: {error})"
    return ops.BACKEND


def _gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [
        f"{index}: {torch.cuda.get_device_name(index)} "
        f"(sm_{''.join(map(str, torch.cuda.get_device_capability(index)))})"
        for index in range(torch.cuda.device_count())
    ]


def collect() -> dict[str, Any]:
    """The facts the report shows, as a plain dict (keys stable for scripts)."""
    module = STATUS.module
    return {
        "apex_amp_version": __version__,
        "extension_loaded": STATUS.loaded,
        "extension_reason": STATUS.reason,
        "extension_path": getattr(module, "__file__", None),
        "backend": _ops_backend(),
        "build_info": STATUS.build_info(),
        "kernels": _registered_kernels(),
        "compiled_devices": compiled_devices(OP_NAMESPACE) if STATUS.loaded else [],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpus": _gpus(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "openmp": torch._C.has_openmp,
        "cuda_emulation": _emulation_status.summary(),
        "fp8": device_support(),
    }


def _cpu_line(build: dict[str, Any]) -> str:
    if not build:
        return "none (no extension loaded)"
    line = "compiled"
    if build.get("cpu_isas"):
        line += f" for {build['cpu_isas']}; {build.get('cpu_isa', '?')} in use on this CPU"
    if build.get("compiler"):
        line += f" (compiler {build['compiler']})"
    return line


def _cuda_line(build: dict[str, Any]) -> str:
    if not build:
        return "none (no extension loaded)"
    if not build.get("cuda"):
        return "not compiled (CPU-only build)"
    return f"compiled for {build.get('cuda_archs') or '?'} with CUDA {build.get('cuda_version') or '?'}"


def _devices_line(info: dict[str, Any]) -> str:
    # Where the ops run compiled, and where the pure-PyTorch ops run instead (apex_amp/_device_fallback.py).
    if not info["extension_loaded"]:
        return "none compiled: every device runs the pure-PyTorch ops"
    compiled = info["compiled_devices"]
    others = [key for key in DEVICE_KEYS if key not in compiled]
    line = f"compiled kernels for {' and '.join(compiled) or 'no device'}; "
    line += f"{' and '.join(others + ['any other device'])} run the pure-PyTorch ops (one warning per device)"
    return line + (f". {REBUILD_HINT}" if "CUDA" in others else "")


def _kernel_lines(kernels: dict[str, list[str]]) -> list[str]:
    if not kernels:
        return ["  ops            none registered in torch.ops.apex_amp"]
    width = max(map(len, kernels))
    return [f"  {name:<{width}}  {' '.join(keys) or 'no kernel'}" for name, keys in kernels.items()]


def format_report(info: dict[str, Any]) -> str:
    """The text of ``python -m apex_amp report`` for facts from :func:`collect`."""
    build = info["build_info"]
    if info["extension_loaded"]:
        extension = f"loaded from {info['extension_path']}"
    else:
        extension = f"not loaded: {info['extension_reason']}"
    known = {"cuda", "cuda_archs", "cuda_version", "compiler", "cpu_isas", "cpu_isa"}
    lines = [
        f"apex_amp {info['apex_amp_version']}",
        f"  extension      {extension}",
        f"  ops backend    {info['backend']}",
        f"  CPU kernels    {_cpu_line(build)}",
        f"  CUDA kernels   {_cuda_line(build)}",
        f"  devices        {_devices_line(info)}",
        f"  CUDA emulation {info['cuda_emulation']['text']}",
        *(f"  {key:<14} {value}" for key, value in build.items() if key not in known),
        "kernels per op (torch.ops.apex_amp)",
        *_kernel_lines(info["kernels"]),
        f"torch {info['torch_version']} (CUDA {info['torch_cuda'] or 'none: CPU build'})",
        f"  CPU ISA        {info['cpu_capability']} ({info['machine']}; torch.backends.cpu.get_cpu_capability())",
        f"  threads        {info['threads']} intra-op, {info['interop_threads']} inter-op"
        + (", OpenMP" if info["openmp"] else ""),
        f"  GPUs           {', '.join(info['gpus']) if info['gpus'] else 'none visible (torch.cuda.is_available() is False)'}",
        "fp8 training (amp.initialize(..., fp8=True))",
        *(f"  {line}" for line in info["fp8"]),
    ]
    return "\n".join(lines)


def problems(info: dict[str, Any], require_cuda: bool) -> list[str]:
    """Why the build falls short of the compiled kernels (CPU, plus CUDA if asked); [] when it does not."""
    if not info["extension_loaded"]:
        return [f"the extension apex_amp._C is not loaded: {info['extension_reason']}"]
    found = []
    if not info["kernels"]:
        found.append("no op is registered in torch.ops.apex_amp")
    wanted = ["CPU", "CUDA"] if require_cuda else ["CPU"]
    if require_cuda and not info["build_info"].get("cuda"):
        found.append("the extension was built without CUDA kernels (rebuild with APEX_AMP_CUDA=1)")
    for name, keys in info["kernels"].items():
        missing = [key for key in wanted if key not in keys]
        if missing:
            found.append(f"op {name} has no {' or '.join(missing)} kernel")
    return found
