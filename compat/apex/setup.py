"""Builds the compat distribution `apex`, refusing an environment that already has another apex.

pip knows NVIDIA apex and this package by the same distribution name, so installing this one
would uninstall NVIDIA apex without asking. pip has no "conflicts" field to prevent that, but it
runs this file (with the interpreter it installs for) before it installs anything, so the check
is made here, with the same rule the import uses (apex/_apex_amp_guard.py). A wheel built
elsewhere and installed later skips this check; the import-time one still applies.
"""

import importlib.util
import sys
import sysconfig
from pathlib import Path

from setuptools import setup


def _load_guard():
    # By path: importing the `apex` package here would import apex_amp and torch, which an
    # isolated build environment does not have.
    path = Path(__file__).resolve().parent / "apex" / "_apex_amp_guard.py"
    spec = importlib.util.spec_from_file_location("_apex_amp_guard", path)
    guard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guard)
    return guard


# In an isolated build the target environment's site-packages is off sys.path: name it too.
_target = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path]
_load_guard().refuse_if_shadowing(_target, action="install")

setup()
