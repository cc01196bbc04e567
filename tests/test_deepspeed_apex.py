"""DeepSpeed's engine in its amp mode (``"amp": {"enabled": true, "opt_level": ...}``) on apex_amp.

DeepSpeed (pinned below, with its pure-Python dependencies) is installed into a throwaway venv
next to ``pip install ./compat/apex`` (``_throwaway_venv.py``); ``_deepspeed_client.py`` then
trains a small regressor through ``deepspeed.initialize`` and the engine's forward, backward and
step, unmodified, at O1 and O2. The environment is the one of a one-rank CPU launch:
``DS_ACCELERATOR=cpu`` (DeepSpeed's CPU accelerator, no compiled ops installed:
``DS_BUILD_OPS=0``; its process group JIT-builds DeepSpeed's shared-memory communication op
on the first run, into a folder of this module's venv) and RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
for its gloo process group.

Why it matters: DeepSpeed >= 0.17.6 runs its engine's forward under
``torch.autocast(enabled=False)`` when ``torch.is_autocast_enabled()`` reads True, which O1
once made it do: the model then trained in fp32 while amp scaled the loss. Under apex (and
apex_amp now) torch's autocast flags read False, and O1's casts reach the forward.

Costs here: the install ~1-2 min (DeepSpeed is built from its source distribution), the first
run ~1-2 min (the JIT build), later runs ~15 s.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from _throwaway_venv import TIMEOUT_S, make_venv, pip_install_compat, pip_install_pinned

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
RUN_TIMEOUT_S = 1800  # the first run JIT-builds DeepSpeed's op: minutes on a loaded 2-core machine
DEEPSPEED = [
    "deepspeed==0.18.2", "hjson==3.1.0", "py-cpuinfo==9.0.0", "psutil==7.2.2", "msgpack==1.2.4", "einops==0.8.2",
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "tqdm==4.70.1", "numpy==2.4.6",
]


@pytest.fixture(scope="module")
def deepspeed_python(tmp_path_factory) -> Path:
    python = make_venv(tmp_path_factory.mktemp("deepspeed-venv") / "venv")
    (python.parents[1] / "torch_extensions").mkdir()  # DeepSpeed's JIT build, this module's own
    done = pip_install_pinned(python, DEEPSPEED, build_isolation=False, env=dict(os.environ, DS_BUILD_OPS="0"),
                              timeout=4 * TIMEOUT_S)
    assert done.returncode == 0, f"installing deepspeed failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    done = pip_install_compat(python)
    assert done.returncode == 0, f"pip install ./compat/apex failed:\n{done.stdout}\n{done.stderr}"
    return python


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _onednn_has_fp16() -> bool:
    # DeepSpeed's CPU accelerator lists fp16 among its dtypes only where this reads True
    # (accelerator/cpu_accelerator.py: is_fp16_supported); its gradient all-reduce then refuses fp16.
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_deepspeeds_amp_mode_trains_in_half_precision(deepspeed_python, tmp_path, opt_level):
    if opt_level == "O2" and not _onednn_has_fp16():
        pytest.skip("DeepSpeed's CPU accelerator reduces no fp16 gradients where oneDNN has no fp16 "
                    "(torch.ops.mkldnn._is_mkldnn_fp16_supported() is False), and O2's model is fp16: 'attempting "
                    "to reduce an unsupported grad type: torch.float16' (seen on an AVX2-only AMD EPYC)")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               # Not the shared ~/.cache: a run killed while building there leaves a lock that blocks the next.
               TORCH_EXTENSIONS_DIR=str(deepspeed_python.parents[1] / "torch_extensions"))
    done = subprocess.run([str(deepspeed_python), str(TESTS / "_deepspeed_client.py"), opt_level],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=tmp_path)
    assert done.returncode == 0, f"DeepSpeed's engine failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["apex_is_compat"] and found["amp_enabled"] and found["deepspeed"] == "0.18.2"
    # The engine's forward ran O1's casts (torch's autocast flags off, as under apex), or O2's half model.
    assert found["hidden_dtypes"] == ["torch.float16"]
    assert found["autocast_flags_in_forward"] == [[False, False]]
    assert found["autocast_flags_outside"] == [False, False]
    assert found["first_param_dtype"] == ("torch.float16" if opt_level == "O2" else "torch.float32")
    losses = found["losses"]
    assert sum(losses[-5:]) < 0.2 * sum(losses[:5])
