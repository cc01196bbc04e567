"""apex_amp: mixed-precision training for PyTorch, a rebuild of NVIDIA apex.amp.

Example::

    >>> from apex_amp import amp
    >>> from apex_amp.optimizers import FusedAdam
    >>> optimizer = FusedAdam(model.parameters(), lr=1e-3)
    >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
"""

__version__ = "0.1.0"

from . import amp, ops, optimizers  # noqa: E402
from .memory import MemoryReport, memory_report  # noqa: E402

__all__ = ["amp", "ops", "optimizers", "memory_report", "MemoryReport", "__version__"]
