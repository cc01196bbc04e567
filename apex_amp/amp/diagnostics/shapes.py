"""``amp.inspect(model)``: what mixed precision will do to a model, before training it.

The report lists, per module:

* layers whose matrix dimensions or channel counts are not multiples of 8
  (fp16/bf16 Tensor Cores need them; otherwise the GEMM falls back to slower
  kernels or pads);
* layers that O1 runs in fp32 (or bans), read from the O1 rule table
  (:data:`apex_amp.amp.casting.rules.RULES`), and under O2/O3 the same layers,
  which then run in half;
* parameters that are already half (``amp.initialize`` refuses them);
* batchnorm layers and what the opt level does to them (``keep_batchnorm_fp32``).

The model is only read, never changed.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..casting.rules import RULES, OpRule, Rule
from ..._dtypes import HALF_DTYPES
from ..opt_levels import resolve_properties

__all__ = ["Finding", "FindingKind", "InspectReport", "inspect", "TENSOR_CORE_MULTIPLE"]

TENSOR_CORE_MULTIPLE = 8  # fp16/bf16 Tensor Core GEMMs want every matrix dimension a multiple of 8


class FindingKind(enum.Enum):
    ALIGNMENT = "alignment"  # a dimension that is not a multiple of TENSOR_CORE_MULTIPLE
    FP32_OP = "fp32-op"  # the O1 table runs this layer's op in fp32
    BANNED = "banned"  # the O1 table bans this layer's op
    ALREADY_HALF = "already-half"  # parameters already fp16/bf16
    BATCHNORM = "batchnorm"  # a batchnorm layer and what the opt level does to it


# The op each module type calls in its forward, by its name in the O1 table (a row's
# name or aten op). The precision comes from the table itself (see _rule_of).
_MODULE_OP: tuple[tuple[type, str], ...] = (
    (nn.LayerNorm, "layer_norm"),
    (nn.GroupNorm, "group_norm"),
    (nn.LocalResponseNorm, "local_response_norm"),
    (nn.Softmax, "softmax"),
    (nn.Softmax2d, "softmax"),
    (nn.LogSoftmax, "log_softmax"),
    (nn.Softmin, "softmin"),
    (nn.Softplus, "softplus"),
    (nn.GELU, "gelu"),
    (nn.CosineSimilarity, "cosine_similarity"),
    (nn.PairwiseDistance, "norm"),
    (nn.Upsample, "interpolate"),
    (nn.CrossEntropyLoss, "cross_entropy"),
    (nn.NLLLoss, "nll_loss"),
    (nn.MSELoss, "mse_loss"),
    (nn.L1Loss, "l1_loss"),
    (nn.SmoothL1Loss, "smooth_l1_loss"),
    (nn.HuberLoss, "huber_loss"),
    (nn.KLDivLoss, "kl_div"),
    (nn.BCEWithLogitsLoss, "binary_cross_entropy_with_logits"),
    (nn.BCELoss, "binary_cross_entropy"),
    (nn.CTCLoss, "ctc_loss"),
    (nn.PoissonNLLLoss, "poisson_nll_loss"),
    (nn.GaussianNLLLoss, "gaussian_nll_loss"),
    (nn.MarginRankingLoss, "margin_ranking_loss"),
    (nn.HingeEmbeddingLoss, "hinge_embedding_loss"),
    (nn.SoftMarginLoss, "soft_margin_loss"),
    (nn.MultiLabelSoftMarginLoss, "multilabel_soft_margin_loss"),
    (nn.MultiMarginLoss, "multi_margin_loss"),
    (nn.MultiLabelMarginLoss, "multilabel_margin_loss"),
    (nn.CosineEmbeddingLoss, "cosine_embedding_loss"),
    (nn.TripletMarginLoss, "triplet_margin_loss"),
    (nn.TripletMarginWithDistanceLoss, "triplet_margin_with_distance_loss"),
)


def _rule_of(op: str) -> OpRule:
    for row in RULES:
        names = {part.strip() for part in row.name.split(",")}
        if op in names or op in row.aten or any(attr == op for _, attr in row.python):
            return row
    raise LookupError(f"no row of the O1 rule table names {op!r}; update _MODULE_OP in diagnostics/shapes.py")


def module_rule(module: nn.Module) -> Optional[tuple[str, OpRule]]:
    """(op name, table row) of the O1 rule this module's forward falls under, if it has one."""
    for module_type, op in _MODULE_OP:
        if type(module) is module_type:
            return op, _rule_of(op)
    return None


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing worth knowing about one module."""

    module: str  # qualified name ("encoder.0"), "(model)" for the root
    kind: FindingKind
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"module": self.module, "kind": self.kind.value, "message": self.message}


@dataclasses.dataclass(frozen=True)
class InspectReport:
    """The findings of :func:`inspect` and the settings they were made for."""

    model: str  # the model's class name
    opt_level: str
    half_dtype: torch.dtype
    num_modules: int
    num_params: int  # elements
    findings: tuple[Finding, ...]

    def of_kind(self, kind: FindingKind) -> list[Finding]:
        """The findings of one kind."""
        return [finding for finding in self.findings if finding.kind is kind]

    def summary(self) -> str:
        """One line: how many findings of each kind."""
        counts = ", ".join(f"{len(self.of_kind(kind))} {kind.value}" for kind in FindingKind)
        return (f"{self.model} under {self.opt_level} ({_dtype_name(self.half_dtype)}): {self.num_modules} modules, "
                f"{self.num_params:,} parameters; findings: {counts}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "opt_level": self.opt_level,
            "half_dtype": _dtype_name(self.half_dtype),
            "num_modules": self.num_modules,
            "num_params": self.num_params,
            "summary": self.summary(),
            "findings": [finding.to_dict() for finding in self.findings],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        if not self.findings:
            return self.summary() + "\nnothing to report"
        width_module = max(len("module"), *(len(f.module) for f in self.findings))
        width_kind = max(len("kind"), *(len(f.kind.value) for f in self.findings))
        lines = [f"{'module':<{width_module}}  {'kind':<{width_kind}}  message",
                 f"{'-' * width_module}  {'-' * width_kind}  {'-' * 7}"]
        lines += [f"{f.module:<{width_module}}  {f.kind.value:<{width_kind}}  {f.message}" for f in self.findings]
        lines.append(self.summary())
        return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dimensions(module: nn.Module) -> list[tuple[str, int]]:
    # (what, size) of every dimension that becomes a GEMM dimension.
    if isinstance(module, nn.Linear):
        return [("in_features", module.in_features), ("out_features", module.out_features)]
    if isinstance(module, nn.Bilinear):
        return [("in1_features", module.in1_features), ("in2_features", module.in2_features),
                ("out_features", module.out_features)]
    if isinstance(module, nn.modules.conv._ConvNd):
        if module.groups > 1:
            if module.groups == module.in_channels:
                return []  # depthwise: not a GEMM, no Tensor Cores whatever the count
            return [("in_channels per group", module.in_channels // module.groups),
                    ("out_channels per group", module.out_channels // module.groups)]
        return [("in_channels", module.in_channels), ("out_channels", module.out_channels)]
    if isinstance(module, nn.Embedding):
        return [("embedding_dim", module.embedding_dim)]
    if isinstance(module, nn.EmbeddingBag):
        return [("embedding_dim", module.embedding_dim)]
    if isinstance(module, nn.MultiheadAttention):
        dims = [("embed_dim", module.embed_dim), ("head_dim", module.head_dim)]
        if not module._qkv_same_embed_dim:
            dims += [("kdim", module.kdim), ("vdim", module.vdim)]
        return dims
    if isinstance(module, nn.RNNBase):
        return [("input_size", module.input_size), ("hidden_size", module.hidden_size)]
    return []


def _alignment(name: str, module: nn.Module, half: str) -> list[Finding]:
    bad = [f"{what}={size}" for what, size in _dimensions(module) if size % TENSOR_CORE_MULTIPLE]
    if not bad:
        return []
    return [Finding(name, FindingKind.ALIGNMENT,
                    f"{type(module).__name__}: {', '.join(bad)} not a multiple of {TENSOR_CORE_MULTIPLE}; "
                    f"{half} Tensor Core kernels need multiples of {TENSOR_CORE_MULTIPLE} (pad the layer)")]


def _precision(name: str, module: nn.Module, properties: Any, half: str) -> list[Finding]:
    found = module_rule(module)
    if found is None:
        return []
    op, row = found
    layer = type(module).__name__
    if row.rule is Rule.BANNED:
        if not properties.patch_torch_functions:
            return []
        return [Finding(name, FindingKind.BANNED,
                        f"{layer} calls {op}, which O1 bans (raises) in half precision; use BCEWithLogitsLoss "
                        "on logits, or pass allow_banned=True to amp.initialize")]
    if row.rule is not Rule.FP32:
        return []
    if properties.patch_torch_functions:
        return [Finding(name, FindingKind.FP32_OP, f"{layer} runs in fp32 under O1 ({op}: rule fp32)")]
    if properties.casts_model_to_half:
        return [Finding(name, FindingKind.FP32_OP,
                        f"{layer} runs in {half} under {properties.opt_level} (the whole model is cast); "
                        f"O1 would run {op} in fp32")]
    return []


def _already_half(name: str, module: nn.Module) -> list[Finding]:
    halves = [f"{param_name} ({_dtype_name(param.dtype)})"
              for param_name, param in module.named_parameters(recurse=False) if param.dtype in HALF_DTYPES]
    if not halves:
        return []
    return [Finding(name, FindingKind.ALREADY_HALF,
                    f"already half: {', '.join(halves)}; amp.initialize expects an fp32 model and refuses "
                    "half parameters (remove the .half()/.to(dtype) call)")]


def _batchnorm(name: str, module: nn.Module, properties: Any, half: str) -> list[Finding]:
    if not isinstance(module, _BatchNorm):
        return []
    layer = type(module).__name__
    level = properties.opt_level
    if properties.casts_model_to_half:
        if properties.keep_batchnorm_fp32:
            message = (f"{layer} kept fp32 under {level} (keep_batchnorm_fp32=True): weights and running "
                       f"statistics stay fp32; its input is the {half} activation")
        else:
            message = (f"{layer} cast to {half} under {level} (keep_batchnorm_fp32=False): running statistics "
                       f"are kept in {half}; pass keep_batchnorm_fp32=True to keep them fp32")
    elif properties.patch_torch_functions:
        message = (f"{layer} stays fp32 under O1 (the model is not cast); batch_norm is not in the O1 table, "
                   "so it runs in the precision of its input")
    else:
        message = f"{layer} stays fp32 under {level}"
    return [Finding(name, FindingKind.BATCHNORM, message)]


def inspect(
    model: nn.Module,
    opt_level: str = "O1",
    half_dtype: torch.dtype = torch.float16,
    keep_batchnorm_fp32: Optional[bool] = None,
) -> InspectReport:
    """Report what mixed precision at ``opt_level`` will do to ``model``; the model is not changed.

    Args:
        model: the fp32 model, before ``amp.initialize``.
        opt_level: "O0", "O1", "O2" or "O3", as for ``amp.initialize``.
        half_dtype: torch.float16 or torch.bfloat16.
        keep_batchnorm_fp32: the ``amp.initialize`` override (O2/O3 only), None for the level's default.

    Returns:
        An :class:`InspectReport`: ``findings`` (module, kind, message), ``summary()``,
        ``to_dict()``/``to_json()``, and a table from ``str(report)``.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(30, 64), torch.nn.LayerNorm(64))
        >>> report = amp.inspect(model, opt_level="O1")
        >>> [(f.module, f.kind.value) for f in report.findings]
        [('0', 'alignment'), ('1', 'fp32-op')]
        >>> print(report)   # a table, then a one-line summary
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"amp.inspect expects a torch.nn.Module, got {type(model).__name__}")
    properties = resolve_properties(opt_level, half_dtype=half_dtype, keep_batchnorm_fp32=keep_batchnorm_fp32)
    half = _dtype_name(properties.half_dtype)
    findings: list[Finding] = []
    modules = list(model.named_modules())
    for name, module in modules:
        where = name or "(model)"
        findings += _alignment(where, module, half)
        findings += _precision(where, module, properties, half)
        findings += _already_half(where, module)
        findings += _batchnorm(where, module, properties, half)
    return InspectReport(
        model=type(model).__name__,
        opt_level=properties.opt_level,
        half_dtype=properties.half_dtype,
        num_modules=len(modules),
        num_params=sum(param.numel() for param in model.parameters()),
        findings=tuple(findings),
    )
