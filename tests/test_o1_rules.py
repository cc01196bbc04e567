"""Every row of the O1 rule table, exercised through the public torch APIs.

The tests are parametrised over ``rules.RULES`` itself: adding a row adds its tests, and a
row without a probe here fails ``test_every_row_has_a_probe``. What each row must do comes
from the independent statement below (HALF_ROWS, FP32_ROWS, ...), not from RULES. fp16 on CPU is very slow for
matmuls, so every shape is tiny.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apex_amp.amp import casting
from apex_amp.amp.casting.rules import RULES, Rule

HALF_DTYPES = [torch.float16, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")])]


class Inputs:
    """Makes the tensors of one probe call and remembers the leaves whose grads to check."""

    def __init__(self, device: str, half_dtype: torch.dtype) -> None:
        self.device, self.half_dtype = device, half_dtype
        self.leaves: list[torch.Tensor] = []
        self.generator = torch.Generator().manual_seed(0)

    def _random(self, shape, low, high):
        return torch.rand(shape, generator=self.generator) * (high - low) + low

    def P(self, *shape, low=-1.0, high=1.0):  # an fp32 weight
        leaf = torch.nn.Parameter(self._random(shape, low, high).to(self.device))
        self.leaves.append(leaf)
        return leaf

    def H(self, *shape, low=-1.0, high=1.0):  # a half activation that requires grad
        leaf = self._random(shape, low, high).to(self.device, self.half_dtype).requires_grad_()
        self.leaves.append(leaf)
        return leaf

    def X(self, *shape, low=-1.0, high=1.0):  # an fp32 activation without grad
        return self._random(shape, low, high).to(self.device)

    def long(self, *shape, high):
        return torch.randint(0, high, shape, generator=self.generator).to(self.device)

    def module(self, module):
        module = module.to(self.device)
        self.leaves.extend(module.parameters())
        return module


def _packed_lstm(i):
    packed = torch.nn.utils.rnn.pack_padded_sequence(i.X(3, 2, 4), [3, 2])
    return i.module(torch.nn.LSTM(4, 3))(packed)[0].data


# Each probe calls the row's operation the way users do. HALF rows get fp32 inputs, FP32 and
# BANNED rows half inputs, PROMOTE rows a mix of half and fp32.
PROBES = {
    "linear": [lambda i: F.linear(i.X(2, 4), i.P(3, 4), i.P(3)), lambda i: i.module(torch.nn.Linear(4, 3))(i.X(2, 4))],
    "matmul, @": [lambda i: i.X(2, 4) @ i.P(4, 3), lambda i: torch.matmul(i.X(2, 2, 4), i.P(4, 3))],
    "mm": [lambda i: torch.mm(i.X(2, 4), i.P(4, 3))],
    "bmm": [lambda i: torch.bmm(i.X(2, 2, 4), i.P(2, 4, 3))],
    "addmm": [lambda i: torch.addmm(i.P(3), i.X(2, 4), i.P(4, 3))],
    "addbmm": [lambda i: torch.addbmm(i.P(2, 3), i.X(2, 2, 4), i.P(2, 4, 3))],
    "baddbmm": [lambda i: torch.baddbmm(i.P(2, 2, 3), i.X(2, 2, 4), i.P(2, 4, 3))],
    "addmv": [lambda i: torch.addmv(i.P(3), i.P(3, 4), i.X(4))],
    "addr": [lambda i: torch.addr(i.P(3, 4), i.X(3), i.P(4))],
    "mv": [lambda i: torch.mv(i.P(3, 4), i.X(4))],
    "einsum": [lambda i: torch.einsum("ij,jk->ik", i.X(2, 4), i.P(4, 3))],
    "conv1d": [lambda i: F.conv1d(i.X(1, 2, 5), i.P(3, 2, 3), i.P(3)),
               lambda i: F.conv1d(i.X(1, 2, 5), i.P(3, 2, 3), padding="same")],
    "conv2d": [lambda i: i.module(torch.nn.Conv2d(2, 3, 3))(i.X(1, 2, 4, 4)),
               lambda i: F.conv2d(i.X(1, 2, 4, 4), i.P(3, 2, 3, 3), padding="same")],
    "conv3d": [lambda i: F.conv3d(i.X(1, 2, 3, 3, 3), i.P(2, 2, 2, 2, 2), i.P(2)),
               lambda i: F.conv3d(i.X(1, 2, 3, 3, 3), i.P(2, 2, 3, 3, 3), padding="same")],
    "conv_transpose1d": [lambda i: F.conv_transpose1d(i.X(1, 2, 4), i.P(2, 3, 3), i.P(3))],
    "conv_transpose2d": [lambda i: i.module(torch.nn.ConvTranspose2d(2, 3, 2))(i.X(1, 2, 3, 3))],
    "conv_transpose3d": [lambda i: F.conv_transpose3d(i.X(1, 2, 2, 2, 2), i.P(2, 2, 2, 2, 2))],
    "conv_tbc": [lambda i: torch.conv_tbc(i.X(5, 1, 2), i.P(3, 2, 4), i.P(4))],
    "prelu": [lambda i: F.prelu(i.X(2, 3), i.P(1))],
    "RNN, LSTM, GRU": [lambda i: i.module(torch.nn.LSTM(4, 3))(i.X(2, 1, 4))[0],
                       lambda i: i.module(torch.nn.GRU(4, 3, batch_first=True))(i.X(1, 2, 4))[0],
                       lambda i: i.module(torch.nn.RNN(4, 3, nonlinearity="relu"))(i.X(2, 1, 4))[0],
                       lambda i: i.module(torch.nn.RNN(4, 3, num_layers=2, bidirectional=True))(i.X(2, 1, 4))[0],
                       _packed_lstm],
    "RNNCell, LSTMCell, GRUCell": [lambda i: i.module(torch.nn.LSTMCell(4, 3))(i.X(2, 4))[0],
                                   lambda i: i.module(torch.nn.GRUCell(4, 3))(i.X(2, 4)),
                                   lambda i: i.module(torch.nn.RNNCell(4, 3))(i.X(2, 4)),
                                   lambda i: i.module(torch.nn.RNNCell(4, 3, nonlinearity="relu"))(i.X(2, 4))],
    "scaled_dot_product_attention": [lambda i: F.scaled_dot_product_attention(i.P(1, 2, 3, 4), i.X(1, 2, 3, 4),
                                                                              i.X(1, 2, 3, 4))],
    "exp": [lambda i: torch.exp(i.H(2, 3)), lambda i: i.H(2, 3).exp()],
    "expm1": [lambda i: torch.expm1(i.H(2, 3))],
    "log": [lambda i: torch.log(i.H(2, 3, low=0.5, high=2))],
    "log10": [lambda i: torch.log10(i.H(2, 3, low=0.5, high=2))],
    "log2": [lambda i: i.H(2, 3, low=0.5, high=2).log2()],
    "log1p": [lambda i: torch.log1p(i.H(2, 3, low=0, high=1))],
    "pow, **": [lambda i: torch.pow(i.H(2, 3), 2), lambda i: i.H(2, 3) ** 2,
                lambda i: i.H(2, 3, low=0.5, high=2) ** i.H(2, 3), lambda i: 2 ** i.H(2, 3)],
    "reciprocal": [lambda i: torch.reciprocal(i.H(2, 3, low=0.5, high=2))],
    "rsqrt": [lambda i: torch.rsqrt(i.H(2, 3, low=0.5, high=2))],
    "sinh": [lambda i: torch.sinh(i.H(2, 3))],
    "cosh": [lambda i: torch.cosh(i.H(2, 3))],
    "tan": [lambda i: torch.tan(i.H(2, 3))],
    "acos": [lambda i: torch.acos(i.H(2, 3, low=-0.5, high=0.5))],
    "asin": [lambda i: torch.asin(i.H(2, 3, low=-0.5, high=0.5))],
    "erfinv": [lambda i: torch.erfinv(i.H(2, 3, low=-0.5, high=0.5))],
    "softmax": [lambda i: F.softmax(i.H(2, 3), dim=-1), lambda i: torch.softmax(i.H(2, 3), -1),
                lambda i: torch.nn.Softmax(dim=-1)(i.H(2, 3))],
    "log_softmax": [lambda i: F.log_softmax(i.H(2, 3), dim=-1), lambda i: i.H(2, 3).log_softmax(-1)],
    "softmin": [lambda i: F.softmin(i.H(2, 3), dim=-1)],
    "softplus": [lambda i: F.softplus(i.H(2, 3))],
    "gelu": [lambda i: F.gelu(i.H(2, 3)), lambda i: torch.nn.GELU(approximate="tanh")(i.H(2, 3))],
    "layer_norm": [lambda i: F.layer_norm(i.H(2, 4), (4,), i.P(4), i.P(4)),
                   lambda i: i.module(torch.nn.LayerNorm(4))(i.H(2, 4))],
    "group_norm": [lambda i: i.module(torch.nn.GroupNorm(2, 4))(i.H(2, 4, 3))],
    "local_response_norm": [lambda i: F.local_response_norm(i.H(1, 4, 3, 3), 2)],
    "normalize": [lambda i: F.normalize(i.H(2, 4), dim=-1)],
    "cosine_similarity": [lambda i: F.cosine_similarity(i.H(2, 4), i.H(2, 4))],
    "sum": [lambda i: torch.sum(i.H(2, 3)), lambda i: i.H(2, 3).sum(dim=0)],
    "mean": [lambda i: torch.mean(i.H(2, 3)), lambda i: i.H(2, 3).mean(dim=0)],
    "prod": [lambda i: torch.prod(i.H(2, 3)), lambda i: i.H(2, 3).prod(dim=0)],
    "cumsum": [lambda i: torch.cumsum(i.H(2, 3), 1)],
    "cumprod": [lambda i: i.H(2, 3).cumprod(1)],
    "norm, linalg.norm, linalg.vector_norm, linalg.matrix_norm": [
        lambda i: torch.norm(i.H(2, 3)), lambda i: i.H(2, 3).norm(dim=0),
        lambda i: torch.linalg.norm(i.H(2, 3)), lambda i: torch.linalg.vector_norm(i.H(2, 3), ord=3),
        lambda i: torch.linalg.matrix_norm(i.H(3, 3)), lambda i: torch.linalg.matrix_norm(i.H(3, 3), ord="nuc"),
        lambda i: torch.norm(i.H(2, 3), p="fro", dim=(0, 1))],
    "var, std, var_mean, std_mean": [lambda i: torch.var(i.H(2, 3)), lambda i: i.H(2, 3).std(dim=0),
                                     lambda i: torch.var_mean(i.H(2, 3))[0], lambda i: torch.std_mean(i.H(2, 3))[1]],
    "dist": [lambda i: torch.dist(i.H(2, 3), i.H(2, 3))],
    "cdist": [lambda i: torch.cdist(i.H(2, 3), i.H(2, 3))],
    "renorm": [lambda i: torch.renorm(i.H(2, 3), 2, 0, 0.5)],
    "logsumexp": [lambda i: torch.logsumexp(i.H(2, 3), -1)],
    "interpolate, upsample": [
        lambda i: F.interpolate(i.H(1, 1, 3), scale_factor=2),
        lambda i: F.interpolate(i.H(1, 1, 3, 3), scale_factor=2, mode="bilinear"),
        lambda i: F.interpolate(i.H(1, 1, 3, 3), size=(4, 4), mode="bicubic"),
        lambda i: F.interpolate(i.H(1, 1, 3, 3), scale_factor=2, mode="nearest-exact"),
        lambda i: F.interpolate(i.H(1, 1, 2, 2, 2), scale_factor=2, mode="trilinear"),
        lambda i: F.interpolate(i.H(1, 1, 4, 4), size=(2, 2), mode="bilinear", antialias=True)],
    "grid_sample": [lambda i: F.grid_sample(i.H(1, 1, 3, 3), i.H(1, 2, 2, 2, low=-0.9, high=0.9),
                                            align_corners=False)],
    "cross_entropy": [lambda i: F.cross_entropy(i.H(2, 3), i.long(2, high=3)),
                      lambda i: torch.nn.CrossEntropyLoss(label_smoothing=0.1)(i.H(2, 3), i.long(2, high=3))],
    "nll_loss": [lambda i: F.nll_loss(i.H(2, 3), i.long(2, high=3)),
                 lambda i: F.nll_loss(i.H(1, 3, 2, 2), i.long(1, 2, 2, high=3))],
    "mse_loss": [lambda i: F.mse_loss(i.H(2, 3), i.H(2, 3))],
    "l1_loss": [lambda i: F.l1_loss(i.H(2, 3), i.H(2, 3))],
    "smooth_l1_loss": [lambda i: F.smooth_l1_loss(i.H(2, 3), i.H(2, 3))],
    "huber_loss": [lambda i: F.huber_loss(i.H(2, 3), i.H(2, 3))],
    "kl_div": [lambda i: F.kl_div(i.H(2, 3), i.H(2, 3, low=0.1, high=1), reduction="batchmean")],
    "binary_cross_entropy_with_logits": [lambda i: F.binary_cross_entropy_with_logits(i.H(2, 3), i.H(2, 3, low=0, high=1))],
    "ctc_loss": [lambda i: F.ctc_loss(i.H(5, 1, 3).log_softmax(-1), i.long(1, 2, high=2) + 1, [5], [2])],
    "poisson_nll_loss": [lambda i: F.poisson_nll_loss(i.H(2, 3), i.H(2, 3, low=0, high=2))],
    "gaussian_nll_loss": [lambda i: F.gaussian_nll_loss(i.H(2, 3), i.H(2, 3), i.H(2, 3, low=0.5, high=1))],
    "margin_ranking_loss": [lambda i: F.margin_ranking_loss(i.H(3), i.H(3), torch.tensor([1.0, -1.0, 1.0],
                                                                                          device=i.device))],
    "hinge_embedding_loss": [lambda i: F.hinge_embedding_loss(i.H(3), torch.tensor([1.0, -1.0, 1.0],
                                                                                    device=i.device))],
    "soft_margin_loss": [lambda i: F.soft_margin_loss(i.H(3), torch.tensor([1.0, -1.0, 1.0], device=i.device))],
    "multilabel_soft_margin_loss": [lambda i: F.multilabel_soft_margin_loss(i.H(2, 3), i.H(2, 3, low=0, high=1))],
    "multi_margin_loss": [lambda i: F.multi_margin_loss(i.H(2, 3), i.long(2, high=3))],
    "multilabel_margin_loss": [lambda i: F.multilabel_margin_loss(i.H(2, 3), i.long(2, 3, high=3))],
    "cosine_embedding_loss": [lambda i: F.cosine_embedding_loss(i.H(2, 3), i.H(2, 3),
                                                                torch.tensor([1.0, -1.0], device=i.device))],
    "triplet_margin_loss": [lambda i: F.triplet_margin_loss(i.H(2, 3), i.H(2, 3), i.H(2, 3))],
    "triplet_margin_with_distance_loss": [lambda i: F.triplet_margin_with_distance_loss(i.H(2, 3), i.H(2, 3), i.H(2, 3))],
    "Tensor.cpu": [lambda i: i.H(2, 3).cpu(), lambda i: torch.Tensor.cpu(i.H(3))],
    "add, sub, mul, div": [lambda i: torch.add(i.H(2, 3), i.P(2, 3)), lambda i: torch.sub(i.P(2, 3), i.H(2, 3)),
                           lambda i: torch.mul(i.H(2, 3), i.P(2, 3)), lambda i: torch.div(i.H(2, 3), i.P(2, 3, low=1, high=2))],
    "addcmul, addcdiv": [lambda i: torch.addcmul(i.H(2, 3), i.P(2, 3), i.H(2, 3)),
                         lambda i: torch.addcdiv(i.P(2, 3), i.H(2, 3), i.H(2, 3, low=1, high=2))],
    "atan2": [lambda i: torch.atan2(i.H(2, 3), i.P(2, 3))],
    "cross, linalg.cross": [lambda i: torch.cross(i.H(2, 3), i.P(2, 3), dim=1),
                            lambda i: torch.linalg.cross(i.P(2, 3), i.H(2, 3))],
    "dot": [lambda i: torch.dot(i.H(3), i.P(3))],
    "bilinear": [lambda i: F.bilinear(i.H(2, 3), i.H(2, 4), i.P(5, 3, 4), i.P(5))],
    "comparisons (eq, ne, lt, le, gt, ge)": [lambda i: i.H(2, 3) < i.P(2, 3), lambda i: torch.eq(i.P(2, 3), i.H(2, 3))],
    "cat": [lambda i: torch.cat([i.H(2, 3), i.P(2, 3)])],
    "stack": [lambda i: torch.stack([i.P(2, 3), i.H(2, 3)])],
    "index_put": [lambda i: i.P(4, 3).index_put((torch.tensor([0, 2], device=i.device),), i.H(2, 3))],
    "scatter_add": [lambda i: i.P(4, 3).scatter_add(0, i.long(2, 3, high=4), i.H(2, 3))],
    "Tensor operators (+ - * / and reflected forms)": [
        lambda i: i.H(2, 3) + i.P(2, 3), lambda i: i.P(2, 3) - i.H(2, 3), lambda i: i.H(2, 3) * i.P(2, 3),
        lambda i: i.H(2, 3) / i.P(2, 3, low=1, high=2), lambda i: i.P(2, 3).__radd__(i.H(2, 3))],
    "binary_cross_entropy, nn.BCELoss": [
        lambda i: F.binary_cross_entropy(torch.sigmoid(i.H(2, 3)), i.H(2, 3, low=0, high=1)),
        lambda i: torch.nn.BCELoss()(torch.sigmoid(i.H(2, 3)), i.H(2, 3, low=0, high=1))],
}

ROW_NAMES = [row.name for row in RULES]
ROWS = {row.name: row for row in RULES}
CASES = [pytest.param(row.name, k, id=f"{row.name}-{k}") for row in RULES for k in range(len(PROBES.get(row.name, [None])))]

# What each row must do, written down here independently of rules.py (ARCHITECTURE.md's rules,
# which are apex's lists): matrix products and convolutions in half; exp/log/pow, softmax,
# norms, reductions and every loss in fp32; mixed elementwise inputs promote to the widest;
# binary_cross_entropy banned. The output dtype each probe must produce follows from this.
HALF_ROWS = {
    "linear", "matmul, @", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "addr", "mv", "einsum",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
    "prelu", "RNN, LSTM, GRU", "RNNCell, LSTMCell, GRUCell", "scaled_dot_product_attention",
}
FP32_ROWS = {
    "exp", "expm1", "log", "log10", "log2", "log1p", "pow, **", "reciprocal", "rsqrt", "sinh", "cosh", "tan",
    "acos", "asin", "erfinv", "softmax", "log_softmax", "softmin", "softplus", "gelu", "layer_norm",
    "group_norm", "local_response_norm", "normalize", "cosine_similarity", "sum", "mean", "prod", "cumsum",
    "cumprod", "norm, linalg.norm, linalg.vector_norm, linalg.matrix_norm", "var, std, var_mean, std_mean",
    "dist", "cdist", "renorm", "logsumexp", "interpolate, upsample", "grid_sample", "cross_entropy",
    "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
    "binary_cross_entropy_with_logits", "ctc_loss", "poisson_nll_loss", "gaussian_nll_loss",
    "margin_ranking_loss", "hinge_embedding_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
    "multi_margin_loss", "multilabel_margin_loss", "cosine_embedding_loss", "triplet_margin_loss",
    "triplet_margin_with_distance_loss", "Tensor.cpu",
}
PROMOTE_ROWS = {
    "add, sub, mul, div", "addcmul, addcdiv", "atan2", "cross, linalg.cross", "dot", "bilinear",
    "comparisons (eq, ne, lt, le, gt, ge)", "cat", "stack", "index_put", "scatter_add",
    "Tensor operators (+ - * / and reflected forms)",
}
BANNED_ROWS = {"binary_cross_entropy, nn.BCELoss"}


def expected_dtype(name: str, half_dtype: torch.dtype) -> torch.dtype:
    """The output dtype of a row's probe (PROMOTE probes mix half and fp32, so fp32 is the widest)."""
    if name.startswith("comparisons"):
        return torch.bool
    return half_dtype if name in HALF_ROWS else torch.float32


def test_the_rule_table_matches_the_independent_statement_of_the_rules():
    stated = {**{n: Rule.HALF for n in HALF_ROWS}, **{n: Rule.FP32 for n in FP32_ROWS},
              **{n: Rule.PROMOTE for n in PROMOTE_ROWS}, **{n: Rule.BANNED for n in BANNED_ROWS}}
    assert {row.name: row.rule for row in RULES} == stated


@pytest.fixture
def o1():
    active = []

    def start(half_dtype, **kwargs):
        casting.activate(half_dtype, **kwargs)
        active.append(True)

    yield start
    if active:
        casting.deactivate()


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _run_probe(name, k, device, half_dtype):
    inputs = Inputs(device, half_dtype)
    output = _first(PROBES[name][k](inputs))
    return inputs, output


@pytest.mark.parametrize("name", ROW_NAMES)
def test_every_row_has_a_probe(name):
    assert name in PROBES, f"add a probe for the new rule row {name!r} to PROBES in {__file__}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name,k", CASES)
def test_row_output_dtype_and_weight_grads(o1, name, k, half_dtype, device):
    row = ROWS[name]
    o1(half_dtype, allow_banned=name in BANNED_ROWS)
    inputs, output = _run_probe(name, k, device, half_dtype)
    if row.name.startswith("comparisons"):
        assert output.dtype == torch.bool
        return
    assert output.dtype == expected_dtype(name, half_dtype)
    if output.requires_grad:
        output.float().sum().backward()
    for leaf in inputs.leaves:
        assert leaf.grad is not None, f"no gradient reached a {leaf.dtype} input of {name}"
        assert leaf.grad.dtype == leaf.dtype  # fp32 weights get fp32 gradients
        assert torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=["fp16", "bf16"])
def test_comparison_runs_in_fp32_with_mixed_inputs(o1, half_dtype):
    o1(half_dtype)
    exact = torch.tensor([1.0 + 2 ** -12])  # rounds to 1.0 in both half dtypes
    near = torch.tensor([1.0]).to(half_dtype)
    assert not torch.equal(near == exact, torch.tensor([True]))  # compared in fp32, not half
    assert bool(near < exact)


@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", [r.name for r in RULES if r.rule is Rule.PROMOTE])
def test_promote_row_keeps_half_when_all_inputs_are_half(o1, name, half_dtype):
    o1(half_dtype)
    inputs = Inputs("cpu", half_dtype)
    inputs.P = inputs.H  # every floating input half
    output = _first(PROBES[name][0](inputs))
    assert output.dtype == (torch.bool if name.startswith("comparisons") else half_dtype)


@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("k", range(len(PROBES["binary_cross_entropy, nn.BCELoss"])))
def test_banned_op_raises_with_advice(o1, k, half_dtype):
    o1(half_dtype)
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):  # as apex (a RuntimeError too)
        _run_probe("binary_cross_entropy, nn.BCELoss", k, "cpu", half_dtype)


@pytest.mark.parametrize("name,k", [c for c in CASES if "cpu" in ROWS[c.values[0]].native])
def test_native_cpu_claims_hold_under_plain_torch_autocast(name, k):
    """Rows marked native on CPU get their rule from torch alone (no apex_amp kernel)."""
    assert not casting.is_active()
    with torch.autocast("cpu", torch.bfloat16):
        _, output = _run_probe(name, k, "cpu", torch.bfloat16)
    assert output.dtype == expected_dtype(name, torch.bfloat16)


@pytest.mark.parametrize("name", [r.name for r in RULES if "cuda" in r.native and r.rule is not Rule.PROMOTE])
def test_native_cuda_claims_name_a_torch_autocast_kernel(name):
    """Rows marked native on CUDA rely on torch's AutocastCUDA kernel, which must exist."""
    for aten in ROWS[name].aten:
        base, _, overload = aten.partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "AutocastCUDA")
        assert has_kernel, f"torch has no AutocastCUDA policy for aten::{aten}"
