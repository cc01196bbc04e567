"""Misuse of the ops in apex_amp.ops: tensors on mixed devices, not dense, overlapping or aliased
tensors, mismatched list lengths, dtypes and layouts, on both backends.

Each bad call raises RuntimeError naming the op and the argument (tests/_errors.py), and
writes nothing (every real tensor argument is compared with a copy taken
before). The 'meta' device stands in for a second device on a CPU-only
machine: a meta tensor routes the call to the fake kernel, which validates
like the real ones (metadata only).
"""

from __future__ import annotations

import pytest
import torch

from _errors import raises_naming

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _t(*shape, dtype=F32, device="cpu"):
    return torch.arange(1, 1 + int(torch.Size(shape).numel()), dtype=F32).reshape(shape).to(dtype).to(device)


def _flag(device="cpu"):
    return torch.zeros(1, device=device)


def _one(device="cpu"):
    return torch.ones(1, device=device)


def _adam_args(params=None, grads=None, exp_avgs=None, exp_avg_sqs=None, model_params=(), step=None):
    params = [_t(4), _t(3)] if params is None else params
    grads = [torch.ones_like(p) for p in params] if grads is None else grads
    exp_avgs = [torch.zeros_like(p) for p in params] if exp_avgs is None else exp_avgs
    exp_avg_sqs = [torch.zeros_like(p) for p in params] if exp_avg_sqs is None else exp_avg_sqs
    step = torch.zeros(1) if step is None else step
    return (params, grads, exp_avgs, exp_avg_sqs, list(model_params), [], [], step, 1e-3, 0.9, 0.999, 1e-8, 0.0,
            True, True, torch.full((1,), 0.5), _flag())


def _overlap_case():
    buffer = _t(8)  # x[0] and y[0]: two views sharing elements 3 and 4
    return "axpby_", ([buffer[0:5]], [buffer[3:8]], _one(), 1.0, _flag())


def _moment_alias_case():
    params = [_t(4)]
    args = list(_adam_args(params=params))
    args[3] = [params[0]]  # exp_avg_sqs[0] is the parameter itself
    return "fused_adam_", tuple(args)


def _duplicate_case(op):
    """One tensor listed twice (or two overlapping views) in a list the op writes in place."""
    shared, buffer = _t(3), _t(8)
    if op == "unscale_":
        return op, ([shared, _t(2), shared], _flag(), _one())
    if op == "scale_":
        return op, ([_t(5), _t(3)], [buffer[0:5], buffer[3:6]], _one(), _flag())
    if op == "axpby_":
        return op, ([_t(3), _t(3)], [shared, shared], _one(), 1.0, _flag())
    return op, _adam_args(params=[shared, shared])


def _adam_moment_duplicate_case():
    moment = torch.zeros(4)
    return "fused_adam_", _adam_args(params=[_t(4), _t(4)], exp_avgs=[moment, moment])


# (id, build() -> (op name, args), the argument the error must name)
OP_ERRORS = [
    ("unscale-first-grad-on-meta", lambda: ("unscale_", ([_t(3, device="meta"), _t(3)], _flag(), _one())), "grads[0]"),
    ("scale-dst-on-meta", lambda: ("scale_", ([_t(3)], [_t(3, device="meta")], _one(), _flag())), "dst[0]"),
    ("unscale-grad-listed-twice", lambda: _duplicate_case("unscale_"), "grads[2]"),
    ("scale-dst-entries-overlap", lambda: _duplicate_case("scale_"), "dst[1]"),
    ("axpby-y-listed-twice", lambda: _duplicate_case("axpby_"), "y[1]"),
    ("adam-param-listed-twice", lambda: _duplicate_case("fused_adam_"), "params[1]"),
    ("adam-moment-shared-by-two-params", _adam_moment_duplicate_case, "exp_avgs[1]"),
    ("scale-scale-on-meta", lambda: ("scale_", ([_t(3)], [_t(3)], _one("meta"), _flag())), "scale"),
    ("axpby-a-on-meta", lambda: ("axpby_", ([_t(3)], [_t(3)], _one("meta"), 1.0, _flag())), "a"),
    ("axpby-found_inf-on-meta", lambda: ("axpby_", ([_t(3)], [_t(3)], _one(), 1.0, _flag("meta"))), "x[0]"),
    ("adam-exp_avg_sqs-on-meta", lambda: ("fused_adam_", _adam_args(exp_avg_sqs=[_t(4), _t(3, device="meta")])),
     "exp_avg_sqs[1]"),
    ("adam-step-on-meta", lambda: ("fused_adam_", _adam_args(step=torch.zeros(1, device="meta"))), "params[0]"),
    ("scale-src-expanded", lambda: ("scale_", ([_t(1).expand(4)], [_t(4)], _one(), _flag())), "src[0]"),
    ("axpby-y-expanded-overlaps-itself", lambda: ("axpby_", ([_t(4)], [_t(1).expand(4)], _one(), 1.0, _flag())),
     "y[0]"),
    ("unscale-grad-sliced-with-a-step", lambda: ("unscale_", ([_t(3), _t(3, 4)[:, ::2]], _flag(), _one())),
     "grads[1]"),
    ("adam-model_params-strided", lambda: ("fused_adam_", _adam_args(model_params=[_t(4, dtype=F16),
                                                                                     _t(6, dtype=F16)[::2]])),
     "model_params[1]"),
    ("adam-exp_avgs-expanded", lambda: ("fused_adam_", _adam_args(exp_avgs=[_t(4), torch.zeros(1).expand(3)])),
     "exp_avgs[1]"),
    ("adam-grads-transposed-params-not", lambda: ("fused_adam_", _adam_args(params=[_t(2, 3)], grads=[_t(3, 2).t()])),
     "grads[0]"),
    ("axpby-x-and-y-overlapping-views", _overlap_case, "y[0]"),
    ("adam-exp_avg_sqs-is-the-param", _moment_alias_case, "exp_avg_sqs[0]"),
    ("adam-exp_avg_sqs-length", lambda: ("fused_adam_", _adam_args(exp_avg_sqs=[_t(4)])), "exp_avg_sqs"),
    ("adam-model_params-longer", lambda: ("fused_adam_", _adam_args(model_params=[_t(4, dtype=BF16)] * 3)),
     "model_params"),
    ("scale-dst-shorter", lambda: ("scale_", ([_t(2), _t(2), _t(2)], [_t(2), _t(2)], _one(), _flag())), "dst"),
    ("scale-src-complex", lambda: ("scale_", ([_t(3, dtype=torch.complex64)], [_t(3)], _one(), _flag())), "src[0]"),
    ("axpby-x-float64", lambda: ("axpby_", ([_t(3, dtype=torch.float64)], [_t(3)], _one(), 1.0, _flag())), "x[0]"),
    ("adam-half-params-fp32-moments", lambda: ("fused_adam_", _adam_args(params=[_t(4, dtype=F16)],
                                                                          grads=[_t(4, dtype=F16)],
                                                                          exp_avgs=[torch.zeros(4)],
                                                                          exp_avg_sqs=[torch.zeros(4)])),
     "exp_avgs[0]"),
    ("adam-bf16-params-fp32-grads", lambda: ("fused_adam_", _adam_args(params=[_t(4, dtype=BF16)],
                                                                        grads=[_t(4)])),
     "grads[0]"),
    ("check_finite-found_inf-half", lambda: ("check_finite", ([_t(3)], torch.zeros(1, dtype=F16))), "found_inf"),
]


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    return []


@pytest.mark.parametrize(("build", "argument"), [c[1:] for c in OP_ERRORS], ids=[c[0] for c in OP_ERRORS])
def test_op_rejects_bad_tensors_and_writes_nothing(amp_ops, build, argument):
    name, args = build()
    real = [t for t in _tensors_in(args) if t.device.type != "meta"]
    before = [t.clone() for t in real]
    with raises_naming(name, argument):
        getattr(amp_ops, name)(*args)
    for old, new in zip(before, real):
        assert torch.equal(old, new)


def test_op_lists_may_mix_dtypes_and_scale_may_write_in_place(amp_ops):
    grads = [_t(5), _t(3, dtype=F16), _t(2, dtype=BF16)]
    found_inf = _flag()
    amp_ops.check_finite(grads, found_inf)
    amp_ops.scale_(grads, grads, torch.full((1,), 0.5), found_inf)  # dst is src: full overlap is allowed
    assert found_inf.item() == 0.0
    for grad, n in zip(grads, (5, 3, 2)):
        assert torch.equal(grad.float(), _t(n) * 0.5)
    # fp32 masters with bf16 grads and a bf16 model copy: the O2 layout.
    master, model_copy = [_t(4)], [_t(4, dtype=BF16)]
    amp_ops.fused_adam_(master, [_t(4, dtype=BF16)], [torch.zeros(4)], [torch.zeros(4)], model_copy, [], [],
                        torch.zeros(1), 0.1, 0.9, 0.999, 1e-8, 0.0, True, True, None, _flag())
    assert torch.equal(model_copy[0], master[0].to(BF16)) and not torch.equal(master[0], _t(4))


def test_op_calls_with_empty_lists_change_nothing(amp_ops):
    found_inf = _flag()
    amp_ops.check_finite([], found_inf)
    amp_ops.unscale_([], found_inf, _one())
    amp_ops.scale_([], [], _one(), found_inf)
    amp_ops.axpby_([], [], _one(), 1.0, found_inf)
    assert found_inf.item() == 0.0
