"""A device type that apex_amp has no compiled kernels for, made in Python: ``nokernels``.

Importing this module renames torch's PrivateUse1 backend to ``nokernels`` (once per process,
for good: import it in a child process only) and makes it a working device for torch's own
ops: each tensor on it is a ``NoKernelsTensor`` that holds a contiguous CPU tensor, and a boxed
fallback registered for the PrivateUse1 key runs every ``aten`` op on those CPU tensors. So the
device behaves as a real backend with kernels for torch's ops and none for a third-party
namespace: the dispatcher finds no PrivateUse1 kernel for an ``apex_amp::`` op, and the
fallback answers for those as the dispatcher does for a missing kernel, with
``NotImplementedError``. That is the situation of CUDA tensors meeting a CPU-only build of the
extension, on a machine without a GPU.

Example::

    >>> import _python_device
    >>> x = torch.ones(3).to(_python_device.NAME)
    >>> (x * 2).cpu()
    tensor([2., 2., 2.])
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

NAME = "nokernels"

_setup_privateuseone_for_python_backend(NAME)


class NoKernelsTensor(torch.Tensor):
    """A tensor on the ``nokernels`` device; ``cpu_data`` holds its elements."""

    # Results of torch functions stay what the dispatcher made them (no conversion to this class).
    __torch_function__ = torch._C._disabled_torch_function_impl

    def data_ptr(self) -> int:
        # apex_amp's fallback checks overlaps by address: answer with the memory that holds the elements.
        return self.cpu_data.data_ptr()


def wrap(cpu_data: torch.Tensor) -> NoKernelsTensor:
    if not cpu_data.is_contiguous():
        # The device's tensors carry contiguous metadata (create_empty_tensor); a strided
        # result would describe its elements wrongly.
        raise NotImplementedError(f"the {NAME} test device holds contiguous tensors only")
    tensor = torch._C._acc.create_empty_tensor(cpu_data.shape, cpu_data.dtype)
    tensor.__class__ = NoKernelsTensor
    tensor.cpu_data = cpu_data
    return tensor


def _cpu_data(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu_data if isinstance(tensor, NoKernelsTensor) else tensor


def _run_on_cpu(op, *args, **kwargs):
    if op.namespace != "aten":
        raise NotImplementedError(f"Could not run '{op.name()}' with arguments from the '{NAME}' backend "
                                  "(the test device has kernels for aten ops only)")
    if op.name() in ("aten::_copy_from", "aten::_copy_from_and_resize"):  # copies across devices
        source, destination = args[0], args[1]
        _cpu_data(destination).copy_(_cpu_data(source))
        return destination
    originals: dict[int, torch.Tensor] = {}  # id of what the op sees -> what the caller passed
    other_devices: list[torch.device] = []

    def unwrap(value):
        if isinstance(value, torch.Tensor):
            data = _cpu_data(value)
            originals[id(data)] = value
            return data
        if isinstance(value, torch.device):
            if value.type != NAME:
                other_devices.append(value)
            return torch.device("cpu")
        return value

    result = op(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    def rewrap(value):
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in originals:  # an in-place op returns its argument
            return originals[id(value)]
        # A new tensor is on this device, unless the op was asked for another one (`.cpu()`).
        return value if other_devices else wrap(value)

    return tree_map(rewrap, result)


_LIBRARY = torch.library.Library("_", "IMPL")
_LIBRARY.fallback(_run_on_cpu, "PrivateUse1")
