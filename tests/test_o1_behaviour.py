"""O1 behaviour beyond single rows: in-place ops, registration API, disable_casts, banned
ops, activation life cycle, and plain torch.autocast left as torch made it."""
from __future__ import annotations

import threading
import types

import pytest
import torch
import torch.nn.functional as F

from apex_amp.amp import casting
from apex_amp.amp.casting.rules import DEVICES, RULES, Rule, aten_rules, python_rules, render_markdown_table
from apex_amp.amp.casting.registry import python_owner

HALF_DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture
def o1():
    def start(half_dtype=torch.bfloat16, **kwargs):
        casting.activate(half_dtype, **kwargs)

    yield start
    casting.deactivate()


def _op(name):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


# -- the table itself ----------------------------------------------------------------------

def test_every_aten_name_in_the_table_exists():
    for row in RULES:
        for name in (*row.aten, *row.inplace):
            assert _op(name).name().startswith("aten::"), name
        for module_name, attribute in row.python:
            assert callable(getattr(python_owner(module_name), attribute))


@pytest.mark.parametrize("device", DEVICES, ids=["dispatch-cpu", "dispatch-gpu"])
def test_no_operator_has_two_rules(device):
    names = [name for name, _ in aten_rules(device)]
    assert len(names) == len(set(names)) > 0


def test_markdown_table_has_one_line_per_row():
    table = render_markdown_table().splitlines()
    assert len(table) == 2 + len(RULES)
    for row, line in zip(RULES, table[2:]):
        assert line.startswith(f"| {row.name} | {row.rule.value} |")


# -- in-place fp32-rule ops ------------------------------------------------------------------

INPLACE_CALLS = {
    "pow_.Scalar": lambda t: t.pow_(2),
    "pow_.Tensor": lambda t: t.pow_(torch.full_like(t, 2)),
    "cumsum_": lambda t: t.cumsum_(0),
    "cumprod_": lambda t: t.cumprod_(0),
    "renorm_": lambda t: t.renorm_(2, 0, 1.0),
    "gelu_": lambda t: torch.ops.aten.gelu_(t),
}
INPLACE_NAMES = [name for row in RULES for name in row.inplace]


def _call_inplace(name, tensor):
    call = INPLACE_CALLS.get(name, lambda t: getattr(t, name)())
    return call(tensor)


@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", INPLACE_NAMES)
def test_inplace_fp32_op_on_half_raises(o1, name, half_dtype):
    o1(half_dtype)
    tensor = torch.full((2, 3), 0.25, dtype=half_dtype)
    with pytest.raises(NotImplementedError, match="in-place op cannot change its tensor's dtype"):
        _call_inplace(name, tensor)
    assert torch.equal(tensor, torch.full((2, 3), 0.25, dtype=half_dtype))  # untouched


@pytest.mark.parametrize("name", INPLACE_NAMES)
def test_inplace_fp32_op_on_fp32_or_with_casts_disabled_runs(o1, name):
    o1(torch.bfloat16)
    fp32 = torch.full((2, 3), 0.25)
    assert _call_inplace(name, fp32).dtype == torch.float32
    with casting.disable_casts():
        assert _call_inplace(name, torch.full((2, 3), 0.25, dtype=torch.bfloat16)).dtype == torch.bfloat16


# -- registration API --------------------------------------------------------------------

def _namespace():
    # Reports the dtypes it was called with, and runs a linear inside so we can see whether
    # the ops inside a registered function are re-cast.
    def probe(a, b, *, weight=None):
        inner = F.linear(a.float() if a.dtype == torch.float64 else a, weight) if weight is not None else None
        return (a.dtype, b.dtype, None if inner is None else inner.dtype)

    return types.SimpleNamespace(probe=probe)


def test_register_before_activate_applies_on_activate_and_is_removed_on_deactivate():
    ns = _namespace()
    original = ns.probe
    casting.register_half_function(ns, "probe")
    try:
        assert ns.probe is original  # nothing patched while O1 is off
        casting.activate(torch.bfloat16)
        try:
            assert ns.probe(torch.ones(2), torch.ones(2))[:2] == (torch.bfloat16, torch.bfloat16)
            with casting.disable_casts():
                assert ns.probe(torch.ones(2), torch.ones(2))[:2] == (torch.float32, torch.float32)
        finally:
            casting.deactivate()
        assert ns.probe is original
    finally:
        casting.unregister_function(ns, "probe")


def test_register_after_activate_applies_at_once(o1):
    o1(torch.float16)
    ns = _namespace()
    casting.register_float_function(ns, "probe")
    try:
        weight = torch.nn.Parameter(torch.ones(2, 2))
        a_dtype, b_dtype, inner = ns.probe(torch.ones(2, dtype=torch.float16), torch.ones(2), weight=weight)
        # inputs cast to fp32, and the linear inside a float function is not re-cast to half
        assert (a_dtype, b_dtype, inner) == (torch.float32, torch.float32, torch.float32)
    finally:
        casting.unregister_function(ns, "probe")
    assert ns.probe(torch.ones(2, dtype=torch.float16), torch.ones(2))[0] == torch.float16


def test_register_promote_function(o1):
    o1(torch.bfloat16)
    ns = _namespace()
    casting.register_promote_function(ns, "probe")
    try:
        assert ns.probe(torch.ones(2, dtype=torch.bfloat16), torch.ones(2))[:2] == (torch.float32, torch.float32)
        half = torch.ones(2, dtype=torch.bfloat16)
        assert ns.probe(half, half)[:2] == (torch.bfloat16, torch.bfloat16)
    finally:
        casting.unregister_function(ns, "probe")


def test_user_registration_overrides_a_builtin_row_until_unregistered(o1):
    o1(torch.bfloat16)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    assert F.normalize(x).dtype == torch.float32
    casting.register_half_function(F, "normalize")
    try:
        assert F.normalize(x).dtype == torch.bfloat16
    finally:
        casting.unregister_function(F, "normalize")
    assert F.normalize(x).dtype == torch.float32


def test_decorators_cast_only_while_active():
    @casting.half_function
    def h(a):
        return a.dtype

    @casting.float_function
    def f(a):
        return a.dtype

    @casting.promote_function
    def p(a, b):
        return a.dtype, b.dtype

    half = torch.ones(2, dtype=torch.bfloat16)
    assert (h(torch.ones(2)), f(half), p(half, torch.ones(2))) == (torch.float32, torch.bfloat16,
                                                                  (torch.bfloat16, torch.float32))
    casting.activate(torch.bfloat16)
    try:
        assert (h(torch.ones(2)), f(half), p(half, torch.ones(2))) == (torch.bfloat16, torch.float32,
                                                                      (torch.float32, torch.float32))
        with casting.disable_casts():
            assert h(torch.ones(2)) == torch.float32
    finally:
        casting.deactivate()
    assert h.__name__ == "h"


@pytest.mark.parametrize("register", [casting.register_half_function, casting.register_float_function,
                                      casting.register_promote_function])
def test_registering_a_missing_name_raises_value_error(register):
    with pytest.raises(ValueError, match="no attribute 'no_such_function'"):
        register(torch, "no_such_function")
    with pytest.raises(TypeError, match="not callable"):
        register(types.SimpleNamespace(x=1), "x")
    with pytest.raises(ValueError, match="never registered"):
        casting.unregister_function(torch, "exp")


# -- disable_casts -----------------------------------------------------------------------

def test_disable_casts_is_nestable_and_restores_after_an_exception(o1):
    o1(torch.bfloat16)
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with casting.disable_casts():
        assert linear(x).dtype == torch.float32
        with casting.disable_casts():
            assert torch.softmax(x.bfloat16(), -1).dtype == torch.bfloat16
        assert linear(x).dtype == torch.float32
    with pytest.raises(KeyError):
        with casting.disable_casts():
            raise KeyError("boom")
    assert linear(x).dtype == torch.bfloat16


def test_disable_casts_is_per_thread(o1):
    o1(torch.bfloat16)
    linear = torch.nn.Linear(4, 4)
    seen = []
    with casting.disable_casts():
        worker = threading.Thread(target=lambda: seen.append(torch.is_autocast_enabled("cpu")))
        worker.start()
        worker.join()
        assert linear(torch.randn(2, 4)).dtype == torch.float32
    assert seen == [False]  # a new thread starts with autocast off, as torch's default


# -- banned ops --------------------------------------------------------------------------

def test_allow_banned_runs_bce_in_fp32_and_matches_reference(o1):
    o1(torch.bfloat16, allow_banned=True)
    probs = torch.rand(4, 3).clamp(0.05, 0.95)
    target = torch.rand(4, 3)
    loss = F.binary_cross_entropy(probs.bfloat16(), target)
    assert loss.dtype == torch.float32
    with casting.disable_casts():
        reference = F.binary_cross_entropy(probs.bfloat16().float(), target)
    torch.testing.assert_close(loss, reference)


def test_bce_works_again_after_deactivate():
    casting.activate(torch.float16)
    with pytest.raises(NotImplementedError, match="banned under apex_amp O1"):
        F.binary_cross_entropy(torch.rand(2), torch.rand(2))
    casting.deactivate()
    assert F.binary_cross_entropy(torch.rand(2), torch.rand(2)).dtype == torch.float32


# -- life cycle and torch.autocast untouched -----------------------------------------------

def _autocast_registrations():
    # (key, op) -> where torch says the kernel came from
    return {(key, name): repr(torch._C._dispatch_get_computed_kernel_for_dispatch_key(name, key))
            for key in ("AutocastCPU", "AutocastCUDA")
            for name in torch._C._dispatch_get_registrations_for_dispatch_key(key)}


def test_o1_leaves_torch_autocast_off_and_its_kernels_untouched_and_deactivate_restores_it():
    before = _autocast_registrations()
    settings = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled())
    casting.activate(torch.float16)
    assert casting.is_active()
    # As under apex: code outside amp sees no autocast (DeepSpeed's engine reads the flag).
    assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
    assert not torch.is_autocast_enabled()  # the legacy form, CUDA's
    assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float16  # yet O1 casts
    assert not torch.is_autocast_cache_enabled()  # our version-checked cache replaces torch's
    assert _autocast_registrations() == before  # O1's kernels live at a key of their own
    casting.deactivate()
    assert not casting.is_active()
    assert _autocast_registrations() == before
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_autocast_cache_enabled()) == settings


def test_autocast_disabled_inside_o1_leaves_o1s_casts_in_force_as_apex(o1):
    o1(torch.bfloat16)
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        y = linear(x)
        assert y.dtype == torch.bfloat16 and torch.softmax(y, -1).dtype == torch.float32
    with casting.disable_casts():  # the way out of O1's casts
        assert linear(x).dtype == torch.float32
    assert linear(x).dtype == torch.bfloat16


def test_a_library_that_reads_the_autocast_flag_gets_o1s_casts(o1):
    # DeepSpeed >= 0.17.6's engine: when torch's autocast is on outside it, its forward runs
    # under torch.autocast(enabled=False).
    o1(torch.float16)
    linear = torch.nn.Linear(4, 4)

    def engine_forward(x):
        if torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
                return linear(x), "autocast seen"
        return linear(x), "no autocast seen"

    out, seen = engine_forward(torch.randn(2, 4))
    assert (out.dtype, seen) == (torch.float16, "no autocast seen")


def test_an_enabled_autocast_inside_o1_adds_torchs_policy(o1):
    o1(torch.bfloat16)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.nn.Linear(4, 4)(x).dtype == torch.float16  # torch's cast of O1's bf16 inputs
        assert torch.softmax(x.half(), -1).dtype == torch.float32  # O1's rule still applies
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("cycle", [False, True], ids=["never-activated", "after-deactivate"])
def test_plain_torch_autocast_keeps_torch_policy_when_o1_is_off(cycle):
    if cycle:
        casting.activate(torch.bfloat16)
        casting.deactivate()
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", torch.bfloat16):
        y = linear(x)
        # torch's CPU policy: softmax and sum stay in half, BCE is allowed (fp32)
        assert torch.softmax(y, -1).dtype == torch.bfloat16
        assert y.sum().dtype == torch.bfloat16
        assert F.binary_cross_entropy(torch.rand(2), torch.rand(2)).dtype == torch.float32
        with pytest.raises(RuntimeError, match="same dtype"):
            torch.dot(torch.ones(2, dtype=torch.bfloat16), torch.ones(2))
        assert torch.exp(torch.ones(2, dtype=torch.bfloat16).exp_()).dtype == torch.bfloat16


def test_backward_ops_follow_torch_policy_not_o1(o1):
    """Autograd runs backward with autocast on; O1 kernels hand those calls to torch's kernels."""
    o1(torch.bfloat16)
    seen = {}

    class LinearInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            weight = torch.ones(2, 2)
            seen["linear"] = F.linear(grad, weight).dtype  # torch's CPU policy: half
            seen["softmax"] = torch.softmax(grad, -1).dtype  # no torch policy: input dtype
            seen["exp_"] = torch.ones(2, dtype=torch.bfloat16).exp_().dtype  # no in-place error
            return grad

    x = torch.randn(2, 2, requires_grad=True)
    LinearInBackward.apply(x).sum().backward()
    assert seen == {"linear": torch.bfloat16, "softmax": torch.float32, "exp_": torch.bfloat16}


def test_activate_validates_arguments():
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        casting.activate(torch.float32)
    with pytest.raises(TypeError, match="allow_banned must be a bool"):
        casting.activate(torch.float16, allow_banned="yes")
    assert not casting.is_active()


def test_activate_twice_switches_dtype_and_python_rows_are_wrapped(o1):
    o1(torch.float16)
    o1(torch.bfloat16)
    assert torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.bfloat16
    for module_name, attribute, _ in python_rules():
        function = getattr(python_owner(module_name), attribute)
        assert hasattr(function, "__apex_amp_original__")
    casting.deactivate()
    for module_name, attribute, _ in python_rules():
        function = getattr(python_owner(module_name), attribute)
        assert not hasattr(function, "__apex_amp_original__")
