#!/usr/bin/env bash
# Sets up everything apex_amp needs, in ./.venv of this repository:
# Python venv, torch (2.14.1, the pin), ninja, the test and example dependencies (the
# test extra takes the docs and lightning extras: the suite builds the
# documentation site and trains with Lightning's Trainer), and apex_amp itself
# installed in editable mode with its compiled extension.
#
#   bash scripts/setup.sh          # then: .venv/bin/python -m pytest -q
#                                  # or:   .venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html
#
# Safe to run again: what is installed already is kept, and ninja recompiles
# only the kernel files that changed. Environment (all optional):
#   PYTHON=python3.11    interpreter for a new venv (default: python3)
#   TORCH_VERSION=2.11.0 the torch release to install (default: 2.14.1, the pin; the
#                        tested releases are listed in docs/getting_started.md)
#   VENV=.venv-torch2.11 the venv's folder (default: .venv); one venv per torch release
#                        can sit beside .venv, but the compiled extension lives next to
#                        the sources (apex_amp/_C*.so), so it belongs to the venv that
#                        built it last: rebuild (run this again) when switching, or
#                        keep a second clone or git worktree per release
#   APEX_AMP_CUDA=0|1    build the CUDA kernels or not (default: when a toolkit is found)
#   CUDA_HOME, TORCH_CUDA_ARCH_LIST, MAX_JOBS: see setup.py
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
TORCH_VERSION="${TORCH_VERSION:-2.14.1}"
VENV="${VENV:-.venv}"

step() { printf '\n== %s (%ss)\n' "$*" "$SECONDS"; }
# pip warns once per package about every configured local index folder that
# lacks it; those lines say nothing about this project.
pip_install() {
    "$PY" -m pip install "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
}

if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating $VENV with ${PYTHON:-python3}"
    "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# pip skips whatever already satisfies these, without asking the index, so a
# second run costs seconds. torch is pinned: the kernels are compiled against it.
step "installing torch $TORCH_VERSION and the build tools"
pip_install --quiet "pip>=23.1" "setuptools>=77" wheel ninja "torch==$TORCH_VERSION"

# The test and example dependencies are pyproject.toml's extras (test includes docs and lightning).
# --no-build-isolation: build against the torch installed above. The build
# folder (./build) is kept between runs, so this is incremental. Editable, so
# that `import apex_amp` from this folder (tests, examples) finds the compiled
# _C next to the sources instead of a copy without it.
step "building and installing apex_amp[test,examples] (editable; log in build/pip-install.log)"
mkdir -p build
if ! pip_install --verbose --no-build-isolation --editable ".[test,examples]" \
        > build/pip-install.log; then
    tail -n 80 build/pip-install.log
    echo "scripts/setup.sh: building apex_amp failed; the whole log is build/pip-install.log" >&2
    exit 1
fi
# setup.py's own lines: which toolkit, which archs (pip runs it more than once).
grep -o 'apex_amp setup: .*' build/pip-install.log | awk '!seen[$0]++'

step "build report"
"$PY" -m apex_amp report
step "set-up done"
