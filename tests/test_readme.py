"""The README's generated parts are current, and its two commands are the ones CI relies on."""

from pathlib import Path

from apex_amp.amp.casting import readme_table

ROOT = Path(__file__).resolve().parents[1]


def test_readme_o1_table_is_generated_from_the_rule_table():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme_table.replace_section(text) == text, (
        "README.md's O1 table is stale: run `python -m apex_amp.amp.casting.readme_table --update README.md`"
    )


def test_readme_test_command_is_the_one_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in readme
    assert "bash scripts/setup.sh" in ci and ".venv/bin/python -m pytest -q" in ci
