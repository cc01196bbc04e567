"""The README: at most about 150 lines, opening with the two commands CI relies on, its code blocks
run or marked as not run (as the docs pages', tests/test_docs.py), and its links resolve."""

import re
from pathlib import Path

from test_docs import code_blocks

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SETUP_AND_MAIN_JOB = "bash scripts/setup.sh && .venv/bin/python examples/train_digits.py"
SETUP_AND_TESTS = "bash scripts/setup.sh && .venv/bin/python -m pytest -q"


def test_readme_is_short_and_opens_with_the_two_commands():
    lines = README.split("\n")
    assert len(lines) <= 160, f"README.md has {len(lines)} lines: move content into a docs/ page"
    first_blocks = [block.code for block in code_blocks(README, "README.md")[:2]]
    assert first_blocks == [SETUP_AND_MAIN_JOB, SETUP_AND_TESTS]


def test_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash scripts/setup.sh" in ci and ".venv/bin/python -m pytest -q" in ci


def test_readme_code_blocks_are_marked_as_not_run():
    # The README's blocks are commands and a fragment; what they do is run by CI and tests/test_docs.py.
    unmarked = [block.source for block in code_blocks(README, "README.md") if block.not_run is None]
    assert not unmarked


def test_readme_links_point_to_files_of_the_repository():
    targets = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [target for target in targets if "://" not in target]
    assert local, "the README links into the documentation"
    missing = [target for target in local if not (ROOT / target.split("#")[0]).exists()]
    assert not missing
