"""Whether the host emulation of the CUDA kernels passed in this source checkout.

tests/emulation/run.py records each run of the emulated-op tests in
build/emulation/status.json, one entry per scope ("all", "not slow", "slow"),
with a fingerprint of the sources it tested (csrc/ and tests/emulation/).
``python -m apex_amp report`` compares that fingerprint with the files as they
are now, so a run on older sources is reported as stale, not as a pass.
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


def summary(root: Optional[Path] = None) -> dict[str, Any]:
    """{"state": ..., "text": one line for the report, "runs": the recorded runs}, for the
    checkout at `root` (default: this package's).

    state is "passed" (every recorded scope passed on the current sources),
    "failed", "stale" (sources changed since), "not run", or "no checkout".
    """
    root = checkout_root() if root is None else root
    if root is None:
        return {"state": "no checkout", "runs": {},
                "text": "not available (an installed copy; the emulation runs from a source checkout)"}
    runs = _read(root)
    if not runs:
        return {"state": "not run", "runs": {}, "text": f"not run in this checkout; run: {RUN_COMMAND}"}
    current = source_fingerprint(root)
    parts, states = [], set()
    for scope, run in sorted(runs.items()):
        counts = ", ".join(f"{n} {word}" for word, n in run.get("counts", {}).items())
        if run.get("fingerprint") != current:
            state = "stale"
        else:
            state = "passed" if run.get("passed") else "failed"
        states.add(state)
        detail = f"{scope}: {state.upper() if state == 'failed' else state} ({counts or 'no counts'}; {run.get('finished', '?')})"
        coverage = run.get("coverage") or {}
        if state == "passed" and coverage.get("percent") is not None:
            detail += f", csrc/cuda lines run {coverage['percent']}%"
        parts.append(detail)
    state = next(s for s in ("failed", "stale", "passed") if s in states)
    text = "; ".join(parts)
    if state == "stale":
        text += f" [sources changed since; rerun {RUN_COMMAND}]"
    return {"state": state, "runs": runs, "text": text}
