"""apex's calling convention, adapted to apex_amp's ops: the argument checks and the noop flag.

Every ``amp_C`` function receives what NVIDIA apex's ``multi_tensor_applier`` passes: a chunk
size, an int32 ``noop_flag`` and a list of tensor lists. apex_amp's ops (``apex_amp.ops``) take
flat lists and a one-element float32 ``found_inf`` instead; this module converts one into the
other, on the tensors' device and without reading any value back to the host:

- :func:`skip_flag`: ``noop_flag`` as apex_amp's ``found_inf`` (the op skips when it is set),
  for the kernels that returned early on a set flag;
- :func:`raise_flag`: set ``noop_flag`` where a one-element found/overflow tensor is set, as
  apex's kernels did with their blind write of 1 (never cleared here either);
- :func:`unpack`: the tensor lists, checked as apex checked them (depth, equal lengths, at
  least one tensor, one device) with errors that say what to pass instead.

This file is also the compat package's mark on ``amp_C`` (``AMP_C_MARKER`` in
``apex/_apex_amp_guard.py``): a folder ``amp_C`` that holds it is this package, not NVIDIA
apex's compiled module, and the import guard lets it through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch
from torch import Tensor

__all__ = ["check_chunk_size", "unpack", "noop_flag_of", "skip_flag", "raise_flag", "device_scalar",
           "host_number", "step_before", "check_optimizer_dtypes"]

# apex's kernels read the first element of noop_flag as a C int.
_FLAG_DTYPE = torch.int32
_OPTIMIZER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_chunk_size(name: str, chunk_size: Any) -> None:
    # Only validated: apex_amp's kernels choose their own chunking (see the package docstring).
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise TypeError(f"amp_C.{name}: chunk_size must be a positive int (multi_tensor_applier passes "
                        f"2048 * 32), got {chunk_size!r}")


def unpack(name: str, chunk_size: Any, tensor_lists: Any,
           depths: Sequence[int]) -> tuple[list[list[Tensor]], torch.device]:
    """The tensor lists as lists, and their device; raises as apex did for a malformed call.

    Args:
        name: the amp_C function, for the messages.
        chunk_size: the applier's chunk size (checked, not used).
        tensor_lists: a list of ``depth`` lists of tensors, of equal lengths.
        depths: the numbers of lists the function takes.
    """
    check_chunk_size(name, chunk_size)
    if isinstance(tensor_lists, Tensor) or not isinstance(tensor_lists, Sequence):
        raise TypeError(f"amp_C.{name}: tensor_lists must be a list of lists of tensors, e.g. [grads, params], "
                        f"got {type(tensor_lists).__name__}")
    lists = [list(tensors) if isinstance(tensors, Sequence) and not isinstance(tensors, Tensor) else tensors
             for tensors in tensor_lists]
    if len(lists) not in depths:
        expected = " or ".join(str(depth) for depth in depths)
        raise ValueError(f"amp_C.{name}: tensor_lists holds {len(lists)} lists, the kernel takes {expected}")
    for index, tensors in enumerate(lists):
        if not isinstance(tensors, list) or not all(isinstance(t, Tensor) for t in tensors):
            raise TypeError(f"amp_C.{name}: tensor_lists[{index}] must be a list of tensors")
        if len(tensors) != len(lists[0]):
            raise ValueError(f"amp_C.{name}: tensor_lists[{index}] holds {len(tensors)} tensors but tensor_lists[0] "
                             f"holds {len(lists[0])}; the lists pair up index by index")
    if not lists[0]:
        raise ValueError(f"amp_C.{name}: tensor_lists[0] is empty; apex's kernels need at least one tensor, so skip "
                         "the call when there is nothing to do")
    device = lists[0][0].device
    for index, tensors in enumerate(lists):
        for position, t in enumerate(tensors):
            if t.device != device:
                raise ValueError(f"amp_C.{name}: tensor_lists[{index}][{position}] is on {t.device}, "
                                 f"tensor_lists[0][0] on {device}; put every tensor of a call on one device")
    return lists, device


def noop_flag_of(name: str, noop_flag: Any, device: torch.device) -> Tensor:
    """The one-element view of ``noop_flag`` that apex's kernels read and write (its first element)."""
    if not isinstance(noop_flag, Tensor):
        raise TypeError(f"amp_C.{name}: noop_flag must be a tensor, e.g. torch.zeros(1, dtype=torch.int, "
                        f"device={str(device)!r}), got {type(noop_flag).__name__}")
    if noop_flag.dtype != _FLAG_DTYPE or noop_flag.numel() == 0:
        raise TypeError(f"amp_C.{name}: noop_flag must be a non-empty torch.int32 tensor, as apex's kernels read it "
                        f"as an int (torch.zeros(1, dtype=torch.int, device=...)), got {noop_flag.numel()} "
                        f"element(s) of {noop_flag.dtype}")
    if noop_flag.device != device:
        raise ValueError(f"amp_C.{name}: noop_flag is on {noop_flag.device} but the tensors are on {device}; create it "
                         f"on their device: torch.zeros(1, dtype=torch.int, device={str(device)!r})")
    # A one-element view at the tensor's first element (its data pointer), whatever its shape.
    return noop_flag.as_strided((1,), (1,))


def skip_flag(flag: Tensor) -> Tensor:
    """apex_amp's ``found_inf`` for a kernel that skipped its work while ``flag`` (from noop_flag_of) is set."""
    return (flag != 0).to(torch.float32)


def raise_flag(flag: Tensor, found: Tensor) -> None:
    """Set ``flag`` (from noop_flag_of) to 1 if the one-element ``found`` is true (bool) or non-zero
    (apex_amp's ``found_inf``); never clear it."""
    flag.masked_fill_(found.reshape(1) if found.dtype == torch.bool else found.reshape(1) != 0, 1)


def device_scalar(value: Union[float, Tensor], device: torch.device) -> Tensor:
    """A one-element float32 tensor on ``device`` (apex's float arguments as apex_amp's device scalars)."""
    if isinstance(value, Tensor):
        return value.reshape(-1)[:1].to(device=device, dtype=torch.float32)
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def host_number(name: str, argument: str, value: Union[float, Tensor]) -> float:
    """A number apex read on the device and apex_amp's op takes from the host (the capturable ``lr``).

    Reading a CUDA tensor waits for the device (a host sync that apex's kernel did not need), and
    CUDA graph capture forbids it: that case raises instead.
    """
    if not isinstance(value, Tensor):
        return float(value)
    if value.numel() != 1:
        raise ValueError(f"amp_C.{name}: {argument} must hold one number, got {value.numel()} elements")
    if value.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"amp_C.{name} reads {argument} from its tensor on the host (apex_amp's kernels take it as a number), "
            "which CUDA graph capture forbids: call it outside the captured region, or capture "
            "apex_amp.optimizers' step instead")
    return float(value.item())


def step_before(step: Union[int, Tensor], device: torch.device) -> Tensor:
    """apex_amp's step counter for apex's step ``step``: its ops count the step they take, so one less."""
    if isinstance(step, Tensor):
        return step.reshape(-1)[:1].to(device=device, dtype=torch.float32) - 1.0
    return torch.full((1,), float(step) - 1.0, dtype=torch.float32, device=device)


def check_optimizer_dtypes(name: str, lists: list[list[Tensor]], replacement: str) -> None:
    """apex's optimizer kernels also took float64; apex_amp's take fp32, fp16 and bf16."""
    for index, tensors in enumerate(lists):
        for position, t in enumerate(tensors):
            if t.dtype not in _OPTIMIZER_DTYPES:
                raise TypeError(f"amp_C.{name}: tensor_lists[{index}][{position}] is {t.dtype}; apex_amp's kernels "
                                "take torch.float32, torch.float16 and torch.bfloat16. "
                                f"For {t.dtype}, use {replacement}")
