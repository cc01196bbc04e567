"""The half dtypes, and mapping a function over the tensors inside nested arguments.

One home for both: the frontend casts models and their inputs/outputs, O1 casts
the arguments of each op, FusedAdam and the diagnostics check dtypes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["HALF_DTYPES", "map_tensors"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def map_tensors(value: Any, fn: Callable[[Tensor], Tensor], on_object: Optional[Callable[[Any], Any]] = None) -> Any:
    """``value`` with ``fn`` applied to each tensor, through lists, tuples (named too) and dicts.

    Anything else is returned as it is, and so is a container none of whose
    tensors ``fn`` changed (the same object, not a copy). With ``on_object``,
    any other ``Mapping`` is walked too (rebuilt as its own type where it can
    be) and every other object is replaced by ``on_object(obj)``.

    Example::

        >>> map_tensors({"x": torch.ones(2), "n": 3}, lambda t: t.half())["x"].dtype
        torch.float16
    """
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        mapped = [map_tensors(item, fn, on_object) for item in value]
        if all(new is old for new, old in zip(mapped, value)):
            return value
        if isinstance(value, list):
            return mapped
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*mapped)
        try:
            return type(value)(mapped)  # tuple subclasses such as torch.return_types
        except TypeError:
            return tuple(mapped)
    if isinstance(value, dict):
        items = [(key, map_tensors(item, fn, on_object)) for key, item in value.items()]
        if all(new is old for (_, new), old in zip(items, value.values())):
            return value
        try:
            return type(value)(items)
        except TypeError:  # dict subclasses with other constructors (defaultdict, ...)
            return dict(items)
    if on_object is None or isinstance(value, (str, bytes)):
        return value
    if isinstance(value, Mapping):
        return _map_mapping(value, fn, on_object)
    return on_object(value)


def _map_mapping(value: Mapping, fn: Callable[[Tensor], Tensor], on_object: Callable[[Any], Any]) -> Any:
    # Mappings that are not dicts (UserDict, Hugging Face's BatchEncoding, a read-only view): a
    # shallow copy of a mutable one keeps its type and attributes; others are rebuilt from items.
    items = {key: map_tensors(item, fn, on_object) for key, item in value.items()}
    if all(items[key] is item for key, item in value.items()):
        return value
    if isinstance(value, MutableMapping):
        try:
            mapped = copy.copy(value)
            mapped.update(items)
            return mapped
        except TypeError:
            pass
    try:
        return type(value)(items)
    except TypeError:
        return items
