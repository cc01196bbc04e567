"""The O1 rule table: which precision each operation runs in.

This is the one table of the O1 casting rules. :mod:`.dispatch` builds its
dispatcher kernels from it, :mod:`.registry` its Python-level wrappers, the
tests are parametrised over it, and :func:`render_markdown_table` turns it into
the table of the documentation's O1 rules page, so the documentation, the behaviour and the tests cannot drift
apart.

Every row names the aten operators (``"op"`` or ``"op.overload"``) that carry the
rule at the dispatcher, which is where calls through ``torch.*``,
``torch.nn.functional.*``, ``Tensor`` methods and operators all meet. A few
functions of ``torch.nn.functional`` are Python compositions without an aten
operator of their own; their rows name the Python attribute instead, and it is
wrapped while O1 is active.

``native`` lists the devices on which torch's own autocast policy already gives the
row's rule, so O1's kernel hands the call to torch's autocast kernel there
(:mod:`.dispatch`): the linear, matmul and convolution ops that torch's autocast casts
to half, fp32 ops that torch's CUDA policy already runs in fp32, and elementwise ops
whose promotion torch's type-promotion rules already perform. Anything absent from the
table runs in the precision of its inputs (torch's autocast policy, which O1 applies
for the ops it casts, may still run it in fp32 on a device that has no half kernel for
it, e.g. FFTs and linear-algebra decompositions on CPU).

Run ``python -m apex_amp.amp.casting.docs_table OUT.md`` to write the markdown table.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterator

__all__ = ["Rule", "OpRule", "RULES", "DEVICES", "aten_rules", "python_rules", "render_markdown_table"]

DEVICES = ("cpu", "cuda")
_BOTH = frozenset(DEVICES)
_CUDA = frozenset({"cuda"})
_CPU = frozenset({"cpu"})
_NONE: frozenset = frozenset()


class Rule(enum.Enum):
    HALF = "half"  # cast floating inputs to the half dtype (fp16 or bf16)
    FP32 = "fp32"  # cast half inputs to float32
    PROMOTE = "promote"  # cast floating inputs to the widest floating dtype among them
    BANNED = "banned"  # raise, unless the user allowed it (then as FP32)


@dataclass(frozen=True)
class OpRule:
    """One row: ``name`` is what users call, ``aten`` the operators carrying the rule,
    ``inplace`` the in-place forms that must refuse a half input (an in-place op cannot
    change its tensor's dtype), ``python`` the ``(module, attribute)`` functions wrapped at
    the Python level, ``native`` the devices where torch already applies the rule."""

    name: str
    rule: Rule
    aten: tuple[str, ...] = ()
    inplace: tuple[str, ...] = ()
    python: tuple[tuple[str, str], ...] = ()
    native: frozenset = _NONE


def _half(name, *aten, native=_NONE):
    return OpRule(name, Rule.HALF, aten=aten, native=native)


def _fp32(name, *aten, inplace=(), python=(), native=_NONE):
    return OpRule(name, Rule.FP32, aten=aten, inplace=inplace, python=python, native=native)


def _promote(name, *aten, native=_NONE):
    return OpRule(name, Rule.PROMOTE, aten=aten, native=native)


_F = "torch.nn.functional"

RULES: tuple[OpRule, ...] = (
    # -- half: the ops that are fast and safe in half precision ------------------------
    _half("linear", "linear", native=_BOTH),
    _half("matmul, @", "matmul", native=_BOTH),
    _half("mm", "mm", native=_BOTH),
    _half("bmm", "bmm", native=_BOTH),
    _half("addmm", "addmm", native=_BOTH),
    _half("addbmm", "addbmm", native=_BOTH),
    _half("baddbmm", "baddbmm", native=_BOTH),
    _half("addmv", "addmv", native=_CUDA),
    _half("addr", "addr", native=_CUDA),
    _half("mv", "mv", native=_CUDA),
    _half("einsum", "einsum", native=_CUDA),
    _half("conv1d", "conv1d", "conv1d.padding", native=_CPU),
    _half("conv2d", "conv2d", "conv2d.padding", native=_CPU),
    _half("conv3d", "conv3d", "conv3d.padding", native=_CPU),
    _half("conv_transpose1d", "conv_transpose1d", native=_BOTH),
    _half("conv_transpose2d", "conv_transpose2d.input", native=_BOTH),
    _half("conv_transpose3d", "conv_transpose3d.input", native=_BOTH),
    _half("conv_tbc", "conv_tbc", native=_BOTH),
    _half("prelu", "prelu", native=_BOTH),
    _half("RNN, LSTM, GRU", "rnn_tanh.input", "rnn_tanh.data", "rnn_relu.input", "rnn_relu.data",
          "lstm.input", "lstm.data", "gru.input", "gru.data"),
    _half("RNNCell, LSTMCell, GRUCell", "rnn_tanh_cell", "rnn_relu_cell", "lstm_cell", "gru_cell"),
    _half("scaled_dot_product_attention", "scaled_dot_product_attention", native=_BOTH),
    # -- fp32: ops whose range or accuracy needs float32 ---------------------------------
    _fp32("exp", "exp", inplace=("exp_",), native=_CUDA),
    _fp32("expm1", "expm1", inplace=("expm1_",), native=_CUDA),
    _fp32("log", "log", inplace=("log_",), native=_CUDA),
    _fp32("log10", "log10", inplace=("log10_",), native=_CUDA),
    _fp32("log2", "log2", inplace=("log2_",), native=_CUDA),
    _fp32("log1p", "log1p", inplace=("log1p_",), native=_CUDA),
    _fp32("pow, **", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
          inplace=("pow_.Scalar", "pow_.Tensor"), native=_CUDA),
    _fp32("reciprocal", "reciprocal", inplace=("reciprocal_",), native=_CUDA),
    _fp32("rsqrt", "rsqrt", inplace=("rsqrt_",), native=_CUDA),
    _fp32("sinh", "sinh", inplace=("sinh_",), native=_CUDA),
    _fp32("cosh", "cosh", inplace=("cosh_",), native=_CUDA),
    _fp32("tan", "tan", inplace=("tan_",), native=_CUDA),
    _fp32("acos", "acos", inplace=("acos_",), native=_CUDA),
    _fp32("asin", "asin", inplace=("asin_",), native=_CUDA),
    _fp32("erfinv", "erfinv", inplace=("erfinv_",), native=_CUDA),
    _fp32("softmax", "softmax.int", native=_CUDA),
    _fp32("log_softmax", "log_softmax.int", native=_CUDA),
    _fp32("softmin", "softmax.int", native=_CUDA),
    _fp32("softplus", "softplus", native=_CUDA),
    _fp32("gelu", "gelu", inplace=("gelu_",)),
    _fp32("layer_norm", "layer_norm", native=_CUDA),
    _fp32("group_norm", "group_norm", native=_CUDA),
    _fp32("local_response_norm", python=((_F, "local_response_norm"),)),
    _fp32("normalize", python=((_F, "normalize"),)),
    _fp32("cosine_similarity", "cosine_similarity", native=_CUDA),
    _fp32("sum", "sum", "sum.dim_IntList", native=_CUDA),
    _fp32("mean", "mean", "mean.dim"),
    _fp32("prod", "prod", "prod.dim_int", native=_BOTH),
    _fp32("cumsum", "cumsum", inplace=("cumsum_",), native=_CUDA),
    _fp32("cumprod", "cumprod", inplace=("cumprod_",), native=_CUDA),
    _fp32("norm, linalg.norm, linalg.vector_norm, linalg.matrix_norm", "norm.Scalar", "norm.ScalarOpt_dim",
          "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "frobenius_norm.dim",
          # Not native on CUDA: torch's policy left linalg.matrix_norm in half there (torch 2.11, H200).
          "nuclear_norm", "nuclear_norm.dim"),
    _fp32("var, std, var_mean, std_mean", "var", "var.dim", "var.correction", "std", "std.dim",
          "std.correction", "var_mean.correction", "std_mean.correction"),
    _fp32("dist", "dist", native=_CUDA),
    _fp32("cdist", "cdist", native=_BOTH),
    _fp32("renorm", "renorm", inplace=("renorm_",), native=_CUDA),
    _fp32("logsumexp", "logsumexp", native=_CUDA),
    _fp32("interpolate, upsample", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
          "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
          "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d",
          "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa", native=_CUDA),
    _fp32("grid_sample", "grid_sampler", native=_CPU),  # torch's CUDA policy promotes it (half stays half)
    # every loss of torch.nn.functional
    _fp32("cross_entropy", "cross_entropy_loss", native=_CPU),
    _fp32("nll_loss", "nll_loss", "nll_loss2d", native=_BOTH),
    _fp32("mse_loss", "mse_loss", native=_BOTH),
    _fp32("l1_loss", "l1_loss", native=_BOTH),
    _fp32("smooth_l1_loss", "smooth_l1_loss", native=_BOTH),
    _fp32("huber_loss", "huber_loss", native=_BOTH),
    _fp32("kl_div", "kl_div", native=_BOTH),
    _fp32("binary_cross_entropy_with_logits", "binary_cross_entropy_with_logits", native=_BOTH),
    _fp32("ctc_loss", "ctc_loss.IntList", "ctc_loss.Tensor", native=_CPU),
    _fp32("poisson_nll_loss", "poisson_nll_loss", native=_BOTH),
    _fp32("gaussian_nll_loss", python=((_F, "gaussian_nll_loss"),)),
    _fp32("margin_ranking_loss", "margin_ranking_loss", native=_BOTH),
    _fp32("hinge_embedding_loss", "hinge_embedding_loss", native=_BOTH),
    _fp32("soft_margin_loss", "soft_margin_loss", native=_BOTH),
    _fp32("multilabel_soft_margin_loss", python=((_F, "multilabel_soft_margin_loss"),)),
    _fp32("multi_margin_loss", "multi_margin_loss", native=_BOTH),
    _fp32("multilabel_margin_loss", "multilabel_margin_loss", native=_BOTH),
    _fp32("cosine_embedding_loss", "cosine_embedding_loss", native=_BOTH),
    _fp32("triplet_margin_loss", "triplet_margin_loss", native=_BOTH),
    _fp32("triplet_margin_with_distance_loss", python=((_F, "triplet_margin_with_distance_loss"),)),
    # apex's rule: a half tensor is cast to fp32 before it moves to the CPU (numpy has no bf16).
    _fp32("Tensor.cpu", python=(("torch.Tensor", "cpu"),)),
    # -- promote: run in the widest floating dtype among the inputs ----------------------
    _promote("add, sub, mul, div", "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", native=_BOTH),
    _promote("addcmul, addcdiv", "addcmul", "addcdiv", native=_BOTH),
    _promote("atan2", "atan2", native=_BOTH),
    _promote("cross, linalg.cross", "cross", "linalg_cross"),
    _promote("dot", "dot"),
    _promote("bilinear", "bilinear", native=_CUDA),
    _promote("comparisons (eq, ne, lt, le, gt, ge)", "eq.Tensor", "ne.Tensor", "lt.Tensor", "le.Tensor",
             "gt.Tensor", "ge.Tensor", native=_BOTH),
    _promote("cat", "cat", native=_BOTH),
    _promote("stack", "stack", native=_BOTH),
    _promote("index_put", "index_put", native=_CUDA),
    _promote("scatter_add", "scatter_add", native=_CUDA),
    _promote("Tensor operators (+ - * / and reflected forms)", "add.Tensor", "sub.Tensor", "mul.Tensor",
             "div.Tensor", native=_BOTH),
    # -- banned --------------------------------------------------------------------------
    OpRule("binary_cross_entropy, nn.BCELoss", Rule.BANNED, aten=("binary_cross_entropy",)),
)


def aten_rules(device: str) -> Iterator[tuple[str, Rule]]:
    """(aten name, rule) pairs that need an apex_amp kernel on ``device``, each once."""
    seen: dict[str, Rule] = {}
    for row in RULES:
        if device in row.native:
            continue
        for name in row.aten:
            if seen.setdefault(name, row.rule) is not row.rule:
                raise RuntimeError(f"rules.py gives aten::{name} two rules ({seen[name].value} and "
                                   f"{row.rule.value}); every operator must have exactly one")
    return iter(seen.items())


def python_rules() -> Iterator[tuple[str, str, Rule]]:
    """(owner, attribute, rule) of the rows applied by wrapping a Python function.

    The owner is a module's dotted name, or a class's (``"torch.Tensor"``).
    """
    for row in RULES:
        for module_name, attribute in row.python:
            yield module_name, attribute, row.rule


def _python_name(owner: str, attribute: str) -> str:
    return f"F.{attribute}" if owner == _F else f"{owner.rpartition('.')[2]}.{attribute}"


def _where(row: OpRule) -> str:
    if row.python:
        return "Python wrapper of " + ", ".join(f"`{_python_name(*entry)}`" for entry in row.python)
    overridden = [d for d in DEVICES if d not in row.native]
    if not overridden:
        return "torch (both devices)"
    if len(overridden) == len(DEVICES):
        return "apex_amp (both devices)"
    return f"apex_amp ({', '.join(overridden)}), torch ({', '.join(sorted(row.native))})"


def render_markdown_table() -> str:
    """The rule table as markdown, one line per row of :data:`RULES`, for the O1 rules page."""
    lines = [
        "| Operation | O1 precision | aten operators | Applied by |",
        "|---|---|---|---|",
    ]
    for row in RULES:
        aten = ", ".join(f"`{name}`" for name in row.aten) or "-"
        if row.inplace:
            aten += " (in-place " + ", ".join(f"`{name}`" for name in row.inplace) + " raise on half input)"
        lines.append(f"| {row.name} | {row.rule.value} | {aten} | {_where(row)} |")
    return "\n".join(lines) + "\n"
