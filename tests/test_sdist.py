"""apex_amp's source distribution holds what its build needs, and installs and trains from it.

``python -m build --sdist`` makes the archive (here with ``APEX_AMP_CUDA=0``: the CUDA sources
must be in it even where it is made without a CUDA toolkit). Then, as a new user would: a fresh
venv that sees none of the project's packages gets torch (the release this suite runs on),
ninja, setuptools and wheel from the package index; ``pip install --no-build-isolation
apex_amp-*.tar.gz`` compiles the kernels (the CPU ones: ``APEX_AMP_CUDA=0``, as the CUDA
kernels could not run here); and a smoke test, run outside the checkout, imports the installed
apex_amp, prints the report and takes an O2 step with FusedAdam on the compiled kernels.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
import torch

from _throwaway_venv import make_bare_venv

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# The files of the repository the build and the installed package need, besides csrc/ and apex_amp/.
BUILD_FILES = {"setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE"}
# What the repository holds for its own work, never the sdist's: the compat distribution is one of
# its own (docs/building.md says why).
LEFT_OUT = ("compat/", "tests/", "docs/", "examples/", "benchmarks/", "scripts/", ".ci/")
# Long enough for a slow build, short of a hang: the CPU kernels' build (MAX_JOBS=2) took over 20
# minutes on the project's 2-core machine while other builds ran on it.
INSTALL_TIMEOUT_S = 3000


def tracked(folder: str = ".") -> set[str]:
    """The checkout's files under ``folder``: committed or not, without what git ignores.

    In a copy of the tree that is not a git checkout (``.ci/run`` tests another torch release in
    one), git lists the copy's files against an empty repository of its own: every file is then
    untracked, and the copy's ``.gitignore`` still leaves out what a clone would not hold.
    """
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the sdist is checked against the files of a clone, "
                    "which git lists (honouring .gitignore)")
    command = ["ls-files", "--cached", "--others", "--exclude-standard", folder]
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True)
    if top.returncode == 0 and Path(top.stdout.strip()).resolve() == ROOT:
        listing = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True, check=True)
    else:
        with tempfile.TemporaryDirectory() as empty:
            subprocess.run(["git", "init", "--quiet", empty], check=True, capture_output=True)
            listing = subprocess.run(["git", f"--git-dir={empty}/.git", f"--work-tree={ROOT}", *command], cwd=ROOT,
                                     capture_output=True, text=True, check=True)
    return {name for name in listing.stdout.split() if (ROOT / name).is_file()}


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    # From a copy of the checkout's files, as in a fresh clone: setuptools also packs whatever an
    # earlier build listed in apex_amp.egg-info/SOURCES.txt, which would hide a missing rule.
    source = tmp_path_factory.mktemp("checkout")
    for name in tracked():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    environment = dict(os.environ, APEX_AMP_CUDA="0")
    result = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out),
                             str(source)], capture_output=True, text=True, timeout=600, env=environment)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (archive,) = out.glob("apex_amp-*.tar.gz")
    return archive


def test_the_sdist_holds_every_source_the_build_needs_and_nothing_else(sdist):
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    needed = tracked("csrc") | tracked("apex_amp") | BUILD_FILES
    assert any(name.startswith("csrc/cuda/") for name in needed)
    assert not needed - names, f"missing from the sdist: {sorted(needed - names)}"
    unwanted = sorted(name for name in names if name.startswith(LEFT_OUT) or name.endswith((".so", ".o", ".pyc")))
    assert not unwanted, f"in the sdist but not wanted: {unwanted}"


SMOKE = r"""
import json, subprocess, sys
import torch
import apex_amp
from apex_amp import _build_report, amp, ops
from apex_amp.optimizers import FusedAdam

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = FusedAdam(model.parameters(), lr=1e-2)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
x, y = torch.randn(32, 8), torch.randn(32, 1)
before = [p.detach().clone() for p in amp.master_params(optimizer)]
with torch.profiler.profile() as profile:
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
# The compiled kernel calls no aten op; the pure-PyTorch implementation calls dozens.
adam_calls = [[child.name for child in event.cpu_children] for event in profile.events()
              if event.name.endswith("::fused_adam_")]
report = subprocess.run([sys.executable, "-m", "apex_amp", "report", "--require-extension"],
                        capture_output=True, text=True)
info = _build_report.collect()
print(json.dumps({
    "apex_amp": apex_amp.__file__, "extension": info["extension_path"], "backend": ops.BACKEND,
    "compiled_devices": info["compiled_devices"], "report_rc": report.returncode, "report": report.stdout,
    "adam_calls": adam_calls, "loss_finite": bool(torch.isfinite(loss)),
    "moved": all(not torch.equal(a, b) for a, b in zip(before, amp.master_params(optimizer))),
}))
"""


def test_the_sdist_installs_into_a_fresh_venv_builds_the_kernels_and_trains(sdist, tmp_path):
    torch_release = torch.__version__.split("+")[0]
    python = make_bare_venv(tmp_path / "venv", [f"torch=={torch_release}", "ninja", "setuptools>=77", "wheel"],
                            timeout_s=INSTALL_TIMEOUT_S)
    environment = dict(os.environ, APEX_AMP_CUDA="0", MAX_JOBS="2")
    environment.pop("PYTHONPATH", None)
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-build-isolation",
                              "--disable-pip-version-check", str(sdist)], capture_output=True, text=True,
                             timeout=INSTALL_TIMEOUT_S, env=environment, cwd=tmp_path)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    # From outside the checkout, so that only the installed apex_amp can be imported.
    smoke = subprocess.run([str(python), "-c", SMOKE], capture_output=True, text=True, timeout=300,
                           env=environment, cwd=tmp_path)
    assert smoke.returncode == 0, smoke.stderr[-3000:]
    outcome = json.loads(smoke.stdout.strip().splitlines()[-1])
    venv = str(tmp_path / "venv")
    assert outcome["apex_amp"].startswith(venv) and outcome["extension"].startswith(venv), outcome
    assert outcome["backend"] == "extension" and outcome["compiled_devices"] == ["CPU"]
    assert outcome["report_rc"] == 0, outcome["report"]
    assert "devices        compiled kernels for CPU" in outcome["report"]
    assert outcome["adam_calls"] == [[]], outcome["adam_calls"]
    assert outcome["loss_finite"] and outcome["moved"]
