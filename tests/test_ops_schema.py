"""The two backends expose the same ops: schemas, wrappers and the backend switch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import _reference as ref
from apex_amp import ops
from apex_amp._op_registry import OPS
from apex_amp._extension import STATUS


def _signature(op_name: str, namespace) -> tuple:
    """Everything a caller sees of a schema: names, types, defaults, keyword-only
    flags and which arguments are written (alias-set letters ignored)."""
    schema = getattr(namespace, op_name).default._schema
    arguments = tuple(
        (
            arg.name,
            str(arg.type),
            repr(arg.default_value) if arg.has_default_value() else None,
            arg.kwarg_only,
            bool(arg.alias_info and arg.alias_info.is_write),
        )
        for arg in schema.arguments
    )
    return arguments, tuple(str(r.type) for r in schema.returns)


OP_NAMES = sorted(OPS)
OPTIMIZER_OPS = {"fused_adam_", "fused_sgd_", "fused_adagrad_", "fused_novograd_", "fused_lamb_", "fused_lamb_moments_",
                 "fused_lamb_update_"}


def test_every_op_is_defined_once_in_the_registry():
    # The list ops and the scaler in apex_amp/_fallback.py, each optimizer's op beside its optimizer.
    assert {"check_finite", "unscale_", "scale_", "axpby_", "l2norm", "update_scale_"} | OPTIMIZER_OPS == set(OPS)


@pytest.mark.parametrize("op_name", OP_NAMES)
def test_fallback_schema_matches_the_extension(op_name):
    if not STATUS.loaded:
        pytest.skip(f"compiled extension not in use: {STATUS.reason}")
    assert _signature(op_name, torch.ops.apex_amp_fallback) == _signature(op_name, torch.ops.apex_amp)


def test_every_op_has_a_fallback_and_a_cpu_kernel():
    # (Each fake kernel is exercised by tests/test_ops_opcheck.py.)
    for op_name in OP_NAMES:
        assert hasattr(torch.ops.apex_amp_fallback, op_name)
    if STATUS.loaded:  # the extension defines exactly these ops, each with a CPU kernel
        defined = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("apex_amp::")}
        assert defined == set(OP_NAMES)
        for op_name in OP_NAMES:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"apex_amp::{op_name}", "CPU"), op_name


# In a child process that loads the compiled kernels without apex_amp: the C++ kernel of
# fused_sgd_ is registered, and a schema that disagrees with it is then refused.
WRONG_SCHEMA = """
import sys, torch
torch.ops.load_library(sys.argv[1])  # the kernels alone: apex_amp itself would define the schema
library = torch.library.Library("apex_amp", "FRAGMENT")
try:
    library.define("fused_sgd_(Tensor(a!)[] params, Tensor[] grads, float lr) -> ()")
    print("accepted")
except RuntimeError as error:
    print("refused:", str(error).splitlines()[0])
"""


def test_a_schema_that_disagrees_with_the_cpp_launcher_is_refused():
    # The one source of a signature is its Python definition; the dispatcher compares each C++
    # launcher's own signature with it when both are known, so a drifted launcher fails at import.
    if not STATUS.loaded:
        pytest.skip(f"compiled extension not in use: {STATUS.reason}")
    result = subprocess.run([sys.executable, "-c", WRONG_SCHEMA, STATUS.module.__file__], capture_output=True,
                            text=True, timeout=120)
    assert "refused: Inferred operator schema for a C++ kernel function doesn't match" in result.stdout, (
        result.stdout + result.stderr)


def test_backend_namespace_rejects_unknown_names():
    with pytest.raises(ValueError, match="backend must be 'extension' or 'fallback'"):
        ops.backend_namespace("cuda")


def test_backend_namespace_explains_a_missing_extension():
    if STATUS.loaded:
        pytest.skip("the extension is loaded")
    with pytest.raises(RuntimeError, match="compiled extension is not available"):
        ops.backend_namespace("extension")


def test_public_wrappers_run_on_the_backend_in_use():
    grads = [torch.full((5,), 4.0), torch.full((3,), 4.0, dtype=torch.bfloat16)]
    found_inf = ref.flag(0.0)
    ops.unscale_(grads, found_inf, ref.flag(0.25))
    ops.check_finite(grads, found_inf)
    assert found_inf.item() == 0.0 and all(torch.equal(g, torch.ones_like(g)) for g in grads)
    master = [torch.zeros(5)]
    model = [torch.empty(5, dtype=torch.float16)]
    ops.scale_(master, model, ref.flag(1.0), found_inf)
    ops.axpby_(grads[:1], master, ref.flag(2.0), 0.5, found_inf)
    assert torch.equal(master[0], torch.full((5,), 2.0))
    total, per_tensor = ops.l2norm(master, per_tensor=True)
    assert total.item() == pytest.approx(20.0**0.5) and per_tensor.shape == (1,)
    step = torch.zeros(1)
    moments = [torch.zeros(5)], [torch.zeros(5)]
    ops.fused_adam_(master, grads[:1], *moments, step, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, model_params=model)
    assert step.item() == 1.0 and torch.equal(model[0], master[0].half())
    scale = torch.full((1,), 1024.0)
    trackers = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    ops.update_scale_(scale, *trackers, ref.flag(1.0))
    assert scale.item() == 512.0
