"""``apex.multi_tensor_apply.multi_tensor_apply``: apex's ``MultiTensorApply``, calling the compat ``amp_C``."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor

__all__ = ["MultiTensorApply"]


class MultiTensorApply:
    """Calls an ``amp_C`` function with a fixed chunk size: ``applier(op, noop_flag, tensor_lists, *args)``
    is ``op(chunk_size, noop_flag, tensor_lists, *args)``, as in apex.

    ``available`` says whether ``amp_C`` imported (apex's optimizers test it before using the
    kernels); :meth:`check_avail` raises with the import error when it did not.

    Example::

        >>> applier = MultiTensorApply(2048 * 32)
        >>> total, _ = applier(amp_C.multi_tensor_l2norm, torch.zeros(1, dtype=torch.int), [grads], False)

    Args:
        chunk_size: passed to every call (apex_amp's kernels check it and choose their own chunks).
    """

    available = False
    warned = False
    import_err: Optional[BaseException] = None

    def __init__(self, chunk_size: int) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise TypeError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size
        try:
            import amp_C  # noqa: F401  the compat distribution's own
        except ImportError as error:
            MultiTensorApply.available = False
            MultiTensorApply.import_err = error
        else:
            MultiTensorApply.available = True

    def check_avail(self) -> None:
        """Raise RuntimeError (with the import error) if ``amp_C`` could not be imported."""
        if not MultiTensorApply.available:
            raise RuntimeError(
                "multi_tensor_applier is unavailable because amp_C failed to import "
                f"({MultiTensorApply.import_err}); reinstall apex_amp's compat distribution: "
                "pip install --no-build-isolation ./compat/apex")

    def __call__(self, op: Callable[..., Any], noop_flag_buffer: Tensor, tensor_lists: list[list[Tensor]],
                 *args: Any) -> Any:
        """``op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)``, and its result."""
        self.check_avail()
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)
