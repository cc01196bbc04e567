"""Diagnostics: overflow reports, underflow reports and the shape report (amp.inspect, CLI)."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from apex_amp import amp
from _diag_models import BAD_SPECS
from apex_amp.__main__ import main
from apex_amp.amp import casting
from apex_amp.amp.diagnostics import FindingKind
from apex_amp.amp.diagnostics.shapes import _MODULE_OP, _rule_of, module_rule
from apex_amp.amp.diagnostics.underflow import flush_threshold, overflow_threshold
from apex_amp.optimizers import FusedAdam

TESTS = Path(__file__).resolve().parent
TARGET = "encoder.0.weight"


def named_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(
        encoder=nn.Sequential(nn.Linear(8, 16), nn.ReLU()),
        head=nn.Linear(16, 4),
    ))


def make_optimizer(kind: str, params):
    return FusedAdam(params, lr=1e-3) if kind == "FusedAdam" else torch.optim.SGD(params, lr=0.1)


def poison(param: torch.Tensor, inf: int, nan: int):
    """A grad hook writing ``inf`` infs and ``nan`` NaNs into the gradient of ``param``."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        flat = grad.view(-1)
        flat[:inf] = float("inf")
        flat[inf:inf + nan] = float("nan")
        return grad

    return param.register_hook(hook)


def train_step(model, optimizer, x):
    optimizer.zero_grad(set_to_none=True)
    with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()


# ---- overflow report -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_report_names_the_parameter_with_the_non_finite_gradient(level, kind, caplog):
    model = named_model()
    optimizer = make_optimizer(kind, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0, overflow_report=True)
    x = torch.randn(4, 8)
    train_step(model, optimizer, x)  # step 0: clean
    assert amp.last_overflow() is None
    weight = dict(model.named_parameters())[TARGET]
    before = [p.detach().clone() for p in amp.master_params(optimizer)]
    handle = poison(weight, inf=3, nan=2)
    with caplog.at_level(logging.DEBUG, logger="apex_amp"):
        train_step(model, optimizer, x)  # step 1: overflows
    handle.remove()

    report = amp.last_overflow(optimizer)
    assert report is not None
    assert report.step == 1 and report.loss_id == 0
    assert report.loss_scale == 2.0**16
    assert report.names == [TARGET]
    (entry,) = report.params
    assert (entry.inf, entry.nan, entry.numel) == (3, 2, weight.numel())
    assert TARGET in caplog.text and "overflow at step 1" in caplog.text
    assert amp.step_was_skipped(optimizer)
    for old, new in zip(before, amp.master_params(optimizer)):
        assert torch.equal(old, new)  # the report changed nothing: the step was skipped as usual

    train_step(model, optimizer, x)  # step 2: clean again; the report of step 1 stays the last one
    assert amp.last_overflow() == report
    assert amp.overflow_reports() == [report]


def test_overflow_report_with_several_models_prefixes_the_names():
    models = [named_model(), named_model()]
    optimizer = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    models, optimizer = amp.initialize(models, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                       verbosity=0, overflow_report=True)
    handle = poison(models[1].head.bias, inf=1, nan=0)
    optimizer.zero_grad()
    loss = models[0](torch.randn(2, 8)).float().sum() + models[1](torch.randn(2, 8)).float().sum()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    handle.remove()
    assert amp.last_overflow().names == ["model1.head.bias"]


def test_overflow_report_covers_gradients_accumulated_with_delay_unscale():
    model = named_model()
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                      verbosity=0, overflow_report=True)
    optimizer.zero_grad()
    for micro_step in range(3):
        handle = poison(model.head.weight, inf=0, nan=1) if micro_step == 0 else None
        with amp.scale_loss(model(torch.randn(2, 8)).float().mean(), optimizer,
                            delay_unscale=micro_step < 2) as scaled_loss:
            scaled_loss.backward()
        if handle is not None:
            handle.remove()
            assert amp.last_overflow() is None  # delayed passes are checked with the last one
    optimizer.step()
    report = amp.last_overflow()
    assert report.names == ["head.weight"] and report.params[0].nan == 1 and report.step == 0


def test_overflow_report_is_none_after_clean_steps():
    model = named_model()
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                                      verbosity=0, overflow_report=True)
    for _ in range(3):
        train_step(model, optimizer, torch.randn(4, 8))
    assert amp.last_overflow() is None
    assert amp.overflow_reports() == []


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _scale_loss_ops(overflow_report: bool) -> list[str]:
    model = named_model()
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                      verbosity=0, overflow_report=overflow_report)
    loss = model(torch.randn(4, 8)).float().mean()  # small gradients: a clean pass at scale 2**16
    with _CountOps() as counter:
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
    return counter.ops


def test_overflow_report_off_costs_no_host_read_and_says_how_to_turn_it_on():
    ops_off = _scale_loss_ops(overflow_report=False)
    with pytest.raises(RuntimeError, match="overflow_report=True"):
        amp.last_overflow()
    with pytest.raises(RuntimeError, match="overflow_report=True"):
        amp.overflow_reports()
    ops_on = _scale_loss_ops(overflow_report=True)
    host_read = "aten._local_scalar_dense.default"
    assert host_read not in ops_off
    assert host_read in ops_on  # the test can tell: reports on do read the flag
    assert [op for op in ops_on if op != host_read] == ops_off  # and nothing else differs on a clean pass


def test_overflow_report_needs_gradient_checks():
    model = named_model()
    with pytest.raises(ValueError, match="skip_nonfinite=True"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O3",
                       verbosity=0, overflow_report=True)
    with pytest.raises(ValueError, match="overflow_report must be True or False"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                       verbosity=0, overflow_report="yes")


# ---- underflow report ----------------------------------------------------------------------

def _reference(grad: torch.Tensor, scale: float, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(non-zero, flushed at scale, flushed unscaled, overflowed) by really casting to ``dtype``."""
    g = grad.float()
    nonzero = torch.isfinite(g) & (g != 0)
    scaled = (g * scale).to(dtype)
    unscaled = g.to(dtype)
    return (int(nonzero.sum()), int((nonzero & (scaled == 0)).sum()), int((nonzero & (unscaled == 0)).sum()),
            int((torch.isfinite(g) & torch.isinf(scaled)).sum()))


def _spread_grads(generator: torch.Generator, n: int) -> torch.Tensor:
    # Magnitudes log-uniform over 2**-48 .. 2**16, random signs, some exact zeros and non-finite values.
    exponent = torch.rand(n, generator=generator) * 64 - 48
    sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
    values = sign * torch.exp2(exponent)
    values[::17] = 0.0
    values[1] = float("inf")
    values[2] = float("nan")
    return values


def _f32_up(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def _f32_down(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(0)))


BOUNDARIES = [  # float32 values around the rounding boundaries of fp16 and bf16
    2.0**-25,  # exactly half the smallest fp16 subnormal: a tie, rounds to 0
    _f32_up(2.0**-25),  # just above: rounds up to 2**-24
    _f32_down(2.0**-25),
    2.0**-24, 65504.0, _f32_down(65520.0), 65520.0, 65536.0,
    2.0**-134, _f32_up(2.0**-134), 2.0**-133,  # bf16 counterparts
    -(2.0**-25), -_f32_up(2.0**-25),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 2.0**8, 2.0**16, 1000.0])
def test_underflow_fraction_matches_a_real_cast(dtype, scale):
    generator = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(40, 50), nn.Linear(50, len(BOUNDARIES)))
    for param in model.parameters():
        param.grad = _spread_grads(generator, param.numel()).reshape(param.shape)
    model[1].bias.grad = torch.tensor(BOUNDARIES, dtype=torch.float32)
    report = amp.underflow_report(model, loss_scale=scale, dtype=dtype)
    assert [layer.name for layer in report.layers] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    for layer, param in zip(report.layers, model.parameters()):
        nonzero, flushed, flushed_unscaled, overflowed = _reference(param.grad, scale, dtype)
        assert (layer.nonzero, layer.flushed, layer.flushed_unscaled, layer.overflowed) == (
            nonzero, flushed, flushed_unscaled, overflowed)
        assert layer.fraction == pytest.approx(flushed / nonzero)
        # histogram of floor(log2|g|) over the finite non-zero values, by numpy in float64
        g = param.grad.double().numpy()
        g = g[np.isfinite(g) & (g != 0)]
        exponents = np.floor(np.log2(np.abs(g))).astype(int)
        expected = {int(e): int(c) for e, c in zip(*np.unique(exponents, return_counts=True))}
        got = {e: c for e, c in zip(report.exponents, layer.histogram) if c}
        assert got == expected
    assert sum(report.histogram) == sum(layer.nonzero for layer in report.layers)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=64),
    log2_scale=st.integers(min_value=-4, max_value=40),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_underflow_counts_match_a_real_cast_for_any_values(values, log2_scale, dtype):
    grad = torch.tensor(values + BOUNDARIES, dtype=torch.float32)
    param = nn.Parameter(torch.zeros_like(grad))
    param.grad = grad
    holder = nn.Module()
    holder.p = param
    (layer,) = amp.underflow_report(holder, loss_scale=2.0**log2_scale, dtype=dtype).layers
    assert (layer.nonzero, layer.flushed, layer.flushed_unscaled, layer.overflowed) == _reference(
        param.grad, 2.0**log2_scale, dtype)


def test_thresholds_are_the_rounding_boundaries():
    for dtype in (torch.float16, torch.bfloat16):
        flush, overflow = flush_threshold(dtype), overflow_threshold(dtype)
        edge = torch.tensor([flush, _f32_up(flush), overflow, _f32_down(overflow)])
        assert edge.to(dtype).tolist()[:2] == [0.0, torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps]
        assert math.isinf(edge.to(dtype)[2]) and math.isfinite(edge.to(dtype)[3])
    assert flush_threshold(torch.float16) == 2.0**-25 and overflow_threshold(torch.float16) == 65520.0


def test_underflow_report_reads_the_masters_and_the_current_scale_under_o2():
    model = named_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    with amp.scale_loss(model(torch.randn(4, 8)).float().sum() * 1e-6, optimizer) as scaled_loss:
        scaled_loss.backward()
    report = amp.underflow_report(model)
    assert report.loss_scale == amp.loss_scale() == 2.0**16
    masters = list(amp.master_params(optimizer))
    assert [layer.name for layer in report.layers] == [name for name, _ in model.named_parameters()]
    for layer, master in zip(report.layers, masters):
        assert master.dtype == torch.float32 and master.grad is not None
        assert (layer.nonzero, layer.flushed, layer.flushed_unscaled, layer.overflowed) == _reference(
            master.grad, 2.0**16, torch.float16)
    by_optimizer = amp.underflow_report(optimizer)
    assert [layer.flushed for layer in by_optimizer.layers] == [layer.flushed for layer in report.layers]


def test_underflow_report_rejects_bad_input():
    model = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="no gradients"):
        amp.underflow_report(model, loss_scale=1.0)
    model.weight.grad = torch.ones(4, 4)
    with pytest.raises(ValueError, match="loss_scale"):
        amp.underflow_report(model, loss_scale=0.0)
    with pytest.raises(ValueError, match="dtype"):
        amp.underflow_report(model, loss_scale=1.0, dtype=torch.float32)
    with pytest.raises(TypeError, match="nn.Module or an optimizer"):
        amp.underflow_report([model], loss_scale=1.0)


def test_save_histogram_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    model = nn.Linear(16, 16)
    model.weight.grad = _spread_grads(torch.Generator().manual_seed(0), 256).reshape(16, 16)
    report = amp.underflow_report(model, loss_scale=2.0**16)
    assert report.fraction_unscaled > report.fraction > 0
    for layer, name in ((None, "all.png"), ("weight", "weight.png")):
        amp.save_histogram(report, tmp_path / name, layer=layer)
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no parameter named"):
        amp.save_histogram(report, tmp_path / "x.png", layer="nope")


# ---- shape report --------------------------------------------------------------------------

def _snapshot(model: nn.Module):
    return ({k: (v.dtype, v.clone()) for k, v in model.state_dict().items()},
            [(m._forward_hooks.copy(), m._forward_pre_hooks.copy()) for m in model.modules()])


def test_inspect_flags_misaligned_layers_and_o1_fp32_layers_without_changing_the_model():
    sys.path.insert(0, str(TESTS))
    from _diag_models import misaligned

    model = misaligned()
    before = _snapshot(model)
    report = amp.inspect(model, opt_level="O1")
    after = _snapshot(model)
    assert before[1] == after[1]
    assert before[0].keys() == after[0].keys()
    for key, (dtype, value) in before[0].items():
        assert after[0][key][0] == dtype and torch.equal(after[0][key][1], value)

    alignment = {f.module: f.message for f in report.of_kind(FindingKind.ALIGNMENT)}
    assert set(alignment) == {"0", "3"}
    assert "in_features=30" in alignment["3"] and "out_features" not in alignment["3"]
    assert "in_channels=3" in alignment["0"] and "out_channels=20" in alignment["0"]
    fp32 = report.of_kind(FindingKind.FP32_OP)
    assert [(f.module, "fp32 under O1" in f.message) for f in fp32] == [("4", True)]
    assert "4 modules" not in report.summary() and "2 alignment" in report.summary()
    text = str(report)
    assert "LayerNorm" in text and text.splitlines()[-1] == report.summary()


def test_inspect_reports_what_o2_and_o3_do_to_batchnorm():
    sys.path.insert(0, str(TESTS))
    from _diag_models import misaligned

    (o2,) = amp.inspect(misaligned(), opt_level="O2").of_kind(FindingKind.BATCHNORM)
    assert o2.module == "1" and "kept fp32" in o2.message and "keep_batchnorm_fp32=True" in o2.message
    (o3,) = amp.inspect(misaligned(), opt_level="O3", half_dtype=torch.bfloat16).of_kind(FindingKind.BATCHNORM)
    assert "cast to bfloat16" in o3.message
    (o2_cast,) = amp.inspect(misaligned(), opt_level="O2", keep_batchnorm_fp32=False).of_kind(FindingKind.BATCHNORM)
    assert "cast to float16" in o2_cast.message


def test_inspect_other_findings():
    model = nn.Sequential(nn.Linear(64, 32), nn.Softmax(dim=-1), nn.BCELoss())
    model[0].half()
    report = amp.inspect(model)
    assert report.of_kind(FindingKind.ALIGNMENT) == []
    (half,) = report.of_kind(FindingKind.ALREADY_HALF)
    assert half.module == "0" and "weight (float16)" in half.message
    assert [f.module for f in report.of_kind(FindingKind.FP32_OP)] == ["1"]
    assert [f.module for f in report.of_kind(FindingKind.BANNED)] == ["2"]
    assert amp.inspect(model, opt_level="O2").of_kind(FindingKind.BANNED) == []
    data = json.loads(report.to_json())
    assert data["opt_level"] == "O1" and {f["kind"] for f in data["findings"]} == {"already-half", "fp32-op", "banned"}
    with pytest.raises(ValueError, match="opt_level"):
        amp.inspect(model, opt_level="O4")
    with pytest.raises(TypeError, match="nn.Module"):
        amp.inspect("model")


def _module_call(module_type, h):
    """A module of ``module_type`` and the arguments of one forward call (float inputs from ``h``)."""
    sign = torch.tensor([1.0, -1.0, 1.0])
    targets = {
        nn.LayerNorm: (nn.LayerNorm(4), (h(2, 4),)),
        nn.GroupNorm: (nn.GroupNorm(2, 4), (h(2, 4, 3),)),
        nn.LocalResponseNorm: (nn.LocalResponseNorm(2), (h(1, 4, 3, 3),)),
        nn.Softmax: (nn.Softmax(-1), (h(2, 4),)),
        nn.Softmax2d: (nn.Softmax2d(), (h(1, 3, 2, 2),)),
        nn.LogSoftmax: (nn.LogSoftmax(-1), (h(2, 4),)),
        nn.Softmin: (nn.Softmin(-1), (h(2, 4),)),
        nn.Softplus: (nn.Softplus(), (h(2, 4),)),
        nn.GELU: (nn.GELU(), (h(2, 4),)),
        nn.CosineSimilarity: (nn.CosineSimilarity(), (h(2, 4), h(2, 4))),
        nn.PairwiseDistance: (nn.PairwiseDistance(), (h(2, 4), h(2, 4))),
        nn.Upsample: (nn.Upsample(scale_factor=2, mode="bilinear"), (h(1, 1, 2, 2),)),
        nn.CrossEntropyLoss: (nn.CrossEntropyLoss(), (h(3, 4), torch.tensor([0, 2, 1]))),
        nn.NLLLoss: (nn.NLLLoss(), (h(3, 4), torch.tensor([0, 2, 1]))),
        nn.MSELoss: (nn.MSELoss(), (h(3), h(3))),
        nn.L1Loss: (nn.L1Loss(), (h(3), h(3))),
        nn.SmoothL1Loss: (nn.SmoothL1Loss(), (h(3), h(3))),
        nn.HuberLoss: (nn.HuberLoss(), (h(3), h(3))),
        nn.KLDivLoss: (nn.KLDivLoss(reduction="batchmean"), (h(2, 3), h(2, 3).softmax(-1))),
        nn.BCEWithLogitsLoss: (nn.BCEWithLogitsLoss(), (h(3), h(3).sigmoid())),
        nn.BCELoss: (nn.BCELoss(), (h(3).sigmoid(), h(3).sigmoid())),
        nn.CTCLoss: (nn.CTCLoss(), (h(5, 1, 3).log_softmax(-1), torch.tensor([[1, 2]]), (5,), (2,))),
        nn.PoissonNLLLoss: (nn.PoissonNLLLoss(), (h(3), h(3).abs())),
        nn.GaussianNLLLoss: (nn.GaussianNLLLoss(), (h(3), h(3), h(3).abs() + 0.5)),
        nn.MarginRankingLoss: (nn.MarginRankingLoss(), (h(3), h(3), sign)),
        nn.HingeEmbeddingLoss: (nn.HingeEmbeddingLoss(), (h(3), sign)),
        nn.SoftMarginLoss: (nn.SoftMarginLoss(), (h(3), sign)),
        nn.MultiLabelSoftMarginLoss: (nn.MultiLabelSoftMarginLoss(), (h(2, 3), torch.tensor([[1.0, 0, 1], [0, 1, 0]]))),
        nn.MultiMarginLoss: (nn.MultiMarginLoss(), (h(2, 3), torch.tensor([0, 2]))),
        nn.MultiLabelMarginLoss: (nn.MultiLabelMarginLoss(), (h(2, 3), torch.tensor([[0, 2, -1], [1, -1, 0]]))),
        nn.CosineEmbeddingLoss: (nn.CosineEmbeddingLoss(), (h(2, 3), h(2, 3), sign[:2])),
        nn.TripletMarginLoss: (nn.TripletMarginLoss(), (h(2, 3), h(2, 3), h(2, 3))),
        nn.TripletMarginWithDistanceLoss: (nn.TripletMarginWithDistanceLoss(), (h(2, 3), h(2, 3), h(2, 3))),
    }
    return targets[module_type]


@pytest.mark.parametrize("module_type", [t for t, _ in _MODULE_OP], ids=[t.__name__ for t, _ in _MODULE_OP])
def test_what_inspect_says_of_a_module_is_what_o1_does_to_it(module_type):
    # amp.inspect names the O1 row each module falls under: running the module under O1 on bf16
    # inputs must then give an fp32 output (FP32 rows) or raise (BANNED rows).
    g = torch.Generator().manual_seed(0)
    module, args = _module_call(module_type, lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16))
    _, row = module_rule(module)
    casting.activate(torch.bfloat16)
    try:
        if row.rule is casting.Rule.BANNED:
            with pytest.raises(NotImplementedError, match="banned"):
                module(*args)
            return
        output = module(*args)
    finally:
        casting.deactivate()
    assert row.rule is casting.Rule.FP32 and output.dtype == torch.float32


def test_a_module_op_missing_from_the_o1_table_is_a_lookup_error():
    with pytest.raises(LookupError, match="no row of the O1 rule table names 'not_an_op'"):
        _rule_of("not_an_op")


# ---- command line --------------------------------------------------------------------------

def test_cli_inspect_prints_the_report_in_a_subprocess():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "apex_amp", "inspect", "_diag_models:misaligned", "--opt-level", "O2",
         "--half-dtype", "bfloat16", "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["opt_level"] == "O2" and data["half_dtype"] == "bfloat16"
    kinds = {(f["module"], f["kind"]) for f in data["findings"]}
    assert {("0", "alignment"), ("3", "alignment"), ("1", "batchnorm")} <= kinds


@pytest.mark.parametrize("spec, message", BAD_SPECS)
def test_cli_inspect_bad_specs_exit_2_with_a_clear_error(spec, message, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["inspect", spec]) == 2
    assert message in capsys.readouterr().err


def test_cli_inspect_accepts_a_module_instance(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["inspect", "_diag_models:ALIGNED"]) == 0
    out = capsys.readouterr().out
    assert "nothing to report" in out and "Linear under O1" in out
