"""``amp_C``, NVIDIA apex's multi-tensor kernel module, rebuilt on apex_amp's ops for the compat distribution.

Code written for apex calls these through ``apex.multi_tensor_apply.multi_tensor_applier``
(Megatron-style gradient clipping, apex's own reference optimizers, copies of apex's fused
optimizers); they take apex's arguments in apex's order and return apex's shapes:

- list kernels: ``multi_tensor_scale``, ``multi_tensor_axpby``, ``multi_tensor_l2norm``,
  ``multi_tensor_l2norm_mp``, ``multi_tensor_l2norm_scale``, ``multi_tensor_unscale_l2norm``;
- the loss-scale update ``update_scale_hysteresis``;
- optimizer kernels: ``multi_tensor_sgd``, ``multi_tensor_adam`` (and ``_capturable``,
  ``_capturable_master``), ``multi_tensor_adagrad``, ``multi_tensor_novograd``,
  ``multi_tensor_lamb``, ``multi_tensor_lamb_mp``, and the two LAMB stages
  ``multi_tensor_lamb_stage1_cuda`` / ``multi_tensor_lamb_stage2_cuda`` (plain PyTorch).

That is every function of apex's ``amp_C`` (csrc/amp_C_frontend.cpp at its last amp commit).

apex's convention: the first argument is a chunk size (checked, but apex_amp's kernels choose
their own chunks), the second an int32 ``noop_flag`` on the tensors' device, the third a list
of tensor lists. Each kernel skips on a set flag exactly where apex's did and sets it where
apex's did (an inf or NaN met), on the device, with no host sync; each function's docstring
says which. The tensors may be on the CPU or on a GPU, fp32, fp16 or bf16 (apex: CUDA only).

Example::

    >>> import torch, amp_C
    >>> from apex.multi_tensor_apply import multi_tensor_applier
    >>> overflow_buf = torch.zeros(1, dtype=torch.int)
    >>> grads = [torch.full((3,), 4.0), torch.full((2,), float("inf"))]
    >>> total, per_tensor = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], True)
    >>> total.shape, per_tensor.shape, int(overflow_buf)
    (torch.Size([1]), torch.Size([2]), 1)
"""

import importlib.util
import os
import sys


def _refuse_if_shadowing() -> None:
    # The compat package's import guard, from the `apex` folder installed beside this one, loaded
    # by path: before anything is imported, refuse to run next to NVIDIA apex or its compiled modules.
    guard_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apex", "_apex_amp_guard.py")
    if not os.path.isfile(guard_path):
        raise ImportError(f"amp_C (apex_amp's compat distribution) is installed without its apex package beside it "
                          f"({guard_path} is missing): reinstall with `pip install --no-build-isolation ./compat/apex`")
    spec = importlib.util.spec_from_file_location("_apex_amp_guard_of_amp_C", guard_path)
    guard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guard)
    guard.refuse_if_shadowing(sys.path, action="import")


_refuse_if_shadowing()

from ._lamb_novograd import multi_tensor_lamb, multi_tensor_lamb_mp, multi_tensor_novograd  # noqa: E402
from ._lamb_stages import multi_tensor_lamb_stage1_cuda, multi_tensor_lamb_stage2_cuda  # noqa: E402
from ._lists import (multi_tensor_axpby, multi_tensor_l2norm, multi_tensor_l2norm_mp,  # noqa: E402
                     multi_tensor_l2norm_scale, multi_tensor_scale, multi_tensor_unscale_l2norm,
                     update_scale_hysteresis)
from ._optimizers import (multi_tensor_adagrad, multi_tensor_adam, multi_tensor_adam_capturable,  # noqa: E402
                          multi_tensor_adam_capturable_master, multi_tensor_sgd)

__all__ = [
    "multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_l2norm_mp",
    "multi_tensor_l2norm_scale", "multi_tensor_unscale_l2norm", "update_scale_hysteresis",
    "multi_tensor_sgd", "multi_tensor_adam", "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master",
    "multi_tensor_adagrad", "multi_tensor_novograd", "multi_tensor_lamb", "multi_tensor_lamb_mp",
    "multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda",
]
