"""The torch releases apex_amp supports, and every difference between them that apex_amp depends on.

One home for both: the rest of the library calls the functions below instead of testing
``torch.__version__`` or probing attributes itself, so supporting a new release (or dropping an
old one) touches this module and its tests only. Each function names the releases on either side
of the difference it bridges.

The tested releases are the ones the whole test suite was seen passing on (Python 3.11, CPU; the
CUDA kernels are built against each but run on no machine of this project). The oldest of them is
``pyproject.toml``'s ``torch>=`` floor; ``scripts/setup.sh`` installs ``PINNED_RELEASE`` unless
``TORCH_VERSION`` says otherwise, and CI runs the fast subset on ``OLDEST_TESTED_RELEASE`` too.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any, Iterator, TypeVar

import torch

__all__ = [
    "TESTED_RELEASES", "PINNED_RELEASE", "OLDEST_TESTED_RELEASE", "release",
    "autocast_disabled", "fsdp2_param_groups", "hash_enum_by_identity", "INDUCTOR_CPU_EMULATES_PRECISION_CASTS",
]

TESTED_RELEASES = ("2.11.0", "2.14.1", "2.15.0")
PINNED_RELEASE = "2.14.1"  # what scripts/setup.sh installs by default, and CI's full suite runs on
OLDEST_TESTED_RELEASE = TESTED_RELEASES[0]


def release(version: str = torch.__version__) -> tuple[int, int]:
    """(major, minor) of a torch version string: ``"2.11.0+cu130"`` and ``"2.16.0a0+git1234"`` alike.

    Example::

        >>> release("2.11.0+cu130")
        (2, 11)
    """
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


_RELEASE = release()


def fsdp2_param_groups(fsdp_state: Any) -> list:
    """The ``FSDPParamGroup`` objects of one ``fully_shard`` call (``module._get_fsdp_state()``).

    torch 2.11: one group per call, ``state._fsdp_param_group`` (None when the module owns no
    parameter). torch 2.12 on: a list, ``state._fsdp_param_groups``; the singular name became a
    property that raises when there are several groups.
    """
    if _RELEASE >= (2, 12):
        return list(fsdp_state._fsdp_param_groups)
    group = fsdp_state._fsdp_param_group
    return [] if group is None else [group]


EnumT = TypeVar("EnumT", bound=type[enum.Enum])


def hash_enum_by_identity(cls: EnumT) -> EnumT:
    """``cls`` with its members hashed by identity in C (``object.__hash__``), where torch.compile allows it.

    Enum's own ``__hash__`` is Python code hashing the member's name; a state machine that looks
    its states up in sets and dicts on every step pays for it. The identity hash is equivalent
    (members are singletons) but cheaper.

    torch 2.11 and 2.12: dynamo refuses to hash an object whose class defines ``__hash__`` at all
    ("User-defined object with overridden __hash__"), so a ``torch.compile(fullgraph=True)`` step
    that looks a state up would fail: there the enum keeps Enum's hash. torch 2.13 on: dynamo
    hashes ``object.__hash__`` by identity.
    """
    if _RELEASE >= (2, 13):
        cls.__hash__ = object.__hash__
    return cls


# What ``torch._inductor.config.emulate_precision_casts = True`` gives on the CPU (eager's rounding of
# every bf16/fp16 intermediate, so a compiled step can be bitwise eager's). torch 2.11: the CPU code
# generator drops a rounding wherever a value is narrowed to bf16/fp16 and widened again in the same
# fused kernel (it caches the widened value as the unrounded fp32 one: pytorch/pytorch#185337, fixed
# by #182882 and #185847, merged May-June 2026). An O2 model's bf16 output widened to fp32, or an
# fp8 cast of a bf16 activation, then differs from eager by that rounding. Seen keeping the roundings
# on 2.14.1 and 2.15.0; 2.12 and 2.13 were not tried, so they count as dropping them. Nothing in
# apex_amp depends on it; tests/test_fp8_training.py's bitwise torch.compile claim does.
INDUCTOR_CPU_EMULATES_PRECISION_CASTS = _RELEASE >= (2, 14)


# torch 2.11: dynamo does not trace torch.set_autocast_enabled (it is on its skip list: a graph
# break, an error under fullgraph=True). torch 2.12 on: it is traced into the graph.
_DYNAMO_SKIPS_SET_AUTOCAST_ENABLED = _RELEASE < (2, 12)


@contextlib.contextmanager
def autocast_disabled(device: str) -> Iterator[None]:
    """Torch's autocast flag of ``device`` off on this thread inside the block; the previous state after.

    The switch is ``torch.set_autocast_enabled``, one C call. Where dynamo does not trace it
    (torch 2.11, see ``_DYNAMO_SKIPS_SET_AUTOCAST_ENABLED``), code being traced by
    ``torch.compile`` uses a ``torch.autocast(device, enabled=False)`` block instead: every
    release traces those, but they cost more in eager (they also save and set the dtype and the
    cache switch, and count the nesting), so eager code keeps the plain switch on every release.
    O1's casts are switched this way (their carrier is the flag of a device of their own, see
    ``apex_amp.amp.casting.carrier``).
    """
    if _DYNAMO_SKIPS_SET_AUTOCAST_ENABLED and torch.compiler.is_compiling():
        with torch.autocast(device, enabled=False):
            yield
        return
    previous = torch.is_autocast_enabled(device)
    torch.set_autocast_enabled(device, False)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, previous)
