"""Where every apex_amp op is defined: once, by its pure-PyTorch implementation.

An op is a typed Python function (its signature *is* the op's schema, inferred
by ``torch.library.infer_schema``), the names of the arguments it writes, and
a fake kernel (the metadata checks, and the outputs' shapes). :func:`define`
derives the rest:

* the schema of the compiled op ``torch.ops.apex_amp.<name>``: csrc registers
  only kernels (``TORCH_LIBRARY_IMPL``), and the dispatcher checks each C++
  launcher's signature against this schema, so a mismatch fails at import;
* the fallback ``torch.ops.apex_amp_fallback.<name>``, which is the function
  itself (it runs the fake kernel's checks first);
* the kernel of ``torch.ops.apex_amp.<name>`` on every device the extension has
  no kernel for (CUDA in a CPU-only build, any other device type): the function
  again, with one warning per device (apex_amp/_device_fallback.py);
* the fake kernel of both namespaces, for ``torch.compile`` and meta tensors;
* an entry in :data:`OPS`, from which :mod:`apex_amp.ops` derives a public
  wrapper where it has no hand-written one, the tests their schema and
  ``opcheck`` checks, and the CUDA emulation its schemas.

Example::

    >>> @define("double_", mutates_args=("x",), fake=lambda x: None)
    ... def double_(x: list[torch.Tensor]) -> None:
    ...     torch._foreach_mul_(x, 2.0)
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch

from . import _device_fallback
from ._extension import STATUS

__all__ = ["EXTENSION_NAMESPACE", "FALLBACK_NAMESPACE", "OpDef", "OPS", "define", "define_schemas"]

EXTENSION_NAMESPACE = "apex_amp"
FALLBACK_NAMESPACE = "apex_amp_fallback"


@dataclasses.dataclass(frozen=True)
class OpDef:
    """One op: its name, schema (``(args) -> returns``), pure-PyTorch implementation and fake kernel."""

    name: str
    schema: str
    mutates_args: tuple[str, ...]
    fallback: Callable
    fake: Callable


OPS: dict[str, OpDef] = {}

# Libraries must stay alive for their definitions to stay registered.
_LIBRARIES: dict[str, torch.library.Library] = {}


def _library(namespace: str) -> torch.library.Library:
    if namespace not in _LIBRARIES:
        _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _LIBRARIES[namespace]


def define_schemas(namespace: str, ops: Iterable[OpDef]) -> None:
    """Define ``ops``' schemas under ``namespace`` (the extension's, or the CUDA emulation's)."""
    library = _library(namespace)
    for op in ops:
        library.define(op.name + op.schema)
        torch.library.register_fake(f"{namespace}::{op.name}", op.fake, lib=library)


def define(name: str, *, mutates_args: tuple[str, ...], fake: Callable) -> Callable[[Callable], Callable]:
    """Decorator: the function is ``name``'s pure-PyTorch implementation; define the op everywhere.

    Args:
        name: the op's name (``torch.ops.apex_amp.<name>``).
        mutates_args: the arguments the op writes.
        fake: the fake kernel, called with the op's arguments; the implementation calls it first too.
    """

    def decorate(implementation: Callable) -> Callable:
        if name in OPS:
            raise RuntimeError(f"apex_amp op {name!r} is defined twice")
        # The ops' integer arguments are host numbers (counts, flags), never symbolic sizes.
        schema = torch.library.infer_schema(implementation, mutates_args=mutates_args).replace("SymInt ", "int ")
        fallback = torch.library.custom_op(
            f"{FALLBACK_NAMESPACE}::{name}", implementation, mutates_args=mutates_args, schema=schema
        )
        fallback.register_fake(fake)
        op = OpDef(name, schema, tuple(mutates_args), implementation, fake)
        OPS[name] = op
        if STATUS.loaded:
            define_schemas(EXTENSION_NAMESPACE, [op])
            _device_fallback.register(_library(EXTENSION_NAMESPACE), name, implementation)
        return fallback

    return decorate
