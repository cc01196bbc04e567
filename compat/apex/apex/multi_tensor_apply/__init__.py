"""apex.multi_tensor_apply: apex's ``multi_tensor_applier``, calling the compat distribution's ``amp_C``.

``multi_tensor_applier(op, noop_flag, tensor_lists, *args)`` calls ``op(2048 * 32, noop_flag,
tensor_lists, *args)`` with an ``amp_C`` function, which runs on apex_amp's ops (see ``amp_C``'s
docstring for what each does with the noop flag).

Example::

    >>> import torch, amp_C
    >>> from apex.multi_tensor_apply import multi_tensor_applier
    >>> overflow_buf = torch.zeros(1, dtype=torch.int)
    >>> grads = [torch.ones(3), torch.ones(4)]
    >>> total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)
    >>> multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [grads, grads], 1.0 / max(1.0, float(total)))
"""

from .multi_tensor_apply import MultiTensorApply

__all__ = ["MultiTensorApply", "multi_tensor_applier"]

# apex's chunk size (elements per chunk of its CUDA launches).
multi_tensor_applier = MultiTensorApply(2048 * 32)
