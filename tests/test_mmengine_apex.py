"""mmengine's own ``ApexOptimWrapper`` and ``Runner`` on apex_amp, through the compat distribution.

mmengine (pinned below) is installed with its pure-Python dependencies into a throwaway venv
next to ``pip install ./compat/apex`` (``_throwaway_venv.py``); ``_mmengine_client.py`` then
trains a classifier with mmengine's Runner at O1 and O2, two epochs straight and one epoch plus
a resume from its checkpoint, on the compiled extension and on the pure-PyTorch fallback.
mmengine's Runner itself is unmodified; two settings are the environment's, not the code's:
``APEX_AMP_HALF_DTYPE=bfloat16`` (fast on CPU) and ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``
(mmengine 0.10.7's resume loads its own checkpoints, which hold its HistoryBuffer objects,
with ``torch.load``'s default, and torch >= 2.6 refuses them: torch's documented switch).

Costs here: the install ~10 s (from the package index), each run ~6 s.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from _throwaway_venv import TIMEOUT_S, make_venv, pip_install_compat, pip_install_pinned

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
# mmengine and the dependencies its Runner imports, at fixed versions (no --deps resolution:
# mmengine asks for opencv-python, of which the headless build is the same cv2 without GUI libraries).
MMENGINE = [
    "mmengine==0.10.7", "addict==2.4.0", "PyYAML==6.0.4", "rich==15.0.0", "termcolor==3.3.0", "yapf==0.43.0",
    "platformdirs==4.14.8", "markdown-it-py==4.3.0", "mdurl==0.1.2", "Pygments==2.21.0",
    "opencv-python-headless==5.0.0.93",
]


@pytest.fixture(scope="module")
def mmengine_python(tmp_path_factory) -> Path:
    python = make_venv(tmp_path_factory.mktemp("mmengine-venv") / "venv")
    done = pip_install_pinned(python, MMENGINE)
    assert done.returncode == 0, f"installing mmengine failed:\n{done.stdout}\n{done.stderr}"
    done = pip_install_compat(python)
    assert done.returncode == 0, f"pip install ./compat/apex failed:\n{done.stdout}\n{done.stderr}"
    return python


@pytest.mark.parametrize("backend", ["extension", "fallback"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_mmengine_runner_trains_and_resumes_bitwise(mmengine_python, tmp_path, opt_level, backend):
    env = dict(os.environ, OMP_NUM_THREADS="1", APEX_AMP_HALF_DTYPE="bfloat16", TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    if backend == "fallback":
        env["APEX_AMP_FORCE_FALLBACK"] = "1"
    done = subprocess.run([str(mmengine_python), str(TESTS / "_mmengine_client.py"), opt_level, str(tmp_path)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=tmp_path)
    assert done.returncode == 0, f"mmengine's Runner failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["apex_is_compat"] and found["has_amp_stash"]
    # Written through apex_amp, loadable by NVIDIA apex (no key without "loss_scaler").
    assert found["saved_amp_keys"] == ["loss_scaler0"]
    assert found["saved_unskipped"] == 6 and found["unskipped_after_resume"] == 12
    assert found["momentum_restored"]
    assert found["first_param_dtype"] == ("torch.bfloat16" if opt_level == "O2" else "torch.float32")
    assert found["master_dtype"] == "torch.float32"
    first, last = found["losses_straight"][:3], found["losses_straight"][-3:]
    assert sum(last) < 0.8 * sum(first)
    assert found["resume_is_bitwise"] and found["model_state_is_bitwise"]
