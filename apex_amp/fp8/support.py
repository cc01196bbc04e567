"""What fp8 training can run on here: ``python -m apex_amp report`` prints it.

fp8 GEMMs are a matter of hardware for speed: NVIDIA's fp8 tensor cores start
with compute capability 8.9 (Ada) and 9.0 (Hopper); there ``torch._scaled_mm``
runs on cuBLASLt at about twice the bf16 rate. torch's CPU kernel of
``torch._scaled_mm`` computes the same result (fp8 inputs, fp32 accumulation)
with no speed-up: it is what the tests and the CPU examples use.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MIN_CAPABILITY", "device_support"]

FP8_MIN_CAPABILITY = (8, 9)


def _cpu_runs_scaled_mm() -> bool:
    try:
        a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False
    return True


def device_support() -> list[str]:
    """One line per device: whether fp8 training runs there, and whether it is fast.

    Example::

        >>> from apex_amp.fp8 import device_support
        >>> device_support()[0].startswith("cpu:")
        True
    """
    lines = [
        "cpu: torch._scaled_mm runs (fp8 numerics, no speed-up)" if _cpu_runs_scaled_mm()
        else "cpu: torch._scaled_mm has no CPU kernel in this torch: fp8 training cannot run on the CPU"
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            capability = torch.cuda.get_device_capability(index)
            name = torch.cuda.get_device_name(index)
            sm = f"sm_{capability[0]}{capability[1]}"
            if capability >= FP8_MIN_CAPABILITY:
                lines.append(f"cuda:{index} {name} ({sm}): fp8 tensor cores, torch._scaled_mm on cuBLASLt")
            else:
                lines.append(f"cuda:{index} {name} ({sm}): no fp8 tensor cores (needs sm_89 or later); "
                             "fp8 training cannot run on this GPU")
    else:
        lines.append("cuda: no GPU visible; fp8 speed needs an sm_89+ GPU (Ada, Hopper, Blackwell) "
                     "with a CUDA build of torch")
    return lines
