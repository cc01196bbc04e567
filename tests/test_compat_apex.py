"""The opt-in compat distribution `apex` (compat/apex): installed into a throwaway venv, used as
third-party code uses NVIDIA apex, refusing to hide another apex, and raising named replacements.

The throwaway venv (``_throwaway_venv.py``) sees the project's packages; pip installs the compat
distribution from the local folder with ``--no-deps --no-build-isolation --no-index``: no network.

Costs here: making the venv and installing ~4 s, the script that uses it ~8 s, the 2-rank run
~12 s (slow); the refusal tests stop before torch is imported, ~0.1 s each.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import apex_amp
from _throwaway_venv import COMPAT, TIMEOUT_S, make_venv, pip_install_compat, site_packages_of

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def _load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Both are standard-library only, so the tests read their rules without importing `apex`.
guard = _load_by_path("_compat_apex_guard_under_test", COMPAT / "apex" / "_apex_amp_guard.py")
unavailable = _load_by_path("_compat_apex_unavailable_under_test", COMPAT / "apex" / "_unavailable.py")


# Import statements a client may run, each with the error it must raise (None: it works) and a
# part of the message that names the replacement.
IMPORTS = {
    "from apex.amp import initialize, scale_loss, master_params": (None, ""),
    "from apex.parallel.distributed import DistributedDataParallel": (None, ""),
    "import apex.normalization": (None, ""),
    "from apex.normalization.fused_layer_norm import fused_layer_norm_affine": (None, ""),
    "from apex.fp16_utils import FP16_Optimizer": ("ModuleNotFoundError", "opt_level='O2'"),
    "from apex.multi_tensor_apply import multi_tensor_applier; import amp_C": (None, ""),
    "from apex.multi_tensor_apply.multi_tensor_apply import MultiTensorApply": (None, ""),
    "import apex.contrib.xentropy": ("ModuleNotFoundError", "torch.nn.CrossEntropyLoss(label_smoothing"),
    "import apex.contrib.bottleneck": ("ModuleNotFoundError", "torch.compile"),
    "from apex.transformer import parallel_state": ("ModuleNotFoundError", "megatron.core"),
    "from apex.optimizers import FusedSGD, FusedLAMB, FusedNovoGrad, FusedAdagrad, FusedMixedPrecisionLamb": (None, ""),
    "import amp_C; amp_C.multi_tensor_lamb_stage1_cuda, amp_C.multi_tensor_lamb_stage2_cuda": (None, ""),
    "import apex_C; from apex.parallel.distributed import flat_dist_call": (None, ""),
    "from apex.amp import init, half_function, float_function, promote_function": (None, ""),
    "from apex.optimizers import FusedLARC": ("ImportError", "cannot import name"),
    "from apex.parallel.LARC import LARC; import apex_amp; assert LARC is apex_amp.optimizers.LARC": (None, ""),
    "from apex.parallel import Reducer": (None, ""),
    "import apex.parallel.multiproc": ("ModuleNotFoundError", "torchrun"),
    "from apex.amp import _amp_state": (None, ""),
    "from apex.amp._amp_state import _amp_state": (None, ""),
    "import apex.amp.handle": ("ModuleNotFoundError", "public API"),
    "apex.fp16_utils": ("AttributeError", "opt_level='O2'"),
    "assert not hasattr(apex, 'fp16_utils')": (None, ""),
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The python of a throwaway venv with the compat distribution installed."""
    python = make_venv(tmp_path_factory.mktemp("compat-venv") / "venv")
    done = pip_install_compat(python)
    assert done.returncode == 0, f"pip install ./compat/apex failed:\n{done.stdout}\n{done.stderr}"
    return python


@pytest.fixture(scope="module")
def findings(installed) -> dict:
    done = subprocess.run([str(installed), str(TESTS / "_compat_apex_installed.py"), *IMPORTS],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, f"the script in the compat venv failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_project_install_does_not_bring_apex():
    # The compat distribution is opt-in: scripts/setup.sh's `pip install .` must not install it.
    assert importlib.util.find_spec("apex") is None
    assert "compat" not in (ROOT / "scripts" / "setup.sh").read_text()


def test_compat_version_follows_apex_amp_and_pins_it():
    pyproject = (COMPAT / "pyproject.toml").read_text()
    assert re.search(r'^version = "(.*)"$', pyproject, re.M).group(1) == f"{apex_amp.__version__}+apexamp"
    assert f'"apex_amp=={apex_amp.__version__}"' in pyproject


def test_metadata_checks_pass_as_transformers_makes_them(findings):
    assert findings["version"] == f"{apex_amp.__version__}+apexamp"
    assert "apex_amp==" + apex_amp.__version__ in findings["requires"]
    assert findings["spec_origin"].endswith(os.path.join("site-packages", "apex", "__init__.py"))


def test_apex_amp_and_fused_adam_are_apex_amps_own_objects(findings):
    assert findings["same_amp"] and findings["same_fused_adam"] and findings["amp_has_state_dict"]


def test_the_venv_imports_the_apex_amp_under_test(findings):
    assert findings["apex_amp_file"] == apex_amp.__file__


OPTIMIZERS = ["FusedAdam", "FusedSGD", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad", "FusedAdagrad"]


def test_apex_optimizers_by_name_and_module_are_apex_amps_classes(findings):
    assert findings["same_optimizers"] == dict.fromkeys(OPTIMIZERS, True)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_trains_at_o2_fp16_through_an_overflow_like_fp32(findings, name):
    o2, fp32 = findings[f"o2_overflow_{name}"], findings[f"fp32_{name}"]
    assert o2["skipped_step_kept_weights"] and fp32["skipped_step_kept_weights"]
    assert o2["loss_scale"] == 2.0**15  # backed off once from 2**16
    assert o2["losses"][-1] < 0.9 * o2["losses"][0]
    gaps = [abs(a - b) / b for a, b in zip(o2["losses"], fp32["losses"])]
    assert max(gaps) < 0.02, gaps


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_training_through_the_apex_names_lowers_the_loss(findings, opt_level):
    first, last = findings[f"losses_{opt_level}"]
    assert last < 0.5 * first
    assert findings[f"amp_state_keys_{opt_level}"] == ["loss_scaler0"]  # only keys NVIDIA apex loads
    assert findings[f"first_weight_dtype_{opt_level}"] == ("torch.float16" if opt_level == "O2" else "torch.float32")


def test_timms_distributed_setup_trains_on_one_cpu_rank(findings):
    assert findings["syncbn_type"] == "apex.parallel.sync_batchnorm.SyncBatchNorm"
    assert findings["syncbn_is_torch_syncbn"] and findings["ddp_is_torch_ddp"]
    assert findings["losses_ddp"][1] < findings["losses_ddp"][0]
    assert findings["syncbn_running_mean_moved"]
    assert findings["ddp_state_dict_prefix"] == "module"


@pytest.mark.parametrize("statement", list(IMPORTS))
def test_import_works_or_names_its_replacement(findings, statement):
    error_type, replacement = IMPORTS[statement]
    got_type, message = findings["imports"][statement]
    if error_type is None:
        assert got_type == "ok", message
    else:
        assert (got_type, replacement in message) == (error_type, True), message


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_average_gradients_and_sync_batchnorm_as_apex(installed, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE="2")
    ranks = []
    for rank in range(2):
        out = open(tmp_path / f"{rank}.out", "w+")
        err = open(tmp_path / f"{rank}.err", "w+")
        ranks.append((subprocess.Popen([str(installed), str(TESTS / "_compat_apex_ranks.py")], stdout=out,
                                       stderr=err, text=True, cwd=ROOT, env=dict(env, RANK=str(rank))), out, err))
    deadline = time.monotonic() + TIMEOUT_S
    while any(process.poll() is None for process, _, _ in ranks):
        if any(process.poll() not in (None, 0) for process, _, _ in ranks) or time.monotonic() > deadline:
            for process, _, _ in ranks:  # a failed rank leaves the other waiting in a collective
                if process.poll() is None:
                    process.kill()
            break
        time.sleep(0.1)
    results = []
    for process, out, err in ranks:
        process.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        out.close()
        err.close()
        assert process.returncode == 0, f"a rank failed:\n{stdout}\n{stderr}"
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    for result in results:
        assert Path(result["apex"]).parent.parent == site_packages_of(installed)
        errors = result["errors"]
        exact = {name: error for name, error in errors.items() if not name.startswith("syncbn_") or "group" in name
                 or name == "syncbn_is_apex"}
        assert exact == dict.fromkeys(exact, 0.0)
        close = {name: error for name, error in errors.items() if name not in exact}
        assert close and all(error < 1e-5 for error in close.values()), close


# --- refusing to hide another apex -------------------------------------------------------------

def _fake_nvidia_apex(folder: Path, *, package: bool = True, metadata: bool = True, extension: bool = False) -> Path:
    """What an NVIDIA apex install leaves in a site-packages folder (without its code)."""
    folder.mkdir(parents=True, exist_ok=True)
    if package:
        (folder / "apex").mkdir()
        (folder / "apex" / "__init__.py").write_text("raise SystemExit('NVIDIA apex was imported')\n")
    if metadata:
        (folder / "apex-0.1.dist-info").mkdir()
        (folder / "apex-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: apex\nVersion: 0.1\n")
    if extension:
        (folder / "amp_C.py").write_text("")
    return folder


def _import_from_source_with(other: Path, statement: str = "import apex") -> subprocess.CompletedProcess:
    # The compat package from its source folder first on the path, the other apex after it.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(COMPAT), str(other)]))
    return subprocess.run([sys.executable, "-c", statement], capture_output=True, text=True, env=env,
                          timeout=TIMEOUT_S, cwd=ROOT)


@pytest.mark.parametrize("statement", ["import apex", "import amp_C", "import apex_C"])
@pytest.mark.parametrize("kind", ["package and metadata", "metadata only", "compiled module only"])
def test_import_refuses_when_another_apex_is_on_the_path(tmp_path, kind, statement):
    other = _fake_nvidia_apex(tmp_path / "nvidia", package=kind == "package and metadata",
                              metadata=kind != "compiled module only", extension=kind == "compiled module only")
    done = _import_from_source_with(other, statement)
    assert done.returncode != 0
    assert "ApexShadowingError" in done.stderr and "refuses to import next to another apex" in done.stderr
    assert str(other) in done.stderr
    # Refused before importing torch: no torch file in the traceback (the checkout's own path may hold "torch").
    assert "torch" not in done.stderr.replace(str(ROOT), "<checkout>")


def test_guard_passes_the_compat_package_itself_and_its_metadata(tmp_path):
    folder = tmp_path / "site"
    (folder / "apex").mkdir(parents=True)
    (folder / "apex" / "__init__.py").write_text("")
    (folder / "apex" / guard.MARKER).write_text("")
    (folder / "apex-0.1.0+apexamp.dist-info").mkdir()
    (folder / "apex-0.1.0+apexamp.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: apex\nVersion: 0.1.0+apexamp\nRequires-Dist: apex_amp==0.1.0\n")
    (tmp_path / "empty" / "apex" / "__pycache__").mkdir(parents=True)  # what an uninstall may leave
    assert guard.other_apex_installations([str(folder), str(tmp_path / "empty"), str(COMPAT)]) == []


def _compat_amp_c(folder: Path, marked: bool = True) -> Path:
    (folder / "amp_C").mkdir(parents=True)
    (folder / "amp_C" / "__init__.py").write_text("")
    if marked:
        (folder / "amp_C" / guard.AMP_C_MARKER).write_text("")
    return folder


def test_guard_passes_the_compat_amp_c_and_refuses_any_other(tmp_path):
    assert (COMPAT / "amp_C" / guard.AMP_C_MARKER).is_file()  # the marker the guard looks for is real
    ours = _compat_amp_c(tmp_path / "ours")
    assert guard.other_apex_installations([str(ours)]) == []
    unmarked = _compat_amp_c(tmp_path / "unmarked", marked=False)
    beside = _compat_amp_c(tmp_path / "beside")
    (beside / "amp_C.cpython-311-x86_64-linux-gnu.so").write_text("")  # hidden by the package, still found
    behind = tmp_path / "behind"
    behind.mkdir()
    (behind / "amp_C.abi3.so").write_text("")
    found = guard.other_apex_installations([str(ours), str(unmarked), str(beside), str(behind)])
    assert found == [f"NVIDIA apex's compiled module `amp_C` at {unmarked / 'amp_C' / '__init__.py'}",
                     f"NVIDIA apex's compiled module `amp_C` at {beside / 'amp_C.cpython-311-x86_64-linux-gnu.so'}",
                     f"NVIDIA apex's compiled module `amp_C` at {behind / 'amp_C.abi3.so'}"]


def test_guard_passes_the_compat_apex_c_and_refuses_nvidias(tmp_path):
    marker = guard.COMPAT_MODULE_MARKERS["apex_C"]
    assert (COMPAT / "apex_C" / marker).is_file()  # the marker the guard looks for is real
    ours = tmp_path / "ours"
    (ours / "apex_C").mkdir(parents=True)
    (ours / "apex_C" / "__init__.py").write_text("")
    (ours / "apex_C" / marker).write_text("")
    assert guard.other_apex_installations([str(ours)]) == []
    (ours / "apex_C.cpython-311-x86_64-linux-gnu.so").write_text("")  # NVIDIA's, hidden behind ours
    assert guard.other_apex_installations([str(ours)]) == [
        f"NVIDIA apex's compiled module `apex_C` at {ours / 'apex_C.cpython-311-x86_64-linux-gnu.so'}"]


def test_guard_names_each_kind_of_other_apex(tmp_path):
    other = _fake_nvidia_apex(tmp_path / "nvidia", extension=True)
    found = guard.other_apex_installations([str(other)])
    assert len(found) == 3
    assert found[0].startswith("a package `apex` at ") and found[0].endswith(str(other / "apex"))
    assert found[1].startswith("the distribution apex 0.1 ")
    assert found[2].startswith("NVIDIA apex's compiled module `amp_C` at ")


@pytest.mark.slow
def test_install_refuses_an_environment_with_nvidia_apex_and_leaves_it_alone(tmp_path):
    python = make_venv(tmp_path / "venv")
    site_packages = _fake_nvidia_apex(site_packages_of(python))
    done = pip_install_compat(python)
    assert done.returncode != 0
    assert "refuses to install next to another apex" in done.stdout + done.stderr
    assert (site_packages / "apex" / "__init__.py").read_text().startswith("raise SystemExit('NVIDIA")
    assert (site_packages / "apex-0.1.dist-info" / "METADATA").exists()


# --- the table of unavailable parts -----------------------------------------------------------

def test_every_unavailable_entry_names_a_replacement():
    for name, message in unavailable.UNAVAILABLE_MODULES.items():
        assert re.search(r"use |apex\.parallel\.SyncBatchNorm", message), name


def test_every_unavailable_module_is_reachable():
    # Python imports a module's parent first: an entry under another entry would never be seen.
    provided = {"apex", "apex.optimizers", "apex.parallel"}
    for name in unavailable.UNAVAILABLE_MODULES:
        assert name.rpartition(".")[0] in provided, name


def test_unlisted_names_are_left_to_python():
    finder = unavailable.UnavailableFinder()
    assert finder.find_spec("apex.no_such_module") is None
    assert finder.find_spec("numpy") is None
    # apex_amp's own modules are never shadowed, even under a name NVIDIA apex's amp used.
    assert finder.find_spec("apex_amp.amp.casting", [str(ROOT / "apex_amp" / "amp")]) is None
    assert finder.find_spec("apex_amp.amp.scaler", [str(ROOT / "apex_amp" / "amp")]) is not None
