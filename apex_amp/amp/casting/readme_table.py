"""Write the O1 rule table of ``rules.py`` as markdown, for the README.

Usage: ``python -m apex_amp.amp.casting.readme_table OUT.md`` (``-`` for stdout).
"""
from __future__ import annotations

import sys

from .rules import render_markdown_table

__all__ = ["main"]

_NOTES = """
- Everything not in the table runs in the precision of its inputs (batch norm keeps its input dtype).
- "half" is fp16 or bf16 (the `half_dtype` given to `amp.initialize`); "promote" runs in the widest
  floating dtype among the tensor inputs.
- In-place forms of fp32 ops (e.g. `x.exp_()`) raise on a half tensor instead of running in half.
- The rules apply to forward and loss; backward and `optimizer.step()` run without them
  (`amp.disable_casts()` turns them off anywhere).
- Half casts of fp32 weights made by apex_amp's kernels are cached and checked against each weight's
  version counter; torch's own autocast weight cache is off while O1 is active.
"""


def main(argv: list[str] | None = None) -> int:
    """Write the table to the path in ``argv`` (``-`` for stdout); returns the exit status.

    Example::

        >>> from apex_amp.amp.casting.readme_table import main
        >>> main(["/tmp/o1_table.md"])
        0
    """
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.stderr.write("usage: python -m apex_amp.amp.casting.readme_table OUT.md\n")
        return 2
    table = render_markdown_table() + _NOTES
    if argv[0] == "-":
        sys.stdout.write(table)
    else:
        with open(argv[0], "w", encoding="utf-8") as out:
            out.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
