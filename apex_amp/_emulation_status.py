"""Whether the host emulation of the CUDA kernels passed in this source checkout.

tests/emulation/run.py records each run of the emulated-op tests in
build/emulation/status.json, one entry per scope ("all", "not slow", "slow"),
with a fingerprint of the sources it tested (csrc/ and tests/emulation/).
``python -m apex_amp report`` compares that fingerprint with the files as they
are now, so only runs on the current sources count as a pass.
An installed copy of apex_amp has no checkout, and says so.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

__all__ = ["RUN_COMMAND", "checkout_root", "source_fingerprint", "record_run", "summary"]

RUN_COMMAND = "python tests/emulation/run.py"
FINGERPRINTED = ("csrc", "tests/emulation")
STATUS_FILE = Path("build") / "emulation" / "status.json"


def checkout_root() -> Optional[Path]:
    """The source checkout this apex_amp package lives in, or None for an installed copy."""
    root = Path(__file__).resolve().parents[1]
    if (root / "csrc" / "cuda").is_dir() and (root / "tests" / "emulation").is_dir():
        return root
    return None


def source_fingerprint(root: Path) -> str:
    """SHA-256 of the paths and contents of every file the emulation tests compile or run."""
    digest = hashlib.sha256()
    for top in FINGERPRINTED:
        for path in sorted((root / top).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _read(root: Path) -> dict[str, Any]:
    try:
        return json.loads((root / STATUS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def record_run(root: Path, run: dict[str, Any]) -> None:
    """Stores `run` (a dict with at least "scope" and "passed") under its scope, fingerprinted."""
    runs = _read(root)
    runs[run["scope"]] = dict(run, fingerprint=source_fingerprint(root))
    path = root / STATUS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(runs, indent=2) + "\n")


# The scopes run.py records, and the words the report uses for them.
SCOPE_NAMES = {"all": "whole suite", "not slow": "fast subset", "slow": "slow part"}


def _describe(scope: str, run: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {word}" for word, n in run.get("counts", {}).items())
    return f"{SCOPE_NAMES.get(scope, scope)} ({counts or 'no counts'}; {run.get('finished', '?')})"


def summary(root: Optional[Path] = None) -> dict[str, Any]:
    """{"state": ..., "text": one line for the report, "runs": the recorded runs}, for the
    checkout at `root` (default: this package's).

    Only runs on the current sources count. state is "passed" (the whole suite
    passed, in one run or as its fast subset and slow part), "fast subset
    passed" (the slow part not run since the sources changed), "failed" (a run
    failed), "stale" (every run predates the sources), "not run" (nothing
    recorded, or only a build with another chunk size), or "no checkout".
    """
    root = checkout_root() if root is None else root
    if root is None:
        return {"state": "no checkout", "runs": {},
                "text": "not available (an installed copy; the emulation runs from a source checkout)"}
    runs = _read(root)
    if not runs:
        return {"state": "not run", "runs": {}, "text": f"not run in this checkout; run: {RUN_COMMAND}"}
    fingerprint = source_fingerprint(root)
    current = {scope: run for scope, run in runs.items() if run.get("fingerprint") == fingerprint}
    failed = [scope for scope, run in current.items() if not run.get("passed")]
    passed = {scope: run for scope, run in current.items() if run.get("passed")}
    if failed:
        state = "failed"
        text = "FAILED: " + "; ".join(_describe(scope, current[scope]) for scope in failed)
    elif "all" in passed or {"not slow", "slow"} <= passed.keys():
        state = "passed"
        shown = ["all"] if "all" in passed else ["not slow", "slow"]
        text = "passed: " + "; ".join(_describe(scope, passed[scope]) for scope in shown)
    elif "not slow" in passed:
        state = "fast subset passed"
        text = (f"passed: {_describe('not slow', passed['not slow'])}; the slow part has not run "
                f"on these sources ({RUN_COMMAND} -m slow)")
    elif current:  # only runs of another build (run.py --chunk-size) on these sources
        return {"state": "not run", "runs": runs,
                "text": f"the default build's suite has not run on these sources; run: {RUN_COMMAND}"}
    else:
        return {"state": "stale", "runs": runs,
                "text": f"stale: the sources changed since the last run; run: {RUN_COMMAND}"}
    latest = max(passed.values(), key=lambda run: run.get("finished", ""), default={})
    coverage = (latest.get("coverage") or {}).get("percent")
    if state != "failed" and coverage is not None:
        text += f"; csrc/cuda lines run {coverage}%"
    return {"state": state, "runs": runs, "text": text}
