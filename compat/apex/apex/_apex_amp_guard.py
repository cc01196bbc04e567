"""Keeps apex_amp's ``apex`` compat package from hiding NVIDIA apex (or any other package named apex).

Both are imported as ``apex``, so whichever comes first on ``sys.path`` hides the other; and
pip, which knows both as the distribution ``apex``, would replace one with the other without a
word. This module finds every other ``apex`` that an environment can see; ``apex/__init__.py``
refuses to import when there is one, and ``setup.py`` refuses to build for such an environment.

Standard library only: ``setup.py`` loads this file by path, in a build environment that may
have neither torch nor apex_amp.

The presence of this file is also the mark of the compat package: an ``apex`` package folder
that contains a file of this name is this package (an installed copy or the source tree). The
compat distribution's own ``amp_C`` and ``apex_C`` (apex's compiled modules, rebuilt on apex_amp's
ops and on torch) are marked the same way, by their entry of :data:`COMPAT_MODULE_MARKERS` in
their package folders; NVIDIA's are compiled modules, never such folders.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Iterable
from importlib.machinery import EXTENSION_SUFFIXES, PathFinder

__all__ = ["MARKER", "AMP_C_MARKER", "COMPAT_MODULE_MARKERS", "ApexShadowingError", "other_apex_installations",
           "refuse_if_shadowing"]

MARKER = "_apex_amp_guard.py"
# NVIDIA apex's compiled modules that the compat distribution rebuilds as packages, each with the
# file that marks its folder: amp_C's adapter of apex's calling convention, apex_C's flatten.
COMPAT_MODULE_MARKERS = {"amp_C": "_apex_amp_adapter.py", "apex_C": "_apex_amp_flatten.py"}
AMP_C_MARKER = COMPAT_MODULE_MARKERS["amp_C"]

# Top-level modules that only NVIDIA apex installs: its compiled extensions. Finding one means
# NVIDIA apex (or what a partial uninstall left of it) is in the environment; the compat
# package's own amp_C and apex_C, package folders holding their markers, are the exceptions.
NVIDIA_APEX_MODULES = ("amp_C", "apex_C", "syncbn", "fused_layer_norm_cuda", "fused_adam_cuda")


class ApexShadowingError(RuntimeError):
    """Another apex is installed where this compat package would hide it or be replaced by it.

    A RuntimeError, not an ImportError, on purpose: code that probes for an optional apex with
    ``try: import apex / except ImportError`` would take an ImportError for "apex is not
    installed" and go on without the NVIDIA apex the user installed, never saying why.
    """


def _is_compat_folder(folder: str, marker: str = MARKER) -> bool:
    return os.path.isfile(os.path.join(folder, marker))


def _nvidia_modules_in(folder: str) -> list[str]:
    # Folder by folder, so that an NVIDIA amp_C is found even behind the compat package's own.
    found: list[tuple[str, str]] = []
    for module in NVIDIA_APEX_MODULES:
        spec = PathFinder.find_spec(module, [folder])
        if spec is None:
            continue
        locations = spec.submodule_search_locations or []
        marker = COMPAT_MODULE_MARKERS.get(module)
        if marker and locations and all(_is_compat_folder(loc, marker) for loc in locations):
            # The compat package's own module. A compiled one beside it, which the package hides
            # from imports (a leftover of NVIDIA apex), still counts.
            found.extend((module, os.path.join(folder, name)) for name in sorted(os.listdir(folder))
                         if name.startswith(module + ".") and name.endswith(tuple(EXTENSION_SUFFIXES)))
        elif spec.origin is not None or any(_holds_python_code(location) for location in locations):
            found.append((module, spec.origin or locations[0]))
    return [f"NVIDIA apex's compiled module `{module}` at {path}" for module, path in found]


def _holds_python_code(folder: str) -> bool:
    # A namespace-package portion counts only if it has something importable in it: an empty
    # `apex/` (or one holding only __pycache__) left behind by an uninstall hides nothing.
    try:
        entries = os.listdir(folder)
    except OSError:
        return False
    return any(entry != "__pycache__" for entry in entries)


def _is_compat_distribution(dist: importlib.metadata.Distribution) -> bool:
    # The compat distribution is the only `apex` that depends on apex_amp.
    for requirement in dist.requires or ():
        name = re.split(r"[\s<>=!~;\[(@]", requirement, maxsplit=1)[0]
        if re.sub(r"[-_.]+", "-", name).lower() == "apex-amp":
            return True
    return False


def other_apex_installations(search_path: Iterable[str]) -> list[str]:
    """One line per ``apex`` installation on ``search_path`` that is not this compat package.

    Looks for ``apex`` package folders (regular or namespace), ``apex`` distribution metadata
    (``*.dist-info`` / ``*.egg-info``) that does not depend on apex_amp, and NVIDIA apex's
    compiled extension modules (``amp_C``, ``apex_C``, ...; the compat package's own ``amp_C``
    and ``apex_C`` packages, marked by :data:`COMPAT_MODULE_MARKERS`, do not count).

    Args:
        search_path: folders to look in, as on ``sys.path``; missing folders are skipped.

    Example::

        >>> import sys
        >>> other_apex_installations(sys.path)
        []
    """
    folders = list(dict.fromkeys(os.path.abspath(entry or os.curdir) for entry in search_path))
    found: list[str] = []
    for folder in folders:
        spec = PathFinder.find_spec("apex", [folder])
        if spec is None:
            continue
        for location in spec.submodule_search_locations or [spec.origin]:
            if location is None or _is_compat_folder(location):
                continue
            if spec.origin is None and not _holds_python_code(location):
                continue
            found.append(f"a package `apex` at {location}")
    for dist in importlib.metadata.distributions(name="apex", path=folders):
        if not _is_compat_distribution(dist):
            found.append(f"the distribution apex {dist.version} (metadata in {dist.locate_file('')})")
    for folder in folders:
        found.extend(_nvidia_modules_in(folder))
    return list(dict.fromkeys(found))


def refuse_if_shadowing(search_path: Iterable[str], action: str) -> None:
    """Raise :class:`ApexShadowingError` if another ``apex`` installation is on ``search_path``.

    Args:
        search_path: folders to look in, as on ``sys.path``.
        action: what is refused, for the message ("import", "install").
    """
    others = other_apex_installations(search_path)
    if not others:
        return
    listing = "\n".join(f"  - {other}" for other in others)
    raise ApexShadowingError(
        f"apex_amp's `apex` compat package refuses to {action} next to another apex:\n{listing}\n"
        "Both are imported as `apex` and pip knows both as the distribution `apex`, so one would "
        "silently hide or replace the other. Keep one of them: to keep NVIDIA apex, uninstall the "
        "compat package (`pip uninstall apex` in the environment it was installed into; it is the "
        "`apex` whose requirements list apex_amp); to use the compat package, uninstall NVIDIA apex "
        "from the places listed above first. Code that only needs apex.amp can also import it "
        "directly: `from apex_amp import amp`."
    )
