"""``apex_C``, NVIDIA apex's C++ flatten/unflatten module, for the compat distribution: the same two functions on torch.

apex's ``apex_C.flatten`` / ``apex_C.unflatten`` called torch's own C++ helpers
(``torch::utils::flatten_dense_tensors`` / ``unflatten_dense_tensors``), which
``torch._utils._flatten_dense_tensors`` / ``_unflatten_dense_tensors`` also call: these are
those, with apex's argument checks. Code that binds them at import (NVIDIA's BERT
``run_pretraining.py`` flattens its gradients for one all-reduce) runs unchanged.

Example::

    >>> import torch, apex_C
    >>> grads = [torch.ones(2, 3), torch.zeros(4)]
    >>> flat = apex_C.flatten(grads)
    >>> flat.shape
    torch.Size([10])
    >>> [view.shape for view in apex_C.unflatten(flat, grads)]
    [torch.Size([2, 3]), torch.Size([4])]
"""

# First, before torch is imported: the compat package's guard refuses to run next to NVIDIA apex
# (or its compiled apex_C), as `import apex` does.
import apex  # noqa: F401

from ._apex_amp_flatten import flatten, unflatten  # noqa: E402

__all__ = ["flatten", "unflatten"]
