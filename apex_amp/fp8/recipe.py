"""``Fp8Recipe``: how fp8 training scales its tensors and which Linears it converts.

The formats follow NVIDIA Transformer Engine's HYBRID recipe: activations and
weights in e4m3 (``torch.float8_e4m3fn``: 3 mantissa bits, largest value 448),
output gradients in e5m2 (``torch.float8_e5m2``: 2 mantissa bits, largest
57344, the range gradients need). Every tensor has one scale (per tensor): it
is multiplied by the scale before the cast to fp8, and the GEMM multiplies its
result by the inverse scales of its two inputs.

Two ways to choose the scale:

* **delayed** (the default, Transformer Engine's ``DelayedScaling``): each
  tensor keeps the amaxes (largest absolute values) of its last
  ``amax_history_len`` optimizer steps; the scale of the next step is
  ``fp8_max / amax / 2**margin``, with ``amax`` the largest amax of the history
  (``amax_compute_algo="max"``) or the latest one (``"most_recent"``). The
  scale is fixed within a step, so every micro-batch of a gradient
  accumulation uses the same one, and the histories are state (checkpointed,
  agreed across data-parallel ranks once per step). A tensor whose history
  holds no amax yet (the first step) is scaled just in time.
* **current** (just in time, torchao's tensorwise default): each tensor is
  scaled by its own amax at the moment it is cast; nothing is kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["Fp8Recipe", "SCALINGS", "AMAX_ALGOS", "FORMATS", "FORWARD_DTYPE", "BACKWARD_DTYPE"]

SCALINGS = ("delayed", "current")
AMAX_ALGOS = ("max", "most_recent")
# fp8_format: the dtypes of (activations and weights, output gradients).
FORMATS = {
    "hybrid": (torch.float8_e4m3fn, torch.float8_e5m2),
    "e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn),
}
FORWARD_DTYPE, BACKWARD_DTYPE = FORMATS["hybrid"]

# module_filter(qualified_name, linear) -> whether that nn.Linear runs in fp8.
ModuleFilter = Callable[[str, nn.Module], bool]


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How fp8 training scales its tensors (``amp.initialize(..., fp8=Fp8Recipe(...))``).

    Args:
        scaling: "delayed" (scales from an amax history, the default) or "current" (just in time).
        amax_history_len: optimizer steps of amaxes each tensor keeps (delayed scaling).
        amax_compute_algo: "max" (the largest amax of the history) or "most_recent".
        margin: the scale is divided by ``2**margin``, leaving that many powers of two of headroom.
        fp8_format: "hybrid" (e4m3 forward, e5m2 gradients) or "e4m3" (e4m3 everywhere).
        module_filter: ``f(name, linear) -> bool``; only the ``nn.Linear`` layers it accepts run in
            fp8 (None: all whose dimensions ``torch._scaled_mm`` takes).

    Example::

        >>> recipe = amp.Fp8Recipe(amax_history_len=32, margin=1,
        ...                        module_filter=lambda name, linear: name != "head")
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
        ...                                   half_dtype=torch.bfloat16, fp8=recipe)
    """

    scaling: str = "delayed"
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0
    fp8_format: str = "hybrid"
    module_filter: Optional[ModuleFilter] = None

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"Fp8Recipe scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"Fp8Recipe amax_compute_algo must be one of {AMAX_ALGOS}, got {self.amax_compute_algo!r}")
        if self.fp8_format not in FORMATS:
            raise ValueError(f"Fp8Recipe fp8_format must be one of {sorted(FORMATS)}, got {self.fp8_format!r}")
        for name in ("amax_history_len", "margin"):
            value = getattr(self, name)
            low = 1 if name == "amax_history_len" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Fp8Recipe {name} must be an integer >= {low}, got {value!r}")
        if self.module_filter is not None and not callable(self.module_filter):
            raise TypeError(
                f"Fp8Recipe module_filter must be a callable f(name, linear) -> bool or None, "
                f"got {type(self.module_filter).__name__}"
            )

    @classmethod
    def from_name(cls, name: str) -> "Fp8Recipe":
        """The recipe called ``name``: "delayed" (Transformer Engine's default) or "current".

        Args:
            name: one of ``SCALINGS``.

        Example::

            >>> amp.Fp8Recipe.from_name("current").scaling
            'current'
        """
        if name not in SCALINGS:
            raise ValueError(f"unknown fp8 recipe {name!r}; the recipes are {SCALINGS}")
        return cls(scaling=name)

    @property
    def delayed(self) -> bool:
        return self.scaling == "delayed"

    @property
    def forward_dtype(self) -> torch.dtype:
        return FORMATS[self.fp8_format][0]

    @property
    def backward_dtype(self) -> torch.dtype:
        return FORMATS[self.fp8_format][1]

    def config(self) -> dict[str, Any]:
        """The settings a checkpoint records (the filter is code, not state)."""
        return {"scaling": self.scaling, "amax_history_len": self.amax_history_len,
                "amax_compute_algo": self.amax_compute_algo, "margin": self.margin,
                "fp8_format": self.fp8_format}

    def describe(self) -> str:
        forward, backward = (str(dtype).replace("torch.float8_", "") for dtype in FORMATS[self.fp8_format])
        if not self.delayed:
            return f"fp8 GEMMs ({forward} forward, {backward} gradients), current (just-in-time) scaling"
        return (f"fp8 GEMMs ({forward} forward, {backward} gradients), delayed scaling from the "
                f"{self.amax_compute_algo} of {self.amax_history_len} steps' amaxes, margin {self.margin}")
