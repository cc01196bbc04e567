"""Throwaway venvs for the tests that install packages: the compat distribution, third-party clients,
apex_amp's own source distribution.

A venv from :func:`make_venv` is made with the project venv's interpreter and sees the project's packages
(torch, apex_amp, setuptools, pip) through one .pth file that runs ``site.addsitedir`` on the
project venv's site-packages: a plain path line would not process that folder's own .pth files,
which is where the editable apex_amp install lives. The same .pth file then names the source
tree of the apex_amp these tests imported, so that the venv imports that one (a worktree under
test) even where the project venv's editable install points at another checkout: the editable
finder only answers after the path entries. Its own site-packages comes first on sys.path, so
what pip installs there is what gets imported. The compat distribution installs
from a clean copy of the local folder with ``--no-deps --no-build-isolation --no-index``: no network.

A venv from :func:`make_bare_venv` sees none of that: only the base interpreter's standard
library and what it installs itself from the package index, as a new user's would.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import apex_amp

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "compat" / "apex"
# The folder that holds the apex_amp package these tests import.
APEX_AMP_TREE = Path(apex_amp.__file__).resolve().parents[1]
TIMEOUT_S = 180


def make_venv(folder: Path) -> Path:
    """A throwaway venv that sees the project venv's packages; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=TIMEOUT_S)
    python = folder / "bin" / "python"
    project_site = sysconfig.get_paths()["purelib"]
    (site_packages_of(python) / "_apex_amp_project_venv.pth").write_text(
        f"import site; site.addsitedir({project_site!r})\n{APEX_AMP_TREE}\n")
    return python


def site_packages_of(python: Path) -> Path:
    return Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())


def pip_install_compat(python: Path) -> subprocess.CompletedProcess:
    """Install the compat distribution from a clean copy of compat/apex beside the venv.

    pip builds a local folder in place, and setuptools never empties the folder's ``build/``:
    a module removed from the sources (or added on another branch) would still be packaged
    from there. The copy leaves ``build/`` and ``*.egg-info`` behind.
    """
    source = python.parents[2] / "compat-apex-source"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(COMPAT, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    return subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "--disable-pip-version-check", str(source)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)


def pip_install_pinned(python: Path, requirements: list[str], *, build_isolation: bool = True,
                       env: dict | None = None, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Install exact versions from the package index, without their dependencies (each is listed).

    ``build_isolation=False`` builds a source distribution against the venv's own packages (one
    whose setup.py imports torch, such as DeepSpeed's, would otherwise download torch to build).
    """
    isolation = [] if build_isolation else ["--no-build-isolation"]
    return subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
                           *isolation, *requirements], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


def make_bare_venv(folder: Path, requirements: list[str], timeout_s: int) -> Path:
    """A venv that sees none of the project's packages, with ``requirements`` (and their dependencies)
    installed from the package index; returns its python."""
    # `python -m venv` run by a venv's interpreter bases the new venv on the base interpreter,
    # without the project venv's site-packages.
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, timeout=TIMEOUT_S)
    python = folder / "bin" / "python"
    result = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                             *requirements], capture_output=True, text=True, timeout=timeout_s, cwd=folder)
    if result.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(requirements)} failed:\n{result.stdout}{result.stderr}")
    return python
