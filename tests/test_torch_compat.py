"""The supported torch releases (apex_amp/_torch_compat.py): one list, which the build, CI and docs agree
with, and each bridged difference working on the running release, compiled by torch.compile too.

The differences are pinned from both sides by running this suite on the tested releases: the pin
(scripts/setup.sh's default) here, and torch 2.11.0 by .ci/run's fast subset.
"""

from __future__ import annotations

import enum
import re
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from apex_amp import _torch_compat as compat

ROOT = Path(__file__).resolve().parents[1]


# ---- one list of tested releases ----------------------------------------------------------------
def test_release_reads_major_and_minor_from_release_local_and_nightly_versions():
    assert compat.release("2.11.0+cu130") == (2, 11)
    assert compat.release("2.14.1") == (2, 14)
    assert compat.release("2.16.0a0+git1234abc") == (2, 16)
    assert compat.release("3.0.0rc1") == (3, 0)


def test_the_oldest_tested_release_is_pyprojects_torch_floor():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    torch_requirements = [req for req in project["dependencies"] if re.match(r"torch\b", req)]
    assert torch_requirements == [f"torch>={compat.OLDEST_TESTED_RELEASE}"]


def test_setup_installs_the_pinned_release_unless_told_otherwise():
    setup = (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    assert f'TORCH_VERSION="${{TORCH_VERSION:-{compat.PINNED_RELEASE}}}"' in setup
    assert compat.PINNED_RELEASE in compat.TESTED_RELEASES


def test_ci_runs_the_fast_subset_on_the_oldest_tested_release():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f"\nOLDEST_TORCH={compat.OLDEST_TESTED_RELEASE}\n" in ci and "TORCH_VERSION=$OLDEST_TORCH" in ci
    assert '-m "not slow"' in ci


def test_the_install_page_lists_the_tested_releases():
    page = (ROOT / "docs" / "getting_started.md").read_text(encoding="utf-8")
    listed = re.search(r"^Tested torch releases: (.*)$", page, re.MULTILINE)
    assert listed, "docs/getting_started.md has a line 'Tested torch releases: ...'"
    assert re.findall(r"\b\d+\.\d+\.\d+\b", listed.group(1)) == list(compat.TESTED_RELEASES)


def test_no_module_outside_the_compat_module_reads_the_torch_version():
    # Release differences live in _torch_compat.py; elsewhere torch.__version__ is only printed.
    readers = []
    for path in (ROOT / "apex_amp").rglob("*.py"):
        if path.name == "_torch_compat.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"torch\.__version__\s*[<>=!]|TorchVersion|version\.parse|hasattr\(torch\b", line):
                readers.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not readers


# ---- autocast_disabled ----------------------------------------------------------------------------
def matmul_with_casts_disabled(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with compat.autocast_disabled("cpu"):
        inside = x @ w
    return inside, x @ w


@pytest.fixture
def cpu_autocast_on():
    torch.set_autocast_dtype("cpu", torch.bfloat16)
    torch.set_autocast_enabled("cpu", True)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cpu", False)
        torch.set_autocast_dtype("cpu", torch.bfloat16)


def test_autocast_disabled_turns_autocast_off_inside_and_restores_it(cpu_autocast_on):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    inside, after = matmul_with_casts_disabled(x, w)
    assert (inside.dtype, after.dtype) == (torch.float32, torch.bfloat16)
    assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")


def test_autocast_disabled_compiles_into_one_graph_without_breaks(cpu_autocast_on):
    # torch 2.11's dynamo skips torch.set_autocast_enabled: a plain switch breaks the graph there.
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(matmul_with_casts_disabled)(x, w)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    inside, after = torch.compile(matmul_with_casts_disabled, backend="aot_eager", fullgraph=True)(x, w)
    assert (inside.dtype, after.dtype) == (torch.float32, torch.bfloat16)
    with torch.autocast("cpu", enabled=False):
        torch.testing.assert_close(inside, x @ w, rtol=0, atol=0)
    assert torch.is_autocast_enabled("cpu")


# ---- hash_enum_by_identity ------------------------------------------------------------------------
@compat.hash_enum_by_identity
class Light(enum.Enum):
    RED = "stop"
    GREEN = "go"


_MOVES_ON = frozenset({Light.GREEN})


def test_an_enum_hashed_by_identity_is_still_a_working_set_and_dict_key():
    assert Light.GREEN in _MOVES_ON and Light.RED not in _MOVES_ON
    assert {Light.RED: 1, Light.GREEN: 2}[Light.GREEN] == 2
    assert Light("go") is Light.GREEN


class Crossing:
    def __init__(self, light: Light) -> None:
        self.light = light

    def scale_if_moving(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if self.light in _MOVES_ON else x


@pytest.mark.parametrize("light, factor", [(Light.GREEN, 2.0), (Light.RED, 1.0)])
def test_an_enum_hashed_by_identity_is_looked_up_inside_a_compiled_graph(light, factor):
    # torch 2.11 and 2.12's dynamo refuse to hash a member whose class defines __hash__ (an error
    # under fullgraph=True). One compilation per state: torch 2.14 and 2.15 reuse a graph traced
    # for one member for another when a method looks self's member up in a module-level set (no
    # guard on the member), with Enum's own hash too; that is torch's, not this function's.
    torch._dynamo.reset()
    compiled = torch.compile(Crossing(light).scale_if_moving, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), factor))


# ---- fsdp2_param_groups ---------------------------------------------------------------------------
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp2_param_groups_are_the_groups_that_set_requires_gradient_sync_switches(process_group):
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    groups = [compat.fsdp2_param_groups(module._get_fsdp_state()) for module in (model[0], model)]
    assert [len(g) for g in groups] == [1, 1]
    model.set_requires_gradient_sync(False)
    assert [group.reduce_grads for g in groups for group in g] == [False, False]
    model.set_requires_gradient_sync(True)
    assert [group.reduce_grads for g in groups for group in g] == [True, True]


# ---- INDUCTOR_CPU_EMULATES_PRECISION_CASTS --------------------------------------------------------
def widened_bf16_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a + b).float()  # eager rounds the sum to bf16, then widens it


@pytest.mark.slow
def test_inductor_rounds_a_widened_bf16_sum_as_eager_exactly_where_the_compat_module_says():
    # torch 2.11's CPU code generator widens the unrounded fp32 sum instead (pytorch/pytorch#185337).
    import torch._inductor.config as inductor_config

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4, 64, generator=generator).to(torch.bfloat16) for _ in range(2))
    torch._dynamo.reset()
    with inductor_config.patch(emulate_precision_casts=True):
        compiled = torch.compile(widened_bf16_sum, backend="inductor")(a, b)
    torch._dynamo.reset()
    assert torch.equal(compiled, widened_bf16_sum(a, b)) == compat.INDUCTOR_CPU_EMULATES_PRECISION_CASTS
    assert torch.equal(compiled.to(torch.bfloat16), widened_bf16_sum(a, b).to(torch.bfloat16))
