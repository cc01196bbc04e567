"""fp8 training: the three GEMMs of each eligible ``nn.Linear`` in fp8 through ``torch._scaled_mm``.

The pieces, each with one job: :mod:`.recipe` (``Fp8Recipe``: formats, scaling,
which Linears), :mod:`.numerics` (scales, the saturating cast, the GEMMs and
their layouts), :mod:`.scaling` (the amax histories and scales, their per-step
update and checkpoint), :mod:`.linear` (``Fp8Linear`` and the conversion), and
:mod:`.support` (what the visible devices can run). ``amp.initialize(...,
fp8=True)`` drives them; this package does not import :mod:`apex_amp.amp`.

Example::

    >>> from apex_amp import amp
    >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
    ...                                   half_dtype=torch.bfloat16, fp8=True)
"""

from .errors import GemmError, gemm_errors
from .linear import Fp8Binding, Fp8Linear, convert_, eligibility
from .recipe import Fp8Recipe
from .scaling import Fp8Scales
from .support import device_support

__all__ = ["Fp8Recipe", "Fp8Linear", "Fp8Binding", "Fp8Scales", "convert_", "eligibility", "device_support", "gemm_errors",
           "GemmError"]
