"""Child process of tests/test_device_fallback.py: apex_amp's ops on a device without compiled kernels.

Runs every list and scaler op, two FusedAdam steps and a compiled function on the ``nokernels``
device (tests/_python_device.py), and the same calls on CPU through the pure-PyTorch namespace
(``torch.ops.apex_amp_fallback``), then prints one JSON object: which results agree bit for bit,
the warnings apex_amp logged, and what the build report says about devices. An op that fails
on the device is reported as the error it raised.
"""

from __future__ import annotations

import json
import logging
import sys

import torch

import _python_device as device
from apex_amp import _build_report, ops
from apex_amp.optimizers import FusedAdam

warnings: list[str] = []


class _Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())


logging.getLogger("apex_amp").addHandler(_Collect())


def on_device(tensors):
    return [t.to(device.NAME) for t in tensors]


def flag(value: float) -> torch.Tensor:
    return torch.full((1,), value)


def same(device_tensors, cpu_tensors) -> bool:
    return all(d.device.type == device.NAME and torch.equal(d.cpu(), c) for d, c in zip(device_tensors, cpu_tensors))


def list_ops() -> dict[str, bool]:
    """Each list and scaler op on the device and through the CPU fallback, with the same inputs."""
    reference = torch.ops.apex_amp_fallback
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, generator=generator) * 1024, torch.randn(5, generator=generator).bfloat16()]
    grads[1][2] = float("inf")
    outcome = {}

    on, cpu = on_device(grads), [g.clone() for g in grads]
    found_on, found_cpu = flag(0.0).to(device.NAME), flag(0.0)
    ops.check_finite(on, found_on)
    reference.check_finite(cpu, found_cpu)
    outcome["check_finite"] = same([found_on], [found_cpu]) and found_cpu.item() == 1.0

    found_on, found_cpu = flag(0.0).to(device.NAME), flag(0.0)
    ops.unscale_(on, found_on, flag(1 / 1024).to(device.NAME))
    reference.unscale_(cpu, found_cpu, flag(1 / 1024))
    outcome["unscale_"] = same(on + [found_on], cpu + [found_cpu])

    master_on, master_cpu = on_device([torch.zeros(7)]), [torch.zeros(7)]
    found_on, found_cpu = flag(0.0).to(device.NAME), flag(0.0)
    ops.scale_(on[:1], master_on, flag(0.5).to(device.NAME), found_on)
    reference.scale_(cpu[:1], master_cpu, flag(0.5), found_cpu)
    outcome["scale_"] = same(master_on + [found_on], master_cpu + [found_cpu])

    ops.axpby_(on[:1], master_on, flag(2.0).to(device.NAME), 0.25, found_on)
    reference.axpby_(cpu[:1], master_cpu, flag(2.0), 0.25, found_cpu)
    outcome["axpby_"] = same(master_on + [found_on], master_cpu + [found_cpu])

    total_on, per_tensor_on = ops.l2norm(master_on + on[:1], per_tensor=True)
    total_cpu, per_tensor_cpu = reference.l2norm(master_cpu + cpu[:1], True)
    outcome["l2norm"] = same([total_on, per_tensor_on], [total_cpu, per_tensor_cpu])

    scaler_cpu = [flag(65536.0), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), flag(1.0)]
    scaler_on = on_device(scaler_cpu)
    ops.update_scale_(*scaler_on)
    reference.update_scale_(*scaler_cpu, 2.0, 0.5, 2000, 1, 1.0, 2.0**24, True)
    outcome["update_scale_"] = same(scaler_on, scaler_cpu) and scaler_cpu[0].item() == 32768.0
    return outcome


def fused_adam_steps() -> bool:
    """Two FusedAdam steps on the device equal two on CPU through the fallback op."""
    torch.manual_seed(0)
    weights = [torch.randn(4, 3), torch.randn(3)]
    gradients = [[torch.randn_like(w) for w in weights] for _ in range(2)]
    # Plain leaf tensors: autograd's detach() (nn.Parameter, .data) makes a tensor the test device cannot map.
    params = [w.to(device.NAME) for w in weights]
    optimizer = FusedAdam(params, lr=0.1, weight_decay=0.01)
    masters = [w.clone() for w in weights]
    moments = [torch.zeros_like(w) for w in weights], [torch.zeros_like(w) for w in weights]
    step = torch.zeros(1)
    for grads in gradients:
        for param, grad in zip(params, grads):
            param.grad = grad.to(device.NAME)
        optimizer.step()
        torch.ops.apex_amp_fallback.fused_adam_(masters, grads, *moments, [], [], [], step, 0.1, 0.9, 0.999, 1e-8, 0.01,
                                                True, True, None, None)
    return same(params, masters)


def compiled_unscale() -> bool:
    """A function compiled whole (dynamo's graph, run eagerly) calls the op; the dispatcher picks its kernel."""
    def unscale_and_check(grads, found_inf, inv_scale):
        ops.unscale_(grads, found_inf, inv_scale)
        ops.check_finite(grads, found_inf)

    # The "eager" backend: inductor has no code generator for the test device.
    compiled = torch.compile(unscale_and_check, backend="eager", fullgraph=True)
    grads, found_inf = on_device([torch.full((4,), 8.0)]), flag(0.0).to(device.NAME)
    compiled(grads, found_inf, flag(0.125).to(device.NAME))
    return same(grads + [found_inf], [torch.ones(4), flag(0.0)])


def main() -> None:
    outcome: dict = {"backend": ops.BACKEND}
    try:
        outcome["ops"] = list_ops()
        outcome["fused_adam"] = fused_adam_steps()
        outcome["compiled"] = compiled_unscale()
    except Exception as error:  # noqa: BLE001 (reported to the parent, which fails with it)
        outcome["error"] = f"{type(error).__name__}: {error}"
    outcome["warnings"] = warnings
    info = _build_report.collect()
    outcome["compiled_devices"] = info["compiled_devices"]
    outcome["report"] = _build_report.format_report(info)
    json.dump(outcome, sys.stdout)


if __name__ == "__main__":
    main()
