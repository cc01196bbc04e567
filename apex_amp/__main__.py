"""Command line of apex_amp: ``python -m apex_amp [report|inspect] [options]``.

Example::

    $ python -m apex_amp                      # the build/environment report
    $ python -m apex_amp report --require-cuda   # also fail unless the CUDA kernels are in
    $ python -m apex_amp inspect mypkg.models:build_model --opt-level O2 --half-dtype bfloat16
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Optional, Sequence

import torch

from apex_amp import _build_report, amp

__all__ = ["main"]


def _report(args: argparse.Namespace) -> int:
    info = _build_report.collect()
    print(json.dumps(info, indent=2) if args.json else _build_report.format_report(info))
    if not (args.require_extension or args.require_cuda):
        return 0
    found = _build_report.problems(info, require_cuda=args.require_cuda)
    for problem in found:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if found else 0


class _SpecError(ValueError):
    """A ``module:factory`` spec that does not lead to a model."""


def _load_model(spec: str) -> Any:
    """The ``nn.Module`` named by ``module:attribute`` (an instance, or a callable returning one)."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise _SpecError(f"expected MODULE:FACTORY (e.g. mypkg.models:build_model), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name == error.name or module_name.startswith(error.name + ".")):
            raise _SpecError(
                f"module {module_name!r} not found (is it on PYTHONPATH, or run from its folder?)"
            ) from None
        raise _SpecError(f"importing {module_name!r} failed: {error}") from error
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise _SpecError(f"{module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if isinstance(target, torch.nn.Module):
        return target
    if not callable(target):
        raise _SpecError(
            f"{spec} is of type {type(target).__name__}: neither an nn.Module nor a callable returning one"
        )
    model = target()
    if not isinstance(model, torch.nn.Module):
        raise _SpecError(f"{spec}() returned an object of type {type(model).__name__}, not a torch.nn.Module")
    return model


def _inspect(args: argparse.Namespace) -> int:
    try:
        model = _load_model(args.spec)
    except _SpecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    half_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[args.half_dtype]
    report = amp.inspect(model, opt_level=args.opt_level, half_dtype=half_dtype)
    print(report.to_json() if args.json else report)
    return 0


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
        "ISA, torch, GPUs and threads, and where fp8 training runs (fp8 tensor cores need sm_89+).",
    )
    report.add_argument("--json", action="store_true", help="print the facts as JSON")
    report.add_argument("--require-extension", action="store_true",
                        help="exit with 1 unless the extension is loaded with CPU kernels for every op")
    report.add_argument("--require-cuda", action="store_true",
                        help="as --require-extension, and every op must have a CUDA kernel too")
    report.set_defaults(handler=_report)
    inspect = commands.add_parser(
        "inspect",
        help="what an opt level does to a model: Tensor Core alignment, fp32 ops, batchnorm",
        description="Import MODULE, take FACTORY from it (an nn.Module, or a callable returning one, "
        "called without arguments) and print amp.inspect's report: layers whose dimensions are not "
        "multiples of 8, layers O1 runs in fp32, parameters already half, batchnorm handling.",
    )
    inspect.add_argument("spec", metavar="MODULE:FACTORY", help="e.g. mypkg.models:build_model")
    inspect.add_argument("--opt-level", default="O1", choices=("O0", "O1", "O2", "O3"), help="default: O1")
    inspect.add_argument("--half-dtype", default="float16", choices=("float16", "bfloat16"),
                         help="default: float16")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(handler=_inspect)
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
