"""Cache of half-precision casts of fp32 weights, guarded so a stale cast is never returned.

Under O1 the model keeps fp32 weights and every half op casts them. A weight used several
times in one iteration (RNN time steps, tied embeddings, a module called twice) is cast
once: the cast is cached. torch's own autocast has such a cache, but it is keyed only by
the tensor and emptied only when the outermost ``torch.autocast`` block exits; with
autocast switched on process-wide it would never be emptied, and an in-place weight update
(``optimizer.step()``, ``load_state_dict``, ``with torch.no_grad(): w.mul_(2)``) would leave
the old values in it. apex_amp therefore turns torch's cache off while O1 is active and uses
this one for the half ops it implements (RNNs and their cells, and the others without a
torch kernel; linear/matmul/conv keep torch's kernels and cast at each call, see
:mod:`.dispatch`). An entry is valid only while all of these still hold:

- the weight's autograd version counter (bumped by every in-place op) is unchanged,
- its storage is the same (``param.data = ...`` swaps storage without an in-place op),
- grad mode is the same as when the cast was made: a cast made under ``torch.no_grad()``
  has no autograd history, so reusing it in training would silently cut the weight off
  from its gradient.

The one change it cannot see is an in-place write through ``tensor.data`` (``.data`` has a
separate version counter); :func:`apex_amp.amp.casting.clear_cache` drops everything, and
the amp frontend calls it after every optimizer step.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["WeightCastCache"]

_grad_enabled = torch.is_grad_enabled
_inference_mode_enabled = torch.is_inference_mode_enabled
_is_compiling = torch.compiler.is_compiling
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # never fake: skips the is_fake check on the hot path


class WeightCastCache:
    """Casts of leaf tensors that require grad (weights), reused while provably fresh.

    Example::

        >>> cache = WeightCastCache()
        >>> w = torch.nn.Parameter(torch.randn(3, 3))
        >>> cache.cast(w, torch.bfloat16) is cache.cast(w, torch.bfloat16)
        True
        >>> with torch.no_grad():
        ...     _ = w.mul_(2)
        >>> torch.equal(cache.cast(w, torch.bfloat16), (w.detach() * 1).bfloat16())
        True
    """

    def __init__(self) -> None:
        # (id(weight), dtype, grad_enabled) -> (weakref to weight, version, data_ptr, cast)
        self._entries: dict = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``tensor.to(dtype)``, served from the cache when ``tensor`` is a weight.

        Args:
            tensor: any tensor; only leaves that require grad are cached.
            dtype: the dtype to cast to.
        """
        if not (tensor.requires_grad and tensor.is_leaf) or _inference_mode_enabled():
            return tensor.to(dtype)
        if type(tensor) not in _PLAIN_TYPES and is_fake(tensor):
            # torch.compile tracing: fake tensors have no data pointer, and the traced
            # graph casts at each run anyway: nothing to cache.
            return tensor.to(dtype)
        key = (id(tensor), dtype, _grad_enabled())
        version = tensor._version
        data_ptr = tensor.data_ptr()
        entry = self._entries.get(key)
        if entry is not None:
            ref, cached_version, cached_ptr, cast = entry
            if ref() is tensor and cached_version == version and cached_ptr == data_ptr:
                return cast
        cast = tensor.to(dtype)
        ref = weakref.ref(tensor, self._forget(key))
        with self._lock:
            self._entries[key] = (ref, version, data_ptr, cast)
        return cast

    def clear(self) -> None:
        """Drop every cached cast."""
        if _is_compiling():
            # Called from a compiled region (an optimizer step hook): dynamo cannot enter a
            # lock, but replays this swap after the graph runs, which drops every entry too.
            self._entries = {}
            return
        with self._lock:
            self._entries.clear()

    def _forget(self, key):
        owner = weakref.ref(self)

        # Runs when the weight is garbage collected: free its cast too, unless the slot has
        # since been reused by a new tensor that happened to get the same id.
        def callback(dead_ref):
            cache = owner()
            if cache is not None:
                entry = cache._entries.get(key)
                if entry is not None and entry[0] is dead_ref:
                    cache._entries.pop(key, None)

        return callback
