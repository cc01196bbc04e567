"""Run by tests/test_compat_amp_c.py with the python of a throwaway venv that has the compat
distribution installed: calls ``amp_C`` through ``apex.multi_tensor_apply.multi_tensor_applier``
the way apex's code does, compares each kernel with what apex's kernel computes
(tests/_amp_c_reference.py), and prints one JSON object: each check's name and "ok" or its error.

The optimizer kernels' checks are in _compat_amp_c_optimizers.py; this script runs both sets.
The first argument is the ``apex_amp.__file__`` of the tests, which the venv must import too.
"""

import copy
import json
import os
import sys

import torch

import amp_C
import apex_amp
from apex.multi_tensor_apply import multi_tensor_applier
from apex.multi_tensor_apply.multi_tensor_apply import MultiTensorApply

import _amp_c_reference as ref

CHECKS = {}
assert_close = torch.testing.assert_close


def check(function):
    CHECKS[function.__name__] = function
    return function


def flag(value: int = 0) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.int)


def randn(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


def raises(error_type, words, function, *args):
    try:
        function(*args)
    except error_type as error:
        assert all(word in str(error) for word in words), str(error)
        return
    raise AssertionError(f"{function} did not raise {error_type.__name__}")


@check
def applier_calls_amp_c_with_apex_chunk_size_first():
    seen = multi_tensor_applier(lambda *args: args, "buf", [["x"]], 1.5, True)
    assert seen == (2048 * 32, "buf", [["x"]], 1.5, True), seen
    assert multi_tensor_applier.available and isinstance(multi_tensor_applier, MultiTensorApply)
    assert apex_amp.__file__ == sys.argv[1], (apex_amp.__file__, sys.argv[1])  # the tree under test
    if os.environ.get("APEX_AMP_FORCE_FALLBACK", "0") not in ("", "0"):
        assert apex_amp.ops.BACKEND == "fallback"


@check
def scale_converts_dtypes_and_flags_only_nonfinite_inputs():
    src = [randn(1000), randn(37, dtype=torch.float16, seed=1), randn(5, 7, dtype=torch.bfloat16, seed=2)]
    dst = [torch.empty(1000, dtype=torch.float16), torch.empty(37), torch.empty(5, 7)]
    buf = flag()
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [src, dst], 0.37)
    expected, _ = ref.scale(src, [d.dtype for d in dst], 0.37)
    assert_close(dst, expected, rtol=0, atol=0)
    assert int(buf) == 0
    # 70000 overflows fp16 in the output: apex's kernel checks the input only.
    out = torch.empty(2, dtype=torch.float16)
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [[torch.tensor([70000.0, 1.0])], [out]], 1.0)
    assert out[0].isinf() and int(buf) == 0
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [[torch.tensor([float("nan"), 2.0])], [out]], 0.5)
    assert int(buf) == 1 and out[1] == 1.0  # flagged, and the work is done all the same


@check
def scale_in_place_through_data_views_and_never_clears_the_flag():
    grads = [randn(64, seed=3), randn(8, 8, seed=4)]
    before = [g.clone() for g in grads]
    buf = flag(1)
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [grads, [g.data for g in grads]], 0.25)
    assert_close(grads, [b * 0.25 for b in before], rtol=0, atol=0)
    assert int(buf) == 1


@check
def axpby_writes_out_y_or_x_and_checks_the_chosen_inputs():
    x = [randn(100, dtype=torch.float16, seed=5), randn(3, 4, seed=6)]
    y = [randn(100, seed=7), randn(3, 4, dtype=torch.float16, seed=8)]
    for out_dtypes in ([torch.float16, torch.float32], [torch.float32, torch.bfloat16]):
        out = [torch.empty_like(t, dtype=d) for t, d in zip(x, out_dtypes)]
        buf = flag()
        multi_tensor_applier(amp_C.multi_tensor_axpby, buf, [x, y, out], 0.5, -2.0, -1)
        assert_close(out, ref.axpby(x, y, out_dtypes, 0.5, -2.0, -1)[0], rtol=0, atol=0)
        assert int(buf) == 0
    for target in ("y", "x"):
        xs, ys = [t.clone() for t in x], [t.clone() for t in y]
        expected, _ = ref.axpby(xs, ys, [t.dtype for t in (ys if target == "y" else xs)], 3.0, 0.5, -1)
        multi_tensor_applier(amp_C.multi_tensor_axpby, flag(), [xs, ys, ys if target == "y" else xs], 3.0, 0.5, -1)
        assert_close(ys if target == "y" else xs, expected, rtol=0, atol=0)
    bad_y = [torch.tensor([float("inf"), 1.0])]
    for arg_to_check, flagged in ((-1, 1), (0, 0), (1, 1), (2, 0)):
        buf = flag()
        multi_tensor_applier(amp_C.multi_tensor_axpby, buf, [[torch.ones(2)], bad_y, [torch.empty(2)]], 1.0, 1.0,
                             arg_to_check)
        assert int(buf) == flagged, (arg_to_check, int(buf))


@check
def l2norm_returns_apex_shapes_and_values():
    tensors = [randn(70000, seed=9), randn(33, dtype=torch.float16, seed=10), randn(4, 5, dtype=torch.bfloat16)]
    for per_tensor in (False, True, None):
        args = () if per_tensor is None else (per_tensor,)
        total, norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag(), [tensors], *args)
        expected_total, expected_norms, _ = ref.l2norm(tensors, bool(per_tensor))
        assert total.shape == (1,) and total.dtype == torch.float32 and norms.shape == expected_norms.shape
        assert_close(total, expected_total, rtol=1e-5, atol=0)
        assert_close(norms, expected_norms, rtol=1e-5, atol=0)


@check
def l2norm_flags_inf_and_nan_and_never_skips():
    for bad in (float("inf"), float("nan")):
        buf = flag()
        total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, buf, [[torch.ones(3), torch.tensor([bad])]], False)
        assert int(buf) == 1 and not torch.isfinite(total).all()
    buf = flag(1)
    total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, buf, [[torch.full((4,), 2.0)]], False)
    assert float(total) == 4.0 and int(buf) == 1


@check
def megatron_style_clipping_matches_torch_clip_grad_norm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    inputs = torch.randn(8, 16)
    for net in (model, reference):
        net(inputs).pow(2).sum().backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    grads = [p.grad for p in model.parameters()]
    # Megatron's clip_grad_norm_fp32: the norm of all grads, then grads *= max_norm / (norm + 1e-6).
    overflow_buf = torch.zeros(1, dtype=torch.int)
    total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)
    clip_coeff = 0.5 / (float(total) + 1.0e-6)
    assert clip_coeff < 1.0
    multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [grads, grads], clip_coeff)
    assert_close(total, expected_norm.reshape(1), rtol=1e-5, atol=0)
    assert_close(grads, [p.grad for p in reference.parameters()], rtol=1e-5, atol=1e-7)
    assert int(overflow_buf) == 0


@check
def l2norm_mp_skips_while_the_flag_is_set():
    tensors = [randn(10, seed=11), randn(6, dtype=torch.bfloat16, seed=12)]
    buf = flag()
    total, norms = multi_tensor_applier(amp_C.multi_tensor_l2norm_mp, buf, [tensors], True)
    expected_total, expected_norms, _ = ref.l2norm(tensors, True)
    assert_close((total, norms), (expected_total, expected_norms), rtol=1e-5, atol=0)
    buf = flag(1)
    total, norms = multi_tensor_applier(amp_C.multi_tensor_l2norm_mp, buf, [tensors], True)
    assert total.shape == (1,) and norms.shape == (2,) and total.isnan().all() and norms.isnan().all()
    buf = flag()
    multi_tensor_applier(amp_C.multi_tensor_l2norm_mp, buf, [[torch.tensor([float("inf")])]], False)
    assert int(buf) == 1


@check
def unscale_l2norm_measures_unscaled_values_and_leaves_tensors():
    tensors = [randn(50, seed=13) * 1024, randn(7, dtype=torch.float16, seed=14) * 1024]
    before = [t.clone() for t in tensors]
    buf = flag()
    total, norms = multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, buf, [tensors],
                                        torch.full((1,), 1 / 1024.0), True)
    expected_total, expected_norms, _ = ref.l2norm(tensors, True, factor=1 / 1024.0)
    assert_close((total, norms), (expected_total, expected_norms), rtol=1e-5, atol=0)
    assert_close(tensors, before, rtol=0, atol=0)
    assert int(buf) == 0
    multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, buf, [[torch.tensor([float("nan")])]], torch.ones(1))
    assert int(buf) == 1


@check
def l2norm_scale_measures_in_and_writes_scaled_out():
    src = [randn(40, seed=15), randn(9, dtype=torch.float16, seed=16)]
    out = [torch.empty(40, dtype=torch.float16), torch.empty(9)]
    buf = flag()
    total, norms = multi_tensor_applier(amp_C.multi_tensor_l2norm_scale, buf, [src, out], 0.125, False)
    assert_close(total, ref.l2norm(src, False)[0], rtol=1e-5, atol=0)
    assert norms.shape == (0,) and int(buf) == 0
    assert_close(out, ref.scale(src, [o.dtype for o in out], 0.125)[0], rtol=0, atol=0)


@check
def update_scale_hysteresis_follows_apex_step_by_step():
    # The second run backs off below fp32's smallest normal number, where apex's scale became 0.
    for init_scale, founds in ((65536.0, (0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0)), (1e-37, (1,) * 6 + (0,) * 4)):
        scale, growth, hysteresis_left = torch.full((1,), init_scale), flag(), flag(2)
        expected = (float(scale), 0, 2)
        for found in founds:
            returned = amp_C.update_scale_hysteresis(scale, growth, hysteresis_left, torch.full((1,), float(found)),
                                                     2.0, 0.5, 3, 2)
            expected = ref.update_scale_hysteresis(*expected, float(found), growth_factor=2.0, backoff_factor=0.5,
                                                   growth_interval=3, hysteresis=2)
            assert returned is scale
            assert (float(scale), int(growth), int(hysteresis_left)) == expected, (found, expected)
        assert init_scale > 1 or float(scale) == 0.0


@check
def malformed_calls_raise_with_the_fix():
    grads = [torch.ones(2)]
    raises(TypeError, ["int32"], multi_tensor_applier, amp_C.multi_tensor_l2norm, torch.zeros(1, dtype=torch.long),
           [grads], False)
    raises(ValueError, ["empty"], multi_tensor_applier, amp_C.multi_tensor_l2norm, flag(), [[]], False)
    raises(ValueError, ["takes 2"], multi_tensor_applier, amp_C.multi_tensor_scale, flag(), [grads], 1.0)
    raises(ValueError, ["tensor_lists[1] holds 2"], multi_tensor_applier, amp_C.multi_tensor_scale, flag(),
           [grads, grads * 2], 1.0)
    raises(ValueError, ["noop_flag is on meta"], multi_tensor_applier, amp_C.multi_tensor_l2norm,
           torch.zeros(1, dtype=torch.int, device="meta"), [grads], False)
    raises(TypeError, ["torch.optim.SGD"], multi_tensor_applier, amp_C.multi_tensor_sgd, flag(),
           [[torch.ones(2, dtype=torch.float64)]] * 3, 0.0, 0.9, 0.0, 0.1, False, False, False, 1.0)
    raises(AttributeError, ["no attribute 'multi_tensor_lamb_stage3_cuda'"], getattr, amp_C,
           "multi_tensor_lamb_stage3_cuda")
    raises(TypeError, ["chunk_size"], amp_C.multi_tensor_l2norm, 0, flag(), [grads], False)


if __name__ == "__main__":
    from _compat_amp_c_optimizers import CHECKS as OPTIMIZER_CHECKS

    CHECKS.update(OPTIMIZER_CHECKS)
    torch.set_num_threads(1)
    results = {}
    for name, function in CHECKS.items():
        try:
            function()
            results[name] = "ok"
        except Exception as error:  # noqa: BLE001 - reported to the test, which names the check
            results[name] = f"{type(error).__name__}: {error}"
    print(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)
