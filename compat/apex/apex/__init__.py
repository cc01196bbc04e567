"""apex_amp's ``apex`` compat package: NVIDIA apex's import names for third-party code, on apex_amp.

Installed only on request (``pip install ./compat/apex`` from the apex_amp repository), for code
that imports apex itself and cannot be edited, such as the Hugging Face Trainer
(``half_precision_backend="apex"``) and timm's ``train.py --amp-impl apex``:

- ``apex.amp`` is ``apex_amp.amp`` (the same module object) and ``apex.optimizers``' fused
  optimizers (``FusedAdam``, ``FusedSGD``, ``FusedLAMB``, ``FusedMixedPrecisionLamb``,
  ``FusedNovoGrad``, ``FusedAdagrad``) are apex_amp's classes themselves;
- ``apex.multi_tensor_apply.multi_tensor_applier`` and the top-level ``amp_C`` module run apex's
  kernel calls (clipping norms, scaling, the optimizer kernels) on apex_amp's ops;
- ``apex.parallel.DistributedDataParallel``, ``SyncBatchNorm`` and ``convert_syncbn_model`` take
  apex's arguments on top of torch's DistributedDataParallel and SyncBatchNorm, and
  ``apex.parallel.distributed.flat_dist_call`` / ``Reducer`` are apex's flat collectives; the
  top-level ``apex_C`` is apex's ``flatten`` / ``unflatten``;
- ``apex.normalization``'s ``FusedLayerNorm`` and ``FusedRMSNorm`` (and ``Mixed*``) are apex's
  layers on torch's ``layer_norm`` / ``rms_norm``;
- every other part of NVIDIA apex (``apex.fp16_utils``, ``apex.contrib``, ``apex.transformer``,
  ...) raises an ImportError that names its replacement, and the names that apex's
  ``__init__`` files export but that cannot work here (``amp.init``, ``RankInfoFormatter``)
  exist and raise when called. docs/third_party_apex.md lists every name with its status.

It refuses to import when another apex (NVIDIA's, or any other package of that name) is
visible too, rather than hide it.

Example::

    >>> import apex
    >>> from apex import amp
    >>> from apex.optimizers import FusedAdam
    >>> import apex_amp
    >>> amp is apex_amp.amp and FusedAdam is apex_amp.optimizers.FusedAdam
    True
"""

import sys

from ._apex_amp_guard import refuse_if_shadowing

# First, before importing torch: a refusal costs nothing and says why at once. This package's
# own folder carries the guard's marker file, so it does not count as another apex.
refuse_if_shadowing(sys.path, action="import")

from apex_amp import amp  # noqa: E402

from . import _unavailable  # noqa: E402

# `import apex.amp` and `from apex.amp import scale_loss` must reach apex_amp.amp itself, not a
# second copy; the finder refuses apex.amp's submodules for the same reason.
sys.modules[__name__ + ".amp"] = amp
sys.modules[__name__ + ".amp._amp_state"] = amp._amp_state  # apex's state object, read and set by clients
_unavailable.install_finder()

from . import normalization, optimizers, parallel  # noqa: E402
from ._top_level import (DeprecatedFeatureWarning, RankInfoFormatter, check_cudnn_version_and_warn,  # noqa: E402
                         deprecated_warning)

__all__ = ["amp", "optimizers", "normalization", "parallel"]


def __getattr__(name: str):
    # apex.fp16_utils, apex.transformer, ... accessed without an import: say what to use instead.
    raise _unavailable.missing_attribute(__name__, name)
