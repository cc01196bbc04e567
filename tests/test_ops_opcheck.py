"""torch.library.opcheck on every op of both backends, and the fake (meta) kernels.

opcheck checks that each op's schema declares exactly what it mutates, that
its fake kernel agrees with the real one, and that it survives
functionalization and torch.compile's dynamic-shape tracing.
"""

from __future__ import annotations

import pytest
import torch

import _reference as ref
import _state_steps as steps
from _backends import BACKENDS, namespace_of
from _errors import raises_naming

CHANNELS_LAST = {"memory_format": torch.channels_last}


def _mixed(seed, sizes=(5, 3, 2)):
    return ref.random_tensors(sizes, ref.FLOAT_DTYPES, seed=seed)


def _layouts(seed):
    """One tensor of each dense layout the ops accept besides contiguous, dtypes mixed."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, 3, 4, 5, generator=g).to(**CHANNELS_LAST),
        torch.randn(2, 3, 2, 2, 3, generator=g).to(torch.bfloat16, memory_format=torch.channels_last_3d),
        torch.randn(4, 3, 5, generator=g).to(torch.float16).permute(2, 0, 1),
    ]


def _adam_sample(model_copy: bool, found_inf: float, inv_scale: bool):
    params = ref.random_tensors((5, 3), [torch.float32], seed=70)
    grads = _mixed(71, (5, 3))
    moments = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    model_params = [p.to(torch.bfloat16) for p in params] if model_copy else []
    hyper = [1e-3, 0.9, 0.999, 1e-8, 0.01, True, True]
    args = [params, grads, *moments, model_params, [], [], torch.zeros(1), *hyper]
    kwargs = {"inv_scale": ref.flag(0.5) if inv_scale else None, "found_inf": ref.flag(found_inf)}
    return args, kwargs


def _adam_channels_last_sample():
    """O2 over a channels_last conv weight: fp32 masters, moments and bf16 model copy all channels_last."""
    g = torch.Generator().manual_seed(73)
    params = [torch.randn(8, 3, 3, 3, generator=g).to(**CHANNELS_LAST), torch.randn(8, generator=g)]
    grads = [p.to(torch.bfloat16) for p in params]
    moments = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    model_params = [p.to(torch.bfloat16) for p in params]
    hyper = [1e-3, 0.9, 0.999, 1e-8, 0.01, True, True]
    args = [params, grads, *moments, model_params, [], [], torch.zeros(1), *hyper]
    return args, {"inv_scale": ref.flag(0.5), "found_inf": ref.flag(0.0)}


def _optimizer_samples():
    """Each fused optimizer op: fp32 masters with mixed grads and a bf16 model copy, and a skipped step."""
    for found_inf, name in ((0.0, "master-weights"), (1.0, "skipped")):
        params = ref.random_tensors((5, 3), [torch.float32], seed=74)
        grads = _mixed(75, (5, 3))
        model = [p.to(torch.bfloat16) for p in params]
        flags = {"inv_scale": ref.flag(0.5), "found_inf": ref.flag(found_inf)}

        def zeros():
            return [torch.zeros_like(p) for p in params]

        yield "fused_sgd_", name, [params, grads, zeros(), model, [], [], 0.1, 0.9, 0.0, 0.01, False, False, False], flags
        yield "fused_adagrad_", name, [params, grads, zeros(), model, [], [], 0.1, 1e-10, 0.01, False], flags
        moments = [torch.full((1,), -1.0) for _ in params]
        yield "fused_novograd_", name, [params, grads, zeros(), moments, model, [], [], torch.zeros(1), 1e-2,
                                        0.95, 0.98, 1e-8, 0.01, True, True, False, 2], flags
        yield "fused_lamb_", name, [params, grads, zeros(), zeros(), model, [], [], torch.zeros(1), ref.flag(3.0),
                                    1e-2, 0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0, False], flags
        lamb_lists = [params, grads, zeros(), zeros(), model, [], [], torch.zeros(1), ref.flag(3.0)]
        lamb_moments = [0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0]
        yield "fused_lamb_moments_", name, [*lamb_lists, *lamb_moments], flags
        norm_squares = torch.rand(2, len(params), generator=torch.Generator().manual_seed(78)) + 0.5
        yield "fused_lamb_update_", name, [*lamb_lists, norm_squares, 1e-2, *lamb_moments, False], flags
        yield "fused_novograd_", f"{name}-given-norms", [
            params, grads, zeros(), [torch.full((1,), -1.0) for _ in params], model, [], [], torch.zeros(1), 1e-2,
            0.95, 0.98, 1e-8, 0.01, True, True, False, 2], dict(flags, grad_norms=torch.tensor([2.0, 0.5]))
    params = ref.random_tensors((4, 6), [torch.bfloat16], seed=76)
    grads = ref.random_tensors((4, 6), [torch.bfloat16], seed=77)
    yield "fused_sgd_", "half-plain", [params, grads, [], [], [], [], 0.1, 0.0, 0.0, 0.0, False, False, False], {}


def _samples():
    """(op name, id, args, kwargs): small representative inputs for every op."""
    scale_state = (torch.full((1,), 1024.0), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    yield "check_finite", "mixed", [_mixed(60), ref.flag(0.0)], {}
    yield "check_finite", "nonfinite", [[torch.tensor([1.0, float("nan")])], ref.flag(0.0)], {}
    yield "check_finite", "layouts", [_layouts(67), ref.flag(0.0)], {}
    yield "unscale_", "mixed", [_mixed(61), ref.flag(0.0), ref.flag(0.125)], {}
    yield "unscale_", "layouts", [_layouts(68), ref.flag(0.0), ref.flag(0.125)], {}
    fp16_dst = [torch.empty(n, dtype=torch.float16) for n in (5, 3, 2)]
    yield "scale_", "to-fp16", [_mixed(62), fp16_dst, ref.flag(2.0), ref.flag(0.0)], {}
    src = _layouts(69)
    yield "scale_", "layouts", [src, [torch.empty_like(t, dtype=torch.float32) for t in src], ref.flag(2.0),
                                ref.flag(0.0)], {}
    yield "axpby_", "mixed", [_mixed(63), _mixed(64), ref.flag(0.5), 2.0, ref.flag(0.0)], {}
    yield "axpby_", "layouts", [_layouts(70), _layouts(71), ref.flag(0.5), 2.0, ref.flag(0.0)], {}
    yield "l2norm", "per-tensor", [_mixed(65), True], {}
    yield "l2norm", "total-only", [_mixed(66), False], {}
    yield "l2norm", "layouts", [_layouts(72), True], {}
    for model_copy, found_inf, inv_scale, name in (
        (True, 0.0, True, "master-weights"),
        (False, 0.0, False, "plain"),
        (True, 1.0, True, "skipped"),
    ):
        yield "fused_adam_", name, *_adam_sample(model_copy, found_inf, inv_scale)
    yield "fused_adam_", "channels_last-masters", *_adam_channels_last_sample()
    for found_inf, consecutive in ((0.0, True), (1.0, True), (0.0, False)):
        rule = ref.ScaleRule(growth_interval=1, consecutive_hysteresis=consecutive)
        args = [t.clone() for t in scale_state] + [ref.flag(found_inf), *rule.op_args()]
        yield "update_scale_", f"found_inf={found_inf:g}-consecutive={consecutive}", args, {}
    yield from _optimizer_samples()


SAMPLES = list(_samples())


@pytest.mark.parametrize(
    ("op_name", "args", "kwargs"), [s[::2] + s[3:] for s in SAMPLES], ids=[f"{s[0]}-{s[1]}" for s in SAMPLES]
)
def test_opcheck(amp_ops, op_name, args, kwargs):
    torch.library.opcheck(getattr(amp_ops, op_name).default, args, kwargs)


def test_fake_l2norm_describes_the_outputs_on_meta(amp_ops):
    tensors = [torch.empty(7, device="meta"), torch.empty(3, 2, dtype=torch.bfloat16, device="meta")]
    total, per_tensor = amp_ops.l2norm(tensors, True)
    assert (total.shape, total.dtype, total.device.type) == ((), torch.float32, "meta")
    assert (per_tensor.shape, per_tensor.dtype) == ((2,), torch.float32)
    _, no_per_tensor = amp_ops.l2norm(tensors, False)
    assert no_per_tensor.shape == (0,)


def _metadata(tensors):
    return [(t.shape, t.stride(), t.dtype, t.device.type) for t in tensors]


def test_fake_kernels_accept_meta_tensors_and_check_their_metadata(amp_ops):
    # Meta tensors run the fake kernels. The in-place ops' fakes return nothing and change no metadata...
    meta = {"device": "meta"}
    found_inf, one = torch.zeros(1, **meta), torch.ones(1, **meta)
    grads = [torch.empty(2, 3, 4, 5, **meta, **CHANNELS_LAST), torch.empty(4, dtype=torch.float16, **meta)]
    params = [torch.empty_like(g, dtype=torch.float32) for g in grads]
    moments = [torch.empty_like(p) for p in params], [torch.empty_like(p) for p in params]
    step = torch.zeros(1, **meta)
    before = _metadata(grads + params + moments[0] + moments[1] + [found_inf, step])
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    assert amp_ops.check_finite(grads, found_inf) is None
    assert amp_ops.unscale_(grads, found_inf, one) is None
    assert amp_ops.scale_(grads, params, one, found_inf) is None
    assert amp_ops.axpby_(grads, params, one, 1.0, found_inf) is None
    assert amp_ops.fused_adam_(params, grads, *moments, [], [], [], step, *hyper) is None
    assert _metadata(grads + params + moments[0] + moments[1] + [found_inf, step]) == before
    # ...and they are ours, checking metadata as the kernels do (torch's default fake for an
    # op that returns nothing would accept anything).
    with raises_naming("unscale_", "grads[1]"):
        amp_ops.unscale_([grads[0], torch.empty(4, dtype=torch.float64, **meta)], found_inf, one)
    with raises_naming("scale_", "dst[0]"):
        amp_ops.scale_(grads[:1], [torch.empty(2, 3, 4, 5, **meta)], one, found_inf)
    with raises_naming("fused_adam_", "exp_avgs[0]"):
        contiguous_moment = [torch.empty(2, 3, 4, 5, **meta), moments[0][1]]
        amp_ops.fused_adam_(params, grads, contiguous_moment, moments[1], [], [], [], step, *hyper)
    with raises_naming("update_scale_", "hysteresis_tracker"):
        amp_ops.update_scale_(one, torch.zeros(1, dtype=torch.int32, **meta), torch.zeros(1, **meta), found_inf,
                              *ref.ScaleRule().op_args())


def test_ops_compile_into_one_graph_with_no_graph_breaks(amp_ops):
    def unscale_and_step(params, grads, exp_avgs, exp_avg_sqs, step, found_inf, inv_scale):
        amp_ops.unscale_(grads, found_inf, inv_scale)
        hyper = (1e-2, 0.9, 0.999, 1e-8, 0.0, True, True)
        amp_ops.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, [], [], [], step, *hyper, None, found_inf)
        return amp_ops.l2norm(params, False)[0]

    def fresh_state():
        params = ref.random_tensors((5, 3), [torch.float32], seed=80)
        grads = ref.random_tensors((5, 3), [torch.float32], seed=81)
        moments = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        return (params, grads, *moments, torch.zeros(1), ref.flag(0.0), ref.flag(0.5))

    eager_state, compiled_state = fresh_state(), fresh_state()
    eager_norm = unscale_and_step(*eager_state)
    compiled = torch.compile(unscale_and_step, backend="aot_eager", fullgraph=True)
    compiled_norm = compiled(*compiled_state)
    torch.testing.assert_close(compiled_norm, eager_norm, rtol=0, atol=0)
    for eager_list, compiled_list in zip(eager_state[:4], compiled_state[:4]):
        for e, c in zip(eager_list, compiled_list):
            assert torch.equal(e, c)
    assert compiled_state[4].item() == 1.0


# The fused optimizer ops with their state operands (issue 27): blocked int8/uint8 and fp8 states with
# their absmaxes, bf16 states, and bf16 weights with remainder masters.


def _state_format_samples():
    for rule in ("adam", "sgd", "adagrad", "novograd", "lamb", "lamb-passes"):  # lamb-passes: its two ops
        for fmt, remainder in (("int8", False), ("fp8", False), ("bf16", True)):
            step = steps.make_step(steps.RULES[rule], [(3, 64), (2, 128)], fmt, 64, grad_dtype=torch.bfloat16,
                                   remainder=remainder, model_dtype=None if remainder else torch.bfloat16,
                                   seed=90)
            recorder = _Recorder()
            steps.RULES[rule].call(recorder, step)
            for op_name, args in recorder.calls:
                yield op_name, f"{rule}-{fmt}{'-remainder' if remainder else ''}", args


class _Recorder:
    """Stands in for an ops namespace: records the ops and arguments the calls would pass (LAMB's first
    pass returns squared norms for the second to take)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, op_name):
        def record(*args):
            self.calls.append((op_name, list(args)))
            if op_name == "fused_lamb_moments_":
                return torch.rand(2, len(args[0]), generator=torch.Generator().manual_seed(91)) + 0.5
        return record


STATE_FORMAT_SAMPLES = list(_state_format_samples())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("op_name", "args"), [s[::2] for s in STATE_FORMAT_SAMPLES],
                         ids=[f"{s[0]}-{s[1]}" for s in STATE_FORMAT_SAMPLES])
def test_opcheck_with_state_formats(backend, op_name, args):
    utils = torch.library._OPCHECK_DEFAULT_UTILS
    if any(t.dtype == torch.float8_e4m3fn for t in _tensors_of(args)):
        # opcheck's schema check compares the inputs before and after the call with torch ops that
        # have no float8 kernel on CPU ("mul_cpu_reduced_float" not implemented; torch 2.14): the
        # other checks still run, and the int8 samples cover the schema.
        utils = tuple(u for u in utils if u != "test_schema")
    torch.library.opcheck(getattr(namespace_of(backend), op_name).default, args, test_utils=utils)


def _tensors_of(args):
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, list):
            yield from (t for t in arg if isinstance(t, torch.Tensor))
