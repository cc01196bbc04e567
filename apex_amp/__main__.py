"""Command line of apex_amp: ``python -m apex_amp [report|inspect|memory] [options]``.

Example::

    $ python -m apex_amp                      # the build/environment report
    $ python -m apex_amp report --require-cuda   # also fail unless the CUDA kernels are in
    $ python -m apex_amp inspect mypkg.models:build_model --opt-level O2 --half-dtype bfloat16
    $ python -m apex_amp memory mypkg.models:build_model --state-precision int8 --master-weights remainder
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
from typing import Any, Optional, Sequence

import torch

from apex_amp import _build_report, amp, memory_report, optimizers

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


_FUSED_OPTIMIZERS = ("FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedSGD", "FusedAdagrad",
                     "FusedNovoGrad")
_MASTER_WEIGHTS = {"remainder": "remainder", "true": True, "false": False}


class _OptionError(ValueError):
    """Options of ``memory`` that cannot build the optimizer they describe."""


def _optimizer_class(name: str) -> type:
    # One of apex_amp's fused optimizers by name, or torch.optim.NAME (for comparison).
    if name in _FUSED_OPTIMIZERS:
        return getattr(optimizers, name)
    if name.startswith("torch.optim."):
        found = getattr(torch.optim, name.removeprefix("torch.optim."), None)
        if isinstance(found, type) and issubclass(found, torch.optim.Optimizer):
            return found
    raise _OptionError(f"unknown optimizer {name!r}: use one of {', '.join(_FUSED_OPTIMIZERS)} "
                       "or torch.optim.NAME (e.g. torch.optim.AdamW)")


def _optimizer_arguments(pairs: Sequence[str]) -> dict[str, Any]:
    # KEY=VALUE, VALUE a Python literal (0.9, (0.9, 0.95), True) or else taken as a string.
    arguments: dict[str, Any] = {}
    for pair in pairs:
        key, equals, text = pair.partition("=")
        if not equals or not key.isidentifier():
            raise _OptionError(f"--optimizer-arg expects KEY=VALUE (e.g. momentum=0.9), got {pair!r}")
        try:
            arguments[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            arguments[key] = text
    return arguments


def _build_optimizer(args: argparse.Namespace, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    cls = _optimizer_class(args.optimizer)
    arguments = {"lr": args.lr, **_optimizer_arguments(args.optimizer_arg)}
    if args.state_precision is not None:
        if not issubclass(cls, optimizers.FusedOptimizer):
            raise _OptionError(f"--state-precision is an option of apex_amp's fused optimizers, not of {args.optimizer}")
        arguments["state_precision"] = args.state_precision
    try:
        return cls(params, **arguments)
    except (TypeError, ValueError) as error:
        raise _OptionError(f"{args.optimizer}({', '.join(arguments)}) failed: {error}") from error


def _device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except RuntimeError as error:
        raise _OptionError(f"--device {name!r} is not a device: {error}") from None


def _measure_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """The memory report at the peak of a training step: between the second backward and step.

    No input is needed: the loss is zero times the sum of every trainable parameter, so its
    backward gives every parameter a gradient of the dtype a real backward would (through
    ``amp.scale_loss``, which holds what amp holds), and the first step creates the optimizer's
    state as a real one does (zero gradients: any state a step creates).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]

    def backward() -> None:
        optimizer.zero_grad()
        loss = sum((p.float().sum() * 0.0 for p in trainable), torch.zeros((), device=trainable[0].device))
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()

    backward()
    optimizer.step()  # creates the state
    backward()
    return memory_report(model, optimizer)


def _memory(args: argparse.Namespace) -> int:
    try:
        model = _load_model(args.spec).to(_device(args.device))
        if not any(p.requires_grad for p in model.parameters()):
            raise _SpecError(f"{args.spec} has no trainable parameters: nothing to measure")
        optimizer = _build_optimizer(args, [p for p in model.parameters() if p.requires_grad])
        half_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[args.half_dtype]
        master_weights = None if args.master_weights is None else _MASTER_WEIGHTS[args.master_weights]
        try:
            model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, half_dtype=half_dtype,
                                              master_weights=master_weights, verbosity=0)
        except ValueError as error:
            raise _OptionError(f"amp.initialize refused the options: {error}") from error
    except (_SpecError, _OptionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    report = _measure_memory(model, optimizer)
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
    memory = commands.add_parser(
        "memory",
        help="bytes per parameter of a model and its optimizer: weights, grads, masters, state",
        description="Import MODULE, take FACTORY from it (as inspect does), build the optimizer the "
        "options describe, amp.initialize both, run one step on zero gradients (no input needed: the loss "
        "is zero times every parameter) to create the optimizer's state, backpropagate again and print "
        "apex_amp.memory_report at that peak: bytes per parameter by category, measured from the tensors.",
    )
    memory.add_argument("spec", metavar="MODULE:FACTORY", help="e.g. mypkg.models:build_model")
    memory.add_argument("--optimizer", default="FusedAdam", metavar="NAME",
                        help=f"one of {', '.join(_FUSED_OPTIMIZERS)}, or torch.optim.NAME (default: FusedAdam)")
    memory.add_argument("--optimizer-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an argument of the optimizer, repeatable (e.g. momentum=0.9)")
    memory.add_argument("--lr", type=float, default=1e-3, help="default: %(default)s")
    memory.add_argument("--state-precision", default=None, choices=("fp32", "bf16", "fp8", "int8"),
                        help="the fused optimizer's state_precision (default: the optimizer's, fp32)")
    memory.add_argument("--opt-level", default="O2", choices=("O0", "O1", "O2", "O3"), help="default: O2")
    memory.add_argument("--half-dtype", default="bfloat16", choices=("float16", "bfloat16"),
                        help="default: bfloat16")
    memory.add_argument("--master-weights", default=None, choices=tuple(_MASTER_WEIGHTS),
                        help="amp.initialize's master_weights (default: the opt level's)")
    memory.add_argument("--device", default="cpu", help="where the model is put (default: cpu)")
    memory.add_argument("--json", action="store_true", help="print the report as JSON")
    memory.set_defaults(handler=_memory)
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
