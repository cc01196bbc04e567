"""The parts of NVIDIA apex that the compat package does not provide, each with its replacement.

One table of modules (``import apex.fp16_utils``), each with its replacement; every name that
apex's ``__init__`` files export from a module the package provides exists (what cannot work
raises when called, naming its replacement). Everything that reports a missing part reads it
from here:

- :class:`UnavailableFinder`, first on ``sys.meta_path``, turns an import of a listed module
  into a ``ModuleNotFoundError`` whose message names the replacement. It also refuses every
  submodule of ``apex.amp``: that name is an alias of ``apex_amp.amp``, and without the finder
  ``import apex.amp.handle`` would load apex_amp's own ``handle.py`` a second time as a
  separate module with its own state.
- :func:`missing_attribute` gives the packages' ``__getattr__`` the same messages as an
  ``AttributeError``, so ``hasattr(apex, "fp16_utils")`` stays ``False`` and
  ``apex.fp16_utils`` (without an import) still says what to use instead.

No entry is a stub: nothing listed here can be imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Optional

__all__ = ["UNAVAILABLE_MODULES", "UnavailableFinder", "install_finder", "missing_attribute",
           "message_for"]

# Modules of NVIDIA apex (as of 25.05, its last release with amp) that are not provided. An entry
# also covers its submodules (`apex.contrib` covers `apex.contrib.xentropy.softmax_xentropy`).
# Every entry's parent is a package the compat package provides (apex, apex.parallel): Python
# imports the parent first, so an entry below a missing one is never reached.
UNAVAILABLE_MODULES: dict[str, str] = {
    "apex.fp16_utils": (
        "FP16_Optimizer, network_to_half and the other fp16_utils helpers are not provided: "
        "use apex.amp.initialize(model, optimizer, opt_level='O2') (half model, fp32 master weights, "
        "dynamic loss scaling), or torch.autocast with torch.amp.GradScaler"
    ),
    # One entry for all of apex.contrib: importing apex.contrib.xentropy imports apex.contrib
    # first, so a message of its own would never be seen.
    "apex.contrib": (
        "apex.contrib's CUDA-only extensions are not provided. Replacements: optimizers.DistributedFusedAdam "
        "-> use torch.optim.AdamW(fused=True) with torch.distributed.fsdp.fully_shard or "
        "torch.distributed.optim.ZeroRedundancyOptimizer; xentropy -> torch.nn.CrossEntropyLoss(label_smoothing=...); "
        "focal_loss -> torchvision.ops.sigmoid_focal_loss; group_norm -> torch.nn.GroupNorm; layer_norm -> "
        "torch.nn.LayerNorm; clip_grad -> torch.nn.utils.clip_grad_norm_(foreach=True); sparsity (ASP) -> "
        "torch.sparse.to_sparse_semi_structured; fused attention (fmha, multihead_attn) -> "
        "torch.nn.functional.scaled_dot_product_attention; other fusions -> torch.compile"
    ),
    "apex.transformer": (
        "apex.transformer (Megatron's tensor and pipeline parallelism) is not provided: use Megatron-Core "
        "(megatron.core), or torch.distributed.tensor.parallel and torch.distributed.pipelining"
    ),
    "apex.mlp": "MLP is not provided: use torch.nn.Linear layers in a torch.nn.Sequential (torch.compile fuses them)",
    "apex.fused_dense": "FusedDense is not provided: use torch.nn.Linear (torch.compile fuses the bias and activation)",
    "apex.RNN": "apex.RNN is not provided: use torch.nn.LSTM, torch.nn.GRU or torch.nn.RNN",
    "apex.parallel.multiproc": (
        "apex.parallel.multiproc is not provided: use torchrun to launch "
        "(python -m torch.distributed.run --nproc_per_node=N train.py)"
    ),
    "apex.parallel.optimized_sync_batchnorm": "use apex.parallel.SyncBatchNorm (or torch.nn.SyncBatchNorm)",
    "apex.parallel.optimized_sync_batchnorm_kernel": "use apex.parallel.SyncBatchNorm (or torch.nn.SyncBatchNorm)",
    "apex.parallel.sync_batchnorm_kernel": "use apex.parallel.SyncBatchNorm (or torch.nn.SyncBatchNorm)",
}

_AMP_SUBMODULE = (
    "{name} is an internal module of NVIDIA apex's amp and is not provided: apex.amp here is apex_amp.amp, "
    "whose public API (initialize, scale_loss, master_params, state_dict, load_state_dict, disable_casts, "
    "register_*_function, ...) is imported from apex.amp itself"
)

# NVIDIA apex's amp modules. `from apex.amp import scaler` looks for `apex_amp.amp.scaler`
# (Python uses the module's own name), so the finder answers for these under apex_amp.amp too,
# but only while apex_amp has no real module of that name (it has `_amp_state`, apex's state
# object, which third-party code reads and sets).
APEX_AMP_MODULES = ("_initialize", "_process_optimizer", "amp", "compat", "lists", "opt",
                    "rnn_compat", "scaler", "utils", "wrap")


def _apex_amp_submodule(fullname: str) -> Optional[str]:
    # "apex.amp.x.y" or "apex_amp.amp.x" (x one of apex's amp modules) -> "x"; else None.
    for prefix in ("apex.amp.", "apex_amp.amp."):
        if fullname.startswith(prefix):
            first = fullname[len(prefix):].partition(".")[0]
            if prefix == "apex.amp." or first in APEX_AMP_MODULES:
                return first
    return None


def message_for(fullname: str) -> Optional[str]:
    """The message for an unavailable module (dotted name), or None if it is not listed."""
    amp_module = _apex_amp_submodule(fullname)
    if amp_module is not None:
        return _AMP_SUBMODULE.format(name="apex.amp." + fullname.split(".amp.", 1)[1])
    module = fullname
    while module:
        if module in UNAVAILABLE_MODULES:
            return f"{fullname}: {UNAVAILABLE_MODULES[module]}"
        module = module.rpartition(".")[0]
    return None


def missing_attribute(module_name: str, attribute: str) -> AttributeError:
    """The AttributeError for ``module_name.attribute``, with the replacement when the name is listed."""
    message = message_for(f"{module_name}.{attribute}")
    if message is None:
        message = f"module {module_name!r} has no attribute {attribute!r}"
    return AttributeError(message, name=attribute)


class _RaisingLoader(importlib.abc.Loader):
    def __init__(self, error_type: type[ImportError], message: str) -> None:
        self.error_type = error_type
        self.message = message

    def create_module(self, spec):
        raise self.error_type(self.message, name=spec.name)

    def exec_module(self, module) -> None:  # never reached: create_module raised
        raise self.error_type(self.message, name=module.__name__)


class UnavailableFinder(importlib.abc.MetaPathFinder):
    """Finds the listed apex modules (and apex's amp submodules), with a loader that raises their ImportError.

    A found spec (rather than ``None``) is what lets the message reach the user: for ``None``
    Python raises its own "No module named ..." instead.
    """

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(("apex.", "apex_amp.amp.")):
            return None
        message = message_for(fullname)
        if message is None:
            return None
        if fullname.startswith("apex_amp.") and importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
            return None  # apex_amp's own module of that name: never stand in its way
        if fullname.startswith("apex_amp."):
            # `from apex.amp import scaler` ends here after the attribute lookup failed; a
            # ModuleNotFoundError would be swallowed by that import and replaced by Python's
            # generic "cannot import name", so this one is a plain ImportError.
            error_type = ImportError
        else:
            error_type = ModuleNotFoundError
        return importlib.machinery.ModuleSpec(fullname, _RaisingLoader(error_type, message))


def install_finder() -> None:
    """Put one :class:`UnavailableFinder` first on ``sys.meta_path`` (again importing apex adds no second one)."""
    if not any(isinstance(finder, UnavailableFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, UnavailableFinder())
