"""Bad arguments raise RuntimeError with a message naming the op and the argument.

The compiled ops (csrc/validate.h) and the fake kernels and fallback
(apex_amp/_fallback.py) word their messages independently; each case checks
the error type, the op and the argument named (tests/_errors.py). Device
mismatches use the 'meta' device as the "other" device: a meta tensor in the
arguments routes the call to the fake kernel, which checks metadata like the
real ones.
"""

from __future__ import annotations

import re

import pytest
import torch

import _reference as ref
from _errors import raises_naming

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _t(*shape, dtype=F32, device="cpu"):
    return torch.ones(*shape, dtype=dtype, device=device)


def _found_inf(**kwargs):
    return torch.zeros(1, **kwargs)


def _overlapping(name_a, name_b):
    """Lists `name_a` and `name_b` of one tensor each: two contiguous views of
    one buffer that share elements 4 and 5."""
    buffer = torch.zeros(10)
    return {name_a: [buffer[:6]], name_b: [buffer[4:]]}


def _same_tensors(name_a, name_b):
    shared = [_t(4), _t(3)]
    return {name_a: shared, name_b: shared}


def _adam(amp_ops, params=None, grads=None, exp_avgs=None, exp_avg_sqs=None, model_params=(), step=None,
          master_remainders=(), state_absmaxes=(), **kwargs):
    params = [_t(4), _t(3)] if params is None else params
    grads = [torch.ones_like(p) for p in params] if grads is None else grads
    exp_avgs = [torch.zeros_like(p) for p in params] if exp_avgs is None else exp_avgs
    exp_avg_sqs = [torch.zeros_like(p) for p in params] if exp_avg_sqs is None else exp_avg_sqs
    step = torch.zeros(1) if step is None else step
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    hyper.update({k: kwargs.pop(k) for k in list(kwargs) if k in hyper})
    tensors = (params, grads, exp_avgs, exp_avg_sqs, list(model_params), list(master_remainders), list(state_absmaxes), step)
    flags = (True, True)  # adamw_mode, bias_correction
    amp_ops.fused_adam_(*tensors, *hyper.values(), *flags, kwargs.get("inv_scale"), kwargs.get("found_inf"))


def _update_scale(amp_ops, scale=None, growth_tracker=None, hysteresis_tracker=None, found_inf=None, **rule):
    args = {
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "hysteresis": 1,
        "min_scale": 1.0,
        "max_scale": 2.0**24,
        "consecutive_hysteresis": True,
    }
    args.update(rule)
    amp_ops.update_scale_(
        torch.ones(1) if scale is None else scale,
        torch.zeros(1, dtype=torch.int32) if growth_tracker is None else growth_tracker,
        torch.ones(1, dtype=torch.int32) if hysteresis_tracker is None else hysteresis_tracker,
        torch.zeros(1) if found_inf is None else found_inf,
        *args.values(),
    )


def _sgd(amp_ops, params=None, momentum_buffers=None, momentum=0.9, model_params=(), **hyper):
    params = [_t(4), _t(3)] if params is None else params
    buffers = [torch.zeros_like(p) for p in params] if momentum_buffers is None else momentum_buffers
    h = {"lr": 0.1, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}
    h.update(hyper)
    amp_ops.fused_sgd_(params, [torch.ones_like(p) for p in params], buffers, list(model_params), [], [], h["lr"], momentum,
                       h["dampening"], h["weight_decay"], h["nesterov"], False, False)


def _adagrad(amp_ops, state_sums=None, **hyper):
    params = [_t(4), _t(3)]
    sums = [torch.zeros_like(p) for p in params] if state_sums is None else state_sums
    h = {"lr": 0.1, "eps": 1e-10, "weight_decay": 0.0}
    h.update(hyper)
    amp_ops.fused_adagrad_(params, [torch.ones_like(p) for p in params], sums, [], [], [], *h.values(), False)


def _novograd(amp_ops, exp_avg_sqs=None, norm_type=2, **hyper):
    params = [_t(4), _t(3)]
    moments = [torch.full((1,), -1.0) for _ in params] if exp_avg_sqs is None else exp_avg_sqs
    h = {"lr": 0.1, "beta1": 0.9, "beta2": 0.98, "eps": 1e-8, "weight_decay": 0.0}
    h.update(hyper)
    amp_ops.fused_novograd_(params, [torch.ones_like(p) for p in params], [torch.zeros_like(p) for p in params],
                            moments, [], [], [], torch.zeros(1), *h.values(), True, True, False, norm_type)


def _lamb(amp_ops, exp_avg_sqs=None, grad_norm=None, **hyper):
    params = [_t(4), _t(3)]
    sqs = [torch.zeros_like(p) for p in params] if exp_avg_sqs is None else exp_avg_sqs
    h = {"lr": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.01}
    h.update({k: hyper.pop(k) for k in list(hyper) if k in h})
    max_grad_norm = hyper.pop("max_grad_norm", 1.0)
    amp_ops.fused_lamb_(params, [torch.ones_like(p) for p in params], [torch.zeros_like(p) for p in params], sqs,
                        [], [], [], torch.zeros(1), torch.ones(1) if grad_norm is None else grad_norm, *h.values(),
                        True, True, True, max_grad_norm, False)


def _strided(*shape):
    """A view with gaps between its elements: not dense."""
    return _t(*shape[:-1], 2 * shape[-1])[..., ::2]


def _channels_last(n=2, c=3, h=2, w=2, dtype=F32):
    return _t(n, c, h, w, dtype=dtype).to(memory_format=torch.channels_last)


# (id, call(amp_ops), the op, the argument its error must name)
CASES = [
    # check_finite
    ("check_finite-float64", lambda o: o.check_finite([_t(3), _t(3, dtype=torch.float64)], _found_inf()),
     "check_finite", "tensors[1]"),
    ("check_finite-int", lambda o: o.check_finite([_t(3, dtype=torch.int32)], _found_inf()),
     "check_finite", "tensors[0]"),
    ("check_finite-strided", lambda o: o.check_finite([_t(3), _strided(4, 4)], _found_inf()),
     "check_finite", "tensors[1]"),
    ("check_finite-expanded", lambda o: o.check_finite([_t(1).expand(5)], _found_inf()),
     "check_finite", "tensors[0]"),
    ("check_finite-found_inf-dtype", lambda o: o.check_finite([_t(3)], _found_inf(dtype=torch.float64)),
     "check_finite", "found_inf"),
    ("check_finite-found_inf-numel", lambda o: o.check_finite([_t(3)], torch.zeros(2)),
     "check_finite", "found_inf"),
    ("check_finite-device", lambda o: o.check_finite([_t(3), _t(3, device="meta")], _found_inf()),
     "check_finite", "tensors[1]"),
    ("check_finite-found_inf-device", lambda o: o.check_finite([_t(3)], _found_inf(device="meta")),
     "check_finite", "tensors[0]"),
    # unscale_
    ("unscale-float64", lambda o: o.unscale_([_t(3), _t(2), _t(2, dtype=torch.float64)], _found_inf(), _t(1)),
     "unscale_", "grads[2]"),
    ("unscale-inv_scale-numel", lambda o: o.unscale_([_t(3)], _found_inf(), torch.ones(0)), "unscale_", "inv_scale"),
    ("unscale-inv_scale-dtype", lambda o: o.unscale_([_t(3)], _found_inf(), _t(1, dtype=F16)), "unscale_", "inv_scale"),
    ("unscale-inv_scale-device", lambda o: o.unscale_([_t(3)], _found_inf(), _t(1, device="meta")),
     "unscale_", "inv_scale"),
    ("unscale-grads-device", lambda o: o.unscale_([_t(3), _t(3, device="meta")], _found_inf(), _t(1)),
     "unscale_", "grads[1]"),
    ("unscale-sliced-with-gaps", lambda o: o.unscale_([_t(2, 3)[:, :2]], _found_inf(), _t(1)), "unscale_", "grads[0]"),
    # scale_
    ("scale-length", lambda o: o.scale_([_t(3), _t(3)], [_t(3)], _t(1), _found_inf()), "scale_", "dst"),
    ("scale-numel", lambda o: o.scale_([_t(3), _t(3)], [_t(3), _t(4)], _t(1), _found_inf()), "scale_", "dst[1]"),
    ("scale-overlap", lambda o: o.scale_(*_overlapping("src", "dst").values(), _t(1), _found_inf()),
     "scale_", "dst[0]"),
    ("scale-dst-dtype", lambda o: o.scale_([_t(3)], [_t(3, dtype=torch.int64)], _t(1), _found_inf()),
     "scale_", "dst[0]"),
    ("scale-dst-transposed-src-flat", lambda o: o.scale_([_t(6)], [_t(2, 3).t()], _t(1), _found_inf()),
     "scale_", "dst[0]"),
    ("scale-dst-channels_last-src-contiguous",
     lambda o: o.scale_([_t(2, 3, 2, 2)], [_channels_last(dtype=F16)], _t(1), _found_inf()), "scale_", "dst[0]"),
    ("scale-scale-dtype", lambda o: o.scale_([_t(3)], [_t(3)], _t(1, dtype=BF16), _found_inf()), "scale_", "scale"),
    # axpby_
    ("axpby-length", lambda o: o.axpby_([_t(3)], [_t(3), _t(3)], _t(1), 1.0, _found_inf()), "axpby_", "y"),
    ("axpby-numel", lambda o: o.axpby_([_t(5)], [_t(3)], _t(1), 1.0, _found_inf()), "axpby_", "y[0]"),
    ("axpby-y-int", lambda o: o.axpby_([_t(3)], [_t(3, dtype=torch.int32)], _t(1), 1.0, _found_inf()),
     "axpby_", "y[0]"),
    ("axpby-y-permuted-x-contiguous",
     lambda o: o.axpby_([_t(2, 3, 4)], [_t(4, 3, 2).permute(2, 1, 0)], _t(1), 1.0, _found_inf()), "axpby_", "y[0]"),
    ("axpby-a-numel", lambda o: o.axpby_([_t(3)], [_t(3)], _t(2), 1.0, _found_inf()), "axpby_", "a"),
    ("axpby-found_inf-int", lambda o: o.axpby_([_t(3)], [_t(3)], _t(1), 1.0, _found_inf(dtype=torch.int32)),
     "axpby_", "found_inf"),
    # l2norm
    ("l2norm-float64", lambda o: o.l2norm([_t(3), _t(3, dtype=torch.float64)], True), "l2norm", "tensors[1]"),
    ("l2norm-device", lambda o: o.l2norm([_t(3), _t(3, device="meta")], False), "l2norm", "tensors[1]"),
    ("l2norm-strided", lambda o: o.l2norm([_strided(3, 3)], False), "l2norm", "tensors[0]"),
    # fused_adam_
    ("adam-grads-length", lambda o: _adam(o, grads=[_t(4)]), "fused_adam_", "grads"),
    ("adam-exp_avgs-length", lambda o: _adam(o, exp_avgs=[_t(4)]), "fused_adam_", "exp_avgs"),
    ("adam-model_params-length", lambda o: _adam(o, model_params=[_t(4, dtype=F16)]), "fused_adam_", "model_params"),
    ("adam-grads-float64", lambda o: _adam(o, grads=[_t(4), _t(3, dtype=torch.float64)]), "fused_adam_", "grads[1]"),
    ("adam-grads-numel", lambda o: _adam(o, grads=[_t(4), _t(5)]), "fused_adam_", "grads[1]"),
    ("adam-moment-dtype", lambda o: _adam(o, exp_avgs=[_t(4, dtype=F16), _t(3)]), "fused_adam_", "exp_avgs[0]"),
    ("adam-moment-sq-dtype", lambda o: _adam(o, exp_avg_sqs=[_t(4), _t(3, dtype=F16)]),
     "fused_adam_", "exp_avg_sqs[1]"),
    ("adam-low-precision-grad-dtype", lambda o: _adam(o, params=[_t(4, dtype=BF16)], grads=[_t(4, dtype=F16)]),
     "fused_adam_", "grads[0]"),
    ("adam-low-precision-model-copy",
     lambda o: _adam(o, params=[_t(4, dtype=F16)], model_params=[_t(4, dtype=F16)]), "fused_adam_", "model_params[0]"),
    ("adam-model_params-int", lambda o: _adam(o, model_params=[_t(4, dtype=F16), _t(3, dtype=torch.int16)]),
     "fused_adam_", "model_params[1]"),
    ("adam-grads-transposed-params-flat", lambda o: _adam(o, params=[_t(6)], grads=[_t(2, 3).t()]),
     "fused_adam_", "grads[0]"),
    ("adam-exp_avgs-contiguous-params-channels_last",
     lambda o: _adam(o, params=[_channels_last()], exp_avgs=[torch.zeros(2, 3, 2, 2)]), "fused_adam_", "exp_avgs[0]"),
    ("adam-model_params-channels_last-params-contiguous",
     lambda o: _adam(o, params=[_t(2, 3, 2, 2)], model_params=[_channels_last(dtype=BF16)]),
     "fused_adam_", "model_params[0]"),
    ("adam-grads-device", lambda o: _adam(o, grads=[_t(4), _t(3, device="meta")]), "fused_adam_", "grads[1]"),
    ("adam-step-dtype", lambda o: _adam(o, step=torch.zeros(1, dtype=torch.int64)), "fused_adam_", "step"),
    ("adam-step-numel", lambda o: _adam(o, step=torch.zeros(2)), "fused_adam_", "step"),
    ("adam-found_inf-dtype", lambda o: _adam(o, found_inf=torch.zeros(1, dtype=torch.bool)), "fused_adam_", "found_inf"),
    ("adam-inv_scale-numel", lambda o: _adam(o, inv_scale=torch.ones(3)), "fused_adam_", "inv_scale"),
    ("adam-lr", lambda o: _adam(o, lr=-1.0), "fused_adam_", "lr"),
    ("adam-lr-nan", lambda o: _adam(o, lr=float("nan")), "fused_adam_", "lr"),
    ("adam-eps", lambda o: _adam(o, eps=-1e-8), "fused_adam_", "eps"),
    ("adam-beta1", lambda o: _adam(o, beta1=1.0), "fused_adam_", "beta1"),
    ("adam-beta2", lambda o: _adam(o, beta2=-0.5), "fused_adam_", "beta2"),
    ("adam-weight_decay", lambda o: _adam(o, weight_decay=-0.1), "fused_adam_", "weight_decay"),
    ("adam-moment-overlaps-param", lambda o: _adam(o, **_overlapping("params", "exp_avgs")),
     "fused_adam_", "exp_avgs[0]"),
    ("adam-moments-are-one-tensor", lambda o: _adam(o, **_same_tensors("exp_avgs", "exp_avg_sqs")),
     "fused_adam_", "exp_avg_sqs[0]"),
    ("adam-model-copy-overlap", lambda o: _adam(o, **_overlapping("params", "model_params")),
     "fused_adam_", "model_params[0]"),
    # update_scale_
    ("update_scale-scale-dtype", lambda o: _update_scale(o, scale=torch.ones(1, dtype=torch.float64)),
     "update_scale_", "scale"),
    ("update_scale-growth_tracker-dtype", lambda o: _update_scale(o, growth_tracker=torch.zeros(1)),
     "update_scale_", "growth_tracker"),
    ("update_scale-hysteresis_tracker-dtype",
     lambda o: _update_scale(o, hysteresis_tracker=torch.ones(1, dtype=torch.int64)),
     "update_scale_", "hysteresis_tracker"),
    ("update_scale-found_inf-numel", lambda o: _update_scale(o, found_inf=torch.zeros(2)), "update_scale_", "found_inf"),
    ("update_scale-found_inf-device", lambda o: _update_scale(o, found_inf=torch.zeros(1, device="meta")),
     "update_scale_", "found_inf"),
    ("update_scale-growth_interval", lambda o: _update_scale(o, growth_interval=0), "update_scale_", "growth_interval"),
    ("update_scale-hysteresis", lambda o: _update_scale(o, hysteresis=0), "update_scale_", "hysteresis"),
    ("update_scale-growth_factor", lambda o: _update_scale(o, growth_factor=0.5), "update_scale_", "growth_factor"),
    ("update_scale-backoff_factor", lambda o: _update_scale(o, backoff_factor=1.0), "update_scale_", "backoff_factor"),
    ("update_scale-min_scale-negative", lambda o: _update_scale(o, min_scale=-1.0), "update_scale_", "min_scale"),
    ("update_scale-min-above-max", lambda o: _update_scale(o, min_scale=4.0, max_scale=2.0),
     "update_scale_", "min_scale"),
    # the fused optimizers' ops (validate_fused_step and each op's own numbers)
    ("sgd-buffer-dtype", lambda o: _sgd(o, momentum_buffers=[_t(4), _t(3, dtype=F16)]), "fused_sgd_",
     "momentum_buffers[1]"),
    ("sgd-buffers-without-momentum", lambda o: _sgd(o, momentum=0.0), "fused_sgd_", "momentum_buffers"),
    ("sgd-nesterov-dampening", lambda o: _sgd(o, nesterov=True, dampening=0.1), "fused_sgd_", "nesterov"),
    ("sgd-lr", lambda o: _sgd(o, lr=-1.0), "fused_sgd_", "lr"),
    ("sgd-model-copy-of-half-params", lambda o: _sgd(o, params=[_t(4, dtype=BF16)], momentum_buffers=[_t(4, dtype=BF16)],
                                                      model_params=[_t(4, dtype=F16)]), "fused_sgd_", "model_params[0]"),
    ("adagrad-sum-length", lambda o: _adagrad(o, state_sums=[_t(4)]), "fused_adagrad_", "state_sums"),
    ("adagrad-sum-layout", lambda o: _adagrad(o, state_sums=[_t(4), _strided(3)]), "fused_adagrad_", "state_sums[1]"),
    ("adagrad-eps", lambda o: _adagrad(o, eps=float("nan")), "fused_adagrad_", "eps"),
    ("novograd-moment-numel", lambda o: _novograd(o, exp_avg_sqs=[torch.zeros(1), torch.zeros(3)]),
     "fused_novograd_", "exp_avg_sqs[1]"),
    ("novograd-norm_type", lambda o: _novograd(o, norm_type=1), "fused_novograd_", "norm_type"),
    ("novograd-beta2", lambda o: _novograd(o, beta2=1.0), "fused_novograd_", "beta2"),
    ("lamb-sq-dtype", lambda o: _lamb(o, exp_avg_sqs=[_t(4), _t(3, dtype=F16)]), "fused_lamb_", "exp_avg_sqs[1]"),
    ("lamb-grad_norm-numel", lambda o: _lamb(o, grad_norm=torch.ones(2)), "fused_lamb_", "grad_norm"),
    ("lamb-max_grad_norm", lambda o: _lamb(o, max_grad_norm=0.0), "fused_lamb_", "max_grad_norm"),
]


I8, U8, FP8, I16 = torch.int8, torch.uint8, torch.float8_e4m3fn, torch.int16


def _codes(dtype, *shape):
    return torch.zeros(*shape, dtype=dtype)


def _blocked_adam(amp_ops, absmaxes=None, **kwargs):
    """Adam over one (2, 64) fp32 param with int8/uint8 moments of 32-element blocks (4 absmaxes each)."""
    params = [_t(2, 64)]
    absmaxes = [torch.zeros(4), torch.zeros(4)] if absmaxes is None else absmaxes
    _adam(amp_ops, **{"params": params, "exp_avgs": [_codes(I8, 2, 64)], "exp_avg_sqs": [_codes(U8, 2, 64)],
                      "state_absmaxes": absmaxes, **kwargs})


def _remainder_adam(amp_ops, **kwargs):
    params = [_t(2, 64, dtype=BF16)]
    _adam(amp_ops, **{"params": params, "grads": [_t(2, 64)], "exp_avgs": [_t(2, 64)], "exp_avg_sqs": [_t(2, 64)],
                      "master_remainders": [_codes(I16, 2, 64)], **kwargs})


# (id, call(amp_ops), the op, the argument its error must name): the state operands.
STATE_OPERAND_CASES = [
    ("absmaxes-missing", lambda o: _blocked_adam(o, absmaxes=[]), "fused_adam_", "state_absmaxes"),
    ("absmaxes-count", lambda o: _blocked_adam(o, absmaxes=[torch.zeros(4)]), "fused_adam_", "state_absmaxes"),
    ("absmaxes-block-not-a-power-of-two", lambda o: _blocked_adam(o, absmaxes=[torch.zeros(4), torch.zeros(3)]),
     "fused_adam_", "state_absmaxes[1]"),
    ("absmaxes-block-too-small", lambda o: _blocked_adam(o, absmaxes=[torch.zeros(8), torch.zeros(4)]),
     "fused_adam_", "state_absmaxes[0]"),
    ("absmaxes-block-too-large", lambda o: _blocked_adam(
        o, params=[_t(2, 8192)], exp_avgs=[_codes(I8, 2, 8192)], exp_avg_sqs=[_codes(U8, 2, 8192)],
        absmaxes=[torch.zeros(4), torch.zeros(2)]), "fused_adam_", "state_absmaxes[1]"),
    ("absmaxes-dtype", lambda o: _blocked_adam(o, absmaxes=[torch.zeros(4, dtype=F16), torch.zeros(4)]),
     "fused_adam_", "state_absmaxes[0]"),
    ("absmaxes-not-contiguous", lambda o: _blocked_adam(o, absmaxes=[torch.zeros(2, 2).t(), torch.zeros(4)]),
     "fused_adam_", "state_absmaxes[0]"),
    ("absmaxes-for-an-fp32-state", lambda o: _adam(o, params=[_t(64)], state_absmaxes=[torch.zeros(2),
                                                                                      torch.zeros(0)]),
     "fused_adam_", "state_absmaxes[0]"),
    ("absmaxes-device", lambda o: _blocked_adam(o, absmaxes=[torch.zeros(4), torch.zeros(4, device="meta")]),
     "fused_adam_", "state_absmaxes[1]"),
    ("absmaxes-shared", lambda o: _shared_absmax(o), "fused_adam_", "state_absmaxes[1]"),
    ("int16-state", lambda o: _adam(o, exp_avgs=[_codes(I16, 4), _t(3)]), "fused_adam_", "exp_avgs[0]"),
    ("int8-state-of-bf16-params", lambda o: _adam(o, params=[_t(64, dtype=BF16)], grads=[_t(64, dtype=BF16)],
                                                  exp_avgs=[_codes(I8, 64)], exp_avg_sqs=[_t(64, dtype=BF16)],
                                                  state_absmaxes=[torch.zeros(2), torch.zeros(0)]),
     "fused_adam_", "exp_avgs[0]"),
    ("remainder-of-fp32-params", lambda o: _remainder_adam(o, params=[_t(2, 64)]), "fused_adam_",
     "master_remainders[0]"),
    ("remainder-of-fp16-params", lambda o: _remainder_adam(o, params=[_t(2, 64, dtype=F16)]), "fused_adam_",
     "master_remainders[0]"),
    ("remainder-dtype", lambda o: _remainder_adam(o, master_remainders=[_codes(torch.int32, 2, 64)]),
     "fused_adam_", "master_remainders[0]"),
    ("remainder-shape", lambda o: _remainder_adam(o, master_remainders=[_codes(I16, 128)]), "fused_adam_",
     "master_remainders[0]"),
    ("remainder-count", lambda o: _remainder_adam(o, master_remainders=[_codes(I16, 2, 64)] * 2), "fused_adam_",
     "master_remainders"),
    ("remainder-with-model-copy", lambda o: _remainder_adam(o, model_params=[_t(2, 64, dtype=BF16)]),
     "fused_adam_", "model_params"),
    ("remainder-is-the-param", lambda o: _remainder_alias(o), "fused_adam_", "master_remainders[0]"),
    ("sgd-absmaxes-without-momentum", lambda o: _sgd_plain_with_absmaxes(o), "fused_sgd_", "state_absmaxes"),
]


def _shared_absmax(amp_ops):
    # Both absmaxes are one tensor: the op would write it twice.
    shared = torch.zeros(4)
    _blocked_adam(amp_ops, absmaxes=[shared, shared])


def _remainder_alias(amp_ops):
    params = [_t(2, 64, dtype=BF16)]
    _remainder_adam(amp_ops, params=params, master_remainders=[params[0].view(I16)])


def _sgd_plain_with_absmaxes(amp_ops):
    params = [_t(64)]
    amp_ops.fused_sgd_(params, [_t(64)], [], [], [], [torch.zeros(2)], 0.1, 0.0, 0.0, 0.0, False, False, False)


@pytest.mark.parametrize(("call", "op", "argument"), [case[1:] for case in CASES + STATE_OPERAND_CASES],
                         ids=[case[0] for case in CASES + STATE_OPERAND_CASES])
def test_bad_argument_raises_runtime_error_naming_it(amp_ops, call, op, argument):
    with raises_naming(op, argument):
        call(amp_ops)


def test_l2norm_of_an_empty_list_raises(amp_ops):
    with pytest.raises(RuntimeError, match="tensors is empty|no tensor arguments"):
        amp_ops.l2norm([], True)


def test_a_rejected_call_changes_nothing(amp_ops):
    # The last tensor is bad: validation must run before any element is written.
    params = [_t(33), _t(3)]
    grads = [_t(33), _t(3, dtype=torch.float64)]
    found_inf = _found_inf()
    with pytest.raises(RuntimeError, match=re.escape("grads[1]")):
        amp_ops.unscale_(grads, found_inf, ref.flag(0.5))
    assert torch.equal(grads[0], _t(33))
    step = torch.zeros(1)
    with pytest.raises(RuntimeError, match=re.escape("grads[1]")):
        _adam(amp_ops, params=params, grads=grads, step=step)
    assert torch.equal(params[0], _t(33)) and step.item() == 0.0
