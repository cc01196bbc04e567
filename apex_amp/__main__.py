"""Command line of apex_amp: ``python -m apex_amp [report] [options]``.

Example::

    $ python -m apex_amp                      # the build/environment report
    $ python -m apex_amp report --require-cuda   # also fail unless the CUDA kernels are in
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

__all__ = ["main"]


def _report(args: argparse.Namespace) -> int:
    from apex_amp import _build_report

    info = _build_report.collect()
    print(json.dumps(info, indent=2) if args.json else _build_report.format_report(info))
    if not (args.require_extension or args.require_cuda):
        return 0
    found = _build_report.problems(info, require_cuda=args.require_cuda)
    for problem in found:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if found else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m apex_amp",
        description="apex_amp's command line; without a command it prints the report.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    report = commands.add_parser(
        "report",
        help="how apex_amp was built and what it runs on (the default command)",
        description="Which implementation of the ops is in use and why, how the extension "
        "was built (CUDA archs, CUDA version, compiler), the kernels of each op, the CPU "
        "ISA, torch, GPUs and threads.",
    )
    report.add_argument("--json", action="store_true", help="print the facts as JSON")
    report.add_argument("--require-extension", action="store_true",
                        help="exit with 1 unless the extension is loaded with CPU kernels for every op")
    report.add_argument("--require-cuda", action="store_true",
                        help="as --require-extension, and every op must have a CUDA kernel too")
    report.set_defaults(handler=_report)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # No command means "report", so `python -m apex_amp --json` works too.
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "report")
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
