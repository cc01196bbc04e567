"""The helpers NVIDIA apex defines in ``apex/__init__.py`` itself, for code that imports them from ``apex``.

``deprecated_warning`` / ``DeprecatedFeatureWarning`` and ``check_cudnn_version_and_warn`` work
as apex's did. ``RankInfoFormatter`` formatted apex.transformer's model-parallel ranks, which
the compat package does not provide: it exists, and making one raises with what to use instead.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

__all__ = ["DeprecatedFeatureWarning", "deprecated_warning", "check_cudnn_version_and_warn", "RankInfoFormatter"]


class DeprecatedFeatureWarning(FutureWarning):
    """apex's category for warnings about features it meant to remove."""


def deprecated_warning(msg: str) -> None:
    """Warn ``msg`` as a :class:`DeprecatedFeatureWarning`, on rank 0 only when torch.distributed is running.

    Example::

        >>> apex.deprecated_warning("my_helper is deprecated: use torch.nn.SyncBatchNorm")
    """
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        warnings.warn(msg, DeprecatedFeatureWarning, stacklevel=2)


def check_cudnn_version_and_warn(global_option: str, required_cudnn_version: int) -> bool:
    """Whether cuDNN is available in at least ``required_cudnn_version``; warns naming ``global_option`` if not.

    Example::

        >>> apex.check_cudnn_version_and_warn("--fast_bottleneck", 8400)
        False
    """
    available = torch.backends.cudnn.is_available()
    version = torch.backends.cudnn.version() if available else None
    if available and version is not None and version >= required_cudnn_version:
        return True
    found = "cuDNN is not available" if not available else version
    warnings.warn(f"`{global_option}` depends on cuDNN {required_cudnn_version} or later, but {found}", stacklevel=2)
    return False


class RankInfoFormatter(logging.Formatter):
    """apex's log formatter with apex.transformer's model-parallel ranks: not provided, raises when made."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "apex.RankInfoFormatter prints apex.transformer's model-parallel ranks, and apex.transformer is not "
            "provided: use logging.Formatter with the rank in the format (e.g. f'rank {torch.distributed.get_rank()} "
            "%(message)s'), or Megatron-Core's parallel_state for model-parallel ranks")
